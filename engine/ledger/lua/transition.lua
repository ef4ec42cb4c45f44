-- ARGV: prefix, target, now, stride, then `stride` values per sample: id [, version, vmin, node].
-- Returns, per sample, 1 when it moved to `target`, else its state at the time ('' if unknown).
local p, target, now, stride = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local legal = {generated = {admitted = true}, received = {generated = true}, trained = {received = true}}
local dropping = string.sub(target, 1, 8) == 'dropped:'
local from = dropping and {admitted = true, generated = true, received = true} or legal[target]
if not from then return redis.error_reply('BAD_TARGET unknown target state ' .. target) end
local b = books(p)
local out = {}
for i = 5, #ARGV, stride do
  local id = ARGV[i]
  local key = p .. 's:' .. id
  local row = redis.call('HMGET', key, 'state', 'vmin', 'node')
  local state = row[1]
  if target == 'generated' and state and row[3] ~= ARGV[i + 3] then
    out[#out + 1] = 'owned by node ' .. row[3]  -- a node reaped and back: the sample is another's now
  elseif state and from[state] then
    if dropping or target == 'trained' then
      finish(b, key, id, state, target, now, row[2])
    elseif target == 'generated' then
      redis.call('HSET', key, 'state', target, 't_gen', now, 'v', ARGV[i + 1], 'vmin', ARGV[i + 2])
    else
      redis.call('HSET', key, 'state', target, 't_rcv', now)
    end
    if not (dropping or target == 'trained') then
      bump(b, state, -1)
      bump(b, target, 1)
    end
    out[#out + 1] = 1
  else
    out[#out + 1] = state or ''
  end
end
flush(b)
return out
