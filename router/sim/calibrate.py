"""``kvroute calibrate``: measure a vLLM engine and fit the replay's step-time model.

Runs a designed set of probe requests against one OpenAI-compatible engine on
127.0.0.1, one probe at a time on an otherwise idle engine, and reads what each probe's
engine steps cost from the engine's own ``/metrics`` deltas:

* ``vllm:request_prefill_time_seconds`` — scheduled to first token: the probe's
  prefill step(s);
* ``vllm:request_decode_time_seconds`` — first to last token: its ``T - 1`` decode steps;
* ``vllm:prefix_cache_hits`` — the tokens the probe found cached (so the work rows use
  the hit the engine had, not the one the probe hoped for).

When the engine exports no prefill / decode histogram the client's clock is used
instead (streamed first / last token; it includes HTTP and tokenization, the report
says ``source: client``).

The probes (token-id prompts of seeded random ids, ``ignore_eos``):

1. **uncached prefill** of one request, prompt lengths 32 .. ``max_model_len`` (a prompt
   longer than ``max_num_batched_tokens`` is prefilled in chunks and modelled so):
   ``base_s``, ``prefill_token_s`` and ``prefill_pair_s`` from context 0;
2. **cached prefill**: a cached prompt of ``L`` tokens plus 64 new ones: 64 tokens
   attending ``L`` cached ones separates ``prefill_pair_s`` from ``prefill_token_s``;
3. **concurrent decodes**: ``k`` = 1, 2, 4, ``max_num_seqs`` requests decoding together
   (prompts of 32 and of up to 512 tokens, 32 output tokens): ``decode_seq_s`` and
   ``decode_context_token_s`` against ``base_s``.

Besides the step costs, the engine's **request overhead** — what a request spends
outside engine steps before its first token reaches the client (the API server's HTTP,
tokenization, output processing) — is measured as the median over single-request probes
of client TTFT minus the engine's ``vllm:request_queue_time_seconds`` and prefill time,
and written as the preset's ``request_overhead_s`` (the replay adds it to each TTFT).

Each probe becomes a :class:`~scoring.replay.calibrate_fit.Sample` and
:func:`~scoring.replay.calibrate_fit.fit` solves for the parameters.  The engine's
limits come from ``/v1/models`` (``max_model_len``) and ``vllm:cache_config_info``
(``block_size``, ``kv_cache_size_tokens``); ``max_num_seqs`` and
``max_num_batched_tokens`` are not exported, so they are flags (default: the base
preset's).  A pod that never answers, or metrics that make no sense, leave the base
preset's values (the priors) in place: logged once, counted in the report.

The fit is of the engine *as it runs on its host*.  On a host shared with other work
(the local CPU engines share 2 cores), start the engine with ``OMP_NUM_THREADS=1`` (with
one OpenMP thread a core, a step's barriers wait for descheduled threads and its time
stops depending on its work), probe every engine of a fleet that shares the host at
once (``tests/bench/bench_engine_agreement.py`` does: a sibling's steps and its
``sched_yield`` polling slow this engine's steps ~1.5-5x), and take
``--repeat-estimate median`` (the fastest repeat is the engine with an idle host, which
the workload will not have).  docs/replay.md, "Where the real engine's TTFT went".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import statistics
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from router.sim.calibrate_probes import (
    Limits,
    ProbeCounts,
    decode_row,
    design,
    discover,
    measure,
    prefill_row,
    reseed,
    samples_of,
    scrape_values,
)
from scoring.replay.calibrate_fit import FitReport, Sample, fastest, fit, repeat_spread, typical
from scoring.replay.preset_file import spec_to_dict, write_preset_file
from scoring.replay.presets import PRESETS, EngineSpec, PresetError

__all__ = ["Calibration", "calibrate", "decode_row", "main", "prefill_row", "scrape_values"]

log = logging.getLogger("kvroute.calibrate")

NOISY_SPREAD = 1.5  # repeat_spread above this: warn that the machine was busy


@dataclass(slots=True)
class Calibration:
    spec: EngineSpec
    limits: Limits
    report: FitReport
    counts: ProbeCounts
    notes: list[str] = field(default_factory=list)
    spread: float = math.nan

    def as_dict(self) -> dict[str, Any]:
        return {
            "report": self.report.as_dict(),
            "probes": {
                "sent": self.counts.sent,
                "answered": self.counts.answered,
                "failed": dict(self.counts.failed),
            },
            "repeat_spread": None if math.isnan(self.spread) else round(self.spread, 3),
            "notes": self.notes,
        }


async def calibrate(
    url: str,
    model: str,
    base: EngineSpec,
    *,
    seed: int,
    repeats: int = 3,
    timeout_s: float = 60.0,
    name: str | None = None,
    given: Mapping[str, int] | None = None,
    max_failures: int = 3,
    estimate: str = "fastest",
) -> Calibration:
    """Probe the engine at ``url`` and fit ``base``'s step costs (its values are the
    priors)."""
    counts = ProbeCounts()
    samples: list[Sample] = []
    overheads: list[float] = []
    notes: list[str] = []
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        limits = await discover(client, url, base, **dict(given or {}))
        try:
            await client.post(url + "/reset_prefix_cache")  # a rerun's prompts hit otherwise
        except httpx.HTTPError:
            notes.append("POST /reset_prefix_cache failed; hits are read from the metrics")
        probes = design(limits, random.Random(seed))
        failures = 0
        for rep in range(repeats):
            for probe in probes:
                if probe.name == "warmup" and rep:
                    continue
                if rep:  # fresh prompts: the first round's are cached now
                    probe = reseed(probe, random.Random(seed * 1000 + rep), limits)
                m = await measure(client, url, model, probe, counts)
                if m is None:
                    failures += 1
                    if failures >= max_failures and counts.answered == 0:
                        notes.append(f"the engine answered none of {counts.sent} probes")
                        break
                    continue
                if probe.name != "warmup":
                    samples.extend(samples_of(probe, m, limits))
                    if len(probe.prompts) == 1 and math.isfinite(m.overhead_s):
                        overheads.append(m.overhead_s)
            else:
                continue
            break
    reduce = typical if estimate == "median" else fastest
    report = fit(reduce(samples), base.cost, min_samples=5)
    spread = repeat_spread(samples)
    if spread > NOISY_SPREAD:
        notes.append(
            f"repeats of one probe differ by {spread:.2f}x (median / fastest): the machine "
            "was busy; calibrate again when it is quiet"
        )
        log.warning("calibrate: %s", notes[-1])
    if overheads:
        overhead = max(0.0, statistics.median(overheads))
    else:
        overhead = base.request_overhead_s
        notes.append("request_overhead_s not measured (no queue/prefill histograms): prior")
    spec = replace(
        base,
        name=name or f"{base.name}-calibrated",
        cost=report.cost,
        max_num_batched_tokens=limits.max_num_batched_tokens,
        max_num_seqs=limits.max_num_seqs,
        max_model_len=limits.max_model_len,
        kv_capacity_tokens=limits.kv_capacity_tokens,
        calibrated=not report.fell_back,
        request_overhead_s=overhead,
        summary=f"calibrated by kvroute calibrate against {model} (seed {seed})",
    )
    if report.fell_back or report.from_prior or counts.failed:
        log.warning(
            "calibrate: %s; kept the priors of %s; probes failed: %s; samples rejected: %s",
            report.reason or "fitted",
            ", ".join(report.from_prior) or "none",
            dict(counts.failed) or "none",
            dict(report.rejected) or "none",
        )
    return Calibration(spec, limits, report, counts, notes, spread)


# --- the command --------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvroute calibrate",
        description="Measure one vLLM engine (on 127.0.0.1) and fit the replay's "
        "step-time model; writes a preset file for --preset-file.",
        epilog="example: kvroute calibrate --url http://127.0.0.1:8001 --model tiny-llama "
        "--base-preset cpu-tiny --out cpu-tiny.json",
    )
    a = p.add_argument
    a("--url", required=True, help="the engine's base URL, e.g. http://127.0.0.1:8001")
    a("--model", required=True, help="served model name")
    a("--out", required=True, help="preset file to write (JSON)")
    a("--base-preset", default="cpu-tiny", choices=sorted(PRESETS),
      help="preset giving the priors and the unmeasured limits (default cpu-tiny)")  # fmt: skip
    a("--name", default=None, help="the written preset's name (default BASE-calibrated)")
    a("--max-num-seqs", type=int, default=None, help="the engine's --max-num-seqs")
    a("--max-num-batched-tokens", type=int, default=None,
      help="the engine's --max-num-batched-tokens")  # fmt: skip
    a("--seed", type=int, default=None, help="probe prompts' seed (default: from the clock)")
    a("--repeats", type=int, default=3,
      help="rounds of the probe set, reduced by --repeat-estimate (default 3)")  # fmt: skip
    a("--repeat-estimate", choices=["fastest", "median"], default="fastest",
      help="reduce a probe's repeats to the fastest (the engine unloaded; default) or the "
      "median (under the machine's load)")  # fmt: skip
    a("--timeout", type=float, default=60.0, help="seconds per probe request (default 60)")
    return p


def _is_loopback(url: str) -> bool:
    host = httpx.URL(url).host
    return host in ("127.0.0.1", "localhost", "::1")


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if not _is_loopback(ns.url):
        print("kvroute calibrate: --url must be a loopback address", file=sys.stderr)
        return 2
    if ns.repeats < 1:
        print("kvroute calibrate: --repeats must be >= 1", file=sys.stderr)
        return 2
    seed = ns.seed if ns.seed is not None else time.time_ns() % 2**31
    given = {
        k: v
        for k, v in (
            ("max_num_seqs", ns.max_num_seqs),
            ("max_num_batched_tokens", ns.max_num_batched_tokens),
        )
        if v is not None
    }
    if any(v < 1 for v in given.values()):
        print("kvroute calibrate: limits must be >= 1", file=sys.stderr)
        return 2
    cal = asyncio.run(
        calibrate(
            ns.url.rstrip("/"),
            ns.model,
            PRESETS[ns.base_preset],
            seed=seed,
            repeats=ns.repeats,
            timeout_s=ns.timeout,
            name=ns.name,
            given=given,
            estimate=ns.repeat_estimate,
        )
    )
    try:
        data = spec_to_dict(
            cal.spec.validate(), block_size=cal.limits.block_size, calibration=cal.as_dict()
        )
        write_preset_file(ns.out, data)
    except (PresetError, OSError, ValueError) as exc:
        print(f"kvroute calibrate: {exc}", file=sys.stderr)
        return 1
    summary = {
        "out": ns.out,
        "seed": seed,
        "params": data["cost"],
        "fitted": cal.report.fitted,
        "from_prior": cal.report.from_prior,
        "request_overhead_s": round(cal.spec.request_overhead_s, 5),
        # what to set in the router for a fleet of this engine (policy: cost)
        "router_policy_params": {k: float(f"{v:.6g}") for k, v in cal.spec.cost_params().items()},
        "rel_rms_error": round(cal.report.rel_rms_error, 4),
        "repeat_spread": cal.as_dict()["repeat_spread"],
        "probes": cal.as_dict()["probes"],
    }
    print(json.dumps(summary))
    return 1 if cal.report.fell_back else 0


if __name__ == "__main__":
    raise SystemExit(main())
