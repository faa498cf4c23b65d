"""Settings of the KV-event subscriber (nested as ``events`` in the router's config)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class EventsSettings(BaseModel):
    """How the router receives vLLM KV events.

    ``mode``:
      * ``dial`` — one SUB socket per pod, connected to the pod's ``events_endpoint``
        (the engine binds: ``"endpoint": "tcp://*:5557"``).
      * ``bind`` — one SUB socket bound to ``bind_endpoint``; every engine's PUB connects
        to it (``"endpoint": "tcp://router:5557"``) and names itself by its topic
        ``kv@<pod>@<model>``.  The default listens on 127.0.0.1 only: set the address
        the pods can reach (``tcp://0.0.0.0:5557``) explicitly.  ``bind_allow:
        discovered`` (the default) admits connections only from the addresses of
        discovered pods and checks that each message's topic names a pod at the
        sender's address (:mod:`router.events.zap`).
    """

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(default=True, description="subscribe to the pods' KV events")
    mode: Literal["dial", "bind"] = Field(
        default="dial",
        description="dial: one SUB per pod connecting to its events_endpoint; bind: one SUB "
        "bound to bind_endpoint that the pods' PUBs connect to (topic kv@<pod>@<model>)",
    )
    bind_endpoint: str = Field(
        default="tcp://127.0.0.1:5557",
        description="bind mode: where the SUB binds; the default accepts local publishers "
        "only: set tcp://0.0.0.0:5557 (or the pod network's address) for remote pods "
        "(tcp://127.0.0.1:* = any port)",
    )
    bind_allow: Literal["discovered", "any"] = Field(
        default="discovered",
        description="bind mode: discovered = admit publishers only from the IP addresses "
        "of discovered pods (a ZAP handler; others wait until discovery names them) and drop "
        "messages whose topic names a pod at another address; any = no address check "
        "(behind NAT or a service mesh that hides the pods' addresses)",
    )
    topic_filter: str = Field(
        default="",
        description="ZMQ subscription prefix ('' = every topic; vLLM's default topic is '')",
    )
    queue_size: int = Field(
        default=2_000,
        ge=1,
        description="batches buffered per pod between its socket reader and the index "
        "writer (also while a replay of the pod runs); beyond, the pod's batch is dropped "
        "and that pod alone resynced",
    )
    replay_on_gap: bool = Field(
        default=True,
        description="on a seq gap, fetch the missed batches from the pod's replay_endpoint",
    )
    replay_on_join: bool = Field(
        default=True,
        description="on a pod's first batch with seq > 0, apply its replay buffer first",
    )
    replay_timeout_s: float = Field(
        default=2.0, gt=0, description="max wait for each replay frame (then resync)"
    )
    replay_deadline_s: float = Field(
        default=10.0,
        gt=0,
        description="max duration of one replay (then resync); the pod's live batches "
        "wait meanwhile, other pods' are applied",
    )
    fault_budget: int = Field(
        default=50,
        ge=1,
        description="a pod's undecodable, rejected or partly skipped batches tolerated per "
        "fault_window_s (each resyncs the pod); beyond, its events are dropped until the "
        "window ends, then it is resynced",
    )
    fault_window_s: float = Field(
        default=10.0, gt=0, description="the window of fault_budget, and the quarantine's length"
    )
    time_slice_s: float = Field(
        default=0.002,
        gt=0,
        description="readers and writer yield the event loop at least this often while busy",
    )
    rcvhwm: int = Field(
        default=100_000,
        ge=0,
        description="ZMQ receive high-water mark per SUB (vLLM's PUB: 100,000)",
    )
    block_size_fallback: int = Field(
        default=16,
        ge=1,
        description="block size assumed for a BlockStored that omits it from a pod whose size "
        "is unknown (no block_size setting, no scraped vllm:cache_config_info, no earlier event "
        "naming one); a guess, never counted as a block-size mismatch",
    )
    model_fallback: str = Field(
        default="", description="model of a pod named neither by its topic nor its discovery entry"
    )
    engine_hash_algo: Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"] | None = Field(
        default=None,
        description="engine-hash mode (off when unset): the pods' prefix_caching_hash_algo; "
        "the router learns routed requests' vLLM block hashes to link orphaned events",
    )
    engine_hash_seed: str | None = Field(
        default=None,
        description="engine-hash mode: the pods' PYTHONHASHSEED (required for xxhash*; "
        "unset: 'vllm-none-hash' for sha256*)",
    )
    engine_hash_int: bool = Field(
        default=True,
        description="engine-hash mode: published hashes are ints (false when the pods set "
        "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)",
    )
    engine_hash_lora_paths: dict[str, str] = Field(
        default_factory=dict,
        description="engine-hash mode: LoRA adapter name -> the path the pods load it from "
        "(vLLM hashes it into every block); unset adapters take the `root` the pods' "
        "/v1/models reports",
    )
    engine_hash_queue: int = Field(
        default=1024,
        ge=1,
        description="engine-hash mode: routed requests waiting to be learned; beyond, one "
        "is dropped and counted",
    )

    @model_validator(mode="after")
    def _check_engine_hash(self) -> EventsSettings:
        algo = self.engine_hash_algo
        if algo is not None and algo.startswith("xxhash") and not self.engine_hash_seed:
            raise ValueError(
                f"events.engine_hash_seed is required with events.engine_hash_algo={algo!r}: "
                "vLLM seeds xxhash with a random per-process value unless PYTHONHASHSEED is "
                "set on the pods; set it there and pass the same value here"
            )
        return self
