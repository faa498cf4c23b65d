"""Lua scripts run server-side by :mod:`scoring.index.redis` (Redis >= 7, Valkey >= 8).

Key layout, all under one hash tag ``{ns}`` so that every key of a namespace lives in
one cluster slot and each script touches a single slot (``P`` = ``"{" + ns + "}:"``;
``K`` = a block key as 8 raw big-endian bytes):

* ``P s <id>`` -- HASH per *slot* (one generation of one (pod, tier)): field ``K`` ->
  count of stored copies.  The source of truth for counts.
* ``P b K`` -- HASH per block: field slot id -> 1 while that slot holds the block (a
  *holder hint*, written and deleted together with the slot's entry).  No TTL: a hot
  block stored once and then only hit must stay findable.
* ``P seen`` -- HASH slot id -> server time (ms) of the slot's last ``add``.  A slot is
  *live* while its id is registered and ``now - seen < ttl_s`` (always, with no TTL);
  the slot hash itself expires ``ttl_s + 60`` s after its last ``add``, so a live slot's
  hash always exists and a pod that stores nothing for ``ttl_s`` (vanished without a
  ``clear_pod``) is ignored at once and freed soon after.
* ``P pods`` -- HASH ``pod NUL tier`` -> current slot id; ``P ids`` -- HASH slot id ->
  ``tier NUL pod``; ``P next`` -- slot id counter (ids are never reused).  No TTL.

``clear_pod`` retires the slot: drops it from ``pods``/``ids``/``seen`` and UNLINKs its
hash (freed in the background; no scan).  Its hint fields are invisible at once (only
live ids count) and are deleted by ``SWEEP`` (run periodically by the writer), which
also retires slots that went stale.

Block and slot key names are built inside the scripts from the prefix in ``ARGV``; they
share the declared keys' hash tag (same cluster slot), which Redis allows for scripts
declared with a shebang.
"""

from __future__ import annotations

#: Seconds a slot hash outlives its ``ttl_s`` (so a slot live by ``seen`` always has one).
SLOT_GRACE_S = 60

_NOW_MS = """
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
"""

#: KEYS: pods, ids, next, seen.  ARGV: prefix P, pod, tier, ttl seconds (0 = none),
#: packed keys (8 bytes each).  Counts one more copy of each key, writes the holder
#: hint of new entries, stamps ``seen`` and refreshes the slot's TTL.
#: Returns the number of new entries.
ADD = (
    """#!lua
"""
    + _NOW_MS
    + """
local P = ARGV[1]
local field = ARGV[2] .. '\\0' .. ARGV[3]
local id = redis.call('HGET', KEYS[1], field)
if not id then
  id = tostring(redis.call('INCR', KEYS[3]))
  redis.call('HSET', KEYS[1], field, id)
  redis.call('HSET', KEYS[2], id, ARGV[3] .. '\\0' .. ARGV[2])
end
local slot = P .. 's' .. id
local bprefix = P .. 'b'
local ttl = tonumber(ARGV[4])
local packed = ARGV[5]
local new = 0
for off = 1, #packed, 8 do
  local kb = string.sub(packed, off, off + 7)
  if redis.call('HINCRBY', slot, kb, 1) == 1 then
    redis.call('HSET', bprefix .. kb, id, 1)
    new = new + 1
  end
end
redis.call('HSET', KEYS[4], id, now_ms)
if ttl > 0 then redis.call('EXPIRE', slot, ttl + """
    + str(SLOT_GRACE_S)
    + """) end
return new
"""
)

#: KEYS: pods.  ARGV: prefix P, pod, tier, packed keys.  Counts one copy fewer; an
#: entry reaching 0 is deleted with its hint.  Returns the number of entries deleted.
REMOVE = """#!lua
local P = ARGV[1]
local id = redis.call('HGET', KEYS[1], ARGV[2] .. '\\0' .. ARGV[3])
if not id then return 0 end
local slot = P .. 's' .. id
local bprefix = P .. 'b'
local packed = ARGV[4]
local gone = 0
for off = 1, #packed, 8 do
  local kb = string.sub(packed, off, off + 7)
  local v = redis.call('HGET', slot, kb)
  if v then
    if tonumber(v) <= 1 then
      redis.call('HDEL', slot, kb)
      redis.call('HDEL', bprefix .. kb, id)
      gone = gone + 1
    else
      redis.call('HINCRBY', slot, kb, -1)
    end
  end
end
return gone
"""

