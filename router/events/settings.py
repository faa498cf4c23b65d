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

    enabled: bool = True
    mode: Literal["dial", "bind"] = "dial"
    #: bind mode: where our SUB socket binds ("tcp://*:5557"; "tcp://127.0.0.1:*" = any port)
    bind_endpoint: str = "tcp://*:5557"
    #: ZMQ subscription prefix ("" = every topic; vLLM's default topic is "")
    topic_filter: str = ""
    #: batches buffered between the socket readers and the index writer; beyond this a
    #: batch is dropped and its pod marked for resync
    queue_size: int = Field(default=10_000, ge=1)
    #: on a seq gap, ask the pod's replay endpoint for the missed batches (else resync)
    replay_on_gap: bool = True
    #: on a pod's first batch with seq > 0, apply what its replay buffer holds first
    replay_on_join: bool = True
    #: seconds to wait for each replay frame before giving up (then resync)
    replay_timeout_s: float = Field(default=2.0, gt=0)
    #: the socket readers and the index writer give the event loop back at least this
    #: often while busy, so requests served by the same loop wait at most about this long
    time_slice_s: float = Field(default=0.002, gt=0)
    #: ZMQ receive high-water mark of each SUB socket (vLLM's PUB uses 100,000)
    rcvhwm: int = Field(default=100_000, ge=0)
    #: block size used when an event omits it
    block_size_fallback: int = Field(default=16, ge=1)
    #: model name used when neither the topic nor the pod spec names one
    model_fallback: str = ""
