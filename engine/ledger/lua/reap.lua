-- ARGV: prefix, mode ('drop' | 'readmit'), now, heartbeat TTL (s). Every node whose heartbeat
-- expired is resolved (reason node_lost). Returns {node, samples resolved, node, samples resolved, ...}.
local p, mode, now, ttl = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
-- A server restarted (from its append-only file) expired every heartbeat that lapsed while it was
-- down: that is no news of the nodes, so they get one TTL from the restart's discovery to beat again.
-- The window runs on the server's clock: a call retried through the outage carries a `now` from
-- before it, which would end the window as soon as it opened.
local server = string.match(redis.call('INFO', 'server'), 'run_id:(%w+)')
local clock = redis.call('TIME')
local server_now = tonumber(clock[1]) + tonumber(clock[2]) / 1e6
local seen = redis.call('HMGET', p .. 'server', 'run_id', 'since')
if seen[1] ~= server then
  redis.call('HSET', p .. 'server', 'run_id', server, 'since', tostring(server_now))
  if seen[1] then return {} end
elseif server_now - tonumber(seen[2]) < ttl then
  return {}
end
local b = books(p)
local out = {}
for _, node in ipairs(redis.call('SMEMBERS', p .. 'nodes')) do
  if redis.call('EXISTS', p .. 'alive:' .. node) == 0 then
    out[#out + 1] = node
    out[#out + 1] = resolve_node(b, node, mode, 'node_lost', now)
  end
end
flush(b)
return out
