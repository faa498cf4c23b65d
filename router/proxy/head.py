"""The head of a request forwarded to a pod: the client's headers minus the hop-by-hop
ones, Host (the pod's own, in :class:`~router.fleet.transport.PodTarget`'s lead) and
the length and encoding the proxy sets itself."""

from __future__ import annotations

#: request headers not forwarded (hop-by-hop, or recomputed by the client)
DROP_REQUEST = frozenset(
    {
        "host",
        "content-length",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "upgrade",
        "proxy-authorization",
        "proxy-connection",
        "accept-encoding",
        "expect",
    }
)
DROP_REQUEST_B = frozenset(h.encode() for h in DROP_REQUEST)


def head_tail(incoming: list[tuple[bytes, bytes]], drop: frozenset[bytes], length: int) -> bytes:
    """The forwarded headers (``drop`` and Host dropped), Content-Length, identity
    encoding and the blank line: everything of the head after the Host line."""
    parts = [k + b": " + v for k, v in incoming if k.lower() not in drop]
    parts.append(b"content-length: %d\r\naccept-encoding: identity\r\n\r\n" % length)
    return b"\r\n".join(parts)
