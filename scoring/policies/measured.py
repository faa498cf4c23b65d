"""``measured``: send the request where the delay it causes — its own time to first token
plus what it adds to the requests that will queue behind it — is smallest, with every
rate measured online from the router's own observations.

For candidate pod ``p`` (``P`` prompt tokens, ``now`` the policy's clock)::

    cached     = leading prompt tokens the pod holds (index hits, fastest tier first,
                 or carried by an in-flight request routed there: computed before this
                 one runs); transfer = seconds to load slower tiers' share into GPU
    U          = P - cached                                   # tokens to compute
    n          = running requests (scraped; router in-flight when not scraped)
    tau        = a_p + b_p * n                                # s per prefill token now
    Q          = uncached tokens queued ahead (own ledger; other routers' outstanding
                 prompts scaled by the ledger's miss share); k = own requests queued
    V          = Q * tau + k * c_p                            # queue wait
    s          = c_p + U * tau                                # own prefill
    ttft       = V + s + transfer
    D          = E[output] * step_p(decoding + 1)             # its decode time
    rho        = min(1, measured prefill utilisation)
    x          = b_p * rho * D / tau                          # prefill slowed by its decode
    e          = clamp(hot_p + new - capacity_p, 0, new)      # hot blocks it evicts
    r          = e * B * tau                                  # their recompute, later
    w          = s + x + r                                    # work it adds to the pod
    N_pod      = lambda_p * (V + w)                           # queued behind it, here
    N_fleet    = mean_q(lambda_q) * (mean_q(V_q) + w / pods)  # behind it, fleet-wide
    N          = max(N_pod, N_fleet)                          # requests it delays
    score(p)   = ttft + r + w * N                             # seconds of delay caused

``a_p, b_p, c_p`` (prefill s/token, its slowdown per running request, per-request
overhead) and ``step_p`` (decode seconds per step, and per decoding request) are fitted
per pod by :class:`scoring.policies.pod_rates.PodRates` from first-token and completion
times; ``lambda_p`` (requests/s routed to the pod) and ``rho`` (its measured prefill
utilisation) from its arrival gaps and service times.  ``N`` is the queueing answer to
"how many requests will this work delay": the ones that arrive at the pod, ``lambda_p``
per second, while the work ahead of them (``V + w``) drains, each delayed by ``w``
(FCFS).  A static split would also delay the arrivals of the busy period that follows
(``/ (1 - rho)``), but the router re-routes those: they see the longer queue and go
elsewhere (measured: with the busy-period factor the policy hoards misses on idle pods;
docs/replay.md).  A miss (large ``U``) is therefore expensive where the pod is busy and
cheap where it is idle; no backlog multiplier.

``V`` counts ``c_p`` once per queued request: the fit puts into ``c_p`` what the
predicted uncached tokens miss (hits the ledger counted that are evicted before the
request runs), and every queued request pays it (without it, on a small bursty RAG
fleet, a pod whose queue takes 40 s was scored as if it took about 1 s).

``N_fleet`` is the same count for a fleet that shares its backlog: when every pod has a
queue, the router spreads later arrivals over the pods, so ``w`` seconds of work
anywhere delay every request the fleet receives until its mean queue ``mean_q(V_q)``
drains, each by ``w / pods``: ``pods * mean(lambda) * (mean V + w / pods)`` requests
times ``w / pods`` seconds is ``w * N_fleet``.  The larger of the two counts is used
(the pod's own followers are among the fleet's when it is balanced; a pod hotter than
the fleet delays more of its own).  ``pooled_delay: false`` keeps ``N_pod`` alone.

``e`` is the duplicated prefix's cost in cache room: ``hot_p`` is the pod's hot set as
this policy knows it (the distinct blocks it routed there in the last ``hot_window_s``,
:class:`scoring.policies.hot_set.HotBlocks`, the same bookkeeping as ``cost``), ``new``
the request's full blocks not cached there, ``capacity_p`` the pod's ``num_gpu_blocks``.
While the hot set and the new blocks fit, nothing is charged; past that each new block
pushes a hot one out (vLLM evicts LRU), a recompute of ``B`` tokens some later request
pays on this pod (``r``, once for its owner and, as work, for the requests behind it).
Unknown capacity, or ``hot_window_s = 0``: no charge.

The smallest score wins; scores within ``tie_epsilon_s`` tie.  Ties narrow to the pods
with the most free KV room as vLLM has it: blocks held by running requests are
occupied, cached blocks with no running request are free (vLLM evicts them LRU when it
needs room), so ``free = capacity_blocks * (1 - kv_usage)``; a pod full of old cache is
not a full pod.  (Without ``kv_usage``: ``capacity - resident``; without a capacity: the
fewest resident.)  Then rendezvous hashing of the request id (as ``cost``).

Priors (used until a pod's observations identify its rates; README has the sources):
``prefill_rate_tokens_per_s``, ``prefill_slowdown_per_running``, ``request_overhead_s``,
``decode_step_s``, ``decode_step_per_running_s``, ``output_tokens``.  Bad observations
are dropped, logged once and counted (:attr:`MeasuredPolicy.calibration`); a fit
that solves to a coefficient <= 0 keeps the prior and is counted apart
(``calibration.prior_fallbacks``), since the observations were fine.  Scores are never
NaN.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from scoring.policies.base import Decision, PodView, Policy, PolicyParams, RouteRequest
from scoring.policies.hot_set import HotBlocks, evicted_hot
from scoring.policies.inflight import InflightPrefixes
from scoring.policies.measured_params import MeasuredParams
from scoring.policies.pod_rates import Calibration, PodRates, Priors, valid_observation
from scoring.policies.room import free_blocks
from scoring.policies.select import require_candidates
from scoring.policies.tiers import tier_hits

_h64 = xxhash.xxh3_64_intdigest
_MAX_SCORED = 65_536


@dataclass(slots=True)
class _Live:
    pod: str
    prompt: int
    uncached: int
    routed_at: float
    running: int  # the pod's running requests when routed
    first_token_at: float | None = None
    decoding: int = 0  # own requests decoding on the pod at the first token


@dataclass(slots=True)
class _PodBook:
    queued_prompt: int = 0  # own live requests not past their first token
    queued_uncached: int = 0
    queued: int = 0  # how many they are
    decoding: int = 0  # own live requests past their first token


def _most_room(tied: Sequence[PodView]) -> list[str]:
    rooms: list[float] = []
    for v in tied:
        f = free_blocks(v)
        if f is None:
            break
        rooms.append(f)
    else:
        top = max(rooms)
        return [v.pod for v, r in zip(tied, rooms, strict=True) if r == top]
    if all(v.resident_blocks is not None for v in tied):
        least = min(v.resident_blocks for v in tied)  # type: ignore[type-var]
        return [v.pod for v in tied if v.resident_blocks == least]
    return [v.pod for v in tied]


class MeasuredPolicy(Policy):
    name = "measured"
    Params = MeasuredParams

    def __init__(self, params: PolicyParams | None = None) -> None:
        super().__init__(params)
        assert isinstance(self.params, MeasuredParams)
        p = self._p = self.params
        self._priors = Priors(
            prefill_rate_tokens_per_s=p.prefill_rate_tokens_per_s,
            prefill_slowdown_per_running=p.prefill_slowdown_per_running,
            request_overhead_s=p.request_overhead_s,
            decode_step_s=p.decode_step_s,
            decode_step_per_running_s=p.decode_step_per_running_s,
            memory=p.memory,
            prior_weight=p.prior_weight,
        )
        self.calibration = Calibration()
        self.rates: dict[str, PodRates] = {}
        self._books: dict[str, _PodBook] = {}
        # (request_id, id(request)) -> (prompt, {pod: cached}, {pod: running}) until routed
        self._scored: OrderedDict[tuple[str, int], tuple[int, dict[str, int], dict[str, int]]] = (
            OrderedDict()
        )
        self._live: dict[tuple[str, int], _Live] = {}
        self._inflight = InflightPrefixes()  # the live requests' chains, per pod
        self._out_mean = p.output_tokens
        self._hot = HotBlocks(p.hot_window_s)
        self._capacity: dict[str, int] = {}
        self._out_w = 1.0 - 1.0 / p.memory

    def pod_rates(self, pod: str) -> PodRates:
        r = self.rates.get(pod)
        if r is None:
            r = self.rates[pod] = PodRates(self._priors)
        return r

    def expected_output(self, request: RouteRequest) -> float:
        m = self._out_mean
        if request.max_tokens is not None and 0 < request.max_tokens < m:
            return float(request.max_tokens)
        return m

    def pick(self, request: RouteRequest, pods: Sequence[PodView]) -> Decision:
        if not pods:
            require_candidates(self.name, pods)  # raises
        p = self._p
        now = self.clock()
        prompt = request.prompt_tokens
        bs = request.block_size
        keys = request.block_keys
        out = self.expected_output(request)
        scores: dict[str, float] = {}
        cached: dict[str, int] = {}
        running_of: dict[str, int] = {}
        evicted: dict[str, int] = {}
        hot = self._hot if p.hot_window_s > 0 else None
        best = math.inf
        rows: list[tuple[str, float, float, float, float]] = []
        tiers, load_rates = p.tiers, p.tier_load_rates_tokens_per_s
        for view in pods:
            name = view.pod
            rates = self.pod_rates(name)
            book = self._books.get(name)
            if view.hits:
                c, transfer = tier_hits(view.hits, prompt, bs, tiers, load_rates)
            else:
                c, transfer = 0, 0.0
            if p.count_inflight_prefixes and keys:
                c = max(c, min(self._inflight.hits(name, keys) * bs, prompt))
            running = view.running if view.running is not None else view.inflight
            decoding = book.decoding if book is not None else 0
            # queued uncached tokens: own ledger, plus other routers' outstanding
            # prompts scaled by the ledger's miss share
            outstanding = view.outstanding_prefill_tokens
            if book is not None and book.queued_prompt > 0:
                share = book.queued_uncached / book.queued_prompt
                q = book.queued_uncached + max(0, outstanding - book.queued_prompt) * share
            else:
                q = float(outstanding)
            tau = rates.token_s(running)
            overhead = rates.prefill.theta[0]
            v = q * tau + (book.queued * overhead if book is not None else 0.0)
            s = overhead + (prompt - c) * tau
            rho = min(rates.utilisation(now), 1.0)  # busy share of time
            x = rates.slowdown_s_per_token() * rho * out * rates.decode_step_s(decoding + 1) / tau
            # hot blocks its fresh blocks push out of the cache: each a recompute on
            # this pod that a later request pays
            r = 0.0
            if hot is not None:
                cap = view.capacity_blocks
                if cap is not None:
                    self._capacity[name] = cap
                    e = evicted_hot(hot.count(name, now), len(keys) - c // bs, cap)
                    if e:
                        r = e * bs * tau
                        evicted[name] = e
            w = s + x + r
            rows.append((name, v, s + transfer + r, w, rates.arrival_rate(now)))
            cached[name] = c
            running_of[name] = running
        pooled = p.pooled_delay
        n = len(rows)
        lam_f = sum(row[4] for row in rows) / n
        v_f = sum(row[1] for row in rows) / n
        for name, v, own, w, lam in rows:
            n_delayed = lam * (v + w)
            if pooled:
                n_delayed = max(n_delayed, lam_f * (v_f + w / n))
            score = v + own + w * n_delayed
            if not math.isfinite(score):  # cannot happen with validated fits; never NaN
                self.calibration.reject(name, "score", score)
                score = 1e30
            scores[name] = score
            if score < best:
                best = score
        limit = best + p.tie_epsilon_s
        tied_views = [v for v in pods if scores[v.pod] <= limit]
        tied = [v.pod for v in tied_views]
        if len(tied) > 1:
            tied = _most_room(tied_views)
        chosen = tied[0]
        if len(tied) > 1:  # rendezvous: the highest hash (the first of equal ones) wins
            rid = request.request_id.encode() + b"\x00"
            top = -1
            for name in tied:
                h = _h64(rid + name.encode(), p.seed)
                if h > top:
                    top = h
                    chosen = name
        scored = self._scored
        scored[(request.request_id, id(request))] = (prompt, cached, running_of)
        if len(scored) > _MAX_SCORED:
            scored.popitem(last=False)
        return Decision(
            chosen,
            scores,
            True,
            {"cached_tokens": cached, "tied": len(tied), "evicted_hot_blocks": evicted},
        )

    def rejected_observations(self) -> dict[str, int]:
        return dict(self.calibration.rejected)

    # --- observations -------------------------------------------------------------

    def on_routed(self, request: RouteRequest, pod: str) -> None:
        key = (request.request_id, id(request))
        now = self.clock()
        got = self._scored.pop(key, None)
        prompt = request.prompt_tokens
        miss, running = prompt, self._books.get(pod, _PodBook()).decoding
        if got is not None:
            c = got[1].get(pod)
            if c is not None:
                miss = prompt - c
                running = got[2][pod]
        old = self._live.pop(key, None)
        if old is not None:  # routed again (retry): forget the first attempt
            self._forget(old, request.block_keys)
        if not valid_observation(now):
            self.calibration.reject(pod, "clock", now)
            now = 0.0
        self._live[key] = _Live(pod, prompt, miss, now, running)
        book = self._books.setdefault(pod, _PodBook())
        book.queued_prompt += prompt
        book.queued_uncached += miss
        book.queued += 1
        if self._p.count_inflight_prefixes:
            self._inflight.add(pod, request.block_keys)
        self.pod_rates(pod).arrived(now)
        if self._p.hot_window_s > 0:
            self._hot.routed(pod, request.block_keys, now, self._capacity.get(pod))

    def on_first_token(self, request: RouteRequest, pod: str, ttft_s: float) -> None:
        entry = self._live.get((request.request_id, id(request)))
        if entry is None or entry.pod != pod or entry.first_token_at is not None:
            return
        now = self.clock()
        book = self._books.setdefault(pod, _PodBook())
        book.queued_prompt -= entry.prompt
        book.queued_uncached -= entry.uncached
        book.queued -= 1
        entry.decoding = book.decoding
        book.decoding += 1
        entry.first_token_at = now
        if not valid_observation(ttft_s):
            self.calibration.reject(pod, "ttft", ttft_s)
            return
        if not (valid_observation(now) and now >= entry.routed_at):
            self.calibration.reject(pod, "clock", now)
            return
        _, ok = self.pod_rates(pod).first_token(
            entry.routed_at, now, float(entry.uncached), float(entry.running)
        )
        if not ok:
            self.calibration.prior_fallbacks["prefill"] += 1

    def on_finished(self, request: RouteRequest, pod: str, output_tokens: int | None) -> None:
        entry = self._live.get((request.request_id, id(request)))
        if entry is None or entry.pod != pod or output_tokens is None:
            return
        if isinstance(output_tokens, bool) or not (
            isinstance(output_tokens, int) and output_tokens >= 0
        ):
            self.calibration.reject(pod, "output tokens", output_tokens)
            return
        self._out_mean = self._out_mean * self._out_w + output_tokens * (1.0 - self._out_w)
        ft = entry.first_token_at
        if ft is None or output_tokens < 2:
            return
        decode_s = self.clock() - ft
        if not valid_observation(decode_s):
            self.calibration.reject(pod, "decode time", decode_s)
            return
        if not self.pod_rates(pod).finished(decode_s, output_tokens - 1, entry.decoding):
            self.calibration.prior_fallbacks["decode"] += 1

    def on_complete(self, request: RouteRequest, pod: str) -> None:
        entry = self._live.pop((request.request_id, id(request)), None)
        if entry is not None:
            self._forget(entry, request.block_keys)

    def on_pod_removed(self, pod: str) -> None:
        self._books.pop(pod, None)
        self._inflight.forget(pod)
        self.rates.pop(pod, None)
        self._hot.forget(pod)
        self._capacity.pop(pod, None)
        for key in [k for k, v in self._live.items() if v.pod == pod]:
            del self._live[key]

    def _forget(self, entry: _Live, keys: Sequence[int]) -> None:
        book = self._books.get(entry.pod)
        if book is not None:
            if entry.first_token_at is None:
                book.queued_prompt -= entry.prompt
                book.queued_uncached -= entry.uncached
                book.queued -= 1
            else:
                book.decoding -= 1
        if self._p.count_inflight_prefixes:
            self._inflight.remove(entry.pod, keys)
