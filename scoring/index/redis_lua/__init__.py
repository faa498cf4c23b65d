"""Lua scripts run server-side by :mod:`scoring.index.redis` (Redis >= 7, Valkey >= 8).

Key layout, all under one hash tag ``{ns}`` so that every key of a namespace lives in
one cluster slot and each script touches a single slot (``P`` = ``"{" + ns + "}:"``;
``K`` = a block key as 8 raw big-endian bytes):

* ``P s <id>`` -- HASH per *slot* (one generation of one (pod, tier)): field ``K`` ->
  count of stored copies.  The source of truth for counts.
* ``P h`` -- HASH block key ``K`` -> its *holder hint*: the sorted 4-byte big-endian
  ids of the slots holding the block, written and deleted together with the slot
  entries.  ``P d`` -- HASH ``K`` -> the *digest* of that holder set (``count:a:b``,
  see ``HINT_OPS``): equal sets have equal digests, so the walk advances every pod at
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

The scripts live by what they do: :mod:`._parts` (the Lua helpers and constants they
share), :mod:`.slots` (writing and sweeping slots and holder hints, counting entries),
:mod:`.lookup` (the prefix walk), :mod:`.load` (the shared load view) and
:mod:`.lease` (the namespace's writer lease).
"""

from __future__ import annotations

from scoring.index.redis_lua._parts import HASHTABLE_FIELD, HASHTABLE_VALUE, SLOT_GRACE_S
from scoring.index.redis_lua.lease import CLAIM_WRITER, RELEASE_WRITER
from scoring.index.redis_lua.load import LOAD_CLEAR_POD, LOAD_SET, LOAD_SNAPSHOT
from scoring.index.redis_lua.lookup import LOOKUP
from scoring.index.redis_lua.slots import ADD, CLEAR, POD_ENTRIES, REMOVE, SWEEP

__all__ = [
    "ADD",
    "CLAIM_WRITER",
    "CLEAR",
    "HASHTABLE_FIELD",
    "HASHTABLE_VALUE",
    "LOAD_CLEAR_POD",
    "LOAD_SET",
    "LOAD_SNAPSHOT",
    "LOOKUP",
    "POD_ENTRIES",
    "RELEASE_WRITER",
    "REMOVE",
    "SLOT_GRACE_S",
    "SWEEP",
]
