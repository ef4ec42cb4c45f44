-- ARGV: prefix, reason, now. Every `received` sample is dropped with `reason`: what a learner took
-- in and never trained, when a new learner starts (nobody sends it again). Returns how many.
local p, target, now = ARGV[1], 'dropped:' .. ARGV[2], ARGV[3]
local b = books(p)
local n = 0
for _, entry in ipairs(groups_in_flight(p)) do
  local group = entry[1]
  for i = 0, tonumber(redis.call('HGET', p .. 'g:' .. group, 'n')) - 1 do
    local id = group .. ':' .. i
    local key = p .. 's:' .. id
    local row = redis.call('HMGET', key, 'state', 'vmin')
    if row[1] == 'received' then
      finish(b, key, id, 'received', target, now, row[2])
      n = n + 1
    end
  end
end
flush(b)
return n
