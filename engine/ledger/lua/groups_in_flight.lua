-- Every group holding a credit, once: those of each node seen (alive or gone), then those waiting
-- for a node (readmit). Bounded by the credit capacity, so scripts may walk it.
local function groups_in_flight(p)
  local seen, out = {}, {}
  local function add(group, node)
    if not seen[group] then seen[group] = true; out[#out + 1] = {group, node} end
  end
  for _, set in ipairs({'nodes', 'lost'}) do
    for _, node in ipairs(redis.call('SMEMBERS', p .. set)) do
      for _, group in ipairs(redis.call('SMEMBERS', p .. 'ng:' .. node)) do add(group, node) end
    end
  end
  for _, group in ipairs(redis.call('LRANGE', p .. 'orphans', 0, -1)) do add(group, '') end
  return out
end
