"""Lua scripts run server-side by :mod:`scoring.index.redis` (Redis >= 7, Valkey >= 8).

Key layout, all under one hash tag ``{ns}`` so that every key of a namespace lives in
one cluster slot and each script touches a single slot (``P`` = ``"{" + ns + "}:"``):

* ``P b <8 bytes>`` -- HASH, one per block key (big-endian uint64, raw bytes):
  field = slot id (decimal), value = count of stored copies.  Carries the TTL,
  refreshed by every ``add`` that touches it.
* ``P pods`` -- HASH ``pod NUL tier`` -> slot id of the pod's *current generation* in
  that tier.
* ``P ids`` -- HASH slot id -> ``tier NUL pod`` for live slots only.
* ``P next`` -- counter for new slot ids (never reused).
* ``P n`` -- HASH slot id -> number of distinct (key) entries of that slot.

A *slot* is one generation of one (pod, tier).  ``clear_pod`` deletes the slot from
``pods`` / ``ids`` / ``n``: every field carrying the old id becomes invisible at once
(lookups only count ids present in ``ids``) and dies with its block key's TTL, or is
removed earlier by ``sweep``.  The next ``add`` allocates a fresh id.

Block keys are built inside the scripts from the prefix in ``ARGV`` and the packed keys;
they share the declared keys' hash tag (same slot), which Redis allows for scripts
declared with a shebang.
"""

from __future__ import annotations

#: KEYS: pods, ids, next, n.  ARGV: block-key prefix, pod, tier, ttl seconds (0 = none),
#: packed keys (8 bytes each).  Returns the number of new (key) entries.
ADD = """#!lua
local field = ARGV[2] .. '\\0' .. ARGV[3]
local id = redis.call('HGET', KEYS[1], field)
if not id then
  id = tostring(redis.call('INCR', KEYS[3]))
  redis.call('HSET', KEYS[1], field, id)
  redis.call('HSET', KEYS[2], id, ARGV[3] .. '\\0' .. ARGV[2])
end
local prefix = ARGV[1]
local ttl = tonumber(ARGV[4])
local packed = ARGV[5]
local new = 0
for off = 1, #packed, 8 do
  local k = prefix .. string.sub(packed, off, off + 7)
  if redis.call('HINCRBY', k, id, 1) == 1 then new = new + 1 end
  if ttl > 0 then redis.call('EXPIRE', k, ttl) end
end
if new > 0 then redis.call('HINCRBY', KEYS[4], id, new) end
return new
"""

#: KEYS: pods, n.  ARGV: block-key prefix, pod, tier, packed keys.
#: Returns the number of entries that reached count 0 and were deleted.
REMOVE = """#!lua
local id = redis.call('HGET', KEYS[1], ARGV[2] .. '\\0' .. ARGV[3])
if not id then return 0 end
local prefix = ARGV[1]
local packed = ARGV[4]
local gone = 0
for off = 1, #packed, 8 do
  local k = prefix .. string.sub(packed, off, off + 7)
  local v = redis.call('HGET', k, id)
  if v then
    if tonumber(v) <= 1 then
      redis.call('HDEL', k, id)
      gone = gone + 1
    else
      redis.call('HINCRBY', k, id, -1)
    end
  end
end
if gone > 0 then
  if redis.call('HINCRBY', KEYS[2], id, -gone) <= 0 then redis.call('HDEL', KEYS[2], id) end
end
return gone
"""

#: KEYS: pods, ids, n.  ARGV: pod, tier...  Retires the pod's slot in each tier.
#: Returns the number of slots retired.
CLEAR = """#!lua
local retired = 0
for i = 2, #ARGV do
  local f = ARGV[1] .. '\\0' .. ARGV[i]
  local id = redis.call('HGET', KEYS[1], f)
  if id then
    redis.call('HDEL', KEYS[1], f)
    redis.call('HDEL', KEYS[2], id)
    redis.call('HDEL', KEYS[3], id)
    retired = retired + 1
  end
end
return retired
"""

