"""Forwarding a split request: the prefill half on a prefill pod, then the decode half on
a decode pod with the prefill pod's ``kv_transfer_params`` (vLLM's NixlConnector, pull
mode; the protocol and its sources are in docs/pd.md).

The decision (router/decision/disagg.py) gave a :class:`~router.decision.disagg.PDPlan`:
the decode pods best first, and for a split request the prefill pods best first.

1. **Prefill** -- a copy of the body (:func:`prefill_body`, through
   :func:`router.rewrite.rewrite_body`): ``kv_transfer_params`` asking for a remote decode,
   ``stream: false``, ``max_tokens: 1`` (and ``max_completion_tokens: 1`` when the body
   has it), ``stream_options`` / ``min_tokens`` / ``min_completion_tokens`` dropped (a
   new ``/v1/responses`` request: ``max_output_tokens: 1``, ``store: false`` so the
   prefill pod keeps no 1-token response, ``stream_options`` / ``background`` dropped; a
   follow-up naming ``previous_response_id`` is never split, its history lives only on
   the pod that owns it, where the decision sends it whole); the
   same ``X-Request-Id`` as the decode half (the client's, else the router's id).  Its
   pod's load is held (prompt tokens, in flight) and the prefill policy told
   ``on_routed`` / ``on_complete``; the time to its answer is
   ``kvroute_pd_prefill_seconds``.  A prefill pod that does not answer (connect,
   timeout, transport error, 502/503, ejected or removed while waiting) is replaced by
   the next prefill pod (at most ``proxy.retries`` times).  The client leaving cancels
   the prefill (vLLM aborts it: no params, its blocks are freed) and answers 499.
2. **Fallbacks to a plain request** (the original body to the decode pods, as vLLM's toy
   proxy does without params; counted in ``kvroute_pd_fallbacks_total{reason}``): no
   prefill pod answered (``prefill_failed``), a 2xx answer without
   ``kv_transfer_params`` (``no_params``), another non-2xx answer (``prefill_status``:
   the decode pod gives the client the real answer or error).
3. **Decode** -- the original body plus the returned ``kv_transfer_params``, relayed
   verbatim, through :meth:`router.proxy.forward.Proxy.forward` (its retries, failover,
   streaming relay and load bookkeeping) with a :class:`DecodeLeg` choosing each
   attempt's body: the params while no decode pod could have used them (the first
   attempt; a retry after a connect failure, within ``pd.kv_lease_s`` of the prefill
   answer), the plain body otherwise (the pod got the request: it may have pulled the
   blocks, which ends the lease, or its pull failed).  A decode answer of 500 before any
   byte reached the client is retryable here too (vLLM's default
   ``kv_load_failure_policy: fail`` answers one when the pull fails): the retry is plain.
   The decode attempt's load charges the tokens the decode pod computes itself (the
   prompt's tail past its last full block; the whole prompt on a plain retry).
4. **Usage** -- the prefill answer's ``usage.prompt_tokens_details.cached_tokens`` (the
   real prefix hit; the decode pod reports the pulled blocks as cached too,
   vllm-project/router#193) replaces the decode answer's, in a JSON answer and in a
   stream's usage event (``stream_options.include_usage``; the stream is relayed line by
   line then, a partial line held until its newline, so only that ``data:`` line is
   re-encoded).  Only when the decode answer has a ``prompt_tokens_details`` object.  A
   response's is ``usage.input_tokens_details``, in its JSON or in its stream's
   ``response.completed`` event (which always carries the usage).  The
   prefill pod's reported cached tokens are set against its prediction
   (``kvroute_engine_cached_tokens_total``); the decode half's are not (they include the
   transfer).
5. **Headers** -- ``x-kvroute-prefill-pod`` (``pd.prefill_pod_header``) names the prefill
   pod whenever the decode attempts carry its params; the pod header names the decode pod.

**Stranded blocks.**  vLLM gives a proxy no call to release a prefill pod's blocks: they
stay pinned until a decode pod reads them or the lease passes (``kv_lease_duration``,
30 s; ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, 480 s, in older versions).  A client that leaves
during the prefill strands nothing (the prefill is aborted first).  One that leaves after
the prefill answered cancels the decode attempt; if the decode pod had not pulled yet,
those blocks stay pinned on the prefill pod until the lease expires (vLLM logs "Releasing
expired KV blocks"; the sim counts ``kvroute_sim_kv_expired_leases_total``).

:class:`Disaggregator` (here) sends the prefill half and chooses between a split, a
fallback and a direct request; the decode half's attempts, the prefill's cached tokens
in their answer and the prefill pod's header (steps 3 to 5:
:class:`~router.proxy.disagg_decode.DecodeLeg`, given the prefill's
:class:`~router.proxy.disagg_decode.Prefilled`) are in :mod:`router.proxy.disagg_decode`,
both re-exported here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx
import msgspec
from starlette.responses import Response
from starlette.types import Receive

from router.decision.disagg import PDPlan, PDSettings, PDStep
from router.decision.request import Routed
from router.fleet.load import RequestLoad
from router.logs import RateLimitedLog
from router.proxy import answers
from router.proxy.attempts import CLIENT_DISCONNECTED
from router.proxy.disagg_decode import DECODE_RETRYABLE, DecodeLeg, Prefilled
from router.proxy.forward import RETRYABLE_STATUS, Proxy
from router.rewrite import rewrite_body
from router.usage import usage_of_json

__all__ = [
    "DECODE_RETRYABLE",
    "PREFILL_PARAMS",
    "DecodeLeg",
    "Disaggregator",
    "Prefilled",
    "prefill_body",
    "with_request_id",
]

log = logging.getLogger(__name__)

#: what a prefill copy asks of its pod (vLLM's toy_proxy_server.py)
PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
#: the kinds split: chat, completions and new responses (a ``/v1/responses`` body has
#: ``max_output_tokens`` and ``kv_transfer_params`` in vLLM 0.32, and its answer carries
#: the params at the top level as a chat answer does)
_SPLIT_KINDS = frozenset({"chat", "completion", "responses"})
_PREFILL_DROP = ("stream_options", "min_tokens", "min_completion_tokens")
#: a response's prefill copy: no stored 1-token response, answered now (not queued)
_RESPONSES_DROP = ("stream_options", "background")

_decode = msgspec.json.decode
_monotonic = time.monotonic


def prefill_body(raw: bytes, body: dict[str, Any], kind: str = "chat") -> bytes:
    """The prefill pod's copy of ``raw`` (parsed: ``body``) for a request of ``kind``."""
    sets: dict[str, Any] = {"kv_transfer_params": PREFILL_PARAMS, "stream": False}
    if kind == "responses":
        sets.update(max_output_tokens=1, store=False)
        return rewrite_body(raw, body, set_fields=sets, drop=_RESPONSES_DROP)
    sets["max_tokens"] = 1
    if "max_completion_tokens" in body:
        sets["max_completion_tokens"] = 1
    return rewrite_body(raw, body, set_fields=sets, drop=_PREFILL_DROP)


