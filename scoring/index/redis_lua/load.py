"""Scripts of the shared load view (used by :mod:`scoring.index.redis_load`)."""

from __future__ import annotations

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
