"""The ``kv@<pod>@<model>`` topic convention that names a publisher in bind mode."""

from __future__ import annotations

from typing import NamedTuple


class TopicError(ValueError):
    """A topic that does not follow ``kv@<pod>@<model>``."""


class Topic(NamedTuple):
    pod: str
    model: str


def parse_topic(raw: bytes) -> Topic:
    """``b"kv@pod-1@Qwen/Qwen3-8B"`` -> ``Topic("pod-1", "Qwen/Qwen3-8B")``.

    The pod name is between the first and second ``@``; the model is the rest (it may
    itself contain ``@``).  The model part may be empty; the pod may not.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise TopicError(f"topic is not UTF-8: {raw[:64]!r}") from None
    prefix, sep, rest = text.partition("@")
    if prefix != "kv" or not sep:
        raise TopicError(f"topic {text[:100]!r} does not start with 'kv@'")
    pod, _, model = rest.partition("@")
    if not pod:
        raise TopicError(f"topic {text[:100]!r} names no pod (expected kv@<pod>@<model>)")
    return Topic(pod, model)


def make_topic(pod: str, model: str) -> str:
    """The topic a pod should publish under (``--kv-events-config '{"topic": ...}'``)."""
    if "@" in pod:
        raise TopicError(f"pod name {pod!r} must not contain '@'")
    return f"kv@{pod}@{model}"
