"""A real gRPC ext_proc client for the tests: plays the proxy's side of one stream
(Envoy's messages, built as Envoy sends them) against a running EPP."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import struct_pb2

from router.epp import protocol as P

__all__ = ["P", "ep"]


def _headers(pairs: Iterable[tuple[str, str]]) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
    )


def metadata(namespace: str, key: str, value: Any) -> base_pb2.Metadata:
    """``filter_metadata[namespace][key] = value`` (a string or a list of strings)."""
    s = struct_pb2.Struct()
    s.update({key: value})
    return base_pb2.Metadata(filter_metadata={namespace: s})


def request_headers(
    path: str,
    *,
    method: str = "POST",
    extra: Sequence[tuple[str, str]] = (),
    end_of_stream: bool = False,
    meta: base_pb2.Metadata | None = None,
) -> ep.ProcessingRequest:
    pairs = [(":method", method), (":path", path), (":authority", "gw"), *extra]
    if method == "POST":
        pairs.append(("content-type", "application/json"))
    msg = ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(headers=_headers(pairs), end_of_stream=end_of_stream)
    )
    if meta is not None:
        msg.metadata_context.CopyFrom(meta)
    return msg


def request_body(chunk: bytes, end_of_stream: bool) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=chunk, end_of_stream=end_of_stream))


def response_headers(
    status: int = 200,
    content_type: str = "application/json",
    served: str | None = None,
    end_of_stream: bool = False,
) -> ep.ProcessingRequest:
    msg = ep.ProcessingRequest(
        response_headers=ep.HttpHeaders(
            headers=_headers([(":status", str(status)), ("content-type", content_type)]),
            end_of_stream=end_of_stream,
        )
    )
    if served is not None:
        msg.metadata_context.CopyFrom(metadata(P.DESTINATION_NS, P.SERVED_KEY, served))
    return msg


def response_body(chunk: bytes, end_of_stream: bool) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(response_body=ep.HttpBody(body=chunk, end_of_stream=end_of_stream))


def chunks(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)] or [b""]


class Stream:
    """One ext_proc stream on ``channel``: write the proxy's messages, read answers."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.call = ep_grpc.ExternalProcessorStub(channel).Process()

    async def send(self, *messages: ep.ProcessingRequest) -> None:
        for m in messages:
            await self.call.write(m)

    async def read(self, n: int) -> list[ep.ProcessingResponse]:
        out: list[ep.ProcessingResponse] = []
        for _ in range(n):
            msg = await self.call.read()
            assert msg is not grpc.aio.EOF, f"stream ended after {len(out)} of {n} answers"
            out.append(msg)
        return out

    async def read_request_pick(self) -> tuple[ep.ProcessingResponse, bytes]:
        """The request-headers answer and the request body the EPP sent back (read
        until its end of stream)."""
        first = (await self.read(1))[0]
        if first.WhichOneof("response") != "request_headers":
            return first, b""
        body = b""
        while True:
            msg = (await self.read(1))[0]
            assert msg.WhichOneof("response") == "request_body", msg
            streamed = msg.request_body.response.body_mutation.streamed_response
            assert len(streamed.body) <= P.BODY_CHUNK
            body += streamed.body
            if streamed.end_of_stream:
                return first, body

    async def close(self) -> None:
        await self.call.done_writing()
        self.call.cancel()


def set_headers(resp: ep.ProcessingResponse, which: str = "request_headers") -> dict[str, str]:
    common = getattr(resp, which).response
    return {
        h.header.key: (h.header.raw_value or h.header.value.encode()).decode()
        for h in common.header_mutation.set_headers
    }


def destination_metadata(resp: ep.ProcessingResponse) -> str:
    return (
        resp.dynamic_metadata.fields[P.DESTINATION_NS]
        .struct_value.fields[P.DESTINATION_KEY]
        .string_value
    )
