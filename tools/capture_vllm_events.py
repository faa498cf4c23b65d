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

The :class:`EngineProcess` launcher is shared with ``tests/vllm/conftest.py``.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import zmq

VLLM_ROOT = Path(os.environ.get("KVROUTE_VLLM_ROOT", "/tmp/vllmcpu"))
SERVE_SH = Path(os.environ.get("KVROUTE_VLLM_SERVE", "/work/shared/vllm-cpu/serve.sh"))
VLLM_BIN = VLLM_ROOT / "venv" / "bin" / "vllm"
SERVED_MODEL = "tiny-llama"  # serve.sh's --served-model-name
BLOCK_SIZE = 32  # serve.sh's default --block-size (the CPU backend needs multiples of 32)
END_SEQ = -1


class EngineStartError(RuntimeError):
    """The engine process exited or did not become healthy; the message has its log tail."""


def missing_engine_reason(model: str = "tiny-llama") -> str | None:
    """Why a real engine cannot be started here, or None when it can."""
    if not VLLM_BIN.exists():
        return f"no vLLM CPU engine: {VLLM_BIN} is missing (run ../shared/vllm-cpu/install.sh)"
    if not (VLLM_ROOT / model / "config.json").exists():
        return f"no model: {VLLM_ROOT / model}/config.json is missing (run install.sh)"
    if not SERVE_SH.exists():
        return f"no launcher: {SERVE_SH} is missing"
    return None


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(*, with_offset: int | None = None) -> int:
    """A port the OS says is free now (and ``port + with_offset`` too, when given)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if with_offset is None:
            return port
        other = port + with_offset
        if other < 65536 and _port_is_free(other):
            return port
    raise RuntimeError("could not find a free port pair")


@dataclass(frozen=True)
class EngineConfig:
    """How to start one engine with serve.sh."""

    hash_algo: str = "sha256"
    #: VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES: True = 64-bit ints, False = raw digest bytes
    int_hashes: bool = True
    #: PYTHONHASHSEED for the engine (None: unset, so NONE_HASH uses vLLM's default)
    python_hash_seed: str | None = None
    #: --num-gpu-blocks-override (a small KV cache to force evictions); None = 1 GiB
    num_blocks: int | None = None
    model: str = "tiny-llama"
    extra_args: tuple[str, ...] = ()
    kv_cache_gib: int = 1
    #: extra environment of the engine, as (name, value) pairs (e.g. the Responses
    #: API store: ``(("VLLM_ENABLE_RESPONSES_API_STORE", "1"),)``)
    env: tuple[tuple[str, str], ...] = ()


@dataclass
class EngineProcess:
    """One real vLLM engine started by serve.sh on free loopback ports; stop() by PID."""

    config: EngineConfig = field(default_factory=EngineConfig)
    log_path: Path | None = None
    http_port: int = 0
    zmq_port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def pub_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.zmq_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.zmq_port + 100}"  # serve.sh: replay on ZMQ_PORT+100

    def start(self) -> None:
        reason = missing_engine_reason(self.config.model)
        if reason:
            raise EngineStartError(reason)
        if not (self.http_port and self.zmq_port):  # preset ports: the caller's range
            self.http_port = free_port()
            self.zmq_port = free_port(with_offset=100)
        env = dict(os.environ)
        env.pop("PYTHONHASHSEED", None)
        if self.config.python_hash_seed is not None:
            env["PYTHONHASHSEED"] = self.config.python_hash_seed
        env["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1" if self.config.int_hashes else "0"
        env["VLLM_CPU_KVCACHE_SPACE"] = str(self.config.kv_cache_gib)
        env["MODEL"] = str(VLLM_ROOT / self.config.model)
        env.update(self.config.env)
        args = [str(SERVE_SH), str(self.http_port), str(self.zmq_port), self.config.hash_algo]
        if self.config.num_blocks is not None:
            args += ["--num-gpu-blocks-override", str(self.config.num_blocks)]
        args += list(self.config.extra_args)
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="vllm-engine-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def wait_ready(self, timeout: float = 420.0) -> None:
        """Poll GET /health until 200; raise EngineStartError if the process dies."""
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise EngineStartError(
                        f"engine exited with code {self.proc.returncode}:\n{self.log_tail()}"
                    )
                try:
                    if client.get(self.base_url + "/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(1.0)
        raise EngineStartError(f"engine not healthy after {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM the engine's PID, then its process group (its EngineCore and workers)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        # children left behind in the session we created for this engine
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    def __enter__(self) -> EngineProcess:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class FrameRecorder:
    """A raw ZMQ SUB socket on a background thread, recording every multipart message."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.messages: list[list[bytes]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sub-recorder", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._ready.wait(5)

    def _run(self) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        self._ready.set()
        try:
            while not self._stop.is_set():
                if sock.poll(100):
                    msg = sock.recv_multipart()
                    with self._lock:
                        self.messages.append(msg)
        finally:
            sock.close()

    def count(self) -> int:
        with self._lock:
            return len(self.messages)

    def wait_quiet(self, quiet: float = 1.0, timeout: float = 20.0) -> None:
        """Return once no message arrived for ``quiet`` seconds (or ``timeout`` passed)."""
        deadline = time.monotonic() + timeout
        last, since = self.count(), time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.1)
            n = self.count()
            if n != last:
                last, since = n, time.monotonic()
            elif time.monotonic() - since >= quiet:
                return

    def stop(self) -> list[list[bytes]]:
        self._stop.set()
        self._thread.join(5)
        with self._lock:
            return list(self.messages)


def replay(endpoint: str, start_seq: int, timeout: float = 10.0) -> list[list[bytes]]:
    """Ask the engine's replay ROUTER for batches from ``start_seq``: every reply frame set,
    up to and including the end marker (seq -1)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    out: list[list[bytes]] = []
    try:
        sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        while True:
            if not sock.poll(int(timeout * 1000)):
                raise TimeoutError(f"replay from {endpoint}: no end frame after {timeout} s")
            msg = sock.recv_multipart()
            out.append(msg)
            if len(msg) >= 3 and int.from_bytes(msg[2], "big", signed=True) == END_SEQ:
                return out
    finally:
        sock.close()


# --- reading the captured files back (shared with the tests) ------------------------


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


# --- the workload -------------------------------------------------------------------

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
