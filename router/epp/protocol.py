"""The Endpoint Picker Protocol on Envoy's ext_proc v3 messages: names, readers, builders.

What the protocol (GIE ``docs/proposals/004-endpoint-picker-protocol``, v1.0.0) fixes,
as this module spells it:

* the picked endpoints go to the proxy twice, identically: the request header
  :data:`DESTINATION_KEY` and the dynamic metadata ``{DESTINATION_NS: {DESTINATION_KEY:
  value}}``; ``value`` is ``ip:port`` or an ordered ``ip:port,ip:port,...`` list (the
  proxy tries them in order on retries);
* the proxy may restrict the candidates with the filter metadata
  ``{SUBSET_NS: {SUBSET_KEY: [ip:port, ...]}}`` (a list, or one comma-separated string,
  as GIE's reference picker accepts both); entries without a port match every port
  of that IP;
* the proxy reports the endpoint that served the request (after its retries) in the
  response's metadata context ``{DESTINATION_NS: {SERVED_KEY: "ip:port"}}``;
* no endpoint -> ImmediateResponse 503; a request to shed -> 429.

Body chunks sent back in ``FULL_DUPLEX_STREAMED`` mode are at most :data:`BODY_CHUNK`
bytes each (GIE's ``BodyByteLimit``: some Envoy builds cap a streamed chunk at 64 KiB).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import msgspec
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

DESTINATION_NS = "envoy.lb"
DESTINATION_KEY = "x-gateway-destination-endpoint"
SERVED_KEY = "x-gateway-destination-endpoint-served"
SUBSET_NS = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
#: largest body chunk echoed back to the proxy (GIE pkg/common/envoy/chunking.go)
BODY_CHUNK = 62_000

ProcessingRequest = ep.ProcessingRequest
ProcessingResponse = ep.ProcessingResponse

json_bytes = msgspec.json.Encoder().encode


# -- reading -------------------------------------------------------------------------


def header_map(headers: ep.HttpHeaders) -> dict[str, str]:
    """The headers of a headers message as one dict, names lowercase (Envoy sends
    ``raw_value`` bytes; older builds ``value``); a repeated header keeps its last value."""
    out: dict[str, str] = {}
    for h in headers.headers.headers:
        raw = h.raw_value
        out[h.key.lower()] = raw.decode("latin-1") if raw else h.value
    return out


def _struct_field(req: ep.ProcessingRequest, namespace: str, key: str) -> Any:
    """``metadata_context.filter_metadata[namespace][key]`` as a plain value (None when
    absent)."""
    ns = req.metadata_context.filter_metadata.get(namespace)
    if ns is None or key not in ns.fields:
        return None
    value = ns.fields[key]
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        return value.string_value
    if kind == "list_value":
        return [v.string_value for v in value.list_value.values if v.HasField("string_value")]
    return None


def subset_hint(req: ep.ProcessingRequest) -> list[str] | None:
    """The endpoints the proxy allows for this request (None: no hint, the whole pool;
    an empty list: nothing allowed)."""
    value = _struct_field(req, SUBSET_NS, SUBSET_KEY)
    if value is None:
        ns = req.metadata_context.filter_metadata.get(SUBSET_NS)
        if ns is None or SUBSET_KEY not in ns.fields:
            return None
        return []  # present but neither a string nor a list of strings: nothing usable
    items = value if isinstance(value, list) else [value]
    return [part.strip() for item in items for part in item.split(",") if part.strip()]


def served_endpoint(req: ep.ProcessingRequest) -> str | None:
    """The ``ip:port`` the proxy reports as having served the request (None: not sent)."""
    value = _struct_field(req, DESTINATION_NS, SERVED_KEY)
    if isinstance(value, list):
        value = value[0] if value else None
    return value.strip() if isinstance(value, str) and value.strip() else None


# -- building --------------------------------------------------------------------------


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode("latin-1")),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def destination_metadata(endpoints: str) -> struct_pb2.Struct:
    meta = struct_pb2.Struct()
    meta.fields[DESTINATION_NS].struct_value.fields[DESTINATION_KEY].string_value = endpoints
    return meta


def pick_headers_response(endpoints: str, content_length: int | None) -> ep.ProcessingResponse:
    """The request-headers answer naming the picked ``endpoints`` (header and dynamic
    metadata, identical); ``content_length``: the body's length, restored (Envoy drops
    it in streamed body modes) — the body goes back unchanged."""
    sets = [_header(DESTINATION_KEY, endpoints)]
    if content_length is not None:
        sets.append(_header("content-length", str(content_length)))
    return ep.ProcessingResponse(
        request_headers=ep.HeadersResponse(
            response=ep.CommonResponse(
                header_mutation=ep.HeaderMutation(set_headers=sets), clear_route_cache=True
            )
        ),
        dynamic_metadata=destination_metadata(endpoints),
    )


def headers_response(
    request: bool, set_headers: Mapping[str, str] | None = None
) -> ep.ProcessingResponse:
    """An answer to a headers message that changes nothing but ``set_headers``."""
    common = ep.CommonResponse()
    if set_headers:
        common.header_mutation.set_headers.extend(_header(k, v) for k, v in set_headers.items())
    if request:
        return ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=common))
    return ep.ProcessingResponse(response_headers=ep.HeadersResponse(response=common))


def body_responses(
    request: bool, chunk: bytes, end_of_stream: bool
) -> Iterator[ep.ProcessingResponse]:
    """``chunk`` sent back unchanged as streamed body responses of at most
    :data:`BODY_CHUNK` bytes; only the last carries ``end_of_stream``."""
    n = len(chunk)
    starts = range(0, n, BODY_CHUNK) if n else (0,)
    for start in starts:
        piece = chunk[start : start + BODY_CHUNK] if n > BODY_CHUNK else chunk
        eos = end_of_stream and start + BODY_CHUNK >= n
        body = ep.BodyResponse(
            response=ep.CommonResponse(
                body_mutation=ep.BodyMutation(
                    streamed_response=ep.StreamedBodyResponse(body=piece, end_of_stream=eos)
                )
            )
        )
        if request:
            yield ep.ProcessingResponse(request_body=body)
        else:
            yield ep.ProcessingResponse(response_body=body)


def trailers_response(request: bool) -> ep.ProcessingResponse:
    if request:
        return ep.ProcessingResponse(request_trailers=ep.TrailersResponse())
    return ep.ProcessingResponse(response_trailers=ep.TrailersResponse())


def immediate_response(
    status: int, body: bytes, headers: Sequence[tuple[str, str]] = ()
) -> ep.ProcessingResponse:
    """Answer the client now with ``status`` and ``body`` (the request goes nowhere)."""
    mutation = ep.HeaderMutation(set_headers=[_header(k, v) for k, v in headers])
    return ep.ProcessingResponse(
        immediate_response=ep.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=mutation,
            body=body,
        )
    )
