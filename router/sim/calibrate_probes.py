"""The probes of ``kvroute calibrate`` (:mod:`router.sim.calibrate`): their design, how
one is measured from the engine's ``/metrics`` deltas, and the fit samples it gives.

See :mod:`router.sim.calibrate` for the procedure; this module holds its parts.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import httpx
from prometheus_client.parser import text_string_to_metric_families

from scoring.replay.calibrate_fit import Sample
from scoring.replay.presets import EngineSpec
from scoring.replay.step_cost import StepWork, features, prefill_pairs

PREFILL_S = "vllm:request_prefill_time_seconds"
DECODE_S = "vllm:request_decode_time_seconds"
QUEUE_S = "vllm:request_queue_time_seconds"
HITS = "vllm:prefix_cache_hits"
DECODE_OUTPUT = 32  # output tokens of a decode probe
CACHED_SUFFIX = 64  # new tokens after a cached prefix
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


def reseed(probe: Probe, rng: random.Random, limits: Limits) -> Probe:
    """``probe`` with fresh random prompts of the same shape (same cached prefix length)."""

    def fresh(p: list[int]) -> list[int]:
        return [rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in p]

    if probe.expected_hit:  # a cached probe: its prefix (cached in round 1), new tokens
        p = probe.prompts[0]
        return replace(probe, prompts=[p[: probe.expected_hit] + fresh(p[probe.expected_hit :])])
    return replace(probe, prompts=[fresh(p) for p in probe.prompts])
