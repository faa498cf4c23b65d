"""Lua scripts run server-side by :mod:`scoring.index.redis` (Redis >= 7, Valkey >= 8).

Key layout, all under one hash tag ``{ns}`` so that every key of a namespace lives in
one cluster slot and each script touches a single slot (``P`` = ``"{" + ns + "}:"``;
``K`` = a block key as 8 raw big-endian bytes):

* ``P s <id>`` -- HASH per *slot* (one generation of one (pod, tier)): field ``K`` ->
  count of stored copies.  The source of truth for counts.
* ``P h`` -- HASH block key ``K`` -> its *holder hint*: the sorted 4-byte big-endian
  ids of the slots holding the block, written and deleted together with the slot
  entries.  ``P d`` -- HASH ``K`` -> the *digest* of that holder set (``count:a:b``,
  see ``_HINT_OPS``): equal sets have equal digests, so the walk advances every pod at
  once over a run of blocks with one holder set (a shared system prompt) by comparing
  a few bytes, however many pods hold it.  No TTL: a hot block stored once and then
  only hit must stay findable.
* ``P seen`` -- HASH slot id -> server time (ms) of the slot's last ``add``.  A slot is
  *live* while its id is registered and ``now - seen < ttl_s`` (always, with no TTL);
  the slot hash itself expires ``ttl_s + 60`` s after its last ``add``, so a live slot's
  hash always exists and a pod that stores nothing for ``ttl_s`` (vanished without a
  ``clear_pod``) is ignored at once and freed soon after.
* ``P p:<tier>`` -- HASH per tier: pod -> its current slot id in that tier (the pod
  names are the fields, so a lookup reads candidates' ids without building strings);
  ``P ids`` -- HASH slot id -> ``tier NUL pod``; ``P next`` -- slot id counter (ids
  are never reused).  No TTL.

``clear_pod`` retires the slot: drops it from ``p:<tier>``/``ids``/``seen``, UNLINKs its
hash (freed in the background; no scan).  Its id in holder hints is invisible at once
(only live ids count) and is deleted by ``SWEEP`` (run periodically by the writer,
which recomputes the digest), which also retires slots that went stale.

Block and slot key names are built inside the scripts from the prefix in ``ARGV``; they
share the declared keys' hash tag (same cluster slot), which Redis allows for scripts
declared with a shebang.
"""

from __future__ import annotations

#: Seconds a slot hash outlives its ``ttl_s`` (so a slot live by ``seen`` always has one).
SLOT_GRACE_S = 60

#: A field every slot hash and registry hash carries from birth: its value is longer than
#: ``hash-max-listpack-value`` (64 by default), which makes the server store the hash as
#: a hashtable for good.  A listpack answers HMGET in O(fields x entries); slot hashes
#: of small pods and the registries of a few hundred pods would stay listpacks.
#: No real field can equal it (block keys are 8 bytes; pod names and ids hold no NUL).
#: Written as a Lua string literal (NUL + "hashtable").
HASHTABLE_FIELD = "\\0hashtable"
HASHTABLE_VALUE = "h" * 200

_FORCE_HASHTABLE = (
    "local function force_hashtable(key) redis.call('HSETNX', key, '"
    + HASHTABLE_FIELD
    + "', '"
    + HASHTABLE_VALUE
    + "') end\n"
)

