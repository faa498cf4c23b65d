"""Ports for tests of pods that refuse connections."""

from __future__ import annotations

import socket

#: sockets bound and never listening, kept open for the test process's life
_HELD: list[socket.socket] = []


def refused_port() -> int:
    """A loopback port that refuses every connection, for as long as the tests run.

    The port stays bound (without ``listen``), so the kernel gives it to no one else: no
    pod, ZMQ socket or server started later in the test can take it over, and no outgoing
    connection can use it as its own port.  (A port bound and released at once, the usual
    trick, can be handed to the next ``bind(0)``: a "dead" pod then answers.)
    """
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    _HELD.append(s)
    return int(s.getsockname()[1])
