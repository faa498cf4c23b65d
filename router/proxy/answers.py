"""What the proxy learns from a pod's answer as it relays it: the ``usage``.

* The output tokens, for the policy's ``on_finished`` (a learning policy's decode
  rates).
* The cached prompt tokens the engine reports (vLLM's
  ``usage.prompt_tokens_details.cached_tokens``, with ``--enable-prompt-tokens-details``),
  set against what the index predicted for the pod: ``kvroute_engine_cached_tokens_total``
  and ``kvroute_cache_prediction_error_tokens_total{direction}``.  No other router
  reports this; it tells an operator at once when a pod's index entries drifted from
  its cache.

A non-streaming answer is already in memory (its JSON is decoded once more for the
usage); a stream keeps only its tail, and only when the request asked for a usage
event (``stream_options.include_usage``).  A tenant's stream whose client did not ask
was asked for it by the router (:mod:`router.proxy.hidden_usage`): its usage event is
read, and removed from what the client receives.
"""

from __future__ import annotations

from collections.abc import AsyncIterable

from router.decision.request import Routed
from router.metrics import RouterMetrics
from router.proxy.hidden_usage import HiddenUsage, asks_for_usage
from router.usage import Usage, UsageReader, usage_of_json

#: kinds whose answers carry a prompt's usage
_USAGE_KINDS = frozenset({"chat", "completion", "responses"})


class Answer:
    """One relayed answer: whether it ended cleanly, and its usage once known."""

    __slots__ = ("count", "hidden", "ok", "reader", "usage")

    def __init__(
        self,
        reader: UsageReader | None = None,
        count: bool = True,
        hidden: HiddenUsage | None = None,
    ) -> None:
        self.reader = reader
        #: the usage event the router asked for, taken out of the client's stream
        self.hidden = hidden
        self.usage: Usage | None = None
        #: count the reported cached tokens against the pod's prediction (not for the
        #: decode half of a split request: its pod reports the pulled blocks as cached)
        self.count = count
        #: the answer ended cleanly (a 2xx relayed to its end)
        self.ok = False

    @classmethod
    def for_stream(cls, routed: Routed, status: int, count: bool = True) -> Answer:
        options = routed.body.get("stream_options")
        wants = isinstance(options, dict) and options.get("include_usage") is True
        ok_kind = routed.kind in _USAGE_KINDS and 200 <= status < 300
        if ok_kind and routed.tenant is not None and asks_for_usage(routed.kind, routed.body):
            # the proxy front asked for the usage of every tenant's stream (TenantGate)
            return cls(None, count, HiddenUsage())
        return cls(UsageReader(event_stream=True) if wants and ok_kind else None, count)

    def wrap(self, source: AsyncIterable[bytes]) -> AsyncIterable[bytes]:
        """What the client receives of ``source``: as it is, or without the usage
        event the router asked for."""
        return source if self.hidden is None else self.hidden.relay(source)

    @property
    def output_tokens(self) -> int | None:
        return self.usage.completion_tokens if self.usage is not None else None

    def feed(self, chunk: bytes) -> None:
        if self.reader is not None:
            self.reader.feed(chunk)

    def finish(self, metrics: RouterMetrics, routed: Routed, pod: str) -> None:
        """The stream ended cleanly: read its usage and count it."""
        self.ok = True
        if self.hidden is not None:
            self.usage = self.hidden.usage
            if self.count:
                count_usage(metrics, routed, pod, self.usage)
        elif self.reader is not None:
            self.usage = self.reader.usage()
            if self.count:
                count_usage(metrics, routed, pod, self.usage)


#: the member an answer that reports its cached prompt tokens carries
_CACHED = b'"cached_tokens"'


def of_body(
    metrics: RouterMetrics,
    routed: Routed,
    pod: str,
    status: int,
    body: bytes,
    count: bool = True,
    want_output: bool = True,
) -> Answer:
    """A complete (non-streaming) answer: its usage read and (``count``) counted.
    Without ``want_output`` (nobody asks for the output tokens: a policy without
    ``on_finished``, no tenants) an answer that reports no cached tokens is not decoded:
    there is nothing to count (vLLM reports them only with
    ``--enable-prompt-tokens-details``), and a substring test costs a fraction of the
    decode."""
    answer = Answer(count=count)
    answer.ok = 200 <= status < 300
    if answer.ok and routed.kind in _USAGE_KINDS and (want_output or (count and _CACHED in body)):
        answer.usage = usage_of_json(body)
        if count:
            count_usage(metrics, routed, pod, answer.usage)
    return answer


def count_usage(metrics: RouterMetrics, routed: Routed, pod: str, usage: Usage | None) -> None:
    """The engine's cached tokens, and the index's error on them, when reported."""
    if usage is None or usage.cached_tokens is None or pod not in routed.views:
        return
    reported = usage.cached_tokens
    # as vLLM serves a hit: whole blocks only, and the last prompt token always computed
    bs = routed.route.block_size
    predicted = min(routed.cached_tokens(pod), (routed.route.prompt_tokens - 1) // bs * bs)
    cached, over, under = metrics.usage_children(routed.model, pod)
    cached.inc(reported)
    # both directions move (by 0 when right), so each pod's series exist from its first
    # reported answer: a panel shows "no error" rather than "no data"
    over.inc(max(predicted - reported, 0))
    under.inc(max(reported - predicted, 0))
