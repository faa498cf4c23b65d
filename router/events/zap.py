"""Bind mode: only discovered pods may publish (``events.bind_allow: discovered``).

Two checks, both keyed by the IP addresses of the pods in the registry (the hosts of
their ``url``, ``events_endpoint`` and ``replay_endpoint``, names resolved):

* **connections** — a ZAP handler (ZMQ's authentication protocol, RFC 27) on the
  subscriber's context admits a publisher's connection to the bound SUB only from an
  address some discovered pod has;
* **messages** — the topic ``kv@<pod>@<model>`` must name a pod at the sender's
  address (the message's ``Peer-Address``), so a pod cannot speak for another
  (:class:`PodAddresses`, used by the subscriber's bind reader).

Why not pyzmq's ``zmq.auth.asyncio.AsyncioAuthenticator``: it answers on a REP socket,
one request at a time, and can only deny; and a libzmq publisher whose handshake was
*denied* (ZAP status 400, or 300) never reconnects — measured with pyzmq 27 / libzmq
4.3.5 — so a pod that connects a moment before discovery lists it (vLLM's PUB connects
once, at engine start) would be shut out until its engine restarts.  :class:`ZapGate`
answers on a ROUTER instead and **holds** a request from an unknown address: it admits
it as soon as discovery names the address, and otherwise never answers; the SUB's
handshake times out after ``HANDSHAKE_S`` and the publisher reconnects and asks again.
A stranger thus never gets in, and costs one held request per attempt (bounded by
``max_pending``).

The checks tell hosts apart, not processes on one host: pods sharing an IP (several
engines on one node) can still publish under each other's names.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import urlsplit

import zmq
import zmq.asyncio

from router.events.ratelimit import limited
from router.fleet.pods import PodSpec

log = logging.getLogger(__name__)

#: where libzmq sends ZAP requests (RFC 27), one handler per context
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
#: the bound SUB's handshake timeout (ZMQ_HANDSHAKE_IVL): how long a held connection
#: waits before the publisher reconnects and asks again
HANDSHAKE_S = 5.0
#: the ZAP domain set on the bound SUB (libzmq consults ZAP for NULL only with a domain)
ZAP_DOMAIN = b"kvroute-events"


def normalize_ip(text: str) -> str | None:
    """``"10.0.0.7"`` / ``"::ffff:10.0.0.7"`` -> ``"10.0.0.7"``; None if not an IP."""
    try:
        ip = ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


def spec_hosts(spec: PodSpec) -> set[str]:
    """The hosts named by a pod's URL and ZMQ endpoints."""
    hosts: set[str] = set()
    for url in (spec.url, spec.events_endpoint, spec.replay_endpoint):
        if not url:
            continue
        host = urlsplit(url).hostname
        if host and host != "*":
            hosts.add(host)
    return hosts


async def resolve_hosts(hosts: Iterable[str], timeout_s: float = 5.0) -> frozenset[str]:
    """The IP addresses of ``hosts`` (IP literals as they are; names through the
    resolver; a name that does not resolve in ``timeout_s`` contributes nothing)."""
    loop = asyncio.get_running_loop()
    out: set[str] = set()
    for host in hosts:
        ip = normalize_ip(host)
        if ip is not None:
            out.add(ip)
            continue
        try:
            infos = await asyncio.wait_for(loop.getaddrinfo(host, None), timeout_s)
        except (OSError, asyncio.TimeoutError) as exc:
            limited(log, f"resolve:{host}", "KV events: cannot resolve pod host %r: %s", host, exc)
            continue
        for info in infos:
            ip = normalize_ip(str(info[4][0]))
            if ip is not None:
                out.add(ip)
    return frozenset(out)


def _consume(fut: asyncio.Future[Any]) -> None:
    """Retrieve a finished send's error (a ZAP reply that could not go out: its
    connection gives up and the publisher retries)."""
    if not fut.cancelled() and fut.exception() is not None:
        log.debug("ZAP reply failed: %s", fut.exception())


class PodAddresses:
    """Pod name -> its IP addresses, and the reverse question."""

    def __init__(self) -> None:
        self._of: dict[str, frozenset[str]] = {}
        self._count: dict[str, int] = {}

    def set(self, pod: str, ips: frozenset[str]) -> None:
        self.remove(pod)
        self._of[pod] = ips
        for ip in ips:
            self._count[ip] = self._count.get(ip, 0) + 1

    def remove(self, pod: str) -> None:
        for ip in self._of.pop(pod, ()):
            n = self._count[ip] - 1
            if n:
                self._count[ip] = n
            else:
                del self._count[ip]

    def of(self, pod: str) -> frozenset[str]:
        return self._of.get(pod, frozenset())

    def known(self, ip: str) -> bool:
        """Whether some discovered pod has ``ip``."""
        norm = normalize_ip(ip)
        return norm is not None and norm in self._count

    def matches(self, pod: str, peer: str) -> bool:
        """Whether ``peer`` (a Peer-Address) is one of ``pod``'s addresses."""
        norm = normalize_ip(peer)
        return norm is not None and norm in self._of.get(pod, ())


