"""The ledger's Lua scripts: each runs atomically inside Redis, so no two writers interleave.

Keys are built inside the scripts from the run prefix (ARGV[1]), so these assume one Redis
server, not a cluster. Every script is safe to run twice with the same arguments (a client that
retries after a dropped connection must not take a second credit or train a sample twice), and
every writing script answers a repeat exactly as it answered the first call: `exactly_once` keeps
the reply under the call's own key (KEYS[1], one per call) for `REPLY_TTL_S`. Without that, a
retried `TRANSITION` whose first reply was lost would report its samples as refused (they moved
the first time), and the learner would never train them.

Key layout under the prefix `streamrl:{run}:`:
  meta            hash   capacity, max_staleness, groups_per_step, finished (time the run ended)
  version         string current policy version
  versions        hash   version -> JSON {"step", "time"}
  rollbacks       list   JSON {"from", "to", "samples", "time"} per roll_back
  learner         hash   incarnation, control_addr, trajectory_addr, time (the learner now serving the run)
  inflight        string groups holding a credit (taken, not every sample resolved)
  counts          hash   total, admitted, generated, received, trained, dropped, dropped:<reason>
  lag             hash   staleness (versions) at training -> samples
  s:<sample_id>   hash   node, group, state, v_adm, v, vmin, v_trn, t_adm, t_gen, t_rcv, t_end
  g:<group_id>    hash   node, n, open (samples not yet resolved), prompt, t
  ng:<node_id>    set    groups of the node holding a credit
  adm / admseq    zset   groups holding a credit, by admission order (the learner trains them in it)
  server          hash   run_id, since: the Redis server the reaper last saw, and when (a restart pauses it)
  tv:<version>    set    samples trained by that policy version (what a roll-back undoes)
  nodes / lost    set    nodes seen alive / nodes reaped or gone
  alive:<node_id> string heartbeat, expires after the TTL
  orphans         list   groups of lost nodes waiting for another node (on_node_lost = readmit)
  rq:<call id>    string a writing call's reply, kept REPLY_TTL_S for its retries
"""

REPLY_TTL_S = 600  # longer than any retry (ledger.retry_s is at most 300 s)


def exactly_once(body: str) -> str:
    """`body` as a script whose reply is kept under KEYS[1]: a repeat of the call returns it unchanged.

    Error replies are not kept (a repeat re-checks). The reply goes through cjson, so it must be
    an integer or a flat array of integers and strings, which every ledger reply is.
    """
    return (
        "local kept = redis.call('GET', KEYS[1])\n"
        "if kept then return cjson.decode(kept) end\n"
        "local function body()\n" + body + "\nend\n"
        "local out = body()\n"
        "if type(out) == 'table' and out.err then return out end\n"
        f"redis.call('SET', KEYS[1], cjson.encode(out), 'EX', {REPLY_TTL_S})\n"
        "return out\n"
    )


# Shared helpers, pasted in front of the scripts that resolve samples. Counter, staleness and
# group changes are summed over the batch (`books`) and written once at the end (`flush`): the
# learner's batches cost two commands per sample instead of a dozen.
_RESOLVE = r"""
local function books(p) return {p = p, counts = {}, lag = {}, groups = {}} end

local function bump(b, field, n) b.counts[field] = (b.counts[field] or 0) + n end

local function finish(b, key, id, state, target, now, vmin)
  redis.call('HSET', key, 'state', target, 't_end', now)
  bump(b, state, -1)
  if target == 'trained' then
    bump(b, 'trained', 1)
    b.version = b.version or tonumber(redis.call('GET', b.p .. 'version') or '0')
    redis.call('HSET', key, 'v_trn', b.version)
    redis.call('SADD', b.p .. 'tv:' .. b.version, id)
    local lag = tostring(b.version - tonumber(vmin or '0'))
    b.lag[lag] = (b.lag[lag] or 0) + 1
  else
    bump(b, 'dropped', 1)
    bump(b, target, 1)
  end
  local group = string.match(id, '^(.*):%d+$')
  b.groups[group] = (b.groups[group] or 0) + 1
end

-- A group whose last sample is resolved returns its credit.
local function flush(b)
  for field, n in pairs(b.counts) do
    if n ~= 0 then redis.call('HINCRBY', b.p .. 'counts', field, n) end
  end
  for lag, n in pairs(b.lag) do
    if n ~= 0 and redis.call('HINCRBY', b.p .. 'lag', lag, n) == 0 then redis.call('HDEL', b.p .. 'lag', lag) end
  end
  for group, n in pairs(b.groups) do
    local gk = b.p .. 'g:' .. group
    if redis.call('HINCRBY', gk, 'open', -n) == 0 then
      redis.call('DECR', b.p .. 'inflight')
      redis.call('SREM', b.p .. 'ng:' .. redis.call('HGET', gk, 'node'), group)
      redis.call('ZREM', b.p .. 'adm', group)
    end
  end
end
"""

