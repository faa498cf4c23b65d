"""``cost`` (the default): send the request where its predicted time to first token is
lowest, charging a miss more when the pod that would pay for it is backlogged.

scoring/policies/README.md, "``cost`` (default)", documents every term, its parameter
(:class:`scoring.policies.cost_params.CostParams`), whether it is learned, a prior or a
switch, and the measurements behind each.  In short, per candidate pod, with ``P``
prompt tokens and block size ``B``::

    cached      = the prompt's leading tokens the pod serves: index hits per tier
                  (scoring/policies/tiers.py), or the prefixes of requests routed there
                  and still in flight (count_inflight_prefixes), whichever is more,
                  cut to what an LRU cache keeps of them until this request runs
                  (lru_evictions: scoring/policies/hot_set.py; queue_evictions:
                  scoring/policies/queued.py)
    transfer    = the slower tiers' share of ``cached`` over their load rates
    uncached    = P - cached
    evicted     = the hot blocks (routed there in the last hot_window_s) this
                  request's new blocks push out of a full cache (charge_hot_evictions)
    queued      = the pod's outstanding prefill tokens, scaled by the uncached share
                  predicted for the requests routed there (discount_queued_hits:
                  scoring/policies/cost_ledger.py)
    w           = miss_weight + backlog_weight * b / u    (1 + the followers a miss
                  delays: b the backlog the pod's misses hold, u the mean predicted
                  uncached tokens of the live requests; count_arrivals adds the
                  requests bound to the pod that arrive during the miss)
    slowdown    = 1 + decode slowdown per running request (set, or learned from clean
                  first tokens: scoring/policies/slowdown_fit.py)
    steps       = (waiting + 1) * per-running step time * running
                  (charge_decode_steps; learned slowdown only)
    kv_wait     = the wait for KV room (scoring/policies/kv_admission.py)
    score(pod)  = (queued + w * (uncached + evicted)) / prefill_rate * slowdown
                  + transfer + steps + kv_wait

``prefill_rate`` is learned per model from the first tokens the router sees
(scoring/policies/learned_rate.py), the setting being its prior.  The pod with the
smallest score wins; pods within ``tie_epsilon_s`` of it are tied, narrowed to those
with the most room for a new prefix (``tie_break_by_room``: vLLM's free blocks less the
hot ones; without a capacity on every tied pod, the pods holding the most of the
prompt), then chosen by rendezvous hashing of the request id (highest ``xxh3(seed,
request_id + pod)``).  ``Decision.scores`` holds each pod's score in seconds
(``lower_is_better``).
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

from scoring.policies.base import Decision, PodView, PolicyParams, RouteRequest
from scoring.policies.cost_ledger import CostLedger
from scoring.policies.cost_params import CostParams
from scoring.policies.hot_set import evicted_hot, most_room
from scoring.policies.kv_admission import admission_wait
from scoring.policies.queued import surviving
from scoring.policies.select import require_candidates
from scoring.policies.slowdown_fit import clean_running
from scoring.policies.tiers import tier_hits

_h64 = xxhash.xxh3_64_intdigest
_MAX_SCORED = 65_536


def predict_ttft(
    request: RouteRequest,
    pod: PodView,
    p: CostParams,
    queued_tokens: float | None = None,
    inflight_blocks: int = 0,
    miss_weight: float | None = None,
) -> tuple[float, int]:
    """Predicted cost (s) of ``request`` on ``pod`` and the prompt tokens it would reuse.

    ``queued_tokens`` overrides ``pod.outstanding_prefill_tokens`` as the queued work;
    ``inflight_blocks`` leading blocks will be computed by requests queued ahead;
    ``miss_weight`` overrides ``p.miss_weight`` (the backlog-adjusted ``w``).
    """
    prompt = request.prompt_tokens
    bs = request.block_size
    cached, transfer = tier_hits(pod.hits, prompt, bs, p.tiers, p.tier_load_rates_tokens_per_s)
    cached = max(cached, min(inflight_blocks * bs, prompt))
    running = pod.running if pod.running is not None else pod.inflight
    slowdown = 1.0 + (p.decode_slowdown_per_running or 0.0) * running
    queued = pod.outstanding_prefill_tokens if queued_tokens is None else queued_tokens
    w = p.miss_weight if miss_weight is None else miss_weight
    work = queued + w * (prompt - cached)
    return work / p.prefill_rate_tokens_per_s * slowdown + transfer, cached


class CostPolicy(CostLedger):
    name = "cost"
    Params = CostParams

    def __init__(self, params: PolicyParams | None = None) -> None:
        super().__init__(params)
        p = self._p
        by_prompt = p.backlog_unit == "prompt"
        default_weight = 12.0 if by_prompt else 1.0
        # the settings pick reads, resolved once (params are frozen): it runs per request
        self._by_prompt = by_prompt
        self._backlog_weight = default_weight if p.backlog_weight is None else p.backlog_weight
        self._charge = self._hot_on and p.charge_hot_evictions
        self._room_ties = p.tie_break_by_room
        self._charge_steps = p.charge_decode_steps
        self._settings = (
            p.discount_queued_hits,
            p.fleet_backlog_share,
            p.miss_weight,
            p.decode_slowdown_per_running or 0.0,
            p.tiers,
            p.tier_load_rates_tokens_per_s,
            p.tiers[0] if p.tiers else None,  # the fastest tier (alone: no transfer)
            p.tie_epsilon_s,
        )

    def pick(self, request: RouteRequest, pods: Sequence[PodView]) -> Decision:
        # predict_ttft inlined over the candidates (same arithmetic, same order of
        # operations: the replay's numbers must not move); this runs on every request
        if not pods:
            require_candidates(self.name, pods)  # raises
        p = self._p
        ledger_get = self._ledger.get
        discount, share, miss_weight, slowdown_per, tiers, rates, gpu, eps = self._settings
        # per pod: (view, queued tokens, live uncached tokens); their total queued
        rows: list[tuple[PodView, float, int]] = []
        total = 0.0
        # (float() of a count below 2**53 is exact: the sums are those of the ints; mypyc,
        # which compiles this module in a compiled build, wants floats typed as floats)
        q: float
        for pod in pods:
            entry = ledger_get(pod.pod)
            if entry is None:
                q = float(pod.outstanding_prefill_tokens)
                rows.append((pod, q, 0))
            else:
                if not discount or entry[0] <= 0:
                    q = float(pod.outstanding_prefill_tokens)
                else:
                    q = pod.outstanding_prefill_tokens * entry[1] / entry[0]
                rows.append((pod, q, entry[1]))
            total += q  # (as sum() over the list: the same additions in the same order)
        backlog = total / len(pods)
        prompt = request.prompt_tokens
        bs = request.block_size
        keys = request.block_keys
        if self._by_prompt:
            size: float = float(max(1, prompt))
        else:  # "request": the backlog in requests = the followers a miss delays
            live_miss, live_count = self._live_total  # (backlog_unit_tokens, inlined)
            size = max(1.0, live_miss / live_count if live_count > 0 else prompt)
        backlog_weight = self._backlog_weight
        share_backlog = (1.0 / len(pods) if share is None else share) * backlog
        learned = self._models.get(request.model) or self._rates_of(request.model)
        rate = p.prefill_rate_tokens_per_s if learned.prefill is None else learned.prefill.rate
        fit = learned.slowdown
        if fit is not None:  # learned (the setting unset)
            slowdown_per = fit.slowdown
        inflight = self._inflight if self._count_inflight and keys else None
        live_on = inflight.pods if inflight is not None else None  # pods with live chains
        # what survives of a cached prefix: its LRU distance in the hot set, or without
        # one the queue rule (pod -> its prompts not past prefill, only pods with one)
        lru = self._hot if self._lru and keys else None
        queues = self._queued.pods if self._queue_rule and keys else None
        predicted: dict[str, float] = {}
        cached: dict[str, int] = {}
        weights: dict[str, float] = {}
        evicted: dict[str, int] = {}
        counted: dict[str, int] = {}  # hot counts the charge read (the tie-break reuses them)
        hot_set = self._hot if self._hot_on else None
        arrivals = self._arrivals
        now = self.clock() if hot_set is not None or arrivals is not None else 0.0
        # hot counts are read only where they matter: every pod when misses are
        # charged their evictions, else only the tied pods of a room tie-break
        charge = self._charge
        slow = self._slow is not None
        decode_s = learned.decode.mean_s if self._kv else 0.0
        # the seconds a running request adds to each engine step (learned: 0 when told)
        step_s = fit.per_running_s if fit is not None and self._charge_steps else 0.0
        unit = -1.0  # blocks of one queued request, computed when first needed
        prompt_blocks = -(-prompt // bs)
        best = None
        for pod, q, uncached in rows:
            name = pod.pod
            own: float = q if q >= uncached else uncached  # max(q, live_uncached)
            b = backlog if backlog <= own else own  # min(backlog, own)
            if share_backlog >= b:  # max(share_backlog, b)
                b = share_backlog
            w = weights[name] = miss_weight + backlog_weight * b / size
            hits = pod.hits
            if not hits:
                c, transfer = 0, 0.0
            elif len(hits) == 1 and gpu in hits:  # (tier_hits' result, without the loop)
                c = hits[gpu] * bs
                if c > prompt:
                    c = prompt
                transfer = 0.0
            else:
                c, transfer = tier_hits(hits, prompt, bs, tiers, rates)
            held = 0  # leading blocks live requests routed here hold (not free)
            if live_on is not None and name in live_on:
                held = inflight.hits(name, keys)  # type: ignore[union-attr]
                if held:  # c = max(c, min(held * bs, prompt))
                    hb = held * bs
                    if hb > prompt:
                        hb = prompt
                    if hb > c:
                        c = hb
            cap_b = pod.capacity_blocks
            if not c or not cap_b:
                pass
            elif lru is not None:
                # the blocks routed here since each of the prefix's: newer in vLLM's LRU
                # (none can push it out while all this pod's routed blocks fit beside it)
                cb = -(-c // bs)
                if lru.routed_keys(name) > cap_b - cb:
                    keep = lru.surviving(name, keys, cb, now, cap_b)
                    if keep < cb:
                        c = keep * bs
            elif queues and name in queues:
                cb = -(-c // bs)
                keep = surviving(queues[name], keys, cb, cap_b)
                if keep < cb:
                    c = keep * bs
            miss = prompt - c
            if charge and cap_b:
                new_b = len(keys) - c // bs
                if new_b > 0:  # (no new block, or no known size: nothing evicted)
                    h = counted[name] = hot_set.count(name, now)  # type: ignore[union-attr]
                    # hot blocks this request's freshly computed blocks push out: each
                    # is a miss a later request pays (0 while the hot set fits the cache)
                    e = evicted_hot(h, new_b, cap_b)
                    if e:
                        evicted[name] = e
                        miss += e * bs
            if arrivals is not None:  # + the arrivals its cache binds to it, meanwhile
                lam = self.bound_arrival_rate(name, now)
                if lam > 0.0:
                    w = weights[name] = w + backlog_weight * lam * miss / rate
            running = 0  # (scraped; router in-flight when not scraped), read when used
            if slowdown_per or step_s:
                scraped_running = pod.running
                running = pod.inflight if scraped_running is None else scraped_running
            # the queue at the pace this pod has kept (queue_slowness), else the model's
            work = q * self.slowness(name) + w * miss if slow and q > 0.0 else q + w * miss
            if slowdown_per:
                t = work / rate * (1.0 + slowdown_per * running) + transfer
            else:  # (the same float: x * 1.0 is x)
                t = work / rate + transfer
            if step_s:  # one step of the running decodes per request queued, and its own
                waiting = pod.waiting
                t += ((waiting if waiting else 0) + 1) * step_s * running
            if decode_s and cap_b:
                usage = pod.kv_usage
                if usage is not None:
                    free = cap_b * (1.0 - usage)
                    # every block of the prompt no running request holds: its cached
                    # prefix too, which leaves the free pool when it is hit (vLLM counts
                    # evictable computed blocks as blocks to allocate)
                    waiting = pod.waiting
                    if self._held_admitted and held:  # only admitted requests hold blocks
                        held = self.held_by_admitted(name, keys, waiting)
                    need: float = float(prompt_blocks - held)
                    if waiting:
                        if unit < 0:
                            unit = self.backlog_unit_tokens(prompt) / bs
                        need += waiting * unit  # the queue ahead is admitted first
                    if need > free:  # short of room: it waits for running requests
                        t += admission_wait(pod, need, decode_s)
            predicted[name] = t
            if best is None or t < best:  # min() over the predictions
                best = t
            cached[name] = c
        limit = best + eps  # type: ignore[operator]
        if self._room_ties:
            near = [v for v in pods if predicted[v.pod] <= limit]
            tied = (
                most_room(near, hot_set, now, cached, counted) if len(near) > 1 else [near[0].pod]
            )
        else:
            tied = [name for name, t in predicted.items() if t <= limit]
        chosen = tied[0]
        if len(tied) > 1:  # rendezvous: the highest hash (the first of equal ones) wins
            rid = request.request_id.encode() + b"\x00"
            seed = p.seed
            top = -1
            for name in tied:
                h = _h64(rid + name.encode(), seed)
                if h > top:
                    top = h
                    chosen = name
        # the predicted uncached tokens per pod are prompt - cached (on_routed)
        scored = self._scored
        cap = None
        clean = -1  # the chosen pod's running requests if it was clean for the slowdown fit
        if hot_set is not None or fit is not None:
            for v in pods:
                if v.pod == chosen:
                    if hot_set is not None:  # its cache bounds its hot set (on_routed)
                        cap = v.capacity_blocks
                    if fit is not None:
                        clean = clean_running(v, prompt_blocks)
                    break
        scored[(request.request_id, id(request))] = (prompt, cached, chosen, cap, learned, clean)
        if len(scored) > _MAX_SCORED:  # picks never routed must not pile up
            scored.popitem(last=False)
        return Decision(
            chosen,
            predicted,
            True,
            {
                "cached_tokens": cached,
                "tied": len(tied),
                "miss_weight": weights,
                "evicted_hot_blocks": evicted,
            },
        )