#: Lua helpers for holder hints (sorted 4-byte big-endian slot ids in one string).
#: Comparisons are numeric (struct.unpack), never on strings (collation-dependent).
#: Lua helpers for holder hints (sorted 4-byte big-endian slot ids in one string) and
#: their digests.  Comparisons are numeric (struct.unpack), never on strings
#: (collation-dependent).  The digest of a holder set is ``count:a:b`` with a and b the
#: sums, mod 2^40, of two 40-bit slices of SHA-1(slot id) over its ids: kept
#: incrementally (O(1) per insert or delete), equal for equal sets whatever the order
#: of writes.
_HINT_OPS = """
local M40 = 1099511627776
local function fid(id)
  local h = redis.sha1hex(tostring(id))
  return tonumber(string.sub(h, 1, 10), 16), tonumber(string.sub(h, 11, 20), 16)
end
local function digest_add(dk, kb, sign, f)
  local c, a, b = 0, 0, 0
  local d = redis.call('HGET', dk, kb)
  if d then
    local x, y, z = string.match(d, '^(%d+):(%d+):(%d+)$')
    c, a, b = tonumber(x), tonumber(y), tonumber(z)
  end
  c = c + sign
  if c <= 0 then
    redis.call('HDEL', dk, kb)
  else
    a = (a + sign * f[1]) % M40
    b = (b + sign * f[2]) % M40
    redis.call('HSET', dk, kb, string.format('%d:%d:%d', c, a, b))
  end
end
local function hint_find(s, v)
  local lo, hi = 0, #s / 4
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    if struct.unpack('>I4', s, mid * 4 + 1) < v then lo = mid + 1 else hi = mid end
  end
  return lo, lo < #s / 4 and struct.unpack('>I4', s, lo * 4 + 1) == v
end
-- f: {fid(id)}
local function hint_insert(hk, dk, kb, id, f)
  local v = tonumber(id)
  local s = redis.call('HGET', hk, kb)
  if not s then
    redis.call('HSET', hk, kb, struct.pack('>I4', v))
    digest_add(dk, kb, 1, f)
    return
  end
  local at, found = hint_find(s, v)
  if not found then
    local rec = struct.pack('>I4', v)
    redis.call('HSET', hk, kb, string.sub(s, 1, at * 4) .. rec .. string.sub(s, at * 4 + 1))
    digest_add(dk, kb, 1, f)
  end
end
local function hint_delete(hk, dk, kb, id, f)
  local v = tonumber(id)
  local s = redis.call('HGET', hk, kb)
  if not s then return end
  local at, found = hint_find(s, v)
  if found then
    if #s == 4 then
      redis.call('HDEL', hk, kb)
    else
      redis.call('HSET', hk, kb, string.sub(s, 1, at * 4) .. string.sub(s, at * 4 + 5))
    end
    digest_add(dk, kb, -1, f)
  end
end
"""

_NOW_MS = """
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
"""

