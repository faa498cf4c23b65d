"""Errors as OpenAI clients expect them.

Every error the router returns has the body::

    {"error": {"message": str, "type": str, "param": str | None, "code": str | None}}

with ``type`` one of OpenAI's classes (``invalid_request_error``, ``authentication_error``,
``not_found_error``, ``upstream_error`` ...).  :class:`RouterError` carries the HTTP
status and a short machine-readable ``reason`` used as the label of
``kvroute_bad_requests_total`` / ``kvroute_upstream_errors_total``.
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.responses import Response

_encode = msgspec.json.Encoder().encode


class RouterError(Exception):
    """An error answered to the client as OpenAI error JSON."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        reason: str,
        type: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason
        self.type = type or _default_type(status)
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.reason)

    def response(self, extra_headers: dict[str, str] | None = None) -> Response:
        headers = dict(self.headers)
        if extra_headers:
            headers.update(extra_headers)
        return json_response(self.body(), self.status, headers)


def _default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 413:
        return "invalid_request_error"
    if status >= 500:
        return "upstream_error" if status in (502, 503, 504) else "server_error"
    return "invalid_request_error"


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def json_response(
    content: Any, status: int = 200, headers: dict[str, str] | None = None
) -> Response:
    """A JSON response serialised with msgspec (faster than the stdlib on the hot path)."""
    return Response(
        _encode(content), status_code=status, headers=headers, media_type="application/json"
    )


def bad_request(message: str, reason: str, param: str | None = None) -> RouterError:
    return RouterError(400, message, reason=reason, param=param)
