"""What ``cost`` remembers between its decisions (scoring/policies/cost.py), and the
hooks that keep it: the requests it scored until they are routed, the live ones until
they complete (their pods, predicted misses and in-flight prefixes), each pod's hot set,
and each model's learned rates.  ``pick`` reads all of it; the router's hooks
(``on_routed``, ``on_first_token``, ``on_complete``, ``on_pod_removed``) write it."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from scoring.policies.base import PodCounters, PodView, Policy, PolicyParams, RouteRequest
from scoring.policies.cost_params import CostParams
from scoring.policies.hot_set import HotBlocks
from scoring.policies.inflight import InflightPrefixes, shared_blocks
from scoring.policies.learned_rate import MEMORY, PRIOR_WEIGHT, ModelRates, PrefillRate
from scoring.policies.queued import QueuedPrompts
from scoring.policies.scraped_steps import ScrapedSteps
from scoring.policies.slowdown_fit import SlowdownFit

#: routings a pod's arrival rate remembers (``measured``'s default memory, not tuned)
ARRIVAL_MEMORY = 64.0
_KEEP = 1.0 - 1.0 / ARRIVAL_MEMORY
#: what each first token keeps of a pod's service sums (queue_slowness: the prefill
#: rate's memory)
_FORGET = 1.0 - 1.0 / MEMORY
_INF = math.inf
#: a live request's first-token time before it (``_live``), and once past its prefill
#: at a time the router did not see (``on_prefill_done``)
_QUEUED = -1.0
_PAST_PREFILL = -2.0


class CostLedger(Policy):
    """``cost``'s state and hooks; :class:`scoring.policies.cost.CostPolicy` adds ``pick``."""

    def __init__(self, params: PolicyParams | None = None) -> None:
        super().__init__(params)
        assert isinstance(self.params, CostParams)
        self._p: CostParams = self.params
        # Requests are keyed by (request_id, id(request)): a client may reuse an id, and
        # the router hands the same RouteRequest object to pick / on_routed / on_complete.
        # key -> (prompt tokens, {pod: predicted cached tokens}, chosen pod, its
        # capacity in blocks, the model's rates, its running requests if it was clean
        # for the slowdown fit, else -1), until routed
        self._scored: OrderedDict[
            tuple[str, int], tuple[int, dict[str, int], str, int | None, ModelRates, int]
        ] = OrderedDict()
        # key -> [pod, prompt tokens, predicted uncached tokens, routed at, first token
        # at (_QUEUED: not yet; _PAST_PREFILL: past it, unseen), the model's rates,
        # clean running count or -1], until complete
        self._live: dict[tuple[str, int], list[Any]] = {}
        # pod -> the block-key chains of the live requests routed there
        self._inflight = InflightPrefixes()
        # pod -> the chains of those past their first token (admitted: blocks allocated)
        self._admitted = InflightPrefixes()
        self._held_admitted = self._p.kv_held_admitted and self._p.count_inflight_prefixes
        # pod -> the chains of those not yet past prefill, in the order routed (kept
        # for the queue rule, which the LRU distance replaces when there is a hot set,
        # and for kv_held_admitted: the newest of them are the pod's waiting requests)
        self._queued = QueuedPrompts()
        self._lru = self._p.lru_evictions and self._p.hot_window_s > 0
        self._queue_rule = self._p.queue_evictions and not self._lru
        # the queue is kept for the rule, or to tell the admitted requests from the waiting
        self._keep_queue = self._queue_rule or self._held_admitted
        # pod -> [sum of prompt tokens, sum of predicted uncached tokens] of live requests
        self._ledger: dict[str, list[int]] = {}
        # [sum of predicted uncached tokens, count] of every live request
        self._live_total = [0, 0]
        # pod -> block keys routed there within hot_window_s (see scoring.policies.hot_set)
        self._hot = HotBlocks(self._p.hot_window_s)
        # pod -> the capacity (blocks) its last view carried: bounds its hot set
        self._capacity: dict[str, int] = {}
        self._kv = self._p.kv_admission
        # pod -> [service seconds, predicted seconds, observations, its last first token]
        # of its first tokens, forgotten over MEMORY observations (queue_slowness)
        self._slow: dict[str, list[float]] | None = {} if self._p.queue_slowness else None
        # first tokens the pace left out that no learned rate counted
        self._slow_rejected = 0
        # model -> what its pods showed: the prefill rate, learned from first tokens
        # (None: the setting, fixed), and the time from first token to end (each live
        # request's first token: in _live)
        self._models: dict[str, ModelRates] = {}
        self._count_inflight = self._p.count_inflight_prefixes
        # pod -> [last routing, mean gap between routings, routings, mean share of the
        # prompt the pod held] (count_arrivals; forgotten over ARRIVAL_MEMORY routings)
        self._arrivals: dict[str, list[float]] | None = {} if self._p.count_arrivals else None
        self._hot_on = self._p.hot_window_s > 0
        # pod -> the model last routed there; model -> what its pods' scrapes show
        # (read only for a model whose first tokens the router never saw)
        self._pod_model: dict[str, str] = {}
        self._scraped: dict[str, ScrapedSteps] = {}

    def learned(self) -> dict[tuple[str, str], float]:
        """Per model routed so far: the prefill rate the scores use (learned, else the
        setting), the learned slowdown and step time per running request (when the
        slowdown is learned) and, with ``kv_admission``, the mean decode time (0 until
        the first)."""
        out: dict[tuple[str, str], float] = {}
        for model, m in self._models.items():
            rate = self._p.prefill_rate_tokens_per_s if m.prefill is None else m.prefill.rate
            out["prefill_rate_tokens_per_s", model] = rate
            if m.slowdown is not None:
                out["decode_slowdown_per_running", model] = m.slowdown.slowdown
                if self._p.charge_decode_steps:
                    out["step_seconds_per_running", model] = m.slowdown.per_running_s
            if self._kv:
                out["decode_seconds", model] = m.decode.mean_s
        return out

    def learned_per_pod(self) -> dict[tuple[str, str], float]:
        """With ``queue_slowness``, each pod's pace (:meth:`slowness`) as the scores use
        it, for the pods whose first tokens it has seen."""
        if self._slow is None:
            return {}
        return {("queue_slowness", pod): self.slowness(pod) for pod in self._slow}

    def rejected_observations(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for m in self._models.values():
            if m.prefill is not None:
                for reason, n in m.prefill.rejected.items():
                    out[reason] = out.get(reason, 0) + n
            if m.decode.rejected:
                out["decode time"] = out.get("decode time", 0) + m.decode.rejected
        if self._slow_rejected:
            out["first token"] = self._slow_rejected
        return out

    def _rates_of(self, model: str) -> ModelRates:
        m = self._models.get(model)
        if m is None:
            p = self._p
            learn = p.learn_prefill_rate
            m = self._models[model] = ModelRates(
                PrefillRate(p.prefill_rate_tokens_per_s) if learn else None,
                SlowdownFit(p.prefill_rate_tokens_per_s, MEMORY, PRIOR_WEIGHT)
                if learn and p.decode_slowdown_per_running is None
                else None,
            )
        return m

    def hot_blocks(self, pod: str) -> int:
        """Distinct blocks routed to ``pod`` within ``hot_window_s`` (0 when off)."""
        return self._hot.count(pod, self.clock()) if self._p.hot_window_s > 0 else 0

    def routed_prefixes(self, keys: Sequence[int], pods: Sequence[str]) -> dict[str, int]:
        """The hot set's routed prefixes (none when ``hot_window_s`` is 0)."""
        if self._p.hot_window_s <= 0 or not keys:
            return {}
        now, hot = self.clock(), self._hot
        found = {pod: hot.prefix(pod, keys, now) for pod in pods}
        return {pod: n for pod, n in found.items() if n}

    def inflight_hits(self, pod: str, keys: Sequence[int]) -> int:
        """Leading blocks of ``keys`` carried by live requests routed to ``pod``."""
        if not self._p.count_inflight_prefixes:
            return 0
        return self._inflight.hits(pod, keys)

    def live_uncached(self, pod: str) -> int:
        """Predicted uncached tokens of the live requests this policy routed to ``pod``."""
        entry = self._ledger.get(pod)
        return entry[1] if entry is not None else 0

    def backlog_unit_tokens(self, prompt_tokens: int) -> float:
        """Tokens of backlog that count as one queued request: the mean predicted miss
        of the live requests this policy routed, else ``prompt_tokens`` (at least 1)."""
        live_miss, live_count = self._live_total
        return max(1.0, live_miss / live_count if live_count > 0 else prompt_tokens)

    def queued_tokens(self, pod: PodView) -> float:
        """Outstanding prefill tokens, scaled by the predicted miss share (see module)."""
        entry = self._ledger.get(pod.pod)
        if not self._p.discount_queued_hits or entry is None or entry[0] <= 0:
            return float(pod.outstanding_prefill_tokens)
        return pod.outstanding_prefill_tokens * entry[1] / entry[0]

    def on_routed(self, request: RouteRequest, pod: str) -> None:
        key = (request.request_id, id(request))
        scored = self._scored.pop(key, None)
        if scored is None:
            prompt = request.prompt_tokens
            miss = prompt
            rates = self._rates_of(request.model)
            clean = -1
        else:
            prompt, cached, chosen, cap, rates, clean = scored
            c = cached.get(pod)
            miss = prompt if c is None else prompt - c
            if pod != chosen:  # (a fallback pod: not looked at)
                clean = -1
            elif cap is not None:
                self._capacity[pod] = cap
        old = self._live.pop(key, None)
        if old is not None:  # routed again (retry): forget the first attempt
            self._unledger(old[0], old[1], old[2], request.block_keys, old[4] != _QUEUED)
        now = self.clock()
        self._live[key] = [pod, prompt, miss, now, _QUEUED, rates, clean]
        self._pod_model[pod] = request.model
        keys = request.block_keys
        if keys and self._count_inflight:
            self._inflight.add(pod, keys)
        if self._keep_queue:
            self._queued.add(pod, key, keys)
        entry = self._ledger.setdefault(pod, [0, 0])
        entry[0] += prompt
        entry[1] += miss
        total = self._live_total
        total[0] += miss
        total[1] += 1
        if keys and self._hot_on:  # (no block: nothing to hold)
            self._hot.routed(pod, keys, now, self._capacity.get(pod))
        if self._arrivals is not None:
            self._arrived(pod, now, (prompt - miss) / prompt if prompt > 0 else 0.0)

    def _arrived(self, pod: str, now: float, share: float) -> None:
        a = self._arrivals.get(pod)  # type: ignore[union-attr]
        if a is None:
            self._arrivals[pod] = [now, 0.0, 1.0, share]  # type: ignore[index]
        elif now >= a[0]:  # (a clock that went back: not a gap)
            gap = now - a[0]
            first = a[2] < 2.0
            a[1] = gap if first else a[1] * _KEEP + gap * (1.0 - _KEEP)
            a[3] = a[3] * _KEEP + share * (1.0 - _KEEP)
            a[0] = now
            a[2] += 1.0

    def held_by_admitted(self, pod: str, keys: Sequence[int], waiting: int | None) -> int:
        """Leading blocks of ``keys`` that live requests routed to ``pod`` and admitted
        there hold (``kv_held_admitted``).  vLLM allocates a request's blocks when it
        admits it, FCFS: of the requests not yet past their first token, the newest
        ``waiting`` (the pod's scraped count) still wait and hold none; the older ones
        are prefilling.  Past its first token a request holds its blocks until its end.
        ``waiting`` unknown: every live request counts as admitted."""
        held = self._admitted.hits(pod, keys)
        queue = self._queued.pods.get(pod)
        if queue:
            n = len(queue) - (waiting if waiting else 0)  # the oldest n are admitted
            for chain in queue.values():  # oldest first
                if n <= 0:
                    break
                n -= 1
                s = shared_blocks(chain, keys)
                if s > held:
                    held = s
        return held

    def bound_arrival_rate(self, pod: str, now: float) -> float:
        """Requests a second routed to ``pod``, each counted by the share of its prompt
        the pod held (0 before two routings, or with ``count_arrivals`` off): the rate
        of arrivals its cache binds to it.  1 / the mean gap, the gap open now bounding
        the mean from below (a pod that stops receiving traffic cools without a timer)."""
        a = self._arrivals.get(pod) if self._arrivals is not None else None
        if a is None or a[2] < 2.0:
            return 0.0
        gap = a[1] if a[1] >= now - a[0] else now - a[0]
        return a[3] / gap if gap > 0.0 else 0.0

    def on_first_token(self, request: RouteRequest, pod: str, ttft_s: float) -> None:
        if self._keep_queue:
            self._queued.remove((request.request_id, id(request)))
        live = self._live.get((request.request_id, id(request)))
        if live is not None and live[0] == pod and live[4] == _QUEUED:
            now = live[4] = self.clock()
            if self._slow is not None:
                self._served(pod, live[3], now, live[2], live[5])
            prefill = live[5].prefill
            if prefill is not None:
                prefill.first_token(pod, live[3], now, live[2], live[6], live[5].slowdown)
            if self._held_admitted and request.block_keys:
                self._admitted.add(pod, request.block_keys)

    def on_prefill_done(self, request: RouteRequest, pod: str) -> None:
        # past its prefill at an unknown time: off the queue and holding its blocks, as
        # at a first token, but no time to learn from (nor its decode time at the end)
        live = self._live.get((request.request_id, id(request)))
        if live is not None and live[0] == pod and live[4] == _QUEUED:
            live[4] = _PAST_PREFILL
            if self._keep_queue:
                self._queued.remove((request.request_id, id(request)))
            if self._held_admitted and request.block_keys:
                self._admitted.add(pod, request.block_keys)

    def on_scraped(self, pod: str, counters: PodCounters) -> None:
        # a model whose first tokens the router never sees (JSON answers forwarded as
        # they came) learns its decode load from its pods' histograms instead
        model = self._pod_model.get(pod)
        rates = self._models.get(model) if model is not None else None
        if rates is None or model is None:
            return
        steps = self._scraped.get(model)
        if steps is None:
            steps = self._scraped[model] = ScrapedSteps()
        decode = steps.scraped(pod, counters)
        if rates.prefill is None or rates.prefill.seen():
            return  # the rate is the setting, or first tokens teach it
        if rates.slowdown is not None:
            rates.slowdown.per_running_s = steps.per_running_s
        if decode is not None and self._kv:
            rates.decode.add(decode)

    def _served(
        self, pod: str, routed_at: float, now: float, tokens: float, rates: ModelRates
    ) -> None:
        """A first token on ``pod`` (queue_slowness): its FCFS service time (from its
        routing, or from the pod's previous first token if later) against the model's
        fit of it (per-request time + predicted uncached tokens at the rate).  Bad input
        is left out and counted (by the learned prefill rate, which sees it too; with the
        rate set, here: ``rejected_observations()["first token"]``)."""
        if not (0.0 <= tokens < _INF and -_INF < routed_at <= now < _INF):
            if rates.prefill is None:
                self._slow_rejected += 1
            return
        s = self._slow.get(pod)  # type: ignore[union-attr]
        if s is None:
            s = self._slow[pod] = [0.0, 0.0, 0.0, routed_at]  # type: ignore[index]
        start = routed_at if s[3] < routed_at else s[3]
        if now > s[3]:
            s[3] = now
        prefill = rates.prefill
        if prefill is None:  # the rate is the setting: no per-request time
            predicted = tokens / self._p.prefill_rate_tokens_per_s
        else:
            predicted = prefill.per_request_s() + tokens / prefill.rate
        g = _FORGET
        s[0] = s[0] * g + (now - start if now > start else 0.0)
        s[1] = s[1] * g + predicted
        s[2] = s[2] * g + 1.0

    def slowness(self, pod: str) -> float:
        """How much longer than the model's fit ``pod``'s first tokens took (service
        seconds over predicted, both summed over its recent first tokens), shrunk to 1
        by PRIOR_WEIGHT observations of its mean prediction: 1 for a pod not seen yet,
        above 1 for a pod slower than its fleet (an older GPU, a queue stalled for KV
        room or by preemptions' recompute), below 1 for a faster one."""
        s = self._slow.get(pod) if self._slow is not None else None
        if s is None or s[2] <= 0.0 or s[1] <= 0.0:
            return 1.0
        prior = PRIOR_WEIGHT * s[1] / s[2]
        return (s[0] + prior) / (s[1] + prior)

    def on_complete(self, request: RouteRequest, pod: str) -> None:
        key = (request.request_id, id(request))
        old = self._live.pop(key, None)
        # (past its first token on its pod, on_first_token took it off the queue)
        if self._keep_queue and (old is None or old[4] == _QUEUED):
            self._queued.remove(key)
        if old is not None:
            if old[4] >= 0.0 and self._kv:
                old[5].decode.add(self.clock() - old[4])
            self._unledger(old[0], old[1], old[2], request.block_keys, old[4] != _QUEUED)

    def on_pod_removed(self, pod: str) -> None:
        self._ledger.pop(pod, None)
        self._pod_model.pop(pod, None)
        for steps in self._scraped.values():
            steps.forget(pod)
        if self._arrivals is not None:
            self._arrivals.pop(pod, None)
        self._inflight.forget(pod)
        self._admitted.forget(pod)
        self._queued.forget(pod)
        self._hot.forget(pod)
        self._capacity.pop(pod, None)
        if self._slow is not None:
            self._slow.pop(pod, None)
        for m in self._models.values():
            if m.prefill is not None:
                m.prefill.forget(pod)
        for rid in [rid for rid, v in self._live.items() if v[0] == pod]:
            self._live_total[0] -= self._live.pop(rid)[2]
            self._live_total[1] -= 1

    def _unledger(
        self, pod: str, prompt: int, miss: int, keys: Sequence[int], admitted: bool
    ) -> None:
        if keys and self._count_inflight:
            self._inflight.remove(pod, keys)
            if admitted and self._held_admitted:
                self._admitted.remove(pod, keys)
        entry = self._ledger.get(pod)
        if entry is not None:
            entry[0] -= prompt
            entry[1] -= miss
        total = self._live_total
        total[0] -= miss
        total[1] -= 1
