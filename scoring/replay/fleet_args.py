"""What a replay run is handed: the fleet its flags describe, and each policy's parameters
(the fleet's defaults, then ``--param``).  ``kvroute replay`` (scoring/replay/cli.py) and
the benches that build a replay themselves share these."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import yaml

from scoring.policies.registry import PolicyConfigError, available_policies
from scoring.replay.preset_file import resolve_engine
from scoring.replay.presets import PresetError
from scoring.replay.simpod import FleetConfig, ReplayConfigError
from scoring.replay.vllm_pod import VllmFleetConfig

DEFAULT_PRESET = "llama3-8b-h100"
#: simple-model settings and their defaults (``None`` on the command line = not given)
SIMPLE_DEFAULTS: dict[str, float | int] = {
    "prefill_rate": 8000.0,
    "decode_rate": 40.0,
    "decode_batch_slope": 0.01,
    "decode_interference": 0.005,
    "cpu_capacity_tokens": 0,
    "cpu_load_rate": 50_000.0,
}


def parse_params(items: Sequence[str], policies: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``["cost.miss_weight=4"]`` -> ``{"cost": {"miss_weight": 4}}``."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        name, dot, rest = item.partition(".")
        key, eq, value = rest.partition("=")
        if not dot or not eq or not key:
            raise PolicyConfigError(f"--param {item!r}: expected POLICY.KEY=VALUE")
        if name not in available_policies():
            raise PolicyConfigError(f"--param {item!r}: unknown policy {name!r}")
        try:
            out.setdefault(name, {})[key] = yaml.safe_load(value)
        except yaml.YAMLError as exc:
            raise PolicyConfigError(f"--param {item!r}: bad value: {exc}") from None
    return out


def fleet_defaults(name: str, cfg: FleetConfig | VllmFleetConfig) -> dict[str, Any]:
    """Parameters a policy takes from the fleet it routes to (an operator sets these to
    the pods' measured rates); ``--param`` overrides them.

    The peers get what their own docs tell an operator to set: llm-d's affinity filter
    says to retune ``peakPrefillThroughput`` to the deployment's prefill rate; Dynamo's
    router asks only for the block size, which every request carries.  vLLM pods'
    prefill rate comes from their preset (:meth:`EngineSpec.prefill_rate_tokens_per_s`:
    ``cost``'s prior, which it then learns); they have no CPU tier.  ``cost``'s slowdown per
    running request is left unset, as `kvroute serve` ships it, so it is learned from
    clean first tokens here as it is live; ``--param
    cost.decode_slowdown_per_running=X`` tells it one (``kvroute calibrate`` prints an
    engine's: :meth:`EngineSpec.decode_slowdown_per_running`)."""
    if isinstance(cfg, VllmFleetConfig):
        prefill_rate = cfg.engine.prefill_rate_tokens_per_s()
    else:
        prefill_rate = cfg.prefill_rate
    if name == "cost" and isinstance(cfg, VllmFleetConfig):
        return {"prefill_rate_tokens_per_s": prefill_rate}
    if name == "cost" and isinstance(cfg, FleetConfig):
        return {
            "prefill_rate_tokens_per_s": prefill_rate,
            "tier_load_rates_tokens_per_s": {"CPU": cfg.cpu_load_rate},
            "decode_slowdown_per_running": cfg.decode_interference,
        }
    if name == "llmd":
        return {"peak_prefill_throughput_tokens_per_s": prefill_rate}
    return {}


def parse_engine_params(items: Sequence[str]) -> dict[str, Any]:
    """``["max_num_seqs=64"]`` -> ``{"max_num_seqs": 64}`` (YAML values)."""
    out: dict[str, Any] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ReplayConfigError(f"--engine-param {item!r}: expected KEY=VALUE")
        try:
            out[key] = yaml.safe_load(value)
        except yaml.YAMLError as exc:
            raise ReplayConfigError(f"--engine-param {item!r}: bad value: {exc}") from None
    return out


def parse_pod_speed(spec: str | None, pods: int) -> tuple[float, ...] | None:
    """``"1,0.5"`` on 4 pods -> ``(1.0, 0.5, 1.0, 0.5)``: the list repeated over the pods."""
    if spec is None:
        return None
    try:
        speeds = [float(x) for x in spec.split(",")]
    except ValueError:
        raise ReplayConfigError(
            f"pod-speed must be comma-separated numbers, e.g. 1,0.5; got {spec!r}"
        ) from None
    return tuple(speeds[i % len(speeds)] for i in range(max(0, pods)))


def fleet_config(args: argparse.Namespace, block_size: int) -> FleetConfig | VllmFleetConfig:
    """The validated fleet settings the arguments describe."""
    speed = parse_pod_speed(args.pod_speed, args.pods)
    given = [k for k in SIMPLE_DEFAULTS if getattr(args, k, None) is not None]
    if args.pod_model == "vllm":
        if given:
            flag = given[0].replace("_", "-")
            raise ReplayConfigError(
                f"--{flag} applies to --pod-model simple; the vllm model takes its rates "
                "from --preset and --engine-param"
            )
        try:
            overrides = parse_engine_params(args.engine_param)
            spec = resolve_engine(args.preset, args.preset_file, overrides, default=DEFAULT_PRESET)
        except PresetError as exc:
            raise ReplayConfigError(str(exc)) from None
        if not spec.calibrated:
            print(
                f"kvroute replay: preset {spec.name!r} is a placeholder: its step costs "
                "are not measured",
                file=sys.stderr,
            )
        capacity = args.capacity_tokens
        return VllmFleetConfig(
            pods=args.pods,
            capacity_tokens=capacity if capacity is not None else spec.kv_capacity_tokens,
            block_size=block_size,
            engine=spec,
            pod_speed=speed,
        ).validate()
    if args.preset is not None or args.preset_file is not None or args.engine_param:
        raise ReplayConfigError(
            "--preset, --preset-file and --engine-param apply to --pod-model vllm"
        )
    if args.capacity_tokens is None:
        raise ReplayConfigError("capacity-tokens is required with --pod-model simple")
    settings: dict[str, Any] = {
        k: d if (v := getattr(args, k)) is None else v for k, d in SIMPLE_DEFAULTS.items()
    }
    return FleetConfig(
        pods=args.pods,
        capacity_tokens=args.capacity_tokens,
        block_size=block_size,
        pod_speed=speed,
        **settings,
    ).validate()
