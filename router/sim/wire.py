"""vLLM's wire details the simulated pod copies: its version, the system fingerprint,
OpenAI error JSON and the server-sent-event framing of streamed answers."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from fastapi.responses import JSONResponse

VLLM_VERSION = "0.32.0"
FINGERPRINT = f"vllm-{VLLM_VERSION}-sim"
DONE = b"data: [DONE]\n\n"


class APIError(Exception):
    """An error answered as OpenAI error JSON."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type_: str = "BadRequestError",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type_
        self.param = param

    def response(self) -> JSONResponse:
        body = {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.status,
            }
        }
        return JSONResponse(body, status_code=self.status)


class ClientDisconnected(Exception):
    """The client went away before a non-streaming answer was ready."""


def sse(obj: Mapping[str, Any]) -> bytes:
    """One chunk of a streamed completion: ``data: <json>``."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def sse_event(obj: Mapping[str, Any]) -> bytes:
    """One Responses API event as vLLM writes it: ``event: <type>`` then its data."""
    return (
        b"event: "
        + str(obj["type"]).encode()
        + b"\ndata: "
        + json.dumps(obj, separators=(",", ":")).encode()
        + b"\n\n"
    )
