-- Shared helpers, pasted in front of the scripts that resolve samples. Counter, staleness and
-- group changes are summed over the batch (`books`) and written once at the end (`flush`): the
-- learner's batches cost two commands per sample instead of a dozen.
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
