"""Scripts that write slots and holder hints (``ADD``, ``REMOVE``, ``CLEAR``, ``SWEEP``)
and count a pod's entries (``POD_ENTRIES``); key layout in :mod:`scoring.index.redis_lua`."""

from __future__ import annotations

from scoring.index.redis_lua._parts import FORCE_HASHTABLE, HINT_OPS, NOW_MS, SLOT_GRACE_S

#: KEYS: p:<tier>, ids, next, seen, hints, digests.  ARGV: prefix P, pod, tier, ttl
#: seconds (0 = none), packed keys (8 bytes each).  Counts one more copy of each key,
#: writes the holder hint and digest of new entries, stamps ``seen`` and refreshes the
#: slot's TTL.
#: Returns the number of new entries.
ADD = (
    """#!lua
"""
    + NOW_MS
    + FORCE_HASHTABLE
    + HINT_OPS
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
    + HINT_OPS
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

#: KEYS: ids, seen.  ARGV: prefix P, ttl seconds.  Returns a flat array pod, entries,
#: ... (entries: HLEN of each live slot, summed over the pod's tiers).
POD_ENTRIES = (
    """#!lua flags=no-writes
"""
    + NOW_MS
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
    + NOW_MS
    + HINT_OPS
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
