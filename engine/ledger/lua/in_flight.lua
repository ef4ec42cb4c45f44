-- ARGV: prefix. Read only: the in-flight samples by holder, in one consistent snapshot.
-- Returns {received, orphaned, node, alive (1|0), admitted + generated, node, alive, n, ...}.
local p = ARGV[1]
local received, orphaned, held, order = 0, 0, {}, {}
for _, entry in ipairs(groups_in_flight(p)) do
  local group, node = entry[1], entry[2]
  for i = 0, tonumber(redis.call('HGET', p .. 'g:' .. group, 'n')) - 1 do
    local state = redis.call('HGET', p .. 's:' .. group .. ':' .. i, 'state')
    if state == 'received' then
      received = received + 1
    elseif state == 'admitted' or state == 'generated' then
      if node == '' then
        orphaned = orphaned + 1
      else
        if not held[node] then held[node] = 0; order[#order + 1] = node end
        held[node] = held[node] + 1
      end
    end
  end
end
local out = {received, orphaned}
for _, node in ipairs(order) do
  out[#out + 1] = node
  out[#out + 1] = redis.call('EXISTS', p .. 'alive:' .. node)
  out[#out + 1] = held[node]
end
return out
