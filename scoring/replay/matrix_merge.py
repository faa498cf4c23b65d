"""Joining the documents of several matrix runs (``bench_quality_matrix.py --merge``):
their cells per (cell, seed), and their other tie seeds, with the ratios recomputed."""

from __future__ import annotations

from typing import Any

from scoring.replay.matrix import VLLM_PRESET, add_ratios


def merge_runs(
    docs: list[dict[str, Any]], seeds: list[int] | None
) -> tuple[list[dict[str, Any]], list[int]]:
    """The cells of several runs joined per (cell, seed), ratios recomputed, and the
    seeds (``seeds`` if given, else in order of appearance); raises ``ValueError``."""
    merged: dict[tuple[str, int], dict[str, Any]] = {}
    order: list[int] = []
    for doc in docs:
        for r in doc["cells"]:
            if r["seed"] not in order:
                order.append(r["seed"])
            key = (r["cell"], r["seed"])
            have = merged.get(key)
            if have is None:
                merged[key] = {**r, "policies": dict(r["policies"])}
            elif have["requests"] != r["requests"] or have["ceilings"] != r["ceilings"]:
                raise ValueError(f"{key[0]} seed {key[1]}: the runs replayed different traces")
            else:
                have["policies"].update(r["policies"])
    sets = {tuple(sorted(r["policies"])) for r in merged.values()}
    if len(sets) > 1:
        raise ValueError(f"cells have different policy sets: {sorted(sets)}")
    seeds = list(seeds) if seeds else order
    results = [merged[k] for k in sorted(merged) if k[1] in seeds]
    for r in results:
        add_ratios(r)
    return results, seeds


def merge_ties(docs: list[dict[str, Any]], seeds: list[int]) -> dict[str, list[dict[str, Any]]]:
    """The runs' other tie seeds (``--tie-seeds``), each joined as :func:`merge_runs`
    joins tie seed 0; {} when no run has any.  Raises ``ValueError`` when the runs were
    drawn under different tie seeds (a variant must meet the peers of its own draw)."""
    drawn = {tuple(sorted(d.get("ties", {}), key=int)) for d in docs}
    if len(drawn) > 1:
        raise ValueError(f"runs differ in tie seeds: {sorted(drawn)}")
    return {
        tie: merge_runs([{"cells": d["ties"][tie]} for d in docs], seeds)[0]
        for tie in next(iter(drawn))
    }


def same_setup(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """What every run was replayed with: block size, pod model, sessions and, for the
    vLLM pod model, the engine preset (as :func:`report`'s keyword arguments); raises
    ``ValueError`` when they differ (a run before ``--sessions`` was open, one before
    ``--preset`` on the matrix's first preset)."""
    setups = {tuple(sorted(_setup(d["run"]).items())) for d in docs}
    if len(setups) > 1:
        raise ValueError(f"runs differ in how they were replayed: {sorted(setups)}")
    return dict(next(iter(setups)))


def _setup(run: dict[str, Any]) -> dict[str, Any]:
    out = {
        "block_size": run["block_size"],
        "pod_model": run["pod_model"],
        "sessions": run.get("sessions", "open"),
    }
    if run["pod_model"] == "vllm":
        out["preset"] = run.get("preset", VLLM_PRESET)
    return out
