"""A simulated vLLM pod in virtual time, and the fleet's settings.

Pod model (one per pod, all times in seconds):

* **Cache** — a :class:`scoring.simcache.PrefixCache` of ``capacity_tokens // block_size``
  blocks (LRU with prefix closure).  Optionally a CPU offload tier of
  ``cpu_capacity_tokens``: blocks evicted from GPU drop into a CPU LRU and are loaded
  back at ``cpu_load_rate`` tokens/s when a prompt needs them.  ``pod_capacity_tokens``
  gives each pod its own cache size, ``pod_speed`` its own speed: every duration below is
  divided by it (a pod at 0.5 prefills and decodes half as fast: an older GPU).
* **Prefill** — one FCFS queue served one request at a time.  When a request starts
  prefill, its cached prefix is looked up (``g`` GPU tokens, ``c`` more CPU tokens) and
  its blocks are inserted (touched) in the cache::

      prefill_s = max(1, P - g - c) / prefill_rate * (1 + decode_interference * decoding)
                  + c / cpu_load_rate

  ``decoding`` is the number of requests in decode on the pod: decode steps share the
  GPU with prefill chunks (chunked prefill), so a busy decode batch slows prefill.
  The first token is emitted when prefill ends: ``TTFT = prefill end - arrival``.
* **Decode** — continuous batching: a request joining a batch of ``b`` (itself included)
  decodes its remaining ``output - 1`` tokens at a step time fixed when it joins::

      step_s = (1 / decode_rate) * (1 + decode_batch_slope * (b - 1))

  (an approximation: the batch size is sampled at join time, not re-evaluated per step).
* **Answers** — when a later prompt of the trace carries a request's answer (a chat's or
  an agent's next turn: ``TraceRequest.answer_keys``), the answer's blocks enter the
  cache when the request ends, so that prompt hits them on this pod; an answer nobody
  reads again is not cached.
* **Not modelled** — admission limits (max_num_seqs, KV-capacity preemption), pinning of
  a running request's blocks (a running chain is the most recently touched, so the LRU
  evicts it last), the room an answer nobody reads again takes.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from scoring.policies.base import PodView
from scoring.simcache import PrefixCache


class ReplayConfigError(ValueError):
    """An invalid replay setting; the message names it."""


class PerPod:
    """Per-pod lookups of a fleet's settings, shared by both pod models' configs
    (:class:`FleetConfig`, :class:`~scoring.replay.vllm_pod.VllmFleetConfig`)."""

    __slots__ = ()
    pods: int
    capacity_tokens: int
    block_size: int
    pod_capacity_tokens: tuple[int, ...] | None
    pod_speed: tuple[float, ...] | None

    def check_pod_speed(self) -> None:
        """Raise :class:`ReplayConfigError` naming what is wrong with ``pod_speed``."""
        speeds = self.pod_speed
        if speeds is None:
            return
        if len(speeds) != self.pods:
            raise ReplayConfigError(
                f"pod-speed must list {self.pods} pods, got {len(speeds)}: {speeds!r}"
            )
        for v in speeds:
            if (
                isinstance(v, bool)
                or not isinstance(v, (int, float))
                or not (math.isfinite(v) and v > 0)
            ):
                raise ReplayConfigError(
                    f"pod-speed must be finite numbers > 0, got {v!r} in {speeds!r}"
                )

    @property
    def capacity_blocks(self) -> int:
        return self.capacity_tokens // self.block_size

    def pod_capacity(self, i: int) -> int:
        """KV cache of pod ``i``, tokens."""
        caps = self.pod_capacity_tokens
        return caps[i] if caps is not None else self.capacity_tokens

    @property
    def total_capacity_tokens(self) -> int:
        """The fleet's KV cache, tokens (what the pooled ceiling pools)."""
        return sum(self.pod_capacity(i) for i in range(self.pods))

    def speed(self, i: int) -> float:
        """Pod ``i``'s speed (1 unless ``pod_speed`` sets it)."""
        return self.pod_speed[i] if self.pod_speed is not None else 1.0

    @property
    def total_speed(self) -> float:
        """The fleet's compute in pods at speed 1 (what the offered load divides by)."""
        return float(sum(self.pod_speed)) if self.pod_speed is not None else float(self.pods)