#: KEYS: pods, ids.  ARGV: block-key prefix, packed keys, number of tiers T,
#: tier names (fastest first, T of them), then candidate pods (none = all pods).
#:
#: Walk: resolve the slot ids of the candidates (or of every live pod holding block 0),
#: then for block i = 1..n fetch only the ids of pods still extending their prefix
#: (HMGET), take each pod's fastest tier holding block i, and extend every tier
#: counter ``c[t]`` with ``c[t] == i-1 and fastest <= t``.  A pod leaves the walk when
#: its slowest-tier counter stops; the walk stops when no pod is left.
#: Returns a flat array: pod, c[1], ..., c[T], pod, ...
LOOKUP = """#!lua flags=no-writes
local prefix = ARGV[1]
local packed = ARGV[2]
local nt = tonumber(ARGV[3])
local nblocks = math.floor(#packed / 8)
if nblocks == 0 then return {} end
local tier_of_name = {}
for t = 1, nt do tier_of_name[ARGV[3 + t]] = t end

local function hmget(key, fields)
  local out = {}
  local n = #fields
  local step = 4000
  for s = 1, n, step do
    local e = math.min(s + step - 1, n)
    local part = redis.call('HMGET', key, unpack(fields, s, e))
    for j = 1, #part do out[s + j - 1] = part[j] end
  end
  return out
end

local function bkey(i)
  return prefix .. string.sub(packed, 8 * i - 7, 8 * i)
end

-- pod names to follow
local names = {}
local first = 4 + nt
if #ARGV >= first then
  for c = first, #ARGV do names[#names + 1] = ARGV[c] end
else
  local seen = {}
  local flat = redis.call('HGETALL', bkey(1))
  local ids = {}
  for j = 1, #flat, 2 do ids[#ids + 1] = flat[j] end
  if #ids == 0 then return {} end
  local infos = hmget(KEYS[2], ids)
  for j = 1, #ids do
    local info = infos[j]
    if info then
      local z = string.find(info, '\\0', 1, true)
      local pod = string.sub(info, z + 1)
      if not seen[pod] then
        seen[pod] = true
        names[#names + 1] = pod
      end
    end
  end
end
if #names == 0 then return {} end

-- slot ids of those pods, per tier
local fields = {}
local want_pod, want_tier = {}, {}
for c = 1, #names do
  for t = 1, nt do
    fields[#fields + 1] = names[c] .. '\\0' .. ARGV[3 + t]
    want_pod[#fields] = names[c]
    want_tier[#fields] = t
  end
end
local slot_ids = hmget(KEYS[1], fields)
local pod_of, tier_of = {}, {}
local ids_of = {}
local active = {}
local counts = {}
for j = 1, #fields do
  local id = slot_ids[j]
  if id then
    local pod = want_pod[j]
    pod_of[id] = pod
    tier_of[id] = want_tier[j]
    if not ids_of[pod] then
      ids_of[pod] = {}
      active[#active + 1] = pod
      local c = {}
      for t = 1, nt do c[t] = 0 end
      counts[pod] = c
    end
    local l = ids_of[pod]
    l[#l + 1] = id
  end
end

for i = 1, nblocks do
  if #active == 0 then break end
  local ask = {}
  for a = 1, #active do
    local l = ids_of[active[a]]
    for j = 1, #l do ask[#ask + 1] = l[j] end
  end
  local vals = hmget(bkey(i), ask)
  local best = {}
  for j = 1, #ask do
    if vals[j] then
      local id = ask[j]
      local pod = pod_of[id]
      local t = tier_of[id]
      local b = best[pod]
      if b == nil or t < b then best[pod] = t end
    end
  end
  local still = {}
  for a = 1, #active do
    local pod = active[a]
    local b = best[pod]
    if b then
      local c = counts[pod]
      for t = b, nt do
        if c[t] == i - 1 then c[t] = i end
      end
      if c[nt] == i then still[#still + 1] = pod end
    end
  end
  active = still
end

local out = {}
for pod, c in pairs(counts) do
  if c[nt] > 0 then
    out[#out + 1] = pod
    for t = 1, nt do out[#out + 1] = c[t] end
  end
end
return out
"""

