"""``cost`` (the default): send the request where its predicted time to first token is
lowest, charging a miss more when the pod that would pay for it is backlogged.

For each candidate pod, with ``P`` prompt tokens, block size ``B`` and ``hits[t]`` =
leading blocks servable from tier ``t`` or faster (tiers fastest first)::

    cached[t]   = min(hits[t] * B, P)                      # made monotone over tiers
    transfer    = sum over slower tiers t with a rate of
                  (cached[t] - cached[faster]) / tier_load_rates_tokens_per_s[t]
    cached      = max(cached[slowest tier with a rate], in-flight hits * B)   (see below)
    cached      = min(cached, kept * B)           (the blocks an LRU cache keeps, below)
    uncached    = P - cached
    evicted     = clamp(hot + new - capacity_blocks, 0, new) * B      (below)
    slowdown    = 1 + decode_slowdown_per_running * running
                  (running = scraped ``running``; router ``inflight`` when not scraped;
                  the per-running slowdown is the setting, or, unset (the default),
                  learned from clean first tokens: scoring/policies/slowdown_fit.py)
    steps       = (waiting + 1) * per_running_step_s * running     (learned slowdown only)
    score(pod)  = (queued_tokens + w * (uncached + evicted)) / prefill_rate_tokens_per_s
                  * slowdown + transfer + steps

``steps`` (``charge_decode_steps``, default on; only while the slowdown is learned):
each request waiting on the pod, and this one, is prefilled in at least one engine step,
and every running request's decode lengthens every step.  ``per_running_step_s`` is
that lengthening, the slope against the running count alone that the slowdown's fit
learns from clean first tokens (scoring/policies/slowdown_fit.py's ``d``); ``waiting``
is scraped (0 when unknown), ``running`` as above.  Short prompts that share a step
are charged a step each (an overestimate); a prompt longer than one step's token
budget one step (an underestimate).  Held-out seeds 103 and 107 (docs/history/quality_matrix.md,
"Session 26"): TTFT p90 within 1.05x of the best peer in 12 and 12 of 14 cells, against 10 and 9
without it.

``queued_tokens`` is the pod's queued prefill work and ``w`` the pod's miss weight,
both below.  With ``w = 1`` the score is the predicted TTFT: queue wait + own prefill +
load from slower tiers.

``prefill_rate_tokens_per_s`` is learned (``learn_prefill_rate``, default on), per
model over its pods (so are the decode times below): prompt tokens per second of
prefill, the slope of a pod's service of a request
(from its routing, or the pod's previous first token, FCFS, to its first token) against
its predicted uncached tokens (scoring/policies/learned_rate.py).  The setting is the prior
until first tokens come back; live, only streamed answers have a first token of their
own, so a fleet serving only non-streamed requests keeps the prior.

``hot`` is the pod's hot working set as this policy knows it: the distinct blocks it
routed there in the last ``hot_window_s`` (300 s, the lifetime hosted APIs give an
unused cached prefix; scoring/policies/hot_set.py), and ``new`` the request's full
blocks not cached there.  With ``charge_hot_evictions`` (default on since session 21),
when the hot set plus the new blocks overflow the pod's cache, each new block pushes a
hot one out (vLLM evicts LRU), a miss some later request (the next turn of a
conversation in progress, the next question over a document) pays: ``evicted`` charges
it now, at the same price as the request's own misses (zero while the hot set fits, or
when the capacity is unknown; with the option off, zero).  Without it a pod waiting
for KV room sends its document to a pod whose cache holds another one, which then
thrashes (RAG on 16 unequal pods: TTFT p90 6.2x the best policy's; 1.04x with it).  It
raises hit rates on every seed measured and loses some balance on RAG fleets of 8 pods
(scoring/policies/README.md has the numbers).  Hot counts are read only where they
change the decision: every pod with a known size and blocks to compute under the
charge, else only the tied pods of a room tie-break (the hot set is kept
incrementally, so a read is one comparison until the pod's oldest block leaves the
window).

The pod with the smallest score wins.  Pods within ``tie_epsilon_s`` of the minimum
are tied.  With ``tie_break_by_room`` (default on) the tie narrows to the pods with the
most room for a new prefix::

    room = min(capacity_blocks * (1 - kv_usage), capacity_blocks - hot)

vLLM's free blocks (blocks no running request holds are free: cached ones are evicted
LRU when room is needed, so a pod full of old cache is not a full pod), less the hot
blocks this policy sent there (cached, but about to be reused).  Without ``kv_usage``
``capacity_blocks - resident_blocks`` stands for vLLM's free blocks.  Without a
capacity on every tied pod (backends that publish no KV events and no vLLM metrics)
nothing says where a copy of the prefix would have room, so none is made: the pods
holding the most of the prompt (index, speculative or in-flight hits) win, then the
fewest resident blocks.  Counting resident blocks alone sent every tie to a pod that
did not hold the prompt, so a repeated short prompt, which ties everywhere, was copied
over two to four pods depending on the first requests' timing.  A prefix no pod holds
(the typical tie: same load, nothing cached) starts where it has the most room, so new
prefix groups spread over the fleet instead of piling onto pods that already hold
others and evicting them.  Among what remains the winner is chosen by rendezvous
hashing of the request id (highest ``xxh3(seed, request_id + pod)``): deterministic
for a request, uniform across pods, with no bias toward the first
candidate.  ``Decision.scores`` holds each pod's
score in seconds (``lower_is_better``).

``outstanding_prefill_tokens`` counts whole prompts, cached parts included.  With
``discount_queued_hits`` (default on) the policy scales it by the uncached share it
predicted for the requests it routed to that pod and that have not completed::

    queued_tokens = outstanding_prefill_tokens * sum(predicted uncached) / sum(prompt)

(a ledger filled by ``on_routed`` and emptied by ``on_complete``; a pod with no ledger
entries, or a request re-routed to a pod it was not scored for, counts whole prompts).
Without it, a pod whose queue is mostly cache hits looks busier than it is, and the
policy drifts away from the pods that hold the prefixes.

With ``count_inflight_prefixes`` (default on) the policy also remembers the block keys
of the requests it routed that have not completed: a pod counts as holding a prefix that
an earlier in-flight request will have computed by the time this one (queued behind it,
FCFS) runs.  ``cached`` above becomes ``max(index hits, in-flight hits)`` (in-flight
blocks count as GPU blocks).  The index only learns a block once the engine stores it,
so without this a burst of requests sharing a new prefix scatters over the fleet.

Only the part of that prefix that survives until this request's prefill counts.  vLLM
evicts unreferenced blocks LRU (a freed request's tail first), so a block survives
while fewer than ``capacity_blocks`` blocks are newer than it, and in a cache too small
for all of them the prefix's tail goes first::

    kept   = the leading blocks of the prefix that stay: block i stays while
             i + (the distinct blocks routed to the pod after block i was last routed
             there, less those this prompt shares) < capacity_blocks
             (scoring/policies/hot_set.py, HotBlocks.surviving).  A shared head that
             every request carries (an instruction, a system prompt) is as recent as
             the last request routed there; a prefix running on past the end of a
             routed prompt (into its answer) is as recent as that prompt; any other
             block not routed there within hot_window_s is older than every routed one
    cached = min(cached, kept * B)

That covers the requests queued ahead (routed after the prefix, touched before this
request runs, FCFS) and the ones already served (touched after the prefix: newer in
the LRU).  It is ``lru_evictions`` (default on; it needs the hot set, ``hot_window_s >
0``).  Without the hot set, ``queue_evictions`` (default on) counts only the requests
queued ahead: routed by this policy, neither at their first token nor complete, after
the newest one that carries the whole prefix (scoring/policies/queued.py).  Without a
capacity nothing changes.  Without either rule, on a RAG fleet whose small caches held
one document each, the policy predicted 97% hits on a pod that delivered 27%: it kept
sending it questions over documents it could not hold together.

The uncached term is weighted per pod by ``w``: a miss costs its own prefill once, and
once more for every request that will queue behind it (a follower)::

    B          = mean over candidate pods of queued_tokens          # the fleet's backlog
    own(pod)   = max(queued_tokens, live_uncached)                  # the pod's own work
    share      = fleet_backlog_share, by default 1 / the candidate pods
    b(pod)     = max(share * B, min(B, own(pod)))                   # tokens
    u          = mean predicted uncached tokens of the live requests this policy routed
                 (any pod); with none live, this request's prompt tokens
    w(pod)     = miss_weight + backlog_weight * b(pod) / u          # 1 + followers

``live_uncached`` is the predicted uncached tokens of the live requests this policy
routed to the pod (the ledger above).  ``b / u`` is the backlog counted in requests: by
Little's law, as many requests arrive while the recomputed tokens hold the queue as are
queued now, and each waits for them.  So with no backlog ``w = miss_weight = 1`` and
the score is the predicted TTFT; with one, a loaded fleet keeps requests on the pods
holding their prefixes, and every quantity is measured: ``u`` from the requests in
flight, no fitted scale (``backlog_weight`` defaults to 1: one delay per follower).  A
miss mostly costs the time of the pod that pays it, so a pod with little work of its
own charges only its share of the fleet's backlog, ``1 / pods`` (the backlog split evenly
over the candidates).  Pricing every miss by the whole fleet mean
(``fleet_backlog_share = 1``) lets one hot pod's queue make misses expensive everywhere;
pricing by the pod's own work alone (``0``) gives up hits on bursty traces
(docs/replay.md).  Until session 17 the share was ``0.125``, chosen on traces (both
Mooncake traces and a small chat fleet, session 5): the same on 8 pods, and on 4 and 16
pods ``1 / pods`` did as well or better on held-out seeds (scoring/policies/README.md).
No constant of the default is fitted now.

``backlog_unit = "prompt"`` with ``fleet_backlog_share = 0.125`` is the formula before:
``w = miss_weight + backlog_weight * b / P`` with ``backlog_weight`` defaulting to 12,
fitted on the same traces (12 was
about ``P / u`` there: the same count of followers, with a fitted scale instead of a
measured one).  On held-out traffic (seeds and fleet shapes never looked at:
scoring/policies/README.md) the measured unit gives a lower TTFT p90 geomean;
``backlog_weight = 0`` gives the pure TTFT prediction in either unit.

With ``count_arrivals`` (opt-in) ``w`` also counts the requests that arrive while the
miss's own prefill runs and are bound to the pod by its cache (the others go elsewhere
while it is busy)::

    w(pod) += backlog_weight * lambda_bound(pod) * miss(pod) / prefill_rate_tokens_per_s

``lambda_bound`` is the pod's routings a second times the mean share of their prompt it
held (scoring/policies/cost_ledger.py, ``bound_arrival_rate``).  It fixes mixed long and
short prompts on small unequal fleets and loses RAG fleets of 8 pods
(scoring/policies/README.md has the matrix), so it is off by default.

With ``queue_slowness`` (opt-in) a pod's ``queued_tokens`` are multiplied by its own
pace, ``CostLedger.slowness(pod)``: its first tokens' FCFS service times over the rate
fit's predictions, shrunk to 1 (1 while nothing is queued there).  It helps 16-pod
fleets mixing two speeds under overload and loses overloaded 4-pod unequal-cache
Mooncake cells (scoring/policies/README.md, "Each pod's pace"), so it is off by default.
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
