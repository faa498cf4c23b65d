"""The bookkeeping of one picked request, as the proxy front keeps it
(:mod:`router.proxy.forward`): the policy's hooks, the router-tracked load and the same
``kvroute_*`` metrics, but driven by what the proxy reports instead of a connection
the router holds.

* **Picked** (the answer with the endpoints went out): ``policy.on_routed`` and the
  load's ``begin`` on the first-ranked pod, its in-flight gauge up.
* **Served** (response headers, with ``x-gateway-destination-endpoint-served``): when
  the proxy's retries ended on another pod, the bookkeeping moves there (the first
  pod's load and ``on_complete`` undone, ``on_routed`` and ``begin`` on the served
  one; counted in ``kvroute_epp_served_elsewhere_total``); prompt tokens and predicted
  cached tokens are counted for the pod that served.
* **First byte** (the first response body chunk of a streamed answer: the request asked
  for a stream, or the answer is ``text/event-stream``; of a Responses API stream, the
  chunk with its first event after ``response.created`` / ``response.in_progress``,
  which vLLM sends before it runs the request: :mod:`router.proxy.first_output`):
  TTFT (``kvroute_ttft_seconds``,
  from the request headers' arrival at the EPP), ``policy.on_first_token`` and the
  prefill part of the load done.  A JSON answer's first byte comes with its last token
  (vLLM sends it whole), so it is no first token: none of these happen, as in the proxy
  front, and a learning policy's prefill rate is not fed the decode time too.  Unless
  the answer is of at most one token (``max_tokens`` <= 1): its last token is its first.
  An error answer's body (a status other than 2xx) is no first token either.
* **Done** (the response's end of stream, or the stream's end without it: the client
  or the proxy gave up, counted as 499): in-flight load ended, ``policy.on_complete``,
  ``kvroute_requests_total`` by status; usage tokens counted when the answer had them.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from router.decision.request import Routed
from router.fleet.load import RequestLoad
from router.metrics import PodMetrics
from router.proxy.assemble import assemblable, one_token
from router.proxy.first_output import FirstOutput, opening_watch

if TYPE_CHECKING:
    from router.epp.picker import EndpointPicker

#: kinds routed without a prompt: no prompt tokens or cached tokens to count
_NO_PROMPT_KINDS = frozenset({"embedding", "passthrough"})


class Accounting:
    """One picked request's load, policy hooks and metrics (each undone exactly once)."""

    __slots__ = (
        "_core",
        "_counted",
        "_done",
        "_first",
        "_load",
        "_pm",
        "_policy_name",
        "_unseen",
        "_watch",
        "pod",
        "routed",
        "started",
        "status",
    )

    def __init__(self, core: EndpointPicker, routed: Routed, started: float) -> None:
        self._core = core
        self.routed = routed
        self.started = started
        self._policy_name = core.settings.policy
        self.pod = ""
        self._load: RequestLoad | None = None
        self._pm: PodMetrics | None = None
        self._first = True
        #: a Responses stream's watch for its first output event (set by ``served``)
        self._watch: FirstOutput | None = None
        self._counted = False
        self._done = False
        #: the answer's HTTP status (499 until response headers say otherwise)
        self.status = 499
        #: a JSON answer forwarded as it came: its first token never shows here
        self._unseen = not (
            routed.stream
            or one_token(routed)
            or (core.settings.proxy.stream_json_answers and assemblable(routed))
        )

    async def begin(self, pod: str) -> None:
        """The request goes to ``pod``: the policy hears of it, its load is held."""
        core = self._core
        self.pod = pod
        tokens = self.routed.route.prompt_tokens
        core.policy.on_routed(self.routed.route, pod)
        ledger = core.first_tokens
        load = self._load = RequestLoad(core.load, pod, tokens, ledger)
        if load.local is not None:
            load.begin_now()
        else:
            core.pending.add(pod, tokens)
            try:
                await load.begin()
            finally:
                core.pending.remove(pod, tokens)
        if self._unseen:  # a JSON answer the gateway carries: the pod's count tells
            ledger.expect(load, self.routed.route)
        pm = self._pm = core.metrics.pod_metrics(self.routed.model, pod, self._policy_name)
        pm.inflight.inc()

    async def _end(self) -> None:
        load, pm = self._load, self._pm
        if load is None or pm is None:
            return
        self._load = None
        pm.inflight.dec()
        if load.local is not None:
            load.end_now()
        else:
            await load.end()
        self._core.policy.on_complete(self.routed.route, self.pod)

    async def served(self, pod: str | None, status: int, event_stream: bool = False) -> None:
        """Response headers arrived with ``status``, served by ``pod`` (None: the proxy
        did not say; the picked pod is assumed); ``event_stream``: the answer is
        ``text/event-stream``."""
        self.status = status
        if not (event_stream or self.routed.stream or one_token(self.routed)):
            self._first = False  # a JSON answer's first byte is its end (module docstring)
        elif not 200 <= status < 300:
            self._first = False  # an error's body is no first token
        else:  # a Responses stream's opening events come before the engine runs
            self._watch = opening_watch(self.routed.kind)
        if pod is not None and pod != self.pod and self._load is not None:
            # the proxy retried on another endpoint of the list: account it there
            await self._end()
            self._core.epp.served_elsewhere.inc()
            await self.begin(pod)
        self._count_served()

    def _count_served(self) -> None:
        if self._counted or self._pm is None:
            return
        self._counted = True
        routed = self.routed
        if routed.kind in _NO_PROMPT_KINDS or self.pod not in routed.views:
            return
        self._pm.served(routed.route.prompt_tokens, routed.cached_tokens(self.pod))

    async def first_byte(self, chunk: bytes) -> None:
        """A response body chunk (not empty) was relayed."""
        if not self._first or self._load is None:
            return
        if self._watch is not None:
            if not self._watch.seen_in(chunk):
                return
            self._watch = None
        self._first = False
        m = self._core.metrics
        ttft = time.perf_counter() - self.started
        m.child(m.ttft_seconds, self.routed.model, self.pod).observe(ttft)
        self._core.tenants.observe_ttft(self.routed.tenant, ttft)
        self._core.policy.on_first_token(self.routed.route, self.pod, ttft)
        load = self._load
        if load.ledger is not None:
            load.ledger.seen(self.pod)
        if load.local is not None:
            load.first_token_now()
        else:
            await load.first_token()

    async def done(self, usage: Any = None) -> None:
        """The answer ended (or the stream did); safe to call more than once."""
        if self._done:
            return
        self._done = True
        self._count_served()
        pm = self._pm
        # (a learning policy reads decode rates from the answer; the base's is a no-op)
        if self._load is not None and self._core.policy_reads_output:
            out = usage.completion_tokens if usage is not None else None
            self._core.policy.on_finished(self.routed.route, self.pod, out)
        await self._end()
        if pm is not None:
            pm.requests(self.status).inc()
        if usage is not None and self.pod:
            c = self._core.epp.usage_tokens
            model, pod = self.routed.model, self.pod
            c.labels(model, pod, "prompt").inc(usage.prompt_tokens)
            c.labels(model, pod, "completion").inc(usage.completion_tokens)
            if usage.cached_tokens is not None:
                c.labels(model, pod, "cached").inc(usage.cached_tokens)
