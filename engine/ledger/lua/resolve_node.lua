-- Resolves a node's samples not yet received by the learner (received ones no longer depend on
-- it): dropped with `reason`, or re-admitted and their groups queued for another node. Returns
-- how many samples.
local function resolve_node(b, node, mode, reason, now)
  local p = b.p
  local resolved = 0
  for _, group in ipairs(redis.call('SMEMBERS', p .. 'ng:' .. node)) do
    local gk = p .. 'g:' .. group
    local reset = false
    for i = 0, tonumber(redis.call('HGET', gk, 'n')) - 1 do
      local id = group .. ':' .. i
      local key = p .. 's:' .. id
      local state = redis.call('HGET', key, 'state')
      if state == 'admitted' or state == 'generated' then
        resolved = resolved + 1
        if mode == 'readmit' then
          redis.call('HSET', key, 'state', 'admitted', 'node', '')
          bump(b, state, -1)
          bump(b, 'admitted', 1)
          reset = true
        else
          finish(b, key, id, state, 'dropped:' .. reason, now)
        end
      end
    end
    if reset then
      redis.call('HSET', gk, 'node', '')
      redis.call('SREM', p .. 'ng:' .. node, group)
      redis.call('RPUSH', p .. 'orphans', group)
    end
  end
  redis.call('DEL', p .. 'alive:' .. node)
  redis.call('SREM', p .. 'nodes', node)
  redis.call('SADD', p .. 'lost', node)
  return resolved
end