#: KEYS: p:<tier>, ids, next, seen, hints, digests.  ARGV: prefix P, pod, tier, ttl
#: seconds (0 = none), packed keys (8 bytes each).  Counts one more copy of each key,
#: writes the holder hint and digest of new entries, stamps ``seen`` and refreshes the
#: slot's TTL.
#: Returns the number of new entries.
ADD = (
    """#!lua
"""
    + _NOW_MS
    + _FORCE_HASHTABLE
    + _HINT_OPS
    + """
local P = ARGV[1]
local field = ARGV[2]
local id = redis.call('HGET', KEYS[1], field)
if id and redis.call('EXISTS', P .. 's' .. id) == 0 then
  -- the slot expired (idle past ttl + grace): its hints must not come back to life
  redis.call('HDEL', KEYS[2], id)
  redis.call('HDEL', KEYS[4], id)
  id = nil
end
local slot
if id then
  slot = P .. 's' .. id
else
  id = tostring(redis.call('INCR', KEYS[3]))
  slot = P .. 's' .. id
  force_hashtable(KEYS[1])
  force_hashtable(KEYS[2])
  force_hashtable(KEYS[4])
  force_hashtable(slot)
  redis.call('HSET', KEYS[1], field, id)
  redis.call('HSET', KEYS[2], id, ARGV[3] .. '\\0' .. ARGV[2])
end
local ttl = tonumber(ARGV[4])
local packed = ARGV[5]
local f = {fid(id)}
local new = 0
for off = 1, #packed, 8 do
  local kb = string.sub(packed, off, off + 7)
  if redis.call('HINCRBY', slot, kb, 1) == 1 then
    hint_insert(KEYS[5], KEYS[6], kb, id, f)
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

#: KEYS: p:<tier>, hints, digests.  ARGV: prefix P, pod, tier, packed keys.  Counts one
#: copy fewer; an entry reaching 0 is deleted with its hint (and digest).  Returns the
#: number of entries deleted.
REMOVE = (
    """#!lua
"""
    + _HINT_OPS
    + """
local P = ARGV[1]
local id = redis.call('HGET', KEYS[1], ARGV[2])
if not id then return 0 end
local slot = P .. 's' .. id
local packed = ARGV[4]
local f = {fid(id)}
local gone = 0
for off = 1, #packed, 8 do
  local kb = string.sub(packed, off, off + 7)
  local v = redis.call('HGET', slot, kb)
  if v then
    if tonumber(v) <= 1 then
      redis.call('HDEL', slot, kb)
      hint_delete(KEYS[2], KEYS[3], kb, id, f)
      gone = gone + 1
    else
      redis.call('HINCRBY', slot, kb, -1)
    end
  end
end
return gone
"""
)

#: KEYS: ids, seen, then p:<tier> of each tier to clear.  ARGV: prefix P, pod.  Retires
#: the pod's slot in each of those tiers (O(tiers); the slot hash is UNLINKed).
#: Returns the number of slots retired.
CLEAR = """#!lua
local retired = 0
for i = 3, #KEYS do
  local id = redis.call('HGET', KEYS[i], ARGV[2])
  if id then
    redis.call('HDEL', KEYS[i], ARGV[2])
    redis.call('HDEL', KEYS[1], id)
    redis.call('HDEL', KEYS[2], id)
    redis.call('UNLINK', ARGV[1] .. 's' .. id)
    retired = retired + 1
  end
end
return retired
"""

#: KEYS: ids, seen, hints, digests, then p:<tier> for the T tiers, fastest first.  ARGV: prefix P,
#: packed keys, ttl seconds (0 = none), then candidate pods (none = every pod holding
#: block 0).
#:
#: 1. Followed pods: the candidates, or the pods named by block 0's holder hint; their
#:    live slot ids per tier (registered, and ``seen`` within ``ttl``).
#: 2. Each followed pod has per-tier counters c[1..T]; block i extends c[t] when
#:    c[t] == i-1 and the pod holds block i in a tier <= t (so c is cumulative over
#:    tiers, c[T] the longest); a pod leaves at its first block held in no tier.
#:    The walk reads the blocks' holder hints with one HMGET per chunk of blocks (16,
#:    32, ... 512) and stops at the first block no followed pod holds.  A hint equal
#:    to the previous one (a pointer comparison: Lua interns strings) is not decoded.
#:    Every pod is checked block by block: the answer is exact.
#: Returns {} or two strings (a compact reply: parsing thousands of RESP elements costs
#: the client more than the walk): the pods with c[T] > 0 joined by NUL, and their rows
#: joined by ';' in the same order, a row being c[1..T] in decimal joined by ','.
LOOKUP = (
    """#!lua flags=no-writes
"""
    + _NOW_MS
    + """
local HINT_MAX = 512
local CHUNK_MAX = 4000
local ssub, sfind, unpack4, pack4 = string.sub, string.find, struct.unpack, struct.pack
local P = ARGV[1]
local packed = ARGV[2]
local ttl_ms = tonumber(ARGV[3]) * 1000
local nt = #KEYS - 4
local HK, DK = KEYS[3], KEYS[4]
local nblocks = math.floor(#packed / 8)
if nblocks == 0 then return {} end

local kb = {}
local built = 0
local function keys_upto(e)
  for i = built + 1, e do kb[i] = ssub(packed, 8 * i - 7, 8 * i) end
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

-- Followed pods and their live slots (registered, and ``seen`` within ``ttl``).  A pod
-- with one live slot keeps t1[p] and one counter n1[p] (its hits are 0 below tier t1
-- and n1 from t1 on); a pod with several keeps per-tier counters pc[p][1..T].
-- rec_p / rec_t: a slot id as found in hints (4 packed bytes) -> pod index / tier;
-- false for a slot known not to count.
keys_upto(1)
local hint0 = redis.call('HGET', HK, kb[1])
if not hint0 then return {} end
local ncand = #ARGV - 3
local np = 0
local pindex, pname, t1, n1, pc = {}, {}, {}, {}, {}
local rec_p, rec_t = {}, {}
local tier_of = {}  -- tier name -> 1..T
for t = 1, nt do tier_of[ssub(KEYS[4 + t], #P + 3)] = t end
local function fresh(stamp)
  stamp = tonumber(stamp)
  return stamp ~= nil and (ttl_ms <= 0 or now_ms - stamp < ttl_ms)
end
-- slot (packed r) of followed pod name in tier t, live; at block i (the pod held
-- blocks 1..i-1, so a single-slot pod becoming multi-slot starts from that)
local function follow(r, name, t, i)
  local p = pindex[name]
  if not p then
    np = np + 1
    p = np
    pindex[name] = p
    pname[p] = name
    t1[p] = t
    n1[p] = 0
  elseif not pc[p] then
    local cc = {}
    for u = 1, nt do
      if u >= t1[p] then cc[u] = i - 1 else cc[u] = 0 end
    end
    pc[p] = cc
  end
  rec_p[r] = p
  rec_t[r] = t
  return p
end
local lazy = false  -- slots missing from block 0 resolved when met in a later hint
local gone = {}  -- pods whose run has ended
if ncand > 0 and #hint0 / 4 >= ncand then
  -- more holders of block 0 than candidates: the candidates' slots, one HMGET per tier
  local names = {}
  for c = 4, #ARGV do names[#names + 1] = ARGV[c] end
  local g_id, g_name, g_tier = {}, {}, {}
  for t = 1, nt do
    local ids = hmget(KEYS[4 + t], names)
    for c = 1, #names do
      if ids[c] then
        g_id[#g_id + 1] = ids[c]
        g_name[#g_name + 1] = names[c]
        g_tier[#g_tier + 1] = t
      end
    end
  end
  if #g_id == 0 then return {} end
  local stamps = hmget(KEYS[2], g_id)
  for g = 1, #g_id do
    if fresh(stamps[g]) then
      follow(pack4('>I4', tonumber(g_id[g])), g_name[g], g_tier[g], 1)
    end
  end
else
  -- the pods holding block 0 (among the candidates): a chain whose first block few pods
  -- hold costs little however many candidates.  Their slots not holding block 0 (a
  -- pod's other tiers) are resolved when a later hint names them.
  local wanted = nil
  if ncand > 0 then
    wanted = {}
    for c = 4, #ARGV do wanted[ARGV[c]] = true end
  end
  local ids, recs = {}, {}
  for off = 1, #hint0, 4 do
    recs[#recs + 1] = ssub(hint0, off, off + 3)
    ids[#ids + 1] = tostring(unpack4('>I4', hint0, off))
  end
  local infos = hmget(KEYS[1], ids)
  local stamps = hmget(KEYS[2], ids)
  for j = 1, #ids do
    local info = infos[j]
    rec_p[recs[j]] = false
    if info and fresh(stamps[j]) then
      local z = sfind(info, '\\0', 1, true)
      local name = ssub(info, z + 1)
      local t = tier_of[ssub(info, 1, z - 1)]
      if t and (wanted == nil or wanted[name]) then follow(recs[j], name, t, 1) end
    end
  end
  lazy = true
end
if np == 0 then return {} end
-- a slot id met in a hint and not yet known (lazy mode): followed pod's live slot?
local function resolve(r, i)
  local id = tostring(unpack4('>I4', r))
  local info = redis.call('HGET', KEYS[1], id)
  if info and fresh(redis.call('HGET', KEYS[2], id)) then
    local z = sfind(info, '\\0', 1, true)
    local name = ssub(info, z + 1)
    local t = tier_of[ssub(info, 1, z - 1)]
    local p = pindex[name]
    if t and p and not gone[p] then return follow(r, name, t, i) end
  end
  rec_p[r] = false
  return false
end

-- the walk: block by block on the holder sets' digests (a few bytes, however many
-- holders), fetched with one HMGET per chunk of blocks (16, 32, ... HINT_MAX).  A
-- digest equal to the previous block's names the same holders: every pod still in
-- stays in, with the same fastest tier.  Lua interns strings, so that test is a
-- pointer comparison, made in a tight loop over the run; only for a digest that
-- differs is the hint read and decoded.  Single-slot pods' counters are set when they
-- drop out (n1 = i - 1) or when the walk ends.
local act = {}
for p = 1, np do act[p] = p end
local multi = {}  -- multi-slot pods still in
for p = 1, np do if pc[p] then multi[#multi + 1] = p end end
-- multi-slot pod p holds blocks s..e at fastest tier b (it held block s - 1)
local function extend_run(p, s, e, b)
  local c = pc[p]
  for t = b, nt do
    if c[t] == s - 1 then c[t] = e end
  end
end
local prev, prev_best = nil, nil
local digs, hs, he, hsize = nil, 1, 0, 16
local i = 1
while i <= nblocks and #act > 0 do
  if i > he then
    hs = i
    he = math.min(i + hsize - 1, nblocks)
    hsize = math.min(hsize * 2, HINT_MAX)
    keys_upto(he)
    digs = redis.call('HMGET', DK, unpack(kb, hs, he))
  end
  local k, n = i - hs + 1, he - hs + 1
  if prev then
    local k0 = k
    while k <= n and digs[k] == prev do k = k + 1 end
    if k > k0 then
      local e = hs + k - 2
      for m = 1, #multi do extend_run(multi[m], i, e, prev_best[multi[m]]) end
      i = e + 1
    end
  end
  if k <= n then
    local d = digs[k]
    local h = ''
    if i == 1 then h = hint0 elseif d then h = redis.call('HGET', HK, kb[i]) or '' end
    local best = {}
    for off = 1, #h, 4 do
      local r = ssub(h, off, off + 3)
      local p = rec_p[r]
      if p == nil then
        if lazy then p = resolve(r, i) else p = false end
      end
      if p then
        local t = rec_t[r]
        local b = best[p]
        if b == nil or t < b then best[p] = t end
      end
    end
    local still, smulti = {}, {}
    for a = 1, #act do
      local p = act[a]
      local b = best[p]
      if b then
        still[#still + 1] = p
        if pc[p] then
          extend_run(p, i, i, b)
          smulti[#smulti + 1] = p
        end
      else
        gone[p] = true
        if not pc[p] then n1[p] = i - 1 end
      end
    end
    act, multi = still, smulti
    prev, prev_best = d, best
    i = i + 1
  end
end
for a = 1, #act do
  if not pc[act[a]] then n1[act[a]] = i - 1 end
end

-- the reply: a pod's counters as one string; single-slot pods with equal (tier, count)
-- share it (formatting numbers is most of this step's cost)
local onames, orows, memo = {}, {}, {}
for p = 1, np do
  local c = pc[p]
  if c then
    if c[nt] > 0 then
      onames[#onames + 1] = pname[p]
      orows[#orows + 1] = table.concat(c, ',', 1, nt)
    end
  elseif n1[p] > 0 then
    onames[#onames + 1] = pname[p]
    local key = n1[p] * 16 + t1[p]
    local row = memo[key]
    if not row then
      local parts = {}
      for t = 1, nt do
        if t >= t1[p] then parts[t] = n1[p] else parts[t] = 0 end
      end
      row = table.concat(parts, ',')
      memo[key] = row
    end
    orows[#orows + 1] = row
  end
end
if #onames == 0 then return {} end
return {table.concat(onames, '\\0'), table.concat(orows, ';')}
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
  local stamp = tonumber(redis.call('HGET', KEYS[2], id))
  if stamp and (ttl_ms <= 0 or now_ms - stamp < ttl_ms) then
    local info = flat[j + 1]
    local z = string.find(info, '\\0', 1, true)
    local pod = string.sub(info, z + 1)
    local n = redis.call('HLEN', ARGV[1] .. 's' .. id) - 1  -- minus the hashtable field
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

#: KEYS: ids, seen, hints, digests.  ARGV: prefix P, ttl seconds, then block keys
#: (hint fields).
#: A slot id is dead when unregistered, stale (``seen`` older than ttl) or its hash is
#: gone: it is dropped from the hints, and a registered dead slot is retired (as by
#: ``clear_pod``).  Returns the number of hint entries deleted.
SWEEP = (
    """#!lua
"""
    + _NOW_MS
    + _HINT_OPS
    + """
local P = ARGV[1]
local ttl_ms = tonumber(ARGV[2]) * 1000
local alive = {}
local function live(id)
  local v = alive[id]
  if v ~= nil then return v end
  local info = redis.call('HGET', KEYS[1], id)
  v = false
  if info then
    local stamp = tonumber(redis.call('HGET', KEYS[2], id))
    local fresh = stamp and (ttl_ms <= 0 or now_ms - stamp < ttl_ms)
    if fresh and redis.call('EXISTS', P .. 's' .. id) == 1 then
      v = true
    else
      local z = string.find(info, '\\0', 1, true)
      local tiered = P .. 'p:' .. string.sub(info, 1, z - 1)
      local pod = string.sub(info, z + 1)
      if redis.call('HGET', tiered, pod) == id then redis.call('HDEL', tiered, pod) end
      redis.call('HDEL', KEYS[1], id)
      redis.call('HDEL', KEYS[2], id)
      redis.call('UNLINK', P .. 's' .. id)
    end
  end
  alive[id] = v
  return v
end
local gone = 0
local fids = {}
for a = 3, #ARGV do
  local h = redis.call('HGET', KEYS[3], ARGV[a])
  if h then
    local kept = {}
    for off = 1, #h, 4 do
      local rec = string.sub(h, off, off + 3)
      if live(tostring(struct.unpack('>I4', rec))) then
        kept[#kept + 1] = rec
      else
        gone = gone + 1
      end
    end
    if #kept == 0 then
      redis.call('HDEL', KEYS[3], ARGV[a])
      redis.call('HDEL', KEYS[4], ARGV[a])
    elseif #kept * 4 < #h then
      redis.call('HSET', KEYS[3], ARGV[a], table.concat(kept))
      local sa, sb = 0, 0
      for j = 1, #kept do
        local id = struct.unpack('>I4', kept[j])
        local f = fids[id]
        if not f then
          f = {fid(id)}
          fids[id] = f
        end
        sa = (sa + f[1]) % M40
        sb = (sb + f[2]) % M40
      end
      redis.call('HSET', KEYS[4], ARGV[a], string.format('%d:%d:%d', #kept, sa, sb))
    end
  end
end
return gone
"""
)

# -- shared load view -------------------------------------------------------------------
# Keys: ``P load:r`` ZSET replica -> expiry (server ms); ``P load:h:<replica>`` HASH
# ``i NUL pod`` -> in-flight requests, ``t NUL pod`` -> outstanding prefill tokens of
# that replica, and the marker ``m`` (see LOAD_SET).  The hash is a mirror of the
# replica's own counts, written as absolute values.  A replica that stops heartbeating
# drops out of snapshots after its TTL.

#: KEYS: replicas zset, this replica's hash.  ARGV: replica, ttl ms, replace ("1": the
#: triples are the replica's whole table, every other field goes), then triples pod,
#: in-flight, tokens -- absolute values, 0 deletes the field (none: a pure heartbeat).
#: Registers the replica until now + ttl and refreshes the hash's TTL.
#: Returns 1 when the hash held the marker ``m`` before the call, 0 when it did not (new,
#: expired, or the server lost it): then the mirror lacks the replica's other pods and
#: the caller publishes its whole table.  The marker's value is 0 so that a replica
#: still summing with an older snapshot script reads it as no load.
LOAD_SET = """#!lua
local now = redis.call('TIME')
local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local ttl = tonumber(ARGV[2])
local had = redis.call('HEXISTS', KEYS[2], 'm')
if ARGV[3] == '1' then redis.call('DEL', KEYS[2]) end
redis.call('HSET', KEYS[2], 'm', '0')
for a = 4, #ARGV, 3 do
  local pod = ARGV[a]
  if tonumber(ARGV[a + 1]) > 0 then
    redis.call('HSET', KEYS[2], 'i\\0' .. pod, ARGV[a + 1])
  else
    redis.call('HDEL', KEYS[2], 'i\\0' .. pod)
  end
  if tonumber(ARGV[a + 2]) > 0 then
    redis.call('HSET', KEYS[2], 't\\0' .. pod, ARGV[a + 2])
  else
    redis.call('HDEL', KEYS[2], 't\\0' .. pod)
  end
end
redis.call('ZADD', KEYS[1], ms + ttl, ARGV[1])
redis.call('PEXPIRE', KEYS[2], ttl)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ms)
return had
"""

#: KEYS: replicas zset.  ARGV: prefix of replica hashes.  Sums live replicas' hashes
#: (their ``i``/``t`` fields), each (replica, pod) value clamped at >= 0.  Returns flat
#: pod, inflight, tokens.
LOAD_SNAPSHOT = """#!lua flags=no-writes
local now = redis.call('TIME')
local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local live = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. ms, '+inf')
local inflight, tokens, order = {}, {}, {}
for r = 1, #live do
  local flat = redis.call('HGETALL', ARGV[1] .. live[r])
  for j = 1, #flat, 2 do
    local f = flat[j]
    local kind = string.sub(f, 1, 2)
    if kind == 'i\\0' or kind == 't\\0' then
      local pod = string.sub(f, 3)
      local v = tonumber(flat[j + 1])
      if v < 0 then v = 0 end
      if inflight[pod] == nil then
        inflight[pod] = 0
        tokens[pod] = 0
        order[#order + 1] = pod
      end
      if kind == 'i\\0' then
        inflight[pod] = inflight[pod] + v
      else
        tokens[pod] = tokens[pod] + v
      end
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

#: KEYS: writer.  ARGV: holder, lease ms.  Takes or renews the namespace's writer lease
#: for ``holder``; returns nil when ``holder`` holds it, else the current holder.
CLAIM_WRITER = """#!lua
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[1] then return cur end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return false
"""

#: KEYS: writer.  ARGV: holder.  Gives the lease up if ``holder`` holds it.
RELEASE_WRITER = """#!lua
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
