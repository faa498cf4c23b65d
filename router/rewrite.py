"""The one place a request body the router forwards is changed.

The router forwards the client's bytes as they came (never re-serialised) unless it
must change the body: a tenant's ``cache_salt`` set over the client's, the copy of a
request sent to a prefill pod (``kv_transfer_params``, ``max_tokens: 1``, no stream),
the decode pod's ``kv_transfer_params``.  :func:`rewrite_body` makes those bytes:

* only top-level fields are set or dropped; everything else keeps its order and value;
* a body that gains fields it did not have is spliced (the new fields appended before
  the closing brace, the client's bytes untouched); one that loses or replaces a field
  is encoded again from the parsed body (msgspec: the same JSON values, compact).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

_encode = msgspec.json.encode


def rewrite_body(
    raw: bytes,
    body: Mapping[str, Any],
    *,
    set_fields: Mapping[str, Any] | None = None,
    drop: Iterable[str] = (),
) -> bytes:
    """``raw`` (whose parsed form is ``body``, a JSON object) with ``set_fields`` set and
    ``drop`` removed, as bytes to forward; ``raw`` itself when nothing changes."""
    sets = dict(set_fields or {})
    gone = [k for k in drop if k in body and k not in sets]
    if not sets and not gone:
        return raw
    if not gone and not any(k in body for k in sets):
        end = raw.rstrip()
        if end.endswith(b"}"):
            head = end[:-1].rstrip()
            sep = b"," if not head.endswith(b"{") else b""
            extra = b",".join(_encode(k) + b":" + _encode(v) for k, v in sets.items())
            return head + sep + extra + b"}"
    out = {k: v for k, v in body.items() if k not in gone}
    out.update(sets)
    return _encode(out)
