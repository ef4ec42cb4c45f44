-- ARGV: prefix, node, group, n, prompt, now[, node_version]. Returns 1 (credit taken; also when this
-- node already holds this group: a retried call), 0 (no credit free: the capacity is used, or the group
-- could not be trained within max_staleness of node_version, or, in sync mode, the step's groups are
-- out or the node's weights are not the learner's newest, or the remaining steps cannot train it).
-- max_staleness is the run meta's, LedgerConfig.staleness_bound: this refusal only saves work (a group
-- generated past it would be dropped); Ledger.drop_stale at consumption is what guarantees the bound.
-- Errors: node not alive, run not set up, group id used by another node.
local p, node, group, n, prompt, now = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5], ARGV[6]
local node_version = tonumber(ARGV[7] or '-1')
if redis.call('EXISTS', p .. 'alive:' .. node) == 0 then
  return redis.error_reply('NODE_NOT_ALIVE node ' .. node .. ' has no live heartbeat; call heartbeat() first')
end
local gk = p .. 'g:' .. group
local owner = redis.call('HGET', gk, 'node')
if owner then
  if owner == node then return 1 end
  return redis.error_reply('GROUP_EXISTS group id ' .. group .. ' was already used (by node ' .. owner ..
                           '); group ids must be unique per run')
end
local cap = redis.call('HGET', p .. 'meta', 'capacity')
if not cap then
  return redis.error_reply('RUN_NOT_SET_UP no capacity recorded for this run; the learner calls init_run() first')
end
-- q: the groups ahead of this one, the places the learner holds for groups it gave up included (their steps
-- train without them, so a group admitted now is trained after those steps, not in them)
local q = tonumber(redis.call('GET', p .. 'inflight') or '0') + tonumber(redis.call('GET', p .. 'held') or '0')
if q >= tonumber(cap) then return 0 end
local meta = redis.call('HMGET', p .. 'meta', 'groups_per_step', 'max_staleness', 'mode', 'steps_left')
local per_step, staleness, left = tonumber(meta[1]), tonumber(meta[2]), tonumber(meta[4] or '-1')
local current = tonumber(redis.call('GET', p .. 'version') or '0')
-- near the end: no group the remaining steps cannot train
if left >= 0 and q >= left * per_step then return 0 end
if node_version >= 0 then
  if meta[3] == 'sync' then
    -- one step's groups, generated with the weights the learner holds now
    if q >= per_step or node_version < current then return 0 end
  else
    -- groups are trained in order: this one by version current + floor(q / per_step); its samples
    -- come from node_version, so it would be that many versions old
    if math.floor(q / per_step) + math.max(0, current - node_version) > staleness then return 0 end
  end
end
redis.call('INCR', p .. 'inflight')
redis.call('ZADD', p .. 'adm', redis.call('INCR', p .. 'admseq'), group)
redis.call('HSET', gk, 'node', node, 'n', n, 'open', n, 'prompt', prompt, 't', now)
redis.call('SADD', p .. 'ng:' .. node, group)
local v = redis.call('GET', p .. 'version') or '0'
for i = 0, n - 1 do
  redis.call('HSET', p .. 's:' .. group .. ':' .. i, 'node', node, 'group', group, 'state', 'admitted',
             'v_adm', v, 't_adm', now)
end
redis.call('HINCRBY', p .. 'counts', 'total', n)
redis.call('HINCRBY', p .. 'counts', 'admitted', n)
return 1
