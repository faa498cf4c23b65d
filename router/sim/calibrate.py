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
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from scoring.replay.calibrate_fit import FitReport, Sample, fastest, fit, repeat_spread
from scoring.replay.preset_file import spec_to_dict, write_preset_file
from scoring.replay.presets import PRESETS, EngineSpec, PresetError
from scoring.replay.step_cost import StepWork, features, prefill_pairs

log = logging.getLogger("kvroute.calibrate")

PREFILL_S = "vllm:request_prefill_time_seconds"
DECODE_S = "vllm:request_decode_time_seconds"
QUEUE_S = "vllm:request_queue_time_seconds"
HITS = "vllm:prefix_cache_hits"
DECODE_OUTPUT = 32  # output tokens of a decode probe
CACHED_SUFFIX = 64  # new tokens after a cached prefix
NOISY_SPREAD = 1.5  # repeat_spread above this: warn that the machine was busy
TOKEN_LOW, TOKEN_HIGH = 100, 4000  # ids valid in tiny-llama's 4096-token vocabulary


@dataclass(frozen=True, slots=True)
class Limits:
    """The engine's scheduling limits and cache shape."""

    block_size: int
    max_model_len: int
    kv_capacity_tokens: int
    max_num_batched_tokens: int
    max_num_seqs: int


@dataclass(slots=True)
class Probe:
    """``k`` concurrent requests of ``prompts`` (token ids) generating ``output`` tokens."""

    name: str
    prompts: list[list[int]]
    output: int
    expected_hit: int = 0  # tokens the probe expects cached (per request)
    prefill_sample: bool = True
    decode_sample: bool = False


@dataclass(slots=True)
class Measured:
    """What one answered probe measured (per request means)."""

    prefill_s: float = math.nan
    decode_s: float = math.nan
    hit_tokens: float = math.nan
    source: str = "metrics"
    #: client TTFT - the engine's queue + prefill time: the API server's share
    overhead_s: float = math.nan


@dataclass(slots=True)
class ProbeCounts:
    sent: int = 0
    answered: int = 0
    failed: Counter[str] = field(default_factory=Counter)


# --- the engine's metrics -----------------------------------------------------------


def scrape_values(text: str) -> dict[str, float]:
    """Sum of every sample of each sample name (over label sets) in Prometheus text."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + float(s.value)
    return out


def _counter(values: Mapping[str, float], name: str) -> float | None:
    for key in (name + "_total", name):
        if key in values:
            return values[key]
    return None


async def _scrape(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    try:
        r = await client.get(url + "/metrics")
        r.raise_for_status()
        return scrape_values(r.text)
    except (httpx.HTTPError, ValueError):
        return {}


async def discover(client: httpx.AsyncClient, url: str, base: EngineSpec, **given: int) -> Limits:
    """The engine's limits: ``/v1/models`` and ``vllm:cache_config_info``, then ``given``
    flags, then the base preset's."""
    max_model_len = base.max_model_len
    block_size, kv_tokens = 16, base.kv_capacity_tokens
    try:
        models = (await client.get(url + "/v1/models")).json()
        max_model_len = int(models["data"][0].get("max_model_len") or max_model_len)
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        pass
    try:
        text = (await client.get(url + "/metrics")).text
        for fam in text_string_to_metric_families(text):
            if fam.name == "vllm:cache_config_info":
                labels = fam.samples[0].labels
                block_size = int(labels.get("block_size", block_size))
                kv_tokens = int(labels.get("kv_cache_size_tokens") or kv_tokens)
    except (httpx.HTTPError, ValueError, IndexError):
        pass
    return Limits(
        block_size=given.get("block_size") or block_size,
        max_model_len=given.get("max_model_len") or max_model_len,
        kv_capacity_tokens=given.get("kv_capacity_tokens") or kv_tokens,
        max_num_batched_tokens=given.get("max_num_batched_tokens") or base.max_num_batched_tokens,
        max_num_seqs=given.get("max_num_seqs") or base.max_num_seqs,
    )


# --- the probes ---------------------------------------------------------------------