class ZapGate:
    """A ZAP handler admitting NULL-mechanism connections from addresses ``allowed``
    says yes to, holding the others (see the module docstring).

    ``on_admit`` / ``on_hold`` are called with the address (for counters)."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        allowed: Callable[[str], bool],
        *,
        hold_s: float = HANDSHAKE_S,
        max_pending: int = 1024,
        on_admit: Callable[[str], None] | None = None,
        on_hold: Callable[[str], None] | None = None,
    ) -> None:
        self._ctx = ctx
        self._allowed = allowed
        self._hold_s = hold_s
        self._max_pending = max_pending
        self._on_admit = on_admit
        self._on_hold = on_hold
        #: (routing id, request id) -> (envelope, request id, address, held since)
        self._pending: dict[tuple[bytes, bytes], tuple[list[bytes], bytes, str, float]] = {}
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def pending(self) -> int:
        return len(self._pending)

    def start(self) -> None:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(ZAP_ENDPOINT)
        self._sock = sock
        self._task = asyncio.create_task(self._serve(), name="kv-events-zap")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        self._pending.clear()

    def recheck(self) -> None:
        """The allowed addresses changed: admit the held requests they now cover."""
        for key, (envelope, request_id, address, _) in list(self._pending.items()):
            if self._allowed(address):
                del self._pending[key]
                self._reply(envelope, request_id, address, admit=True)

    async def _serve(self) -> None:
        assert self._sock is not None
        sock = self._sock
        while True:
            # the asyncio socket, not a plain one polled by its FD: a reply sent from
            # recheck() may consume the FD's edge, and pyzmq re-checks for waiting receivers
            if self._pending:
                try:
                    frames = await asyncio.wait_for(sock.recv_multipart(), self._hold_s)
                except asyncio.TimeoutError:
                    frames = None
            else:
                frames = await sock.recv_multipart()
            if frames is not None:
                self._handle(frames)
            self._expire(time.monotonic())

    def _handle(self, frames: list[bytes]) -> None:
        try:
            split = frames.index(b"")
        except ValueError:
            return  # not a ZAP request envelope; nothing to answer
        envelope, body = frames[: split + 1], frames[split + 1 :]
        if len(body) < 6:
            if len(body) >= 2:
                self._send(envelope, body[1], b"400", b"malformed ZAP request", b"")
            return
        version, request_id, _domain, address_b, _identity, mechanism = body[:6]
        address = address_b.decode("utf-8", "replace")
        if version != b"1.0" or mechanism != b"NULL":
            self._send(envelope, request_id, b"400", b"only ZAP 1.0 with NULL", b"")
            return
        if self._allowed(address):
            self._reply(envelope, request_id, address, admit=True)
            return
        if self._on_hold is not None:
            self._on_hold(address)
        limited(
            log,
            f"zap:{address}",
            "KV events: connection from %s held: no discovered pod has this address "
            "(admitted once discovery names it; events.bind_allow=any turns this off)",
            address,
        )
        if len(self._pending) >= self._max_pending:
            self._pending.pop(next(iter(self._pending)))  # its handshake just times out
        self._pending[(envelope[0], request_id)] = (
            envelope,
            request_id,
            address,
            time.monotonic(),
        )

    def _reply(self, envelope: list[bytes], request_id: bytes, address: str, admit: bool) -> None:
        if admit and self._on_admit is not None:
            self._on_admit(address)
        self._send(envelope, request_id, b"200", b"OK", address.encode())

    def _send(
        self, envelope: list[bytes], request_id: bytes, status: bytes, text: bytes, user: bytes
    ) -> None:
        if self._sock is None:
            return
        # a ROUTER never blocks (a reply to a session that is gone is dropped): the send
        # completes at once, also when called from a registry callback
        done = asyncio.ensure_future(
            self._sock.send_multipart(
                [*envelope, b"1.0", request_id, status, text, user, b""], flags=zmq.NOBLOCK
            )
        )
        done.add_done_callback(_consume)

    def _expire(self, now: float) -> None:
        """Forget held requests whose handshake has timed out (their session is gone)."""
        for key, (_, _, _, since) in list(self._pending.items()):
            if now - since > self._hold_s:
                del self._pending[key]


class SourceCheck:
    """Bind mode, ``bind_allow: discovered``: the discovered pods' addresses (resolved
    as pods come and go), the :class:`ZapGate` admitting connections from them, and the
    per-message question "may this sender speak for that pod"."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        *,
        on_admit: Callable[[str], None] | None = None,
        on_hold: Callable[[str], None] | None = None,
    ) -> None:
        self.addresses = PodAddresses()
        self.gate = ZapGate(
            ctx, self.addresses.known, hold_s=HANDSHAKE_S, on_admit=on_admit, on_hold=on_hold
        )
        self._resolving: dict[str, asyncio.Task[None]] = {}

    def start(self, sock: zmq.asyncio.Socket) -> None:
        """Start the ZAP handler and make ``sock`` (a SUB, before it binds) use it."""
        self.gate.start()
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))

    async def stop(self) -> None:
        tasks = list(self._resolving.values())
        self._resolving.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.gate.stop()

    def pod_changed(self, name: str, spec: PodSpec) -> None:
        """Record the pod's IPs: now when its hosts are IP literals, else once resolved."""
        self._cancel(name)
        hosts = spec_hosts(spec)
        literal = {normalize_ip(h) for h in hosts}
        if None not in literal:
            self._set(name, frozenset(ip for ip in literal if ip is not None))
            return

        async def resolve() -> None:
            ips = await resolve_hosts(hosts)
            self._resolving.pop(name, None)
            self._set(name, ips)

        self._resolving[name] = asyncio.create_task(resolve(), name=f"kv-events-resolve-{name}")

    def pod_removed(self, name: str) -> None:
        self._cancel(name)
        self.addresses.remove(name)

    def matches(self, pod: str, peer: str) -> bool:
        return self.addresses.matches(pod, peer)

    def describe(self, pod: str) -> str:
        return ", ".join(sorted(self.addresses.of(pod))) or "none known yet"

    def _set(self, name: str, ips: frozenset[str]) -> None:
        self.addresses.set(name, ips)
        self.gate.recheck()

    def _cancel(self, name: str) -> None:
        task = self._resolving.pop(name, None)
        if task is not None:
            task.cancel()
