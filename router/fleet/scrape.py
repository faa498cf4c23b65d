"""The scraped half of the load view: each pod's ``/metrics`` every ``scrape.interval_s``.

``vllm:num_requests_waiting``, ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``
(summed / averaged over engines), ``vllm:prefix_cache_hits_total`` (summed; what the
speculative entries are checked against, router/decision/learning.py) and
``vllm:cache_config_info{block_size=...}``; the first tokens and finished requests the
engine counted (scoring/unseen_first_tokens.py) and its inter-token latency and decode
time histograms (``Policy.on_scraped``).  A value
older than ``scrape.stale_after_s`` is reported as unknown (None), never as stale truth.
``max_model_len`` is learned from ``GET /v1/models`` on the same loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import httpx

from router.fleet.pods import PodRegistry
from router.logs import RateLimitedLog
from scoring.policies.base import PodCounters

log = logging.getLogger(__name__)


_NO_COUNTERS = PodCounters()


@dataclass(slots=True)
class Scraped:
    """One pod's last successful scrape."""

    at: float  # time.monotonic() of the scrape
    waiting: int | None = None
    running: int | None = None
    kv_usage: float | None = None
    block_size: int | None = None
    #: the KV cache's size in blocks (``num_gpu_blocks``)
    capacity_blocks: int | None = None
    #: ``vllm:prefix_cache_hits_total``: prompt tokens served from the prefix cache, ever
    prefix_hits: float | None = None
    #: ``vllm:time_to_first_token_seconds_count``: first tokens out of the engine, ever
    #: (observed at the first token, not at the end: scoring/unseen_first_tokens.py)
    first_tokens: float | None = None
    #: ``vllm:request_success_total`` (every finished reason): requests finished, ever
    finished: float | None = None
    #: what a policy reads of the engine's histograms (``Policy.on_scraped``)
    counters: PodCounters = _NO_COUNTERS


_INF = float("inf")
#: histogram and counter series summed over the pod's engines and labels, by name: the
#: Scraped field (or PodCounters field) each feeds.  A negative or non-finite sample
#: leaves its field unknown (it is optional: the scrape stands)
_SUMS = {
    "vllm:time_to_first_token_seconds_count": "first_tokens",
    "vllm:request_success_total": "finished",
    "vllm:inter_token_latency_seconds_sum": "itl_sum_s",
    "vllm:inter_token_latency_seconds_count": "itl_count",
    # its name before vLLM 0.10 (the same samples)
    "vllm:time_per_output_token_seconds_sum": "tpot_sum_s",
    "vllm:time_per_output_token_seconds_count": "tpot_count",
    "vllm:request_decode_time_seconds_sum": "decode_sum_s",
    "vllm:request_decode_time_seconds_count": "decode_count",
}
#: the series a policy reads as counts or shares: a negative or non-finite sample of one
#: fails the scrape (counted, and the pod's scraped view goes unknown when it is stale)
_COUNTS = frozenset(
    {
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:prefix_cache_hits_total",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
    }
)