def with_request_id(headers: list[tuple[bytes, bytes]], rid: str) -> list[tuple[bytes, bytes]]:
    """``headers`` with an ``x-request-id`` (the router's id when the client sent none)."""
    if any(k.lower() == b"x-request-id" for k, _ in headers):
        return headers
    return [*headers, (b"x-request-id", rid.encode("latin-1"))]


class Disaggregator:
    """Sends requests of models with P/D roles: direct, or split (the module docstring)."""

    def __init__(self, proxy: Proxy, step: PDStep, settings: PDSettings) -> None:
        self.proxy = proxy
        self.step = step
        self.settings = settings
        self.metrics = proxy.metrics
        self._log = RateLimitedLog(log)

    async def forward(
        self,
        routed: Routed,
        path: str,
        raw: bytes,
        headers: list[tuple[bytes, bytes]],
        receive: Receive,
        started: float,
    ) -> Response:
        plan = routed.pd
        assert plan is not None
        m = self.metrics
        reason = plan.decision.reason if routed.kind in _SPLIT_KINDS else "unsupported_kind"
        m.child(m.pd_decisions, routed.model, reason).inc()
        if not plan.split or routed.kind not in _SPLIT_KINDS:
            return await self.proxy.forward(routed, path, raw, headers, receive, started)
        headers = with_request_id(headers, routed.route.request_id)
        got = await self._prefill(routed, plan, path, raw, headers, receive)
        if isinstance(got, Response):
            return got
        if isinstance(got, str):  # a fallback: the original request, as a normal one
            m.child(m.pd_fallbacks, routed.model, got).inc()
            return await self.proxy.forward(routed, path, raw, headers, receive, started)
        leg = DecodeLeg(routed, raw, got, self.settings, self.proxy)
        return await self.proxy.forward(routed, path, raw, headers, receive, started, leg)

    async def _prefill(
        self,
        routed: Routed,
        plan: PDPlan,
        path: str,
        raw: bytes,
        headers: list[tuple[bytes, bytes]],
        receive: Receive,
    ) -> Prefilled | str | Response:
        """The prefill half: its answer with params, a fallback reason, or the 499 of a
        client that left."""
        proxy, m = self.proxy, self.metrics
        body = prefill_body(raw, routed.body, routed.kind)
        tail = proxy._head_tail(headers, len(body))
        route = routed.route
        policy = self.step.router.prefill_policy
        for i, pod in enumerate(plan.prefill_ranking[: 1 + proxy.settings.retries]):
            state = proxy.registry.get(pod)
            if state is None or (i > 0 and not state.healthy):
                continue
            load = RequestLoad(proxy.load, pod, route.prompt_tokens, proxy.first_tokens)
            policy.on_routed(route, pod)
            await _begin(proxy, load)
            t0 = time.perf_counter()
            status, content, failure = await self._send(
                pod, state.spec.url, path, tail, body, receive
            )
            await _end(load)
            policy.on_complete(route, pod)
            if failure == CLIENT_DISCONNECTED:
                m.child(m.pd_prefill_attempts, pod, "client_disconnected").inc()
                return Response(status_code=499)
            if failure is not None or status in RETRYABLE_STATUS:
                m.child(m.pd_prefill_attempts, pod, "failed").inc()
                if failure is None:
                    m.child(m.upstream_errors, pod, f"status_{status}").inc()
                self._log.warning(
                    ("pd_prefill", pod), "prefill on pod %s failed (%s)", pod, failure or status
                )
                continue
            if not 200 <= status < 300:
                m.child(m.pd_prefill_attempts, pod, "status").inc()
                return "prefill_status"
            elapsed = time.perf_counter() - t0
            m.child(m.pd_prefill_seconds, routed.model, pod).observe(elapsed)
            policy.on_first_token(route, pod, elapsed)
            if proxy.first_tokens is not None:  # its one token: the pod counted it too
                proxy.first_tokens.seen(pod)
            params = _params_of(content)
            if params is None:
                m.child(m.pd_prefill_attempts, pod, "no_params").inc()
                return "no_params"
            m.child(m.pd_prefill_attempts, pod, "ok").inc()
            usage = usage_of_json(content)
            answers.count_usage(m, routed, pod, usage)
            cached = None if usage is None else usage.cached_tokens
            return Prefilled(pod, params, cached, _monotonic())
        return "prefill_failed"

    async def _send(
        self, pod: str, url: str, path: str, tail: bytes, body: bytes, receive: Receive
    ) -> tuple[int, bytes, str | None]:
        """One prefill attempt: (status, body, None) or (0, b"", why it failed)."""
        proxy = self.proxy
        target = proxy._target(url, path)
        attempt = proxy._watch.begin(receive, pod, None)  # never committed: all may move it
        resp = None
        try:
            resp = await proxy.transport.send_raw(
                target.host,
                target.port,
                target.lead + tail,
                body,
                proxy._connect_timeout,
                proxy._read_timeout,
                target.tls,
            )
            try:
                return resp.status, await resp.stream.read_all(), None
            finally:
                await resp.stream.aclose()
        except asyncio.CancelledError:
            if resp is not None:
                await resp.stream.aclose()  # closing cancels it on the pod
            cause = proxy._watch.cause(attempt)
            if cause is None:
                raise
            if cause != CLIENT_DISCONNECTED:
                proxy._stall_error(pod, cause)  # counted by pod and cause
            return 0, b"", cause
        except httpx.HTTPError as exc:
            return 0, b"", proxy._upstream_error(pod, exc).reason
        finally:
            proxy._watch.end(attempt)


def _params_of(content: bytes) -> dict[str, Any] | None:
    """The top-level ``kv_transfer_params`` of a prefill answer (None: none)."""
    if b'"kv_transfer_params"' not in content:
        return None
    try:
        obj = _decode(content)
    except msgspec.DecodeError:
        return None
    params = obj.get("kv_transfer_params") if isinstance(obj, dict) else None
    return params if isinstance(params, dict) and params else None


async def _begin(proxy: Proxy, load: RequestLoad) -> None:
    if load.local is not None:
        load.begin_now()
        return
    proxy.pending.add(load.pod, load.prefill_tokens)
    try:
        await load.begin()
    finally:
        proxy.pending.remove(load.pod, load.prefill_tokens)


async def _end(load: RequestLoad) -> None:
    if load.local is not None:
        load.end_now()
    else:
        await load.end()
