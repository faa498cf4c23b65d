"""The files of captured KV-event frames (``<scenario>.frames.jsonl`` and
``manifest.json``, see :mod:`tools.capture_vllm_events`): read back for the tests, and
written by the capture tool.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class CapturedMessage:
    """One multipart ZMQ message as captured: ``source`` is "pub" or "replay:<start>"."""

    source: str
    frames: tuple[bytes, ...]

    @property
    def is_replay(self) -> bool:
        return self.source.startswith("replay:")

    def _body(self) -> tuple[bytes, ...]:
        # a replay reply carries the DEALER's empty delimiter frame first
        return self.frames[1:] if self.is_replay else self.frames

    @property
    def topic(self) -> bytes:
        return self._body()[0]

    @property
    def seq(self) -> int:
        return int.from_bytes(self._body()[1], "big", signed=True)

    @property
    def payload(self) -> bytes:
        return self._body()[2]


def load_manifest(directory: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((directory / "manifest.json").read_text())
    return data


def load_capture(directory: Path, scenario: str) -> list[CapturedMessage]:
    """Every captured message of ``scenario``, in capture order."""
    entry = load_manifest(directory)["scenarios"][scenario]
    out = []
    for line in (directory / entry["file"]).read_text().splitlines():
        obj = json.loads(line)
        frames = tuple(base64.b64decode(f) for f in obj["frames"])
        out.append(CapturedMessage(obj["source"], frames))
    return out


def _dump_manifest(manifest: Mapping[str, Any]) -> str:
    """Indented JSON, with each list of numbers kept on one line (token ids, seqs)."""
    text = json.dumps(manifest, indent=1)
    return (
        re.sub(
            r"\[\s*(-?\d+(?:,\s*-?\d+)*)\s*\]",
            lambda m: "[" + ", ".join(re.split(r",\s*", m.group(1))) + "]",
            text,
        )
        + "\n"
    )


def _b64(frames: Sequence[bytes]) -> list[str]:
    return [base64.b64encode(f).decode() for f in frames]
