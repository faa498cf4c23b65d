"""Settings of one simulated vLLM pod (``kvroute sim``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from scoring.replay.preset_file import resolve_engine
from scoring.replay.presets import EngineSpec, PresetError


class SimSettings(BaseModel):
    """Everything a :class:`router.sim.pod.SimPod` needs; unknown fields are an error.

    Time model (see :mod:`router.sim.engine`): a request waits FCFS for the prefill
    engine, then ``TTFT = queue wait + uncached prompt tokens / prefill_rate``, then
    decodes one token per ``1 / decode_rate`` seconds, with at most ``max_batch``
    requests running.  Every simulated delay is multiplied by ``time_scale``
    (``0`` = never sleep, for fast tests).

    ``pod_model="vllm"`` replaces that time model with the replay's vLLM engine model
    (:mod:`router.sim.vllm_engine`): ``preset`` / ``preset_file`` (+ ``engine_params``)
    give its step costs, ``max_num_batched_tokens`` and ``max_num_seqs``;
    ``prefill_rate``, ``decode_rate`` and ``max_batch`` do not apply.
    """

    model_config = ConfigDict(extra="forbid")

    model: str = "sim-model"
    pod_name: str = "sim-0"
    host: str = "127.0.0.1"
    #: HTTP port; 0 picks a free one (read :attr:`SimPod.url` after start)
    port: int = Field(default=0, ge=0, le=65535)

    block_size: int = Field(default=16, gt=0)
    #: KV cache size in tokens (vLLM's ``kv_cache_size_tokens``); // block_size blocks
    capacity_tokens: int = Field(default=65536, gt=0)
    #: prefill speed, tokens per second (one prefill at a time)
    prefill_rate: float = Field(default=20000.0, gt=0)
    #: decode speed, tokens per second per running sequence
    decode_rate: float = Field(default=100.0, gt=0)
    #: at most this many requests run (prefill or decode) at once; the rest wait
    max_batch: int = Field(default=64, gt=0)
    max_model_len: int = Field(default=32768, gt=0)
    #: output length when a request gives no max_tokens / max_completion_tokens
    output_tokens: int = Field(default=16, gt=0)
    #: LoRA adapter names a request's ``model`` may name
    lora_adapters: list[str] = Field(default_factory=list)

    #: "simple": the time model above; "vllm": vLLM V1's scheduler + step-cost model
    pod_model: Literal["simple", "vllm"] = "simple"
    #: vllm pod model: a built-in preset (scoring.replay.presets; default llama3-8b-h100)
    preset: str | None = None
    #: vllm pod model: a preset file (what ``kvroute calibrate`` writes)
    preset_file: str | None = None
    #: vllm pod model: preset overrides (scoring.replay.presets.ENGINE_PARAMS)
    engine_params: dict[str, int | float] = Field(default_factory=dict)

    kv_events: bool = True
    #: PUB endpoint.  Binds when it contains ``*`` or ``::``, is ipc:// or inproc://
    #: (vLLM's rule) or has port 0; otherwise the PUB connects out to a bound SUB.
    kv_endpoint: str = "tcp://127.0.0.1:0"
    #: ROUTER endpoint serving replays (always bound); None = no replay socket
    replay_endpoint: str | None = "tcp://127.0.0.1:0"
    #: ZMQ topic; "" -> ``kv@<pod_name>@<model>``
    topic: str = ""
    #: "map": events are maps with "type" and defaults omitted (vLLM 0.32);
    #: "array": positional arrays, tag first (older vLLM)
    encoding: Literal["map", "array"] = "map"
    #: 64-bit int hashes (vLLM's default) or raw 32-byte digests
    #: (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)
    int_hashes: bool = True
    #: "sim": an engine-private sha256 chain nobody else reproduces (the default: the
    #: router must learn blocks from the events' token ids); "sha256": exactly vLLM's
    #: sha256 (pickle) prefix-caching hash, to test an engine-hash mode
    hash_algo: Literal["sim", "sha256"] = "sim"
    #: seeds the engine's NONE_HASH (vLLM: $PYTHONHASHSEED or "vllm-none-hash")
    hash_seed: str = "vllm-none-hash"
    #: batches kept for replay
    replay_buffer: int = Field(default=10_000, gt=0)

    #: router.tokenize.load_tokenizer spec
    tokenizer: str = "builtin"
    time_scale: float = Field(default=1.0, ge=0)
    #: length of the deterministic vectors /v1/embeddings returns
    embedding_dim: int = Field(default=64, gt=0)

    #: P/D role (router.sim.disagg): "prefill" honours ``do_remote_decode`` (computes the
    #: prompt, holds its blocks under a lease, returns ``kv_transfer_params``), "decode"
    #: honours ``do_remote_prefill`` (pulls the blocks from the prefill pod), "both" both
    role: Literal["prefill", "decode", "both"] = "both"
    #: the engine id named in ``kv_transfer_params`` ("" -> ``sim-engine-<pod_name>``)
    engine_id: str = ""
    #: wall seconds a prefill pod holds blocks nobody pulled (vLLM NixlConnector
    #: ``kv_lease_duration``, default 30 s; not scaled by ``time_scale``)
    kv_lease_s: float = Field(default=30.0, gt=0)
    #: simulated seconds to pull one block (x ``time_scale``)
    kv_transfer_s_per_block: float = Field(default=1e-4, ge=0)
    #: a failed pull: "fail" the request (vLLM's default ``kv_load_failure_policy``) or
    #: "recompute" the prompt locally
    kv_load_failure_policy: Literal["fail", "recompute"] = "fail"
    #: hosts a decode pod may pull blocks from (the sim dials only these)
    kv_peer_hosts: list[str] = Field(default_factory=lambda: ["127.0.0.1", "localhost", "::1"])

    @model_validator(mode="after")
    def _check(self) -> SimSettings:
        if self.capacity_tokens < self.block_size:
            raise ValueError(
                f"capacity_tokens ({self.capacity_tokens}) must hold at least one block "
                f"of block_size ({self.block_size})"
            )
        for name, ep in (
            ("kv_endpoint", self.kv_endpoint),
            ("replay_endpoint", self.replay_endpoint),
        ):
            if ep is not None and "://" not in ep:
                raise ValueError(f"{name} must be a ZMQ endpoint like tcp://host:port, got {ep!r}")
        if self.pod_model == "vllm":
            if self.role != "both":
                raise ValueError("pod_model 'vllm' serves role 'both' only (no P/D)")
            try:
                self.engine_spec()
            except PresetError as exc:
                raise ValueError(str(exc)) from None
        elif self.preset or self.preset_file or self.engine_params:
            raise ValueError("preset, preset_file and engine_params apply to pod_model 'vllm'")
        if self.model in self.lora_adapters:
            raise ValueError(f"lora_adapters must not repeat the base model name {self.model!r}")
        return self

    def engine_spec(self) -> EngineSpec:
        """The vLLM engine model's preset (``pod_model="vllm"``)."""
        return resolve_engine(self.preset, self.preset_file, self.engine_params)

    @property
    def capacity_blocks(self) -> int:
        return self.capacity_tokens // self.block_size

    @property
    def kv_engine_id(self) -> str:
        return self.engine_id or f"sim-engine-{self.pod_name}"

    @property
    def event_topic(self) -> str:
        return self.topic or f"kv@{self.pod_name}@{self.model}"
