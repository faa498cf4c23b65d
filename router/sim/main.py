"""``kvroute sim``: run one simulated vLLM pod until SIGINT / SIGTERM.

Prints one JSON line on stdout once serving (``{"url", "events_endpoint",
"replay_endpoint", "topic"}``) so a script that asked for port 0 learns the ports.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from collections.abc import Callable

import zmq
from pydantic import ValidationError

from router.sim.pod import SimPod
from router.sim.settings import SimSettings
from scoring.replay.fleet_args import parse_engine_params
from scoring.replay.preset_file import resolve_engine


def build_parser() -> argparse.ArgumentParser:
    d = SimSettings()
    p = argparse.ArgumentParser(prog="kvroute sim", description="Run one simulated vLLM pod.")
    a = p.add_argument
    a("--host", default=d.host, help=f"HTTP bind address (default {d.host})")
    a("--port", type=int, default=d.port, help="HTTP port; 0 picks a free one (default 0)")
    a("--model", default=d.model, help=f"served model name (default {d.model})")
    a("--pod-name", default=d.pod_name, help=f"pod name, used in the topic (default {d.pod_name})")
    a("--lora-adapters", default="", help="comma-separated LoRA adapter names")
    a("--block-size", type=int, default=d.block_size, help=f"tokens per block ({d.block_size})")
    a("--capacity-tokens", type=int, default=None,
      help=f"KV cache, tokens (default {d.capacity_tokens}; vllm: the preset's)")  # fmt: skip
    a("--prefill-rate", type=float, default=d.prefill_rate, help="prefill tokens/s")
    a("--decode-rate", type=float, default=d.decode_rate, help="decode tokens/s per sequence")
    a("--max-batch", type=int, default=d.max_batch, help="max running requests")
    a("--max-model-len", type=int, default=None,
      help=f"max prompt + output (default {d.max_model_len}; vllm: the preset's)")  # fmt: skip
    a("--pod-model", choices=["simple", "vllm"], default=d.pod_model,
      help="simple (FCFS prefill + per-sequence decode rate) or vllm (the replay's vLLM V1 "
      "scheduler and step-cost model, in real time)")  # fmt: skip
    a("--preset", default=None, help="vllm pod model: engine preset (default llama3-8b-h100)")
    a("--preset-file", default=None, help="vllm pod model: preset file (kvroute calibrate's)")
    a("--engine-param", action="append", default=[], metavar="KEY=VALUE",
      help="vllm pod model: override a preset parameter")  # fmt: skip
    a("--output-tokens", type=int, default=d.output_tokens, help="output length w/o max_tokens")
    a("--time-scale", type=float, default=d.time_scale, help="multiply delays; 0 = no sleeping")
    a("--tokenizer", default=d.tokenizer, help="'builtin' or a model directory")
    a("--no-kv-events", action="store_true", help="publish no KV events")
    a("--kv-endpoint", default=d.kv_endpoint, help="PUB endpoint: binds on '*' or port 0, "
      "else connects out (default %(default)s)")  # fmt: skip
    a("--replay-endpoint", default=d.replay_endpoint, help="ROUTER endpoint, or 'none'")
    a("--topic", default=d.topic, help="ZMQ topic (default kv@POD@MODEL)")
    a("--encoding", choices=["map", "array"], default=d.encoding, help="event encoding")
    a("--bytes-hashes", action="store_true", help="publish 32-byte digests, not 64-bit ints")
    a("--hash-seed", default=d.hash_seed, help="seed of the engine's NONE_HASH")
    a("--hash-algo", choices=["sim", "sha256"], default=d.hash_algo,
      help="'sim' (engine-private) or 'sha256' (exactly vLLM's)")  # fmt: skip
    a("--role", choices=["prefill", "decode", "both"], default=d.role,
      help="P/D role: prefill holds blocks for a decode pod to pull (default both)")  # fmt: skip
    a("--engine-id", default=d.engine_id, help="engine id in kv_transfer_params")
    a("--kv-lease-s", type=float, default=d.kv_lease_s, help="seconds unpulled blocks are held")
    a("--kv-transfer-s-per-block", type=float, default=d.kv_transfer_s_per_block,
      help="simulated seconds to pull one block")  # fmt: skip
    a("--kv-load-failure-policy", choices=["fail", "recompute"], default=d.kv_load_failure_policy,
      help="a failed pull fails the request (vLLM's default) or recomputes")  # fmt: skip
    return p


def settings_from_args(ns: argparse.Namespace) -> SimSettings:
    replay = None if str(ns.replay_endpoint).lower() in ("", "none") else ns.replay_endpoint
    d = SimSettings()
    capacity, max_len = ns.capacity_tokens, ns.max_model_len
    engine_params = parse_engine_params(ns.engine_param)
    if ns.pod_model == "vllm":  # unset sizes come from the engine preset
        spec = resolve_engine(ns.preset, ns.preset_file, engine_params)
        capacity = capacity if capacity is not None else spec.kv_capacity_tokens
        max_len = max_len if max_len is not None else spec.max_model_len
    return SimSettings(
        host=ns.host,
        port=ns.port,
        model=ns.model,
        pod_name=ns.pod_name,
        lora_adapters=[x.strip() for x in ns.lora_adapters.split(",") if x.strip()],
        block_size=ns.block_size,
        capacity_tokens=capacity if capacity is not None else d.capacity_tokens,
        prefill_rate=ns.prefill_rate,
        decode_rate=ns.decode_rate,
        max_batch=ns.max_batch,
        max_model_len=max_len if max_len is not None else d.max_model_len,
        pod_model=ns.pod_model,
        preset=ns.preset,
        preset_file=ns.preset_file,
        engine_params=engine_params,
        output_tokens=ns.output_tokens,
        time_scale=ns.time_scale,
        tokenizer=ns.tokenizer,
        kv_events=not ns.no_kv_events,
        kv_endpoint=ns.kv_endpoint,
        replay_endpoint=replay,
        topic=ns.topic,
        encoding=ns.encoding,
        int_hashes=not ns.bytes_hashes,
        hash_seed=ns.hash_seed,
        hash_algo=ns.hash_algo,
        role=ns.role,
        engine_id=ns.engine_id,
        kv_lease_s=ns.kv_lease_s,
        kv_transfer_s_per_block=ns.kv_transfer_s_per_block,
        kv_load_failure_policy=ns.kv_load_failure_policy,
    )


async def serve(settings: SimSettings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    pod = SimPod(settings)
    await pod.start()
    try:
        info = {
            "url": pod.url,
            "events_endpoint": pod.events_endpoint,
            "replay_endpoint": pod.replay_endpoint_url,
            "topic": pod.topic if settings.kv_events else None,
        }
        print(json.dumps(info), flush=True)
        await stop.wait()
    finally:
        await pod.stop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop when installed (faster HTTP), else asyncio's default loop."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        settings = settings_from_args(ns)
    except ValidationError as exc:
        print(f"kvroute sim: invalid settings:\n{exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # PresetError, ReplayConfigError: a bad preset or param
        print(f"kvroute sim: {exc}", file=sys.stderr)
        return 2
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(serve(settings))
    except (OSError, zmq.ZMQError) as exc:  # e.g. port in use
        print(f"kvroute sim: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
