"""Scripts of the namespace's writer lease."""

from __future__ import annotations

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
