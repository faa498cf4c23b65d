"""A simulated pod that schedules as a vLLM V1 engine does, and the router's view of it.

``--pod-model vllm`` in ``kvroute replay``.  Each pod is one engine: a
:class:`~scoring.replay.vllm_sched.Scheduler` (continuous batching, chunked prefill,
KV blocks as the one resource, prefix-cache lookup at schedule time, preemption by
recompute) whose steps take the time of a
:class:`~scoring.replay.step_cost.StepCost` model with the parameters of an
:class:`~scoring.replay.presets.EngineSpec` preset.

The KV cache holds ``capacity_tokens // block_size`` blocks of the trace's block size
(512 tokens for Mooncake traces, whose hash ids name 512-token blocks; vLLM allocates
16-token blocks on GPUs, so a request here may hold up to one block's worth of slots
more than it would there).  ``pod_speed`` gives each pod its own speed: its steps take
the preset's time divided by it (an older GPU next to newer ones).  ``max_model_len``
is the preset's, at most the KV capacity (vLLM refuses to start otherwise): a prompt
of ``max_model_len`` tokens or more is rejected, as vLLM rejects it; a longer output
than fits is cut at ``max_model_len``.

What the router sees (:meth:`VllmPod.view`), as a vLLM pod exposes it: the prefix
hits a precise KV-event index reports (blocks stored and not yet removed, whether
held or free), ``waiting`` and ``running`` (``vllm:num_requests_waiting`` /
``vllm:num_requests_running``), ``kv_usage`` (``vllm:kv_cache_usage_perc``: blocks
held by running requests / all blocks), resident and capacity blocks, plus the load
the router tracks itself (in-flight requests, outstanding prefill tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scoring.policies.base import PodCounters, PodView
from scoring.replay.presets import EngineSpec, PresetError
from scoring.replay.simpod import PerPod, ReplayConfigError
from scoring.replay.trace import TraceRequest
from scoring.replay.vllm_sched import Scheduler, Seq, StepPlan, StepResult


@dataclass(frozen=True, slots=True)
class VllmFleetConfig(PerPod):
    """Settings of a fleet of vLLM-like pods (validated by :meth:`validate`)."""

    pods: int
    capacity_tokens: int
    block_size: int
    engine: EngineSpec
    fast_forward: bool = True  # step over decode runs analytically (same results)
    pod_model: str = "vllm"
    #: KV cache of each pod when the pods differ (one entry per pod); None = every pod
    #: holds ``capacity_tokens``
    pod_capacity_tokens: tuple[int, ...] | None = None
    #: each pod's speed, a multiple of the preset's (one entry per pod: 0.5 = every
    #: step takes twice as long); None = every pod at 1
    pod_speed: tuple[float, ...] | None = None

    def validate(self) -> VllmFleetConfig:
        if self.pods < 1:
            raise ReplayConfigError(f"pods must be >= 1, got {self.pods}")
        if self.block_size < 1:
            raise ReplayConfigError(f"block-size must be >= 1, got {self.block_size}")
        if self.capacity_tokens < self.block_size:
            raise ReplayConfigError(
                f"capacity-tokens must hold at least one block ({self.block_size} tokens), "
                f"got {self.capacity_tokens}"
            )
        caps = self.pod_capacity_tokens
        if caps is not None and (len(caps) != self.pods or any(c < self.block_size for c in caps)):
            raise ReplayConfigError(
                f"pod-capacity-tokens must list {self.pods} pods of at least one block "
                f"({self.block_size} tokens), got {caps!r}"
            )
        self.check_pod_speed()
        try:
            self.engine.validate()
        except PresetError as exc:
            raise ReplayConfigError(f"engine-param {exc}") from None
        return self

    @property
    def max_model_len(self) -> int:
        return min(self.engine.max_model_len, self.capacity_blocks * self.block_size)


class VllmPod:
    """One simulated vLLM engine and the router-tracked load on it."""

    __slots__ = (
        "busy_s",
        "cfg",
        "decode_count",
        "decode_sum_s",
        "inflight",
        "itl_count",
        "itl_sum_s",
        "max_model_len",
        "name",
        "outstanding",
        "sched",
    )

    def __init__(
        self,
        name: str,
        cfg: VllmFleetConfig,
        capacity_tokens: int | None = None,
        speed: float = 1.0,
    ) -> None:
        self.name = name
        self.cfg = cfg
        spec = cfg.engine
        tokens = cfg.capacity_tokens if capacity_tokens is None else capacity_tokens
        self.sched = Scheduler(
            spec.cost if speed == 1.0 else spec.cost.scaled(1.0 / speed),
            num_blocks=tokens // cfg.block_size,
            block_size=cfg.block_size,
            max_num_batched_tokens=spec.max_num_batched_tokens,
            max_num_seqs=spec.max_num_seqs,
            fast_forward=cfg.fast_forward,
        )
        self.max_model_len = min(spec.max_model_len, tokens // cfg.block_size * cfg.block_size)
        self.busy_s = 0.0  # seconds spent running engine steps
        # the engine's histograms a router scrapes (counters(): their _sum and _count)
        self.itl_sum_s = 0.0
        self.itl_count = 0
        self.decode_sum_s = 0.0
        self.decode_count = 0
        # router-tracked load (what a router replica knows without scraping)
        self.inflight = 0
        self.outstanding = 0

    def view(self, keys: list[int]) -> PodView:
        sched = self.sched
        pool = sched.pool
        hit = pool.hit_blocks(keys)
        return PodView(
            pod=self.name,
            hits={"GPU": hit} if hit else {},
            inflight=self.inflight,
            outstanding_prefill_tokens=self.outstanding,
            waiting=len(sched.waiting),
            running=len(sched.running),
            kv_usage=pool.usage,
            resident_blocks=pool.resident_blocks,
            capacity_blocks=pool.num_blocks,
        )

    def admit(self, rid: int, request: TraceRequest) -> Seq | None:
        """Queue ``request``; ``None`` when vLLM would reject it (prompt too long)."""
        prompt = request.prompt_tokens
        if prompt >= self.max_model_len:
            return None
        full = prompt // self.cfg.block_size
        keys = request.route.block_keys
        if request.answer_keys:  # its answer's blocks, keyed as the next turn has them
            keys = request.cached_keys()
        elif len(keys) > full:
            keys = keys[:full]
        seq = Seq(
            rid=rid,
            prompt_keys=keys,
            prompt_tokens=prompt,
            max_output=max(1, min(request.output_tokens, self.max_model_len - prompt)),
        )
        self.sched.add(seq)
        return seq

    @property
    def stepping(self) -> bool:
        return self.sched.stepping

    def plan_step(self, max_span_s: float = math.inf) -> StepPlan | None:
        plan = self.sched.plan_step(max_span_s)
        if plan is not None:
            self.busy_s += plan.duration_s
            # each decoding request's token of each step: one gap of a step's time
            # (counted when the step, or the run of decode steps, is planned)
            decoding = plan.work.decode_seqs
            if decoding:
                self.itl_sum_s += decoding * plan.duration_s
                self.itl_count += decoding * plan.steps
        return plan

    def decoded(self, seconds: float) -> None:
        """A request finished ``seconds`` after its first token."""
        self.decode_sum_s += seconds
        self.decode_count += 1

    def counters(self) -> PodCounters:
        """What the pod's ``/metrics`` would show now."""
        return PodCounters(
            running=len(self.sched.running),
            itl_sum_s=self.itl_sum_s,
            itl_count=float(self.itl_count),
            decode_sum_s=self.decode_sum_s,
            decode_count=float(self.decode_count),
        )

    def finish_step(self) -> StepResult:
        return self.sched.finish_step()
