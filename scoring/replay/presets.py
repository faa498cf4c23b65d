"""Engine presets for the vLLM pod model: step-cost parameters and scheduler limits.

A preset is an :class:`EngineSpec`: the :class:`~scoring.replay.step_cost.StepCost`
parameters, vLLM's ``max_num_batched_tokens`` / ``max_num_seqs`` / ``max_model_len``,
and the KV capacity (tokens) such a deployment reports (``GPU KV cache size: N tokens``).

**How the GPU presets are derived.**  No published benchmark reports these five
parameters, so they are derived from first principles — FLOPs and HBM traffic per unit
of work, over the hardware's datasheet rates times an efficiency — by :func:`derive`,
and the assumptions are stated here:

* Hardware: H100 SXM5 80GB — HBM3 3.35 TB/s, BF16 dense 989.4 TFLOPS, NVLink 450 GB/s
  per direction (NVIDIA H100 datasheet); 85.0e9 bytes of device memory as CUDA reports
  it (79.2 GiB); vLLM's default ``gpu_memory_utilization`` 0.9.
* Models (Hugging Face configs): Llama-3.1-8B — 8.03e9 parameters, 0.525e9 of them the
  input embedding (no FLOPs), 32 layers, 32 query / 8 KV heads of 128, hidden 4096;
  Llama-3.1-70B — 70.55e9 / 1.05e9, 80 layers, 64 / 8 heads of 128, hidden 8192.
  BF16 weights and KV cache, ``max_position_embeddings`` 131072.
* KV bytes per token = 2 (K, V) x layers x KV heads x head dim x 2 bytes: 128 KiB for
  8B (matches the vLLM log in vllm-project/vllm#10517: 3.81 GiB = 1,952 blocks of 16
  tokens), 320 KiB for 70B (80 KiB on each of 4 GPUs).
* ``base_s`` = weight bytes / (HBM bandwidth x 0.77), plus, with tensor parallelism,
  2 all-reduces per layer x 5 us (assumed latency of vLLM's custom all-reduce).  0.77
  is the fraction of the memory-bandwidth ceiling vLLM reaches decoding Llama-3.1-8B
  alone (75 tokens/s on an A100 40GB, vLLM 0.23: johnmusgrave.com/p/vllm-throughput-
  latency-sweep-on).
* ``prefill_token_s`` = 2 x non-embedding parameters / (BF16 FLOPS x 0.5 x TP), plus,
  with TP, the ring all-reduce traffic per token (2 per layer x hidden x 2 bytes x
  2(TP-1)/TP over NVLink).  0.5 (50% MFU for large GEMMs) is an assumption.
* ``decode_seq_s`` = ``prefill_token_s``: a decode token costs the same linear-layer
  FLOPs as a prompt token.
* ``prefill_pair_s`` = 4 x layers x query heads x head dim FLOPs per (query, key) pair
  (QK^T and PV) / (BF16 FLOPS x 0.5 x TP).
* ``decode_context_token_s`` = KV bytes per token / (HBM bandwidth x 0.77 x TP).
* KV capacity = TP x (device memory x 0.9 - weights / TP - activation and CUDA-graph
  overhead) / KV bytes per token, with 2 GiB overhead per GPU for 8B (the profile of
  vllm-project/vllm#10517 peaks 2.07 GiB above the weights) and 3 GiB for 70B
  (assumption: larger activations).
* Scheduler limits: ``vllm serve`` on a GPU of >= 70 GiB that is not an A100 defaults to
  ``max_num_batched_tokens`` 8192 and ``max_num_seqs`` 1024
  (``EngineArgs.get_batch_defaults``, ``vllm/engine/arg_utils.py``).

Plausibility check (not a fit): vLLM PR #8804 logs one H100 serving Llama-3-8B ShareGPT
traffic with 190 running requests at 8,318 generated + 3,943 prompt tokens/s, i.e. one
step every 22.8 ms; ``llama3-8b-h100`` predicts 17.6 ms for 190 decodes of ~300 context
tokens plus the ~90 prompt tokens per step that rate implies (that run used vLLM's V0
engine, whose per-step CPU overhead was larger).

``cpu-tiny`` is a placeholder for the local vLLM CPU engine (``../shared/vllm-cpu``:
tiny-llama, float32, block 32, ``--max-num-seqs 8``, ``--max-model-len 2048``,
``VLLM_CPU_KVCACHE_SPACE=1`` GiB = 524,288 tokens of 2 KiB).  Its step costs are NOT
measured: a ``calibrate`` step is to fit them by least squares
(:data:`scoring.replay.step_cost.FEATURES`) to the engine's measured step times.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from scoring.replay.step_cost import PARAMS, StepCost, StepCostError

GiB = 1024**3


class PresetError(ValueError):
    """An unknown preset or an invalid engine parameter; the message names it."""


@dataclass(frozen=True, slots=True)
class Model:
    """The dimensions of a decoder-only transformer that set its serving cost."""

    params: float
    embedding_params: float
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    dtype_bytes: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class Gpu:
    memory_bytes: float
    hbm_bytes_per_s: float
    bf16_flops: float
    link_bytes_per_s: float


LLAMA_31_8B = Model(8.03e9, 0.525e9, layers=32, heads=32, kv_heads=8, head_dim=128, hidden=4096)
LLAMA_31_70B = Model(70.55e9, 1.05e9, layers=80, heads=64, kv_heads=8, head_dim=128, hidden=8192)
H100_SXM = Gpu(85.0e9, 3.35e12, 989.4e12, 450e9)

MEMORY_EFFICIENCY = 0.77  # measured (see module docstring)
COMPUTE_EFFICIENCY = 0.5  # assumed
ALLREDUCE_LATENCY_S = 5e-6  # assumed
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """One engine configuration: step costs, scheduler limits, KV capacity."""

    name: str
    cost: StepCost
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    kv_capacity_tokens: int
    calibrated: bool = True  # False: a placeholder whose costs are not measured
    summary: str = ""
    #: seconds a request spends outside engine steps before its first token reaches
    #: the client (the API server's HTTP, tokenization, output processing): added to
    #: every TTFT.  ``kvroute calibrate`` measures it (client TTFT - the engine's queue
    #: and prefill time); 0 in the built-in presets (not modelled)
    request_overhead_s: float = 0.0

    def validate(self) -> EngineSpec:
        try:
            self.cost.validate()
        except StepCostError as exc:
            raise PresetError(str(exc)) from None
        v = self.request_overhead_s
        if (
            isinstance(v, bool)
            or not isinstance(v, (int, float))
            or not (math.isfinite(v) and v >= 0)
        ):
            raise PresetError(f"request_overhead_s must be a finite number >= 0, got {v!r}")
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise PresetError(f"{name} must be an integer >= 1, got {v!r}")
        return self

    def prefill_rate_tokens_per_s(self) -> float:
        """Prompt tokens/s of one full chunk from an empty context (what an operator
        measuring one long prompt would see), for policies that take a prefill rate."""
        n = self.max_num_batched_tokens
        c = self.cost
        return n / (c.base_s + c.prefill_token_s * n + c.prefill_pair_s * n * (n + 1) / 2)

    def cost_params(self) -> dict[str, float]:
        """``cost``'s two settings this engine implies: its prefill rate (a prior, which
        ``cost`` then learns) and its slowdown per running request (left unset, ``cost``
        learns one from clean first tokens, which in the replay gets a third of the way
        to what setting it gives, docs/history/quality_matrix.md, "Session 22").  ``kvroute
        calibrate`` prints them for a real engine."""
        return {
            "prefill_rate_tokens_per_s": self.prefill_rate_tokens_per_s(),
            "decode_slowdown_per_running": self.decode_slowdown_per_running(),
        }

    def decode_slowdown_per_running(self) -> float:
        """Fraction by which one running decode (of one chunk's worth of context)
        lengthens a step that prefills a full chunk."""
        n = self.max_num_batched_tokens
        c = self.cost
        chunk_s = c.base_s + c.prefill_token_s * n + c.prefill_pair_s * n * (n + 1) / 2
        return (c.decode_seq_s + c.decode_context_token_s * n) / chunk_s


def derive(model: Model, gpu: Gpu, tp: int, overhead_bytes_per_gpu: float) -> tuple[StepCost, int]:
    """Step costs and KV capacity (tokens) of ``model`` on ``tp`` x ``gpu`` (see above)."""
    bandwidth = gpu.hbm_bytes_per_s * MEMORY_EFFICIENCY * tp
    flops = gpu.bf16_flops * COMPUTE_EFFICIENCY * tp
    allreduce_bytes = (
        2 * model.layers * model.hidden * model.dtype_bytes * 2 * (tp - 1) / tp if tp > 1 else 0.0
    )
    per_token = 2 * (model.params - model.embedding_params) / flops
    per_token += allreduce_bytes / gpu.link_bytes_per_s
    base = model.weight_bytes / bandwidth
    if tp > 1:
        base += 2 * model.layers * ALLREDUCE_LATENCY_S
    cost = StepCost(
        base_s=base,
        prefill_token_s=per_token,
        prefill_pair_s=4 * model.layers * model.heads * model.head_dim / flops,
        decode_seq_s=per_token,
        decode_context_token_s=model.kv_bytes_per_token / bandwidth,
    )
    kv_bytes = tp * (
        gpu.memory_bytes * GPU_MEMORY_UTILIZATION - model.weight_bytes / tp - overhead_bytes_per_gpu
    )
    return cost, int(kv_bytes // model.kv_bytes_per_token)


def _gpu_preset(name: str, model: Model, tp: int, overhead: float, summary: str) -> EngineSpec:
    cost, kv_tokens = derive(model, H100_SXM, tp, overhead)
    return EngineSpec(
        name=name,
        cost=cost,
        max_num_batched_tokens=8192,
        max_num_seqs=1024,
        max_model_len=131072,
        kv_capacity_tokens=kv_tokens,
        summary=summary,
    )


PRESETS: dict[str, EngineSpec] = {
    p.name: p
    for p in (
        _gpu_preset("llama3-8b-h100", LLAMA_31_8B, 1, 2 * GiB, "Llama-3.1-8B, BF16, 1x H100 SXM"),
        _gpu_preset(
            "llama3-70b-h100-tp4", LLAMA_31_70B, 4, 3 * GiB, "Llama-3.1-70B, BF16, 4x H100 TP4"
        ),
        EngineSpec(
            name="cpu-tiny",
            # placeholder orders of magnitude for a 1.4M-parameter model on 2 CPU cores,
            # dominated by per-step overhead: NOT measured; calibrate is to fit them
            cost=StepCost(
                base_s=0.02,
                prefill_token_s=2e-5,
                prefill_pair_s=0.0,
                decode_seq_s=5e-4,
                decode_context_token_s=0.0,
            ),
            max_num_batched_tokens=2048,
            max_num_seqs=8,
            max_model_len=2048,
            kv_capacity_tokens=GiB // 2048,
            calibrated=False,
            summary="tiny-llama on the local vLLM CPU engine (placeholder, not calibrated)",
        ),
    )
}

#: engine parameters ``--engine-param`` may override
ENGINE_PARAMS = (
    *PARAMS,
    "max_num_batched_tokens",
    "max_num_seqs",
    "max_model_len",
    "request_overhead_s",
)


def resolve_preset(name: str, overrides: dict[str, Any] | None = None) -> EngineSpec:
    """The preset ``name`` with ``overrides`` (any of :data:`ENGINE_PARAMS`) applied."""
    spec = PRESETS.get(name)
    if spec is None:
        raise PresetError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})")
    return override_spec(spec, overrides)


def override_spec(spec: EngineSpec, overrides: dict[str, Any] | None = None) -> EngineSpec:
    """``spec`` with ``overrides`` (any of :data:`ENGINE_PARAMS`) applied, validated."""
    cost_kw: dict[str, Any] = {}
    spec_kw: dict[str, Any] = {}
    for key, value in (overrides or {}).items():
        if key not in ENGINE_PARAMS:
            raise PresetError(
                f"unknown engine parameter {key!r} (known: {', '.join(ENGINE_PARAMS)})"
            )
        (cost_kw if key in PARAMS else spec_kw)[key] = value
    if cost_kw:
        spec_kw["cost"] = dataclasses.replace(spec.cost, **cost_kw)
    return dataclasses.replace(spec, **spec_kw).validate()
