"""Engine presets as JSON files: what ``kvroute calibrate`` writes, ``--preset-file`` reads.

The file is one JSON object::

    {
      "kvroute_preset": 1,
      "name": "cpu-tiny-calibrated",
      "summary": "...",
      "calibrated": true,
      "cost": {"base_s": ..., "prefill_token_s": ..., "prefill_pair_s": ...,
               "decode_seq_s": ..., "decode_context_token_s": ...},
      "max_num_batched_tokens": 2048, "max_num_seqs": 8, "max_model_len": 2048,
      "kv_capacity_tokens": 524288,
      "request_overhead_s": 0.004,     # added to every TTFT (optional, default 0)
      "block_size": 32,                # informational: the engine's block size
      "calibration": {...}             # informational: the fit report
    }

Unknown top-level or ``cost`` keys are an error (a typo is not a silent default), and
every value is checked as :meth:`EngineSpec.validate` checks a built-in preset: a NaN,
a negative cost or a zero limit is a :class:`PresetError` naming the field.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from scoring.replay.presets import EngineSpec, PresetError, override_spec, resolve_preset
from scoring.replay.step_cost import PARAMS, StepCost

FORMAT_VERSION = 1
_LIMITS = ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "kv_capacity_tokens")
_KEYS = {"kvroute_preset", "name", "summary", "calibrated", "cost", "block_size", "calibration"}
_KEYS |= {"request_overhead_s"}
_KEYS |= set(_LIMITS)


def spec_to_dict(
    spec: EngineSpec, *, block_size: int | None = None, calibration: Any = None
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "kvroute_preset": FORMAT_VERSION,
        "name": spec.name,
        "summary": spec.summary,
        "calibrated": spec.calibrated,
        "cost": {p: getattr(spec.cost, p) for p in PARAMS},
    }
    out |= {k: getattr(spec, k) for k in _LIMITS}
    out["request_overhead_s"] = spec.request_overhead_s
    if block_size is not None:
        out["block_size"] = block_size
    if calibration is not None:
        out["calibration"] = calibration
    return out


def write_preset_file(path: str | Path, data: dict[str, Any]) -> None:
    """Write ``data`` (from :func:`spec_to_dict`); refuses non-finite numbers."""
    Path(path).write_text(json.dumps(data, indent=2, allow_nan=False) + "\n")


def _int(data: dict[str, Any], key: str, path: str) -> int:
    v = data.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise PresetError(f"preset file {path}: {key} must be an integer >= 1, got {v!r}")
    return v


def _overhead(v: Any, path: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise PresetError(
            f"preset file {path}: request_overhead_s must be a finite number >= 0, got {v!r}"
        )
    return float(v)


def spec_from_dict(data: Any, path: str = "<dict>") -> EngineSpec:
    """The :class:`EngineSpec` a preset file describes (see the module docstring)."""
    if not isinstance(data, dict):
        raise PresetError(f"preset file {path}: expected a JSON object")
    unknown = set(data) - _KEYS
    if unknown:
        raise PresetError(f"preset file {path}: unknown keys {sorted(unknown)}")
    if data.get("kvroute_preset") != FORMAT_VERSION:
        raise PresetError(
            f"preset file {path}: kvroute_preset must be {FORMAT_VERSION}, "
            f"got {data.get('kvroute_preset')!r}"
        )
    cost = data.get("cost")
    if not isinstance(cost, dict):
        raise PresetError(f"preset file {path}: cost must be an object of {', '.join(PARAMS)}")
    if set(cost) != set(PARAMS):
        raise PresetError(
            f"preset file {path}: cost must have exactly {', '.join(PARAMS)}; "
            f"missing {sorted(set(PARAMS) - set(cost))}, unknown {sorted(set(cost) - set(PARAMS))}"
        )
    for p in PARAMS:
        v = cost[p]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise PresetError(f"preset file {path}: cost.{p} must be a finite number, got {v!r}")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise PresetError(f"preset file {path}: name must be a non-empty string")
    spec = EngineSpec(
        name=name,
        cost=StepCost(**{p: float(cost[p]) for p in PARAMS}),
        max_num_batched_tokens=_int(data, "max_num_batched_tokens", path),
        max_num_seqs=_int(data, "max_num_seqs", path),
        max_model_len=_int(data, "max_model_len", path),
        kv_capacity_tokens=_int(data, "kv_capacity_tokens", path),
        calibrated=bool(data.get("calibrated", True)),
        summary=str(data.get("summary", "")),
        request_overhead_s=_overhead(data.get("request_overhead_s", 0.0), path),
    )
    try:
        return spec.validate()
    except PresetError as exc:
        raise PresetError(f"preset file {path}: {exc}") from None


def load_preset_file(path: str | Path) -> EngineSpec:
    """Read and check a preset file; a :class:`PresetError` names what is wrong."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise PresetError(f"preset file {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise PresetError(f"preset file {path}: not JSON: {exc}") from None
    return spec_from_dict(data, str(path))


def resolve_engine(
    preset: str | None,
    preset_file: str | Path | None,
    overrides: dict[str, Any] | None = None,
    *,
    default: str = "llama3-8b-h100",
) -> EngineSpec:
    """The engine ``--preset`` or ``--preset-file`` names (not both), with
    ``--engine-param`` overrides applied."""
    if preset is not None and preset_file is not None:
        raise PresetError("give --preset or --preset-file, not both")
    if preset_file is None:
        return resolve_preset(preset or default, overrides)
    spec = load_preset_file(preset_file)
    return override_spec(spec, overrides)
