"""Random bytes through the KV-event decoder and the trace reader (hypothesis): bad input
is a named, counted error, never an uncaught exception.

The decoder may only raise :class:`~scoring.events.decode.DecodeError` (the subscriber
counts it and resyncs the pod); the trace readers skip a bad line and report it with its
number (``Trace.errors``), whatever the line holds.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from pathlib import Path

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scoring.events.decode import DecodeError, decode_batch, encode_batch
from scoring.replay.trace import load_trace

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

#: msgpack values of the shapes vLLM's payload is made of, nested at random
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=12),
    st.binary(max_size=12),
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5)
    ),
    max_leaves=20,
)


def _decodes_or_names_the_problem(payload: bytes) -> None:
    with contextlib.suppress(DecodeError):
        decode_batch(payload)


@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes_are_a_decode_error_or_a_batch(payload: bytes) -> None:
    _decodes_or_names_the_problem(payload)


@FUZZ
@given(_values)
def test_well_formed_msgpack_of_the_wrong_shape_is_a_decode_error_or_a_batch(value: object) -> None:
    _decodes_or_names_the_problem(msgspec.msgpack.encode(value))


@FUZZ
@given(
    st.lists(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "X"])},
            optional={
                "block_hashes": _values,
                "parent_block_hash": _values,
                "token_ids": _values,
                "block_size": _values,
                "medium": _values,
                "lora_name": _values,
                "extra_keys": _values,
            },
        ),
        max_size=4,
    )
)
def test_events_with_random_fields_are_a_decode_error_or_a_batch(events: list[dict]) -> None:
    _decodes_or_names_the_problem(msgspec.msgpack.encode([1.0, events, 0]))


def test_a_real_batch_still_decodes() -> None:  # (the fuzzing above must not hide this)
    from scoring.events.decode import AllBlocksCleared

    batch = decode_batch(encode_batch([AllBlocksCleared()], ts=1.0))
    assert isinstance(batch.events[0], AllBlocksCleared)


_line = st.one_of(
    st.text(max_size=80),
    _values.map(lambda v: json.dumps(v, default=repr)),
    st.fixed_dictionaries(
        {},
        optional={
            "timestamp": _values,
            "input_length": _values,
            "output_length": _values,
            "hash_ids": _values,
            "body": _values,
            "messages": _values,
        },
    ).map(lambda d: json.dumps(d, default=repr)),
)


@FUZZ
@given(st.lists(_line, max_size=6), st.sampled_from(["mooncake", "openai"]))
def test_any_trace_line_is_read_or_reported_with_its_number(lines: list[str], fmt: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.jsonl"
        path.write_text("\n".join(line.replace("\n", " ") for line in lines) + "\n")
        trace = load_trace(path, fmt)
    # (the reader's own line count: a '\r' inside a line counts as a break there)
    assert len(trace.requests) + len(trace.errors) <= trace.lines
    assert all(isinstance(n, int) and isinstance(msg, str) for n, msg in trace.errors)
