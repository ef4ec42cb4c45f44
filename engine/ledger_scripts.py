"""The ledger's Lua scripts: each runs atomically inside Redis, so no two writers interleave.

Keys are built inside the scripts from the run prefix (ARGV[1]), so these assume one Redis
server, not a cluster. Every script is safe to run twice with the same arguments (a client that
retries after a dropped connection must not take a second credit or train a sample twice).

Key layout under the prefix `streamrl:{run}:`:
  meta            hash   capacity, max_staleness, groups_per_step
  version         string current policy version
  versions        hash   version -> JSON {"step", "time"}
  inflight        string groups holding a credit (taken, not every sample resolved)
  counts          hash   total, admitted, generated, received, trained, dropped, dropped:<reason>
  lag             hash   staleness (versions) at training -> samples
  s:<sample_id>   hash   node, group, state, v_adm, v, vmin, t_adm, t_gen, t_rcv, t_end
  g:<group_id>    hash   node, n, open (samples not yet resolved), prompt, t
  ng:<node_id>    set    groups of the node holding a credit
  nodes / lost    set    nodes seen alive / nodes reaped or gone
  alive:<node_id> string heartbeat, expires after the TTL
  orphans         list   groups of lost nodes waiting for another node (on_node_lost = readmit)
"""

# Shared helpers, pasted in front of the scripts that resolve samples.
_RESOLVE = r"""
local function release(p, key)
  local group = redis.call('HGET', key, 'group')
  local gk = p .. 'g:' .. group
  if redis.call('HINCRBY', gk, 'open', -1) == 0 then
    redis.call('DECR', p .. 'inflight')
    redis.call('SREM', p .. 'ng:' .. redis.call('HGET', gk, 'node'), group)
  end
end

local function finish(p, key, state, target, now)
  redis.call('HSET', key, 'state', target, 't_end', now)
  redis.call('HINCRBY', p .. 'counts', state, -1)
  if target == 'trained' then
    redis.call('HINCRBY', p .. 'counts', 'trained', 1)
    local lag = tonumber(redis.call('GET', p .. 'version') or '0') - tonumber(redis.call('HGET', key, 'vmin') or '0')
    redis.call('HINCRBY', p .. 'lag', tostring(lag), 1)
  else
    redis.call('HINCRBY', p .. 'counts', 'dropped', 1)
    redis.call('HINCRBY', p .. 'counts', target, 1)
  end
  release(p, key)
end
"""

# ARGV: prefix, node, group, n, prompt, now. Returns 1 (credit taken; also when this node already
# holds this group: a retried call), 0 (no credit free). Errors: node not alive, run not set up,
# group id used by another node.
TAKE_CREDIT = r"""
local p, node, group, n, prompt, now = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5], ARGV[6]
if redis.call('EXISTS', p .. 'alive:' .. node) == 0 then
  return redis.error_reply('NODE_NOT_ALIVE node ' .. node .. ' has no live heartbeat; call heartbeat() first')
end
local gk = p .. 'g:' .. group
local owner = redis.call('HGET', gk, 'node')
if owner then
  if owner == node then return 1 end
  return redis.error_reply('GROUP_EXISTS group id ' .. group .. ' was already used (by node ' .. owner .. '); group ids must be unique per run')
end
local cap = redis.call('HGET', p .. 'meta', 'capacity')
if not cap then
  return redis.error_reply('RUN_NOT_SET_UP no capacity recorded for this run; the learner calls init_run() first')
end
if tonumber(redis.call('GET', p .. 'inflight') or '0') >= tonumber(cap) then return 0 end
redis.call('INCR', p .. 'inflight')
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
"""

# ARGV: prefix, target, now, stride, then `stride` values per sample: id [, version, vmin].
# Returns, per sample, 1 when it moved to `target`, else its state at the time ('' if unknown).
TRANSITION = _RESOLVE + r"""
local p, target, now, stride = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local legal = {generated = {admitted = true}, received = {generated = true}, trained = {received = true}}
local dropping = string.sub(target, 1, 8) == 'dropped:'
local from = dropping and {admitted = true, generated = true, received = true} or legal[target]
if not from then return redis.error_reply('BAD_TARGET unknown target state ' .. target) end
local out = {}
for i = 5, #ARGV, stride do
  local key = p .. 's:' .. ARGV[i]
  local state = redis.call('HGET', key, 'state')
  if state and from[state] then
    if dropping or target == 'trained' then
      finish(p, key, state, target, now)
    else
      local stamp = target == 'generated' and 't_gen' or 't_rcv'
      redis.call('HSET', key, 'state', target, stamp, now)
      if target == 'generated' then redis.call('HSET', key, 'v', ARGV[i + 1], 'vmin', ARGV[i + 2]) end
      redis.call('HINCRBY', p .. 'counts', state, -1)
      redis.call('HINCRBY', p .. 'counts', target, 1)
    end
    out[#out + 1] = 1
  else
    out[#out + 1] = state or ''
  end
end
return out
"""

# ARGV: prefix, node, mode ('drop' | 'readmit'), reason, now, force ('1': the node leaves; '0':
# only when its heartbeat expired). Resolves the node's samples not yet received by the learner
# (received ones no longer depend on it). Returns how many, or -1 when the node is still alive.
RESOLVE_NODE = _RESOLVE + r"""
local p, node, mode, reason, now, force = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
if force ~= '1' and redis.call('EXISTS', p .. 'alive:' .. node) == 1 then return -1 end
local resolved = 0
for _, group in ipairs(redis.call('SMEMBERS', p .. 'ng:' .. node)) do
  local gk = p .. 'g:' .. group
  local reset = false
  for i = 0, tonumber(redis.call('HGET', gk, 'n')) - 1 do
    local key = p .. 's:' .. group .. ':' .. i
    local state = redis.call('HGET', key, 'state')
    if state == 'admitted' or state == 'generated' then
      resolved = resolved + 1
      if mode == 'readmit' then
        redis.call('HSET', key, 'state', 'admitted', 'node', '')
        redis.call('HINCRBY', p .. 'counts', state, -1)
        redis.call('HINCRBY', p .. 'counts', 'admitted', 1)
        reset = true
      else
        finish(p, key, state, 'dropped:' .. reason, now)
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
"""

# ARGV: prefix, node. Hands the oldest orphaned group to `node`.
# Returns {} when none waits, else {group, prompt, sample ids still to generate...}.
CLAIM_ORPHAN = r"""
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
"""

# ARGV: prefix, version, record JSON. Versions only move forward; the same one again is a no-op
# (a resumed learner republishes its version).
PUBLISH_VERSION = r"""
local p, v = ARGV[1], tonumber(ARGV[2])
local cur = tonumber(redis.call('GET', p .. 'version') or '-1')
if v < cur then
  return redis.error_reply('VERSION_BACKWARDS version ' .. v .. ' is older than the current ' .. cur)
end
redis.call('SET', p .. 'version', v)
redis.call('HSETNX', p .. 'versions', tostring(v), ARGV[3])
return cur
"""
