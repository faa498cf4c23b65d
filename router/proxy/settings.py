"""The ``proxy`` section of `kvroute serve`'s settings (router/config.py): how requests
reach the pods and come back, and the paths the router answers or relays."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from router.config_types import Names, Section, on_off_schema

#: the paths `kvroute serve` answers itself (not passthrough paths)
OWN_PATHS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/route",
        "/v1/models",
        "/health",
        "/ready",
        "/metrics",
    }
)
#: vLLM's other JSON POST endpoints, relayed by default (``/v1/responses`` is served by
#: the router itself: a response naming a ``previous_response_id`` must reach the pod
#: that stored it, see router/decision/owners.py)
PASSTHROUGH_PATHS = (
    "/tokenize",
    "/detokenize",
    "/pooling",
    "/classify",
    "/score",
    "/v1/score",
    "/rerank",
    "/v1/rerank",
    "/v2/rerank",
)


class ProxySettings(Section):
    """How requests are forwarded to pods."""

    connect_timeout_s: float = Field(default=2.0, gt=0, description="TCP connect timeout to a pod")
    read_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="max wait for the next byte from a pod: between the chunks of a stream, "
        "and for the head of a non-streaming answer (which comes when the whole generation "
        "is done)",
    )
    first_byte_timeout_s: float | None = Field(
        default=60.0,
        gt=0,
        description="a streaming request (or a JSON answer assembled from a stream: "
        "proxy.stream_json_answers) whose pod sends no first body byte (the first SSE "
        "event: after queueing and prefill; of a Responses stream, the first after "
        "response.created and response.in_progress, held until then) within this is "
        "cancelled there and failed over "
        "to the next pod once; null: no deadline. JSON answers sent as they came have none "
        "(their head is the whole answer); they fail over when their pod is ejected",
    )
    stream_json_answers: bool = Field(
        default=True,
        description="a chat or text completion that asks for a JSON answer (one choice, no "
        "logprobs or echo, more than one token), or a Responses request that does not run "
        "in the background, is asked of its pod as a stream and assembled into the JSON "
        "answer at the router, so its first token is seen as a stream's: TTFT, the "
        "prefill part of its load, the policy's learned rates and the first-byte deadline "
        "(router/proxy/assemble.py, responses_answer.py); `kvroute epp` too, the pod's "
        "response headers held until the answer is whole (router/epp/assembled.py); "
        "false: sent as it came",
    )
    ejected_stream_idle_s: float = Field(
        default=10.0,
        gt=0,
        description="a stream already relaying from a pod that health checks eject or "
        "discovery removes ends (truncated: stream_broken) once that pod sends nothing for "
        "this long; streams still flowing (a pod draining) go on",
    )
    max_keepalive: int = Field(
        default=200, ge=0, description="idle keep-alive connections kept per pod"
    )
    max_body_bytes: int = Field(
        default=16 * 1024 * 1024, ge=1024, description="largest request body accepted (413 above)"
    )
    max_header_bytes: int = Field(
        default=64 * 1024,
        ge=1024,
        description="largest request head accepted from a client (request line and headers; "
        "431 above, before routing)",
    )
    max_headers: int = Field(
        default=100, ge=1, description="most request header lines accepted (431 above)"
    )
    client_keepalive_timeout_s: float = Field(
        default=5.0,
        gt=0,
        description="a client connection with no request in progress (new, or idle between "
        "keep-alive requests) is closed after this (uvicorn's default); behind a load "
        "balancer keep it above the balancer's idle timeout",
    )
    client_header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="a request head not complete this long after its first bytes: 408, "
        "connection closed",
    )
    client_body_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="a request body not complete this long after its head (a client that "
        "stops or trickles): 408, connection closed; max_body_bytes at >= 4.5 Mbit/s",
    )
    max_json_depth: int = Field(
        default=128,
        ge=2,
        le=500,
        description="deepest JSON nesting accepted in a request body (400 invalid_json "
        "above; the top-level object is 1); serde_json's default",
    )
    retries: int = Field(
        default=1,
        ge=0,
        le=3,
        description="retries on the next-best pod when connecting fails or the pod answers "
        "502/503 before any byte reached the client; a failover (first-byte deadline, pod "
        "ejected or removed) takes one of them, and happens at most once per request",
    )
    passthrough_paths: Names = Field(
        default_factory=lambda: list(PASSTHROUGH_PATHS),
        description="other POST endpoints of the pods relayed as they are (JSON bodies with a "
        "`model`, or none when one model is served), to the least-loaded pod serving it",
    )
    pod_ca_file: str | None = Field(
        default=None,
        description="CA bundle (PEM) to verify https pods against (default: the system "
        "trust store); used by requests, health checks and scrapes",
    )
    pod_tls_verify: bool = Field(
        default=True,
        description="verify https pods' certificates and host names; false is INSECURE "
        "(encrypted but unauthenticated: anyone on the path can pose as a pod)",
    )

    access_log: Literal["off", "on"] = Field(
        default="off",
        json_schema_extra=on_off_schema,
        description="one line per generation request on stdout when its response ends "
        "(method, path, status, model, pod, prompt and predicted cached tokens, TTFT, "
        "latency; never the prompt): off or on (docs/observability.md)",
    )
    access_log_sample: float = Field(
        default=1.0,
        ge=0,
        le=1,
        description="with access_log on, the share of requests logged (drawn per request)",
    )
    access_log_format: Literal["text", "json"] = Field(
        default="text", description="access-log lines as key=value text or one JSON object"
    )

    @field_validator("access_log", mode="before")
    @classmethod
    def _on_off(cls, v: Any) -> Any:
        # YAML 1.1 reads a bare off / on as a boolean
        if isinstance(v, bool):
            return "on" if v else "off"
        return v

    @field_validator("passthrough_paths")
    @classmethod
    def _passthrough_paths(cls, v: list[str]) -> list[str]:
        for path in v:
            if not path.startswith("/") or "?" in path or "#" in path:
                raise ValueError(f"passthrough path {path!r}: a path starting with '/'")
            if path in OWN_PATHS:
                raise ValueError(f"passthrough path {path!r}: kvroute serves it itself")
        return v

    @field_validator("pod_ca_file")
    @classmethod
    def _ca_file_exists(cls, v: str | None) -> str | None:
        if v is not None and not Path(v).is_file():
            raise ValueError(f"no such CA file: {v}")
        return v
