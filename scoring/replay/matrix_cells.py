"""What the benchmark matrix is made of: its dimensions, its cells, each cell's trace and
fleet (:mod:`scoring.replay.matrix` replays them; its docstring describes the
dimensions).  ``--preset`` picks the vLLM pod model's engine among
:func:`matrix_presets`; the cells' caches stay sized to their working sets."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from scoring.replay.families import bursty, family_params, rag
from scoring.replay.families import generate as generate_family
from scoring.replay.offered_load import working_set_tokens
from scoring.replay.presets import PRESETS, EngineSpec, resolve_preset
from scoring.replay.simpod import FleetConfig, ReplayConfigError
from scoring.replay.trace import Trace, load_trace
from scoring.replay.vllm_pod import VllmFleetConfig

TRACES_DIR = Path(__file__).resolve().parents[2] / ".." / "shared" / "traces"
MOONCAKE = {
    "mooncake_conversation": "mooncake_conversation.jsonl",
    "mooncake_synthetic": "mooncake_synthetic.jsonl",
}
SYNTHETIC = ("agentic", "rag", "rag_bursty", "chat", "mixed")
WORKLOADS = (*SYNTHETIC, *MOONCAKE)
FLEET_KINDS = ("equal", "unequal", "mixed")
#: the matrix's fleet sizes (pods); others are held out (bench_quality_matrix.py --fleet-sizes)
FLEET_SIZES = (4, 8, 16)
CACHE_FRACTIONS = {"small": 0.1, "medium": 0.3, "large": 1.0}
LOADS = (0.5, 0.8, 1.1)
#: the unequal and mixed fleets' per-pod cache weights, repeated over the pods (mean 1);
#: the mixed fleet's speeds too
UNEQUAL_WEIGHTS = (4 / 3, 2 / 3)
#: the replay's pod models: its own simple one and the vLLM-scheduler one (the preset below)
POD_MODELS = ("simpod", "vllm")
#: how the matrix replays sessions unless told (session 38; before, "open"): a session's
#: next turn after its previous answer, as an agent or a chat client sends it
MATRIX_SESSIONS = "closed"
#: the vLLM pod model's engine unless --preset names another (docs/replay.md)
VLLM_PRESET = "llama3-8b-h100"


def matrix_presets() -> list[str]:
    """The engine presets the matrix takes (``--preset``): those whose costs come from
    published figures (``calibrated``), not placeholders."""
    return [name for name, spec in PRESETS.items() if spec.calibrated]


def matrix_preset(name: str) -> EngineSpec:
    """The engine of preset ``name``; a :class:`ReplayConfigError` naming the known ones
    for any other."""
    if name not in matrix_presets():
        raise ReplayConfigError(
            f"preset {name!r} is not one the matrix takes; known: {', '.join(matrix_presets())}"
        )
    return resolve_preset(name, {})


@dataclass(frozen=True, order=True)
class Cell:
    workload: str
    pods: int
    caches: str  # the fleet kind: "equal" | "unequal" | "mixed" (caches and speeds)
    cache: str  # "small" | "medium" | "large"
    load: float  # offered load, a share of the fleet's prefill capacity

    @property
    def id(self) -> str:
        return (
            f"{self.workload}/p{self.pods}-{self.caches}/{self.cache}/load{round(self.load * 100)}"
        )


def full_matrix(sizes: Sequence[int] = FLEET_SIZES) -> list[Cell]:
    """Every workload x fleet (``sizes`` pods, each fleet kind) x cache x load."""
    return [
        Cell(w, n, c, size, load)
        for w in WORKLOADS
        for n in sizes
        for c in FLEET_KINDS
        for size in CACHE_FRACTIONS
        for load in LOADS
    ]


def quick_matrix() -> list[Cell]:
    """Every workload on a medium 8-pod fleet at 80%, plus a small unequal 4-pod fleet
    pushed past capacity: the two corners most policies differ on."""
    return [
        cell
        for w in WORKLOADS
        for cell in (Cell(w, 8, "equal", "medium", 0.8), Cell(w, 4, "unequal", "small", 1.1))
    ]


def select(cells: Iterable[Cell], patterns: Sequence[str]) -> list[Cell]:
    """The cells whose id matches any of the ``fnmatch`` ``patterns`` (none: all)."""
    from fnmatch import fnmatchcase

    cells = list(cells)
    if not patterns:
        return cells
    return [c for c in cells if any(fnmatchcase(c.id, p) for p in patterns)]


# --- traces and fleets --------------------------------------------------------------


def _synthetic(name: str, seed: int, block_size: int) -> Trace:
    if name == "rag_bursty":
        return rag.generate(bursty(family_params("rag", block_size=block_size)), seed)
    return generate_family(name, seed, block_size=block_size)


@lru_cache(maxsize=3)
def load_workload(
    name: str, seed: int, *, limit: int | None, block_size: int, traces_dir: str
) -> Trace:
    """The workload's trace for ``seed`` (its first ``limit`` requests), memoised per
    process: every cell of a workload replays the same one."""
    if name in MOONCAKE:
        trace = load_trace(Path(traces_dir) / MOONCAKE[name], "mooncake")
        if trace.malformed:
            raise ReplayConfigError(f"{name}: {trace.malformed} malformed lines")
    elif name in SYNTHETIC:
        trace = _synthetic(name, seed, block_size)
    else:
        raise ReplayConfigError(f"unknown workload {name!r}; available: {', '.join(WORKLOADS)}")
    if limit is not None:
        trace.requests = trace.requests[:limit]
    return trace


def fleet_for(cell: Cell, trace: Trace, *, prefill_rate: float = 8000.0) -> FleetConfig:
    """The cell's fleet for ``trace``: total cache = the cache share of the working set,
    split equally or 2:1, no pod below the longest prompt; other settings are
    ``kvroute replay``'s defaults."""
    bs = trace.block_size
    total = CACHE_FRACTIONS[cell.cache] * working_set_tokens(trace)
    floor = -(-max(r.prompt_tokens for r in trace.requests) // bs) * bs
    if cell.caches not in FLEET_KINDS:
        raise ReplayConfigError(
            f"caches must be one of {', '.join(FLEET_KINDS)}, got {cell.caches!r}"
        )
    weights = [1.0] * cell.pods
    if cell.caches != "equal":
        weights = [UNEQUAL_WEIGHTS[i % len(UNEQUAL_WEIGHTS)] for i in range(cell.pods)]
    caps = tuple(max(floor, int(total * w / cell.pods) // bs * bs) for w in weights)
    return FleetConfig(
        pods=cell.pods,
        capacity_tokens=sum(caps) // cell.pods // bs * bs,
        block_size=bs,
        prefill_rate=prefill_rate,
        decode_rate=40.0,
        pod_capacity_tokens=caps if cell.caches != "equal" else None,
        pod_speed=tuple(weights) if cell.caches == "mixed" else None,
    ).validate()


def pod_fleet(
    cfg: FleetConfig, pod_model: str, preset: str = VLLM_PRESET
) -> FleetConfig | VllmFleetConfig:
    """The cell's fleet in ``pod_model``: ``simpod`` as is; ``vllm`` the same pods and
    per-pod caches, engines of ``preset`` (its rates replace simpod's; the caches stay
    the cell's, sized to its working set, not the preset's GPU memory)."""
    if pod_model == "simpod":
        return cfg
    if pod_model == "vllm":
        return VllmFleetConfig(
            pods=cfg.pods,
            capacity_tokens=cfg.capacity_tokens,
            block_size=cfg.block_size,
            engine=matrix_preset(preset),
            pod_capacity_tokens=cfg.pod_capacity_tokens,
            pod_speed=cfg.pod_speed,
        ).validate()
    raise ReplayConfigError(
        f"pod-model {pod_model!r} is not available; available: {', '.join(POD_MODELS)}"
    )