def parse_vllm_metrics(text: str) -> Scraped:
    """Pick the routing-relevant series out of a Prometheus text exposition.

    Sums ``num_requests_waiting/running`` and ``prefix_cache_hits_total`` over engines,
    averages ``kv_cache_usage_perc`` (older engines call it ``gpu_cache_usage_perc``),
    takes ``block_size`` and ``num_gpu_blocks`` (the cache's capacity) from the labels of
    ``vllm:cache_config_info`` (summed over engines: data-parallel engines each have
    their own cache).  Raises ValueError on a negative or non-finite sample of those
    series: a publisher that says -3 requests wait must not make its pod look idle.
    """
    waiting = running = 0.0
    seen_w = seen_r = False
    usage: list[float] = []
    block_size: int | None = None
    capacity = 0
    hits = 0.0
    seen_h = False
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name_end = line.find("{")
        if name_end < 0:
            name_end = line.find(" ")
            labels = ""
            rest = line[name_end:]
        else:
            close = line.rfind("}")
            labels = line[name_end + 1 : close]
            rest = line[close + 1 :]
        name = line[:name_end]
        parts = rest.split()
        if not parts:
            continue
        try:
            value = float(parts[0])
        except ValueError:
            continue
        if name in _COUNTS and not 0.0 <= value < _INF:  # (NaN fails too)
            raise ValueError(f"{name} is {parts[0]}: not a count")
        field = _SUMS.get(name)
        if field is not None:
            sums[field] = sums.get(field, 0.0) + (value if 0.0 <= value < _INF else math.nan)
        elif name == "vllm:num_requests_waiting":
            waiting += value
            seen_w = True
        elif name == "vllm:num_requests_running":
            running += value
            seen_r = True
        elif name == "vllm:prefix_cache_hits_total":
            hits += value
            seen_h = True
        elif name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
            usage.append(value)
        elif name == "vllm:cache_config_info":
            bs = _label(labels, "block_size")
            if bs is not None and bs.isdigit() and int(bs) > 0:
                block_size = int(bs)
            blocks = _label(labels, "num_gpu_blocks")
            if blocks is not None and blocks.isdigit():
                capacity += int(blocks)
    known = {k: v for k, v in sums.items() if v == v}  # (NaN: a bad sample among them)
    if "itl_count" not in known and "tpot_count" in known:
        known["itl_sum_s"] = known.get("tpot_sum_s", math.nan)
        known["itl_count"] = known["tpot_count"]
    run = int(running) if seen_r else None
    return Scraped(
        at=time.monotonic(),
        waiting=int(waiting) if seen_w else None,
        running=run,
        kv_usage=(sum(usage) / len(usage)) if usage else None,
        block_size=block_size,
        capacity_blocks=capacity or None,
        prefix_hits=hits if seen_h else None,
        first_tokens=known.get("first_tokens"),
        finished=known.get("finished"),
        counters=PodCounters(
            running=run,
            itl_sum_s=known.get("itl_sum_s"),
            itl_count=known.get("itl_count"),
            decode_sum_s=known.get("decode_sum_s"),
            decode_count=known.get("decode_count"),
        ),
    )


def _label(labels: str, key: str) -> str | None:
    needle = key + '="'
    i = labels.find(needle)
    while i > 0 and labels[i - 1] not in ", ":
        i = labels.find(needle, i + 1)
    if i < 0:
        return None
    start = i + len(needle)
    end = labels.find('"', start)
    return labels[start:end] if end >= 0 else None


