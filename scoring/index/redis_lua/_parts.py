"""Lua pieces and constants shared by the scripts of :mod:`scoring.index.redis_lua`."""

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

FORCE_HASHTABLE = (
    "local function force_hashtable(key) redis.call('HSETNX', key, '"
    + HASHTABLE_FIELD
    + "', '"
    + HASHTABLE_VALUE
    + "') end\n"
)

#: Lua helpers for holder hints (sorted 4-byte big-endian slot ids in one string) and
#: their digests.  Comparisons are numeric (struct.unpack), never on strings
#: (collation-dependent).  The digest of a holder set is ``count:a:b`` with a and b the
#: sums, mod 2^40, of two 40-bit slices of SHA-1(slot id) over its ids: kept
#: incrementally (O(1) per insert or delete), equal for equal sets whatever the order
#: of writes.
HINT_OPS = """
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

NOW_MS = """
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
"""
