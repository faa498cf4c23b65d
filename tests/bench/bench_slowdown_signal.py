"""What the clean first tokens of ``cost``'s learned slowdown show, cell by cell.

    python tests/bench/bench_slowdown_signal.py --seed 89 --cells '*/p4-unequal/small/load110'

``cost`` learns its per-running prefill slowdown (scoring/policies/slowdown_fit.py) from
*clean* first tokens: requests routed to a pod with nothing queued or waiting.  This
replays ``cost`` (the slowdown unset, as a user runs it) on each quick-matrix cell
selected (vLLM pod model), keeps every clean observation the fit was given (uncached
tokens ``T``, the pod's running requests ``R``, seconds to the first token ``s``) and
fits them by ordinary least squares, all at once, without the fit's forgetting::

    s = c + a * T + b * T * R + d * R

It prints per cell: the observations, ``R``'s mean and maximum, ``a`` (s a token), the
multiplicative slowdown ``b / a`` the fit looks for, the additive ``d`` (ms a running
request), the slowdown the policy ended with, and the one the pods' preset implies
(:meth:`scoring.replay.presets.EngineSpec.decode_slowdown_per_running`: one running
decode's share of a step that prefills a full chunk).  Replay time is virtual: the
numbers do not depend on the machine.  About 2-30 s a cell.
``--no-charge-decode-steps`` replays ``cost`` as it was before session 26, when what
the fit learned of ``d`` was not charged.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from scoring.policies import cost_ledger
from scoring.policies.registry import build_policy
from scoring.policies.slowdown_fit import SlowdownFit
from scoring.replay.engine import replay_policy
from scoring.replay.fleet_args import fleet_defaults
from scoring.replay.matrix import cell_replay_input, quick_matrix
from scoring.replay.matrix import select as select_cells
from scoring.replay.vllm_pod import VllmFleetConfig

#: every clean observation given to a fit in this process: (tokens, running, seconds)
SEEN: list[tuple[float, float, float]] = []


class RecordingFit(SlowdownFit):
    """The policy's own fit, also keeping what it is given."""

    def add(self, tokens: float, running: float, service: float) -> None:
        SEEN.append((tokens, running, service))
        super().add(tokens, running, service)


def least_squares(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float] | None:
    """The coefficients minimising the squared error of ``rows @ x - ys`` (normal
    equations, Gaussian elimination with partial pivoting); None when singular."""
    k = len(rows[0])
    m = [[sum(r[i] * r[j] for r in rows) for j in range(k)] for i in range(k)]
    v = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(k)]
    for col in range(k):
        pivot = max(range(col, k), key=lambda i: abs(m[i][col]))
        if abs(m[pivot][col]) < 1e-300:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        v[col], v[pivot] = v[pivot], v[col]
        for i in range(col + 1, k):
            f = m[i][col] / m[col][col]
            for j in range(col, k):
                m[i][j] -= f * m[col][j]
            v[i] -= f * v[col]
    x = [0.0] * k
    for i in reversed(range(k)):
        x[i] = (v[i] - sum(m[i][j] * x[j] for j in range(i + 1, k))) / m[i][i]
    return x


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=89)
    ap.add_argument(
        "--cells", action="append", default=[], metavar="GLOB", help="quick-matrix cells"
    )
    ap.add_argument(
        "--no-charge-decode-steps",
        action="store_true",
        help="replay cost as before session 26 (charge_decode_steps off)",
    )
    a = ap.parse_args()
    cells = select_cells(quick_matrix(), a.cells or ["*/p4-unequal/small/load110"])
    if not cells:
        print("bench_slowdown_signal: no quick-matrix cell matches --cells", file=sys.stderr)
        return 2
    cost_ledger.SlowdownFit = RecordingFit
    print(f"seed {a.seed}; clean first tokens of `cost` (slowdown learned), fitted at once")
    print()
    print(
        "| cell | clean | R mean / max | a (s/token) | b / a | d (ms / running) "
        "| learned | preset |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for cell in cells:
        scaled, cfg, _ = cell_replay_input(cell, a.seed, block_size=64, pod_model="vllm")
        assert isinstance(cfg, VllmFleetConfig)
        params = {
            **fleet_defaults("cost", cfg),
            "decode_slowdown_per_running": None,
            "charge_decode_steps": not a.no_charge_decode_steps,
        }
        policy = build_policy("cost", params)
        SEEN.clear()
        replay_policy(scaled, policy, cfg)
        learned = [
            v for (q, _), v in policy.learned().items() if q == "decode_slowdown_per_running"
        ]
        preset = cfg.engine.decode_slowdown_per_running()
        fit = (
            least_squares([(1.0, t, t * r, r) for t, r, _ in SEEN], [s for _, _, s in SEEN])
            if len(SEEN) >= 8
            else None
        )
        n = len(SEEN)
        r_mean = sum(r for _, r, _ in SEEN) / n if n else 0.0
        r_max = max((r for _, r, _ in SEEN), default=0.0)
        if fit is None:
            cols = "| | | "
        else:
            _, slope, cross, per_running = fit
            cols = f"| {slope:.3g} | {cross / slope:+.4f} | {1e3 * per_running:.2f} "
        print(
            f"| {cell.id} | {n} | {r_mean:.1f} / {r_max:.0f} {cols}"
            f"| {learned[0] if learned else 0.0:.4f} | {preset:.4f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