# ARGV: prefix, node, group, n, prompt, now[, node_version]. Returns 1 (credit taken; also when this
# node already holds this group: a retried call), 0 (no credit free: the capacity is used, or the group
# could not be trained within max_staleness of node_version, or, in sync mode, the step's groups are
# out or the node's weights are not the learner's newest, or the remaining steps cannot train it).
# Errors: node not alive, run not set up, group id used by another node.
TAKE_CREDIT = r"""
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
local q = tonumber(redis.call('GET', p .. 'inflight') or '0')
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
"""

# ARGV: prefix, target, now, stride, then `stride` values per sample: id [, version, vmin, node].
# Returns, per sample, 1 when it moved to `target`, else its state at the time ('' if unknown).
TRANSITION = (
    _RESOLVE
    + r"""
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
"""
)

# Resolves a node's samples not yet received by the learner (received ones no longer depend on
# it): dropped with `reason`, or re-admitted and their groups queued for another node. Returns
# how many samples.
_RESOLVE_NODE = (
    _RESOLVE
    + r"""
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
"""
)

# Every group holding a credit, once: those of each node seen (alive or gone), then those waiting
# for a node (readmit). Bounded by the credit capacity, so scripts may walk it.
_GROUPS_IN_FLIGHT = r"""
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
"""

# ARGV: prefix, mode ('drop' | 'readmit'), now, heartbeat TTL (s). Every node whose heartbeat
# expired is resolved (reason node_lost). Returns {node, samples resolved, node, samples resolved, ...}.
REAP = (
    _RESOLVE_NODE
    + r"""
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
"""
)

# ARGV: prefix, node, reason, now. A node leaving, or one that is gone resolved by another
# process: its samples not yet received are dropped with `reason`.
LEAVE = (
    _RESOLVE_NODE
    + r"""
local b = books(ARGV[1])
local resolved = resolve_node(b, ARGV[2], 'drop', ARGV[3], ARGV[4])
flush(b)
return resolved
"""
)

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


# ARGV: prefix, from_version, now. A learner resumed from the weights of `from_version` undoes
# what came after them: samples trained by that version or a later one (the steps the checkpoint
# does not contain) and in-flight samples generated by a later one (a policy the run no longer
# has) become dropped:rolled_back; the version goes back to `from_version`, the later versions'
# records move into `rollbacks`. Returns the samples rolled back.
ROLL_BACK = (
    _RESOLVE
    + _GROUPS_IN_FLIGHT
    + r"""
local p, from, now = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local cur = tonumber(redis.call('GET', p .. 'version') or '0')
if from > cur then
  return redis.error_reply('ROLLBACK_AHEAD version ' .. from .. ' is newer than the current ' .. cur)
end
local b = books(p)
local n = 0
for v = from, cur do
  for _, id in ipairs(redis.call('SMEMBERS', p .. 'tv:' .. v)) do
    local key = p .. 's:' .. id
    local row = redis.call('HMGET', key, 'state', 'vmin')
    if row[1] == 'trained' then
      redis.call('HSET', key, 'state', 'dropped:rolled_back', 't_end', now)
      bump(b, 'trained', -1)
      bump(b, 'dropped', 1)
      bump(b, 'dropped:rolled_back', 1)
      local lag = tostring(v - tonumber(row[2] or '0'))
      b.lag[lag] = (b.lag[lag] or 0) - 1
      n = n + 1
    end
  end
  redis.call('DEL', p .. 'tv:' .. v)
end
for _, entry in ipairs(groups_in_flight(p)) do
  local group = entry[1]
  for i = 0, tonumber(redis.call('HGET', p .. 'g:' .. group, 'n')) - 1 do
    local id = group .. ':' .. i
    local key = p .. 's:' .. id
    local row = redis.call('HMGET', key, 'state', 'v', 'vmin')
    if (row[1] == 'generated' or row[1] == 'received') and tonumber(row[2]) > from then
      finish(b, key, id, row[1], 'dropped:rolled_back', now, row[3])
      n = n + 1
    end
  end
end
flush(b)
for v = from + 1, cur do redis.call('HDEL', p .. 'versions', tostring(v)) end
redis.call('SET', p .. 'version', from)
redis.call('RPUSH', p .. 'rollbacks', cjson.encode({from = from, to = cur, samples = n, time = tonumber(now)}))
return n
"""
)

# ARGV: prefix, reason, now. Every `received` sample is dropped with `reason`: what a learner took
# in and never trained, when a new learner starts (nobody sends it again). Returns how many.
DROP_RECEIVED = (
    _RESOLVE
    + _GROUPS_IN_FLIGHT
    + r"""
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
"""
)

# ARGV: prefix. Read only: the in-flight samples by holder, in one consistent snapshot.
# Returns {received, orphaned, node, alive (1|0), admitted + generated, node, alive, n, ...}.
IN_FLIGHT = (
    _GROUPS_IN_FLIGHT
    + r"""
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
"""
)