class MetricsScraper:
    """Scrapes every registered pod's /metrics on an interval (one task for all pods)."""

    def __init__(
        self,
        registry: PodRegistry,
        client: httpx.AsyncClient,
        *,
        interval_s: float,
        timeout_s: float,
        stale_after_s: float,
        on_error: Callable[[str], None] | None = None,
        models_every: int = 10,
        on_scraped: Callable[[str, Scraped], None] | None = None,
    ) -> None:
        self.registry = registry
        self.client = client
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.stale_after_s = stale_after_s
        self.on_error = on_error
        #: called with every successful scrape (the speculative entries' hit check)
        self.on_scraped = on_scraped
        self.models_every = models_every
        self._log = RateLimitedLog(log)
        self._scraped: dict[str, Scraped] = {}
        #: pod -> {model id: max_model_len} from /v1/models
        self.max_model_len: dict[str, dict[str, int]] = {}
        #: LoRA adapter id -> base model id (the ``parent`` field of /v1/models)
        self.parents: dict[str, str] = {}
        #: LoRA adapter id -> the path the pod loaded it from (the ``root`` field of
        #: /v1/models; vLLM hashes it into every block of the adapter's requests)
        self.adapter_paths: dict[str, str] = {}
        self._rounds = 0
        #: bumped whenever what the request path derives per model may change (a pod's
        #: block size, max_model_len or adapter parents learned or forgotten)
        self.version = 0
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    # reading ---------------------------------------------------------------------------

    def get(self, pod: str, now: float | None = None) -> Scraped | None:
        """The pod's scraped values, or None when never scraped or stale."""
        s = self._scraped.get(pod)
        if s is None:
            return None
        if (now if now is not None else time.monotonic()) - s.at > self.stale_after_s:
            return None
        return s

    def cache_config(self, pod: str) -> Scraped | None:
        """The pod's last successful scrape, however old: what the KV-event checks read
        (its cache size and block size change only when its engine restarts)."""
        return self._scraped.get(pod)

    def fresh(self) -> Callable[[str], Scraped | None]:
        """:meth:`get` at one instant, for reading several pods (one clock read)."""
        scraped = self._scraped
        oldest = time.monotonic() - self.stale_after_s

        def get(pod: str) -> Scraped | None:
            s = scraped.get(pod)
            return s if s is not None and s.at >= oldest else None

        return get

    def block_size(self, pods: Iterable[str]) -> int | None:
        """The block size the given pods report (the first fresh one; they should agree)."""
        for p in pods:
            s = self._scraped.get(p)
            if s is not None and s.block_size:
                return s.block_size
        return None

    def model_max_len(self, model: str, pods: Iterable[str]) -> int | None:
        known = self.max_model_len
        out: int | None = None
        for p in pods:
            lens = known.get(p)
            n = lens.get(model) if lens is not None else None
            if n and (out is None or n < out):
                out = n
        return out

    # running ---------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kvroute-metrics-scraper")

    def trigger(self) -> None:
        """Scrape now (e.g. a pod was added) instead of waiting for the interval."""
        self._wake.set()

    def forget(self, pod: str) -> None:
        self._scraped.pop(pod, None)
        self.max_model_len.pop(pod, None)
        self.version += 1

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            try:
                await self.scrape_all()
            except Exception:  # never let one bad round kill the loop
                self._log.exception("round", "metrics scrape round failed")
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_s)

    async def scrape_all(self) -> None:
        pods = self.registry.all()
        with_models = self._rounds % self.models_every == 0
        self._rounds += 1
        await asyncio.gather(*(self._scrape(p.spec.name, p.spec.url, with_models) for p in pods))

    async def _scrape(self, pod: str, url: str, with_models: bool) -> None:
        try:
            r = await self.client.get(url.rstrip("/") + "/metrics", timeout=self.timeout_s)
            r.raise_for_status()
            scraped = parse_vllm_metrics(r.text)
            old = self._scraped.get(pod)
            self._scraped[pod] = scraped
            if old is None or old.block_size != scraped.block_size:
                self.version += 1
        except Exception as exc:
            log.debug("scrape of %s failed: %s", pod, exc)
            if self.on_error is not None:
                self.on_error(pod)
            return
        if self.on_scraped is not None:
            try:
                self.on_scraped(pod, scraped)
            except Exception:  # a listener's bug is not a failed scrape
                log.exception("scrape listener failed for %s", pod)
        if with_models or pod not in self.max_model_len:
            await self._scrape_models(pod, url)

    async def _scrape_models(self, pod: str, url: str) -> None:
        try:
            r = await self.client.get(url.rstrip("/") + "/v1/models", timeout=self.timeout_s)
            r.raise_for_status()
            data: Any = r.json().get("data", [])
            lens = {
                str(m["id"]): int(m["max_model_len"])
                for m in data
                if isinstance(m, dict) and m.get("id") and m.get("max_model_len")
            }
            if self.max_model_len.get(pod) != lens:
                self.max_model_len[pod] = lens
                self.version += 1
            for m in data:
                if isinstance(m, dict) and m.get("parent") and m.get("id") != m.get("parent"):
                    adapter, parent = str(m["id"]), str(m["parent"])
                    if self.parents.get(adapter) != parent:
                        self.parents[adapter] = parent
                        self.version += 1
                    root = m.get("root")
                    if isinstance(root, str) and root and root != adapter:
                        self.adapter_paths[adapter] = root
        except Exception as exc:
            log.debug("/v1/models of %s failed: %s", pod, exc)