@dataclass(frozen=True, slots=True)
class FleetConfig(PerPod):
    """Settings of the simulated fleet (validated by :meth:`validate`)."""

    pods: int
    capacity_tokens: int
    block_size: int
    prefill_rate: float = 6000.0  # prompt tokens / s / pod
    decode_rate: float = 40.0  # tokens / s for one sequence alone
    decode_batch_slope: float = 0.01  # step time grows 1% per extra sequence in the batch
    decode_interference: float = 0.005  # prefill slows 0.5% per decoding request
    cpu_capacity_tokens: int = 0  # 0 = no CPU offload tier
    cpu_load_rate: float = 50_000.0  # tokens / s loaded from CPU into GPU
    #: KV cache of each pod when the pods differ (one entry per pod); None = every pod
    #: holds ``capacity_tokens``
    pod_capacity_tokens: tuple[int, ...] | None = None
    #: each pod's speed, a multiple of the rates above (one entry per pod: 0.5 = half as
    #: fast, every duration doubled); None = every pod at 1
    pod_speed: tuple[float, ...] | None = None

    def validate(self) -> FleetConfig:
        checks = [
            ("pods", self.pods >= 1, "must be >= 1"),
            ("block_size", self.block_size >= 1, "must be >= 1"),
            (
                "capacity_tokens",
                self.capacity_tokens >= self.block_size,
                f"must hold at least one block ({self.block_size} tokens)",
            ),
            ("prefill_rate", self.prefill_rate > 0, "must be > 0"),
            ("decode_rate", self.decode_rate > 0, "must be > 0"),
            ("decode_batch_slope", self.decode_batch_slope >= 0, "must be >= 0"),
            ("decode_interference", self.decode_interference >= 0, "must be >= 0"),
            ("cpu_capacity_tokens", self.cpu_capacity_tokens >= 0, "must be >= 0"),
            ("cpu_load_rate", self.cpu_load_rate > 0, "must be > 0"),
        ]
        if self.pod_capacity_tokens is not None:
            caps = self.pod_capacity_tokens
            checks.append(
                ("pod_capacity_tokens", len(caps) == self.pods, f"must list {self.pods} pods")
            )
            checks.append(
                (
                    "pod_capacity_tokens",
                    all(c >= self.block_size for c in caps),
                    f"must hold at least one block ({self.block_size} tokens) on every pod",
                )
            )
        self.check_pod_speed()
        for name, ok, why in checks:
            if not ok or (
                isinstance(getattr(self, name), float) and not math.isfinite(getattr(self, name))
            ):
                raise ReplayConfigError(
                    f"{name.replace('_', '-')} {why}, got {getattr(self, name)!r}"
                )
        return self


class SimPod:
    """One simulated pod: cache, prefill queue, decode batch, and the router's view of it."""

    __slots__ = (
        "active_blocks",
        "busy_s",
        "cache",
        "capacity_blocks",
        "cfg",
        "cpu",
        "decoding",
        "inflight",
        "name",
        "outstanding",
        "prefilling",
        "queue",
        "slowness",
    )

    def __init__(
        self,
        name: str,
        cfg: FleetConfig,
        capacity_tokens: int | None = None,
        speed: float = 1.0,
    ) -> None:
        self.name = name
        self.cfg = cfg
        self.slowness = 1.0 / speed  # every duration's multiple
        tokens = cfg.capacity_tokens if capacity_tokens is None else capacity_tokens
        self.capacity_blocks = tokens // cfg.block_size
        self.cache = PrefixCache(self.capacity_blocks)
        self.cpu = (
            PrefixCache(cfg.cpu_capacity_tokens // cfg.block_size)
            if cfg.cpu_capacity_tokens >= cfg.block_size
            else None
        )
        self.queue: deque[int] = deque()
        self.prefilling = False
        self.decoding = 0
        self.busy_s = 0.0  # seconds spent prefilling
        self.active_blocks = 0  # blocks held by requests in prefill or decode
        # router-tracked load (what a router replica knows without scraping)
        self.inflight = 0
        self.outstanding = 0

    def lookup(self, keys: list[int]) -> tuple[int, int]:
        """Leading blocks held in GPU, and in GPU or CPU."""
        gpu = self.cache.match(keys)
        if self.cpu is None:
            return gpu, gpu
        lru, cpu = self.cache, self.cpu
        n = gpu
        for k in keys[gpu:]:
            if k in lru or k in cpu:
                n += 1
            else:
                break
        return gpu, n

    def view(self, keys: list[int]) -> PodView:
        """What the router would see for a request with ``keys``: precise index hits
        (the pod's true cache), router-tracked load, and scraped metrics."""
        gpu, anywhere = self.lookup(keys)
        hits = {"GPU": gpu} if self.cpu is None else {"GPU": gpu, "CPU": anywhere}
        return PodView(
            pod=self.name,
            hits=hits if anywhere else {},
            inflight=self.inflight,
            outstanding_prefill_tokens=self.outstanding,
            waiting=len(self.queue),
            running=self.decoding + (1 if self.prefilling else 0),
            kv_usage=min(1.0, self.active_blocks / max(1, self.capacity_blocks)),
            resident_blocks=len(self.cache),
            capacity_blocks=self.capacity_blocks,
        )

    def start_prefill(self, keys: list[int], prompt_tokens: int) -> tuple[float, int, int]:
        """Begin prefilling; returns ``(duration_s, gpu_hit_tokens, cpu_hit_tokens)``."""
        cfg = self.cfg
        bs = cfg.block_size
        gpu, anywhere = self.lookup(keys)
        gpu_tok = min(gpu * bs, prompt_tokens)
        cpu_tok = min(anywhere * bs, prompt_tokens) - gpu_tok
        uncached = max(1, prompt_tokens - gpu_tok - cpu_tok)
        duration = (
            uncached / cfg.prefill_rate * (1.0 + cfg.decode_interference * self.decoding)
            + cpu_tok / cfg.cpu_load_rate
        ) * self.slowness
        self._insert(keys)
        self.prefilling = True
        self.busy_s += duration
        return duration, gpu_tok, cpu_tok

    def cache_answer(self, keys: list[int]) -> None:
        """A request ended: its answer's blocks enter the cache (``keys``: the prompt's
        full blocks, then the answer's), touched as the newest."""
        self._insert(keys)

    def _insert(self, keys: list[int]) -> None:
        _, evicted = self.cache.insert(keys)
        if self.cpu is not None and evicted:
            self.cpu.insert(evicted)

    def decode_step_s(self) -> float:
        """Step time for a request joining the batch now (batch includes it)."""
        cfg = self.cfg
        return (self.slowness / cfg.decode_rate) * (1.0 + cfg.decode_batch_slope * self.decoding)
