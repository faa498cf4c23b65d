"""``LOOKUP``: the prefix walk over holder hints and digests; key layout in
:mod:`scoring.index.redis_lua`."""

from __future__ import annotations

from scoring.index.redis_lua._parts import NOW_MS

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
    + NOW_MS
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
