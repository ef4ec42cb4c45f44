-- ARGV: prefix, node. Hands the oldest orphaned group to `node`.
-- Returns {} when none waits, else {group, prompt, sample ids still to generate...}.
local p, node = ARGV[1], ARGV[2]
if redis.call('EXISTS', p .. 'alive:' .. node) == 0 then
  return redis.error_reply('NODE_NOT_ALIVE node ' .. node .. ' has no live heartbeat; call heartbeat() first')
end
local group = redis.call('LPOP', p .. 'orphans')
if not group then return {} end
local gk = p .. 'g:' .. group
redis.call('HSET', gk, 'node', node)
redis.call('SADD', p .. 'ng:' .. node, group)
local out = {group, redis.call('HGET', gk, 'prompt')}
for i = 0, tonumber(redis.call('HGET', gk, 'n')) - 1 do
  local id = group .. ':' .. i
  if redis.call('HGET', p .. 's:' .. id, 'state') == 'admitted' then
    redis.call('HSET', p .. 's:' .. id, 'node', node)
    out[#out + 1] = id
  end
end
return out
