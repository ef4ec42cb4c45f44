-- ARGV: prefix, version, record JSON. Versions only move forward; the same one again is a no-op
-- (a resumed learner republishes its version).
local p, v = ARGV[1], tonumber(ARGV[2])
local cur = tonumber(redis.call('GET', p .. 'version') or '-1')
if v < cur then
  return redis.error_reply('VERSION_BACKWARDS version ' .. v .. ' is older than the current ' .. cur)
end
redis.call('SET', p .. 'version', v)
redis.call('HSETNX', p .. 'versions', tostring(v), ARGV[3])
return cur
