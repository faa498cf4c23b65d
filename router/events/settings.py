"""Settings of the KV-event subscriber (nested as ``events`` in the router's config)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class EventsSettings(BaseModel):
    """How the router receives vLLM KV events.

    ``mode``:
      * ``dial`` — one SUB socket per pod, connected to the pod's ``events_endpoint``
        (the engine binds: ``"endpoint": "tcp://*:5557"``).
      * ``bind`` — one SUB socket bound to ``bind_endpoint``; every engine's PUB connects
        to it (``"endpoint": "tcp://router:5557"``) and names itself by its topic
        ``kv@<pod>@<model>``.
    """

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(default=True, description="subscribe to the pods' KV events")
    mode: Literal["dial", "bind"] = Field(
        default="dial",
        description="dial: one SUB per pod connecting to its events_endpoint; bind: one SUB "
        "bound to bind_endpoint that the pods' PUBs connect to (topic kv@<pod>@<model>)",
    )
    bind_endpoint: str = Field(
        default="tcp://*:5557",
        description="bind mode: where the SUB binds (tcp://127.0.0.1:* = any port)",
    )
    topic_filter: str = Field(
        default="",
        description="ZMQ subscription prefix ('' = every topic; vLLM's default topic is '')",
    )
    queue_size: int = Field(
        default=10_000,
        ge=1,
        description="batches buffered between socket readers and index writer; beyond, a "
        "batch is dropped and its pod resynced",
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
        default=16, ge=1, description="block size used when an event omits it (kvroute index)"
    )
    model_fallback: str = Field(
        default="", description="model of a pod named neither by its topic nor its discovery entry"
    )