#: KEYS: pods, ids, seen.  ARGV: prefix P, pod, tier...  Retires the pod's slot in each
#: tier (O(tiers); the slot hash is UNLINKed).  Returns the number of slots retired.
CLEAR = """#!lua
local retired = 0
for i = 3, #ARGV do
  local f = ARGV[2] .. '\\0' .. ARGV[i]
  local id = redis.call('HGET', KEYS[1], f)
  if id then
    redis.call('HDEL', KEYS[1], f)
    redis.call('HDEL', KEYS[2], id)
    redis.call('HDEL', KEYS[3], id)
    redis.call('UNLINK', ARGV[1] .. 's' .. id)
    retired = retired + 1
  end
end
return retired
"""

#: KEYS: pods, ids, seen.  ARGV: prefix P, packed keys, ttl seconds (0 = none),
#: number of tiers T, T tier names (fastest first), then candidate pods (none = every
#: pod holding block 0).
#:
#: 1. Followed pods: the candidates, or the pods named by block 0's holder hint; their
#:    live slot ids per tier (registered, and ``seen`` within ``ttl``).
#: 2. Each followed pod has per-tier counters c[1..T]; block i extends c[t] when
#:    c[t] == i-1 and the pod holds block i in a tier <= t (so c is cumulative over
#:    tiers, c[T] the longest); a pod leaves at its first block held in no tier.
#:    Phase A, while more than FAN pods are in: one HMGET per block on the block's
#:    holder hint, asking only the ids of pods still in.  Phase B, once FAN or fewer
#:    are left: each pod alone, one HMGET per slot per chunk of blocks (16, 32, 64, ...)
#:    on its own slot hash.  Every pod is checked block by block: the answer is exact.
#: Returns a flat array pod, c[1], ..., c[T], ... for pods with c[T] > 0.
LOOKUP = (
    """#!lua flags=no-writes
"""
    + _NOW_MS
    + """
local FAN = 8
local CHUNK_MAX = 4000
local P = ARGV[1]
local packed = ARGV[2]
local ttl_ms = tonumber(ARGV[3]) * 1000
local nt = tonumber(ARGV[4])
local nblocks = math.floor(#packed / 8)
if nblocks == 0 then return {} end
local bprefix = P .. 'b'
local sprefix = P .. 's'

local kb = {}
local built = 0
local function keys_upto(e)
  for i = built + 1, e do kb[i] = string.sub(packed, 8 * i - 7, 8 * i) end
  if e > built then built = e end
end

local function hmget(key, fields)
  local out = {}
  local n = #fields
  for s = 1, n, CHUNK_MAX do
    local e = math.min(s + CHUNK_MAX - 1, n)
    local part = redis.call('HMGET', key, unpack(fields, s, e))
    for j = 1, #part do out[s + j - 1] = part[j] end
  end
  return out
end

keys_upto(1)
local names = {}
local first = 5 + nt
if #ARGV >= first then
  for c = first, #ARGV do names[#names + 1] = ARGV[c] end
else
  local seen_pod = {}
  local ids = redis.call('HKEYS', bprefix .. kb[1])
  if #ids == 0 then return {} end
  local infos = hmget(KEYS[2], ids)
  for j = 1, #ids do
    local info = infos[j]
    if info then
      local z = string.find(info, '\\0', 1, true)
      local pod = string.sub(info, z + 1)
      if not seen_pod[pod] then
        seen_pod[pod] = true
        names[#names + 1] = pod
      end
    end
  end
end
if #names == 0 then return {} end

-- live slot ids of the followed pods, per tier
local fields, want_pod, want_tier = {}, {}, {}
for c = 1, #names do
  for t = 1, nt do
    fields[#fields + 1] = names[c] .. '\\0' .. ARGV[4 + t]
    want_pod[#fields] = names[c]
    want_tier[#fields] = t
  end
end
local slot_ids = hmget(KEYS[1], fields)
local got, got_j = {}, {}
for j = 1, #fields do
  if slot_ids[j] then
    got[#got + 1] = slot_ids[j]
    got_j[#got] = j
  end
end
if #got == 0 then return {} end
local stamps = hmget(KEYS[3], got)
local pod_of, tier_of, ids_of, counts = {}, {}, {}, {}
local active = {}
for g = 1, #got do
  local stamp = stamps[g]
  if stamp and (ttl_ms <= 0 or now_ms - tonumber(stamp) < ttl_ms) then
    local id = got[g]
    local pod = want_pod[got_j[g]]
    pod_of[id] = pod
    tier_of[id] = want_tier[got_j[g]]
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

-- extend the counters of pod with block i held at fastest tier b (nil: not held)
local function extend(pod, i, b)
  if not b then return false end
  local c = counts[pod]
  for t = b, nt do
    if c[t] == i - 1 then c[t] = i end
  end
  return true
end

-- phase A: block by block on the holder hints (always for block 0)
local i = 1
while i <= nblocks and #active > 0 and (i == 1 or #active > FAN) do
  keys_upto(i)
  local ask = {}
  for a = 1, #active do
    local l = ids_of[active[a]]
    for j = 1, #l do ask[#ask + 1] = l[j] end
  end
  local vals = hmget(bprefix .. kb[i], ask)
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
    if extend(pod, i, best[pod]) then still[#still + 1] = pod end
  end
  active = still
  i = i + 1
end

-- phase B: each remaining pod alone, chunk by chunk on its slot hashes
for a = 1, #active do
  local pod = active[a]
  local l = ids_of[pod]
  local s = i
  local size = 16
  local going = true
  while going and s <= nblocks do
    local e = math.min(s + size - 1, nblocks)
    keys_upto(e)
    if #l == 1 then
      -- one slot: the run of present blocks extends every tier >= the slot's tier
      local vals = redis.call('HMGET', sprefix .. l[1], unpack(kb, s, e))
      local run = 0
      while run < #vals and vals[run + 1] do run = run + 1 end
      local c = counts[pod]
      for t = tier_of[l[1]], nt do
        if c[t] == s - 1 then c[t] = s - 1 + run end
      end
      going = run == e - s + 1
    else
      local best = {}
      for j = 1, #l do
        local id = l[j]
        local t = tier_of[id]
        local vals = redis.call('HMGET', sprefix .. id, unpack(kb, s, e))
        for k = 1, #vals do
          if vals[k] then
            local b = best[k]
            if b == nil or t < b then best[k] = t end
          end
        end
      end
      for k = 1, e - s + 1 do
        if not extend(pod, s + k - 1, best[k]) then
          going = false
          break
        end
      end
    end
    s = e + 1
    size = math.min(size * 2, CHUNK_MAX)
  end
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
)

#: KEYS: ids, seen.  ARGV: prefix P, ttl seconds.  Returns a flat array pod, entries,
#: ... (entries: HLEN of each live slot, summed over the pod's tiers).
POD_ENTRIES = (
    """#!lua flags=no-writes
"""
    + _NOW_MS
    + """
local ttl_ms = tonumber(ARGV[2]) * 1000
local flat = redis.call('HGETALL', KEYS[1])
local total, order = {}, {}
for j = 1, #flat, 2 do
  local id = flat[j]
  local stamp = redis.call('HGET', KEYS[2], id)
  if stamp and (ttl_ms <= 0 or now_ms - tonumber(stamp) < ttl_ms) then
    local info = flat[j + 1]
    local z = string.find(info, '\\0', 1, true)
    local pod = string.sub(info, z + 1)
    local n = redis.call('HLEN', ARGV[1] .. 's' .. id)
    if n > 0 then
      if total[pod] == nil then
        total[pod] = 0
        order[#order + 1] = pod
      end
      total[pod] = total[pod] + n
    end
  end
end
local out = {}
for j = 1, #order do
  out[#out + 1] = order[j]
  out[#out + 1] = total[order[j]]
end
return out
"""
)

#: KEYS: pods, ids, seen.  ARGV: prefix P, ttl seconds, then holder-hint key names.
#: A slot id is dead when unregistered, stale (``seen`` older than ttl) or its hash is
#: gone: its hint fields are deleted, and a registered dead slot is retired (as by
#: ``clear_pod``).  Returns the number of hint fields deleted.
SWEEP = (
    """#!lua
"""
    + _NOW_MS
    + """
local P = ARGV[1]
local ttl_ms = tonumber(ARGV[2]) * 1000
local alive = {}
local function live(id)
  local v = alive[id]
  if v ~= nil then return v end
  local info = redis.call('HGET', KEYS[2], id)
  v = false
  if info then
    local stamp = redis.call('HGET', KEYS[3], id)
    local fresh = stamp and (ttl_ms <= 0 or now_ms - tonumber(stamp) < ttl_ms)
    if fresh and redis.call('EXISTS', P .. 's' .. id) == 1 then
      v = true
    else
      local z = string.find(info, '\\0', 1, true)
      local field = string.sub(info, z + 1) .. '\\0' .. string.sub(info, 1, z - 1)
      if redis.call('HGET', KEYS[1], field) == id then redis.call('HDEL', KEYS[1], field) end
      redis.call('HDEL', KEYS[2], id)
      redis.call('HDEL', KEYS[3], id)
      redis.call('UNLINK', P .. 's' .. id)
    end
  end
  alive[id] = v
  return v
end
local gone = 0
for a = 3, #ARGV do
  local ids = redis.call('HKEYS', ARGV[a])
  for j = 1, #ids do
    if not live(ids[j]) then
      redis.call('HDEL', ARGV[a], ids[j])
      gone = gone + 1
    end
  end
end
return gone
"""
)

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
