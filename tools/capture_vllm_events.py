"""Capture real KV-event frames from a real vLLM CPU engine, reproducibly.

Usage::

    python tools/capture_vllm_events.py [--out tests/fixtures/vllm_events]
                                        [--scenario NAME ...] [--keep-logs DIR]

For each scenario (see :data:`SCENARIOS`) it starts one engine with
``/work/shared/vllm-cpu/serve.sh`` on free loopback ports, subscribes with a raw ZMQ SUB
socket *before* the engine binds (so nothing from seq 0 on is missed), sends the
workload of :func:`_requests` (completions and chats sharing a prefix, a repeated
prompt, a ``cache_salt``, a second chat turn, generation that fills blocks, a
block-aligned prompt sent twice, ``POST /reset_prefix_cache``, then distinct long prompts
until the small KV cache evicts), asks the replay ROUTER socket for its buffered
batches from a DEALER, stops the engine by PID and writes:

* ``<scenario>.frames.jsonl`` — one line per multipart ZMQ message, every frame base64
  encoded exactly as received: ``{"source": "pub" | "replay:<start_seq>", "frames": [...]}``
  (pub messages are ``[topic, seq, payload]``; replay messages are
  ``[b"", topic, seq, payload]``, ending with ``[b"", b"", seq=-1, b""]``).
* ``manifest.json`` — per scenario: engine version, hash algorithm, int or bytes hashes,
  PYTHONHASHSEED, KV blocks, every request sent (endpoint, body, the ``/tokenize`` ids
  of its prompt, the engine's ``usage``, the seqs that arrived after it) and the
  engine's prefix-cache counters at the end.

The engine launcher (:class:`EngineProcess`, in :mod:`tools.vllm_engine`) is shared with
``tests/vllm/conftest.py``; the captured files are read back by
:mod:`tools.vllm_capture_files`.  Both are importable from here too.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

if __package__ in (None, ""):  # run as ``python tools/capture_vllm_events.py``
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.vllm_capture_files import (
    CapturedMessage,
    _b64,
    _dump_manifest,
    load_capture,
    load_manifest,
)
from tools.vllm_engine import (
    BLOCK_SIZE,
    END_SEQ,
    SERVE_SH,
    SERVED_MODEL,
    VLLM_BIN,
    VLLM_ROOT,
    EngineConfig,
    EngineProcess,
    EngineStartError,
    FrameRecorder,
    _port_is_free,
    free_port,
    missing_engine_reason,
    replay,
)

__all__ = [
    "BLOCK_SIZE",
    "END_SEQ",
    "SCENARIOS",
    "SERVED_MODEL",
    "SERVE_SH",
    "VLLM_BIN",
    "VLLM_ROOT",
    "CapturedMessage",
    "EngineConfig",
    "EngineProcess",
    "EngineStartError",
    "FrameRecorder",
    "Scenario",
    "_port_is_free",
    "capture_scenario",
    "free_port",
    "load_capture",
    "load_manifest",
    "main",
    "missing_engine_reason",
    "replay",
]


SHARED_PREFIX = (
    "You are a careful assistant for the kvroute project. Answer briefly and precisely. "
    "The fleet has many pods; each pod keeps a prefix cache of key and value blocks. "
    "Requests that share a long prefix should land on the pod that already holds it, "
    "because recomputing the prefix costs time to first token. "
) * 2


def _long_prompt(i: int) -> str:
    words = " ".join(f"item{i}-{j}" for j in range(260))
    return f"Document {i} begins. {words}. Summarise document {i}."


def _requests() -> list[dict[str, Any]]:
    """The workload, in order.  kind: completion | chat | reset."""
    # the questions are long enough that each adds full blocks of its own after the
    # shared ones, so the second one's BlockStored chains to a parent hash
    q1 = SHARED_PREFIX + "Question one: which pod should serve this request? " * 6
    q2 = SHARED_PREFIX + "Question two: what happens when the cache evicts a block? " * 6
    reqs: list[dict[str, Any]] = [
        {"name": "completion_a", "kind": "completion", "prompt": q1},
        {"name": "completion_b_shared_prefix", "kind": "completion", "prompt": q2},
        {"name": "completion_a_repeat_hit", "kind": "completion", "prompt": q1},
        {
            "name": "completion_a_salted",
            "kind": "completion",
            "prompt": q1,
            "cache_salt": "tenant-a",
        },
        {
            "name": "chat_a",
            "kind": "chat",
            "messages": [
                {"role": "system", "content": SHARED_PREFIX},
                {"role": "user", "content": "Which pod holds my prefix?"},
            ],
        },
        {
            "name": "chat_a_multi_turn",
            "kind": "chat",
            "messages": [
                {"role": "system", "content": SHARED_PREFIX},
                {"role": "user", "content": "Which pod holds my prefix?"},
                {"role": "assistant", "content": "The one that served your last turn."},
                {"role": "user", "content": "And if it was evicted?"},
            ],
        },
        {
            # generation fills whole blocks: are generated tokens published too?
            "name": "completion_generates_blocks",
            "kind": "completion",
            "prompt": "Count upwards, never stop: " + " ".join(str(i) for i in range(40)),
            "max_tokens": 72,
        },
        {
            # a fully cached prompt whose length is a multiple of the block size: vLLM
            # recomputes its last block and publishes it again (same hash, stored twice)
            "name": "completion_block_aligned",
            "kind": "completion",
            "prompt": "An aligned prompt, padded to whole blocks. " * 8,
            "align": True,
        },
        {
            "name": "completion_block_aligned_repeat",
            "kind": "completion",
            "prompt": "An aligned prompt, padded to whole blocks. " * 8,
            "align": True,
        },
        {"name": "reset_prefix_cache", "kind": "reset"},
        {"name": "after_reset", "kind": "completion", "prompt": q2},
    ]
    return reqs


def _pad_to_blocks(client: httpx.Client, prompt: str) -> str:
    """``prompt`` plus " x" fillers until its token count is a multiple of BLOCK_SIZE."""
    for _ in range(4 * BLOCK_SIZE):
        n = len(client.post("/tokenize", json={"prompt": prompt}).json()["tokens"])
        if n % BLOCK_SIZE == 0:
            return prompt
        prompt += " x"
    raise RuntimeError("could not pad the prompt to whole blocks")


def _tokenize(client: httpx.Client, req: Mapping[str, Any]) -> list[int]:
    if req["kind"] == "chat":
        body: dict[str, Any] = {
            "model": SERVED_MODEL,
            "messages": req["messages"],
            "add_generation_prompt": True,
        }
    else:
        body = {"model": SERVED_MODEL, "prompt": req["prompt"]}
    resp = client.post("/tokenize", json=body)
    resp.raise_for_status()
    return [int(t) for t in resp.json()["tokens"]]


def _send(client: httpx.Client, req: Mapping[str, Any]) -> dict[str, Any]:
    """Send one request; returns the body sent (for the manifest)."""
    if req["kind"] == "reset":
        client.post("/reset_prefix_cache").raise_for_status()
        return {}
    body: dict[str, Any] = {
        "model": SERVED_MODEL,
        "max_tokens": req.get("max_tokens", 4),
        "temperature": 0.0,
        "ignore_eos": True,
    }
    if req.get("cache_salt"):
        body["cache_salt"] = req["cache_salt"]
    if req["kind"] == "chat":
        body["messages"] = req["messages"]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = req["prompt"]
        path = "/v1/completions"
    resp = client.post(path, json=body)
    resp.raise_for_status()
    return {"endpoint": path, "body": body, "usage": resp.json().get("usage")}


def _prefix_cache_counters(client: httpx.Client) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in client.get("/metrics").text.splitlines():
        for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
            if line.startswith(name + "{"):
                out[name] = float(line.rsplit(" ", 1)[1])
    return out


def _has_block_removed(messages: Sequence[Sequence[bytes]]) -> bool:
    return any(b"BlockRemoved" in m[-1] for m in messages)


@dataclass(frozen=True)
class Scenario:
    name: str
    config: EngineConfig
    note: str
    #: send distinct long prompts until the small cache evicts (False: hash-only scenarios)
    evict: bool = True


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            "sha256_int",
            EngineConfig("sha256", int_hashes=True, num_blocks=96),
            "vLLM defaults: sha256 (pickle), NONE_HASH from 'vllm-none-hash', 64-bit int hashes",
        ),
        Scenario(
            "sha256_bytes",
            EngineConfig("sha256", int_hashes=False, num_blocks=96),
            "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: raw 32-byte sha256 digests",
        ),
        Scenario(
            "sha256_int_seed7",
            EngineConfig("sha256", int_hashes=True, python_hash_seed="7", num_blocks=96),
            "sha256 with PYTHONHASHSEED=7: NONE_HASH = sha256(pickle('7')), not the default",
        ),
        Scenario(
            "sha256_cbor_int",
            EngineConfig("sha256_cbor", int_hashes=True, num_blocks=96),
            "sha256_cbor: sha256 over canonical CBOR, NONE_HASH from 'vllm-none-hash'",
            evict=False,
        ),
        Scenario(
            "xxhash_bytes_seed42",
            EngineConfig("xxhash", int_hashes=False, python_hash_seed="42", num_blocks=96),
            "xxhash with PYTHONHASHSEED=42 and raw digests: 16-byte xxh3_128 hashes",
            evict=False,
        ),
        Scenario(
            "xxhash_int_seed42",
            EngineConfig("xxhash", int_hashes=True, python_hash_seed="42", num_blocks=96),
            "xxhash (xxh3_128 over pickle) with PYTHONHASHSEED=42: NONE_HASH = xxhash('42')",
        ),
    )
}


def capture_scenario(
    scenario: Scenario, log_dir: Path | None = None, max_evict_prompts: int = 8
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Start an engine, run the workload, replay, stop.  Returns (manifest entry, lines)."""
    log_path = (log_dir / f"{scenario.name}.log") if log_dir else None
    engine = EngineProcess(scenario.config, log_path=log_path)
    engine.start()
    recorder = FrameRecorder(engine.pub_endpoint)
    recorder.start()  # before the engine binds: ZMQ reconnects, so seq 0 is not missed
    lines: list[dict[str, Any]] = []
    try:
        engine.wait_ready()
        with httpx.Client(base_url=engine.base_url, timeout=120.0) as client:
            version = client.get("/version").json().get("version")
            sources = client.get("/kv_event_sources").json()
            recorder.wait_quiet()
            requests: list[dict[str, Any]] = []
            reqs = _requests()
            reqs += [
                {"name": f"evict_{i}", "kind": "completion", "prompt": _long_prompt(i)}
                for i in range(max_evict_prompts if scenario.evict else 0)
            ]
            for req in reqs:
                if req["name"].startswith("evict_") and _has_block_removed(recorder.messages):
                    break
                if req.get("align"):
                    req = {**req, "prompt": _pad_to_blocks(client, req["prompt"])}
                token_ids = _tokenize(client, req) if req["kind"] != "reset" else []
                first = recorder.count()
                sent = _send(client, req)
                recorder.wait_quiet()
                seqs = [
                    int.from_bytes(m[1], "big") for m in recorder.messages[first : recorder.count()]
                ]
                entry: dict[str, Any] = {"name": req["name"], "kind": req["kind"], **sent}
                if req["kind"] != "reset":
                    entry["token_ids"] = token_ids
                    entry["cache_salt"] = req.get("cache_salt")
                entry["seqs_after"] = seqs
                requests.append(entry)
            counters = _prefix_cache_counters(client)
        pub = recorder.stop()
        if not pub:
            raise RuntimeError(f"{scenario.name}: the engine published nothing")
        last_seq = int.from_bytes(pub[-1][1], "big")
        replay_starts = [0, max(0, last_seq - 1)]
        for start in replay_starts:
            for msg in replay(engine.replay_endpoint, start):
                lines.append({"source": f"replay:{start}", "frames": _b64(msg)})
        lines = [{"source": "pub", "frames": _b64(m)} for m in pub] + lines
    finally:
        recorder.stop()
        engine.stop()
    cfg = scenario.config
    entry = {
        "note": scenario.note,
        "file": f"{scenario.name}.frames.jsonl",
        "vllm_version": version,
        "served_model_name": SERVED_MODEL,
        "model_dir": cfg.model,
        "block_size": BLOCK_SIZE,
        "hash_algo": cfg.hash_algo,
        "int_hashes": cfg.int_hashes,
        "env": {
            "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "1" if cfg.int_hashes else "0",
            "PYTHONHASHSEED": cfg.python_hash_seed,
        },
        "num_gpu_blocks_override": cfg.num_blocks,
        "kv_event_sources": sources,
        "replay_start_seqs": replay_starts,
        "requests": requests,
        "prefix_cache_counters_at_end": counters,
    }
    return entry, lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("tests/fixtures/vllm_events"))
    ap.add_argument("--scenario", action="append", choices=sorted(SCENARIOS))
    ap.add_argument("--keep-logs", type=Path, default=None, help="write engine logs here")
    args = ap.parse_args(argv)
    # a TERM (e.g. from a job runner) unwinds normally, so every engine started is stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    reason = missing_engine_reason()
    if reason:
        print(f"capture_vllm_events: {reason}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    if args.keep_logs:
        args.keep_logs.mkdir(parents=True, exist_ok=True)
    manifest_path = args.out / "manifest.json"
    manifest: dict[str, Any] = (
        json.loads(manifest_path.read_text()) if manifest_path.exists() else {"scenarios": {}}
    )
    manifest["produced_by"] = "python tools/capture_vllm_events.py --out " + str(args.out)
    manifest["frame_format"] = (
        "one JSON object per line: source ('pub' or 'replay:<start_seq>') and frames "
        "(base64 of each ZMQ frame as received; pub = [topic, seq, payload], replay = "
        "[b'', topic, seq, payload], end of replay = [b'', b'', seq -1, b''])"
    )
    for name in args.scenario or list(SCENARIOS):
        t0 = time.monotonic()
        entry, lines = capture_scenario(SCENARIOS[name], args.keep_logs)
        (args.out / entry["file"]).write_text("".join(json.dumps(x) + "\n" for x in lines))
        manifest["scenarios"][name] = entry
        manifest_path.write_text(_dump_manifest(manifest))
        n_pub = sum(1 for x in lines if x["source"] == "pub")
        print(f"{name}: {n_pub} batches, {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