def design(limits: Limits, rng: random.Random) -> list[Probe]:
    """The probe set for an engine with ``limits`` (see the module docstring)."""

    def ids(n: int) -> list[int]:
        return [rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(n)]

    top = limits.max_model_len - 2  # leaves room for one output token
    probes = [Probe("warmup", [ids(64)], 4, prefill_sample=False)]
    lengths = sorted({n for n in (32, 128, 512, 1024, 1536, 2000, 4000, 8000) if n <= top})
    chunked = min(top, 2 * limits.max_num_batched_tokens)
    if limits.max_num_batched_tokens < top and chunked not in lengths:  # one chunked prompt
        lengths.append(chunked)
    cached: list[list[int]] = []
    for n in lengths:
        p = ids(n)
        probes.append(Probe(f"prefill/{n}", [p], 1))
        if n >= 512 and n + CACHED_SUFFIX <= top:
            cached.append(p)
    bs = limits.block_size
    for p in cached:
        hit = len(p) // bs * bs
        probes.append(
            Probe(f"cached/{hit}+{CACHED_SUFFIX}", [p[:hit] + ids(CACHED_SUFFIX)], 1, hit)
        )
    room = limits.max_model_len - DECODE_OUTPUT - 1
    for k in sorted({1, 2, 4, limits.max_num_seqs}):
        if k > limits.max_num_seqs:
            continue
        for n in (32, 512):
            n = min(n, limits.max_num_batched_tokens // k, room)
            if n < 1:
                continue
            probes.append(
                Probe(
                    f"decode/{k}x{n}",
                    [ids(n) for _ in range(k)],
                    DECODE_OUTPUT,
                    prefill_sample=False,
                    decode_sample=True,
                )
            )
    return probes


async def _one(
    client: httpx.AsyncClient, url: str, model: str, prompt: list[int], output: int
) -> tuple[float, float]:
    """Stream one completion; (seconds to first token, seconds first -> last token)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
    }
    t0 = time.perf_counter()
    first = last = math.nan
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            now = time.perf_counter()
            if math.isnan(first):
                first = now
            last = now
    if math.isnan(first):
        raise ValueError("the stream carried no token")
    return first - t0, last - first


async def measure(
    client: httpx.AsyncClient, url: str, model: str, probe: Probe, counts: ProbeCounts
) -> Measured | None:
    """Run ``probe`` alone; ``None`` when the engine did not answer it."""
    before = await _scrape(client, url)
    counts.sent += 1
    calls = [_one(client, url, model, p, probe.output) for p in probe.prompts]
    results = await asyncio.gather(*calls, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        counts.failed[type(errors[0]).__name__] += 1
        return None
    counts.answered += 1
    after = await _scrape(client, url)
    times = [r for r in results if not isinstance(r, BaseException)]
    k = len(probe.prompts)
    m = Measured()

    def delta(name: str) -> float | None:
        a, b = after.get(name), before.get(name)
        return None if a is None or b is None else a - b

    pre_sum, pre_n = delta(PREFILL_S + "_sum"), delta(PREFILL_S + "_count")
    dec_sum, dec_n = delta(DECODE_S + "_sum"), delta(DECODE_S + "_count")
    queue_sum = delta(QUEUE_S + "_sum")
    if pre_sum is not None and pre_n == k and dec_sum is not None and dec_n == k:
        m.prefill_s, m.decode_s = pre_sum / k, dec_sum / k
        if queue_sum is not None:
            m.overhead_s = sum(t[0] for t in times) / k - m.prefill_s - queue_sum / k
    else:
        m.source = "client"
        m.prefill_s = sum(t[0] for t in times) / k
        m.decode_s = sum(t[1] for t in times) / k
    hits_b, hits_a = _counter(before, HITS), _counter(after, HITS)
    if hits_a is not None and hits_b is not None:
        m.hit_tokens = (hits_a - hits_b) / k
    return m


def prefill_row(prompt: int, hit: int, budget: int) -> tuple[float, ...]:
    """Summed feature rows of prefilling ``prompt`` tokens after ``hit`` cached ones,
    alone, in chunks of at most ``budget`` tokens (one step each)."""
    rows = [0.0] * 5
    done = hit
    while done < prompt:
        n = min(budget, prompt - done)
        for i, x in enumerate(features(StepWork(n, prefill_pairs(done, n)))):
            rows[i] += x
        done += n
    return tuple(rows)


def decode_row(k: int, prompt: int, output: int) -> tuple[float, ...]:
    """Summed rows of the ``output - 1`` decode steps of ``k`` requests of ``prompt``
    tokens decoding together (step ``j`` attends ``prompt + j`` tokens per request)."""
    steps = output - 1
    context = k * (steps * prompt + steps * (steps + 1) // 2)
    return (float(steps), 0.0, 0.0, float(k * steps), float(context))


def samples_of(probe: Probe, m: Measured, limits: Limits) -> list[Sample]:
    """The fit samples ``m`` gives (per request: a prefill and/or a decode sample)."""
    out: list[Sample] = []
    n = len(probe.prompts[0])
    hit = probe.expected_hit if math.isnan(m.hit_tokens) else m.hit_tokens
    if not math.isfinite(hit) or hit < 0:
        return [Sample((math.nan,) * 5, m.prefill_s, probe.name, m.source)]
    hit = round(hit)
    if probe.prefill_sample:
        row = prefill_row(n, min(hit, n - 1), limits.max_num_batched_tokens)
        out.append(Sample(row, m.prefill_s, probe.name, m.source))
    if probe.decode_sample and probe.output > 1:
        row = decode_row(len(probe.prompts), n, probe.output)
        out.append(Sample(row, m.decode_s, probe.name + "/decode", m.source))
    return out


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
                    probe = _reseed(probe, random.Random(seed * 1000 + rep), limits)
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
    report = fit(fastest(samples), base.cost, min_samples=5)
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


def _reseed(probe: Probe, rng: random.Random, limits: Limits) -> Probe:
    """``probe`` with fresh random prompts of the same shape (same cached prefix length)."""

    def fresh(p: list[int]) -> list[int]:
        return [rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in p]

    if probe.expected_hit:  # a cached probe: its prefix (cached in round 1), new tokens
        p = probe.prompts[0]
        return replace(probe, prompts=[p[: probe.expected_hit] + fresh(p[probe.expected_hit :])])
    return replace(probe, prompts=[fresh(p) for p in probe.prompts])


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
      help="rounds of the probe set; the fastest of each probe is fitted (default 3)")  # fmt: skip
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
        "rel_rms_error": round(cal.report.rel_rms_error, 4),
        "repeat_spread": cal.as_dict()["repeat_spread"],
        "probes": cal.as_dict()["probes"],
    }
    print(json.dumps(summary))
    return 1 if cal.report.fell_back else 0


if __name__ == "__main__":
    raise SystemExit(main())