#: KEYS: ids, n.  Returns a flat array pod, entries, pod, entries (summed over tiers).
POD_ENTRIES = """#!lua flags=no-writes
local flat = redis.call('HGETALL', KEYS[2])
local total = {}
local order = {}
for j = 1, #flat, 2 do
  local info = redis.call('HGET', KEYS[1], flat[j])
  if info then
    local z = string.find(info, '\\0', 1, true)
    local pod = string.sub(info, z + 1)
    if total[pod] == nil then
      total[pod] = 0
      order[#order + 1] = pod
    end
    total[pod] = total[pod] + tonumber(flat[j + 1])
  end
end
local out = {}
for j = 1, #order do
  out[#out + 1] = order[j]
  out[#out + 1] = total[order[j]]
end
return out
"""

#: KEYS: ids.  ARGV: block keys (full names) to clean.  Deletes fields whose slot id
#: is no longer live.  Returns the number of fields deleted.
SWEEP = """#!lua
local gone = 0
for a = 1, #ARGV do
  local flat = redis.call('HGETALL', ARGV[a])
  for j = 1, #flat, 2 do
    if redis.call('HEXISTS', KEYS[1], flat[j]) == 0 then
      redis.call('HDEL', ARGV[a], flat[j])
      gone = gone + 1
    end
  end
end
return gone
"""

# -- shared load view -------------------------------------------------------------------
# Keys: ``P load:r`` ZSET replica -> expiry (server ms); ``P load:h:<replica>`` HASH
# ``i NUL pod`` -> in-flight requests, ``t NUL pod`` -> outstanding prefill tokens of
# that replica.  A replica that stops heartbeating drops out of snapshots after its TTL.

#: KEYS: replicas zset, this replica's hash.  ARGV: replica, ttl ms, then triples
#: pod, inflight delta, tokens delta (possibly none: a pure heartbeat).  A counter that
#: would go <= 0 is deleted (clamped at 0, like the in-memory store).
LOAD_INCR = """#!lua
local now = redis.call('TIME')
local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local ttl = tonumber(ARGV[2])
for a = 3, #ARGV, 3 do
  local pod = ARGV[a]
  local di = tonumber(ARGV[a + 1])
  local dt = tonumber(ARGV[a + 2])
  if di ~= 0 then
    if redis.call('HINCRBY', KEYS[2], 'i\\0' .. pod, di) <= 0 then
      redis.call('HDEL', KEYS[2], 'i\\0' .. pod)
    end
  end
  if dt ~= 0 then
    if redis.call('HINCRBY', KEYS[2], 't\\0' .. pod, dt) <= 0 then
      redis.call('HDEL', KEYS[2], 't\\0' .. pod)
    end
  end
end
redis.call('ZADD', KEYS[1], ms + ttl, ARGV[1])
redis.call('PEXPIRE', KEYS[2], ttl)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ms)
return ms
"""

#: KEYS: replicas zset.  ARGV: prefix of replica hashes.  Sums live replicas' hashes,
#: each (replica, pod) value clamped at >= 0.  Returns flat pod, inflight, tokens.
LOAD_SNAPSHOT = """#!lua flags=no-writes
local now = redis.call('TIME')
local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local live = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. ms, '+inf')
local inflight, tokens, order = {}, {}, {}
for r = 1, #live do
  local flat = redis.call('HGETALL', ARGV[1] .. live[r])
  for j = 1, #flat, 2 do
    local f = flat[j]
    local pod = string.sub(f, 3)
    local v = tonumber(flat[j + 1])
    if v < 0 then v = 0 end
    if inflight[pod] == nil then
      inflight[pod] = 0
      tokens[pod] = 0
      order[#order + 1] = pod
    end
    if string.sub(f, 1, 1) == 'i' then
      inflight[pod] = inflight[pod] + v
    else
      tokens[pod] = tokens[pod] + v
    end
  end
end
local out = {}
for j = 1, #order do
  local pod = order[j]
  out[#out + 1] = pod
  out[#out + 1] = inflight[pod]
  out[#out + 1] = tokens[pod]
end
return out
"""

#: KEYS: replicas zset.  ARGV: prefix of replica hashes, pod.  Drops ``pod`` from every
#: live replica's hash (pod gone).  Returns the number of fields deleted.
LOAD_CLEAR_POD = """#!lua
local live = redis.call('ZRANGE', KEYS[1], 0, -1)
local gone = 0
for r = 1, #live do
  local h = ARGV[1] .. live[r]
  gone = gone + redis.call('HDEL', h, 'i\\0' .. ARGV[2], 't\\0' .. ARGV[2])
end
return gone
"""
