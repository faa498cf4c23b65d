"""One ``/metrics`` for all the worker processes of `kvroute serve --workers N`.

uvicorn's workers share the listening socket, so a scrape reaches one of them; each has
its own registry.  With N > 1, `kvroute serve` makes a directory (``$KVROUTE_METRICS_
SHARE_DIR``) and every worker writes its exposition there every ``SHARE_INTERVAL_S``
(atomically: a temporary file renamed).  The worker that answers a scrape renders its
own registry afresh and merges the other workers' files (those written in the last
``STALE_AFTER_S``: a dead worker's numbers leave with it) into one exposition:

* counters and histograms of the request path (requests, tokens, retries, errors,
  latencies): summed over the workers -- each counted the requests it served;
* counters of loops every worker runs for itself over the same inputs (KV events,
  health checks, pod scrapes): the largest -- every worker saw the same events, and a
  sum would count each one N times;
* gauges: the largest (the workers' index sizes, pod health and event lag describe the
  same fleet), except in-flight requests, which add up;
* ``_created`` timestamps: the earliest.

Another worker's numbers are at most ``SHARE_INTERVAL_S`` old; scrape less often than
that (Prometheus' usual 15 s is fine) so a counter never appears to go back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

#: the environment variable naming the directory the workers share
ENV = "KVROUTE_METRICS_SHARE_DIR"
#: seconds between two writes of a worker's exposition
SHARE_INTERVAL_S = 1.0
#: a worker's file older than this is left out (the worker is gone)
STALE_AFTER_S = 10.0

#: families counted by loops each worker runs on its own over the same inputs
_PER_WORKER_LOOPS = ("kvroute_event", "kvroute_health_", "kvroute_scrape_errors")
#: gauges whose per-worker values add up (each worker holds its own speculative entries)
_SUM_GAUGES = frozenset({"kvroute_inflight_requests", "kvroute_speculative_entries"})


def _adds_up(family: Any) -> bool:
    """Whether a family's samples are summed over workers (else the largest is kept)."""
    if family.type == "gauge":
        return bool(family.name in _SUM_GAUGES)
    if family.type in ("counter", "histogram", "summary"):
        return not family.name.startswith(_PER_WORKER_LOOPS)
    return False


def merge(texts: Iterable[str]) -> bytes:
    """Prometheus text expositions of the workers -> one exposition (rules: module)."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for text in texts:
        for fam in text_string_to_metric_families(text):
            if fam.name not in families:
                families[fam.name] = Metric(fam.name, fam.documentation, fam.type)
                values[fam.name] = {}
            into = values[fam.name]
            add = _adds_up(fam)
            for s in fam.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                old = into.get(key)
                if old is None:
                    into[key] = s.value
                elif s.name.endswith("_created"):
                    into[key] = min(old, s.value)
                elif add:
                    into[key] = old + s.value
                else:
                    into[key] = max(old, s.value)
    for name, metric in families.items():
        for (sample, labels), value in values[name].items():
            metric.add_sample(sample, dict(labels), value)
    return generate_latest(_Families(list(families.values())))


class _Families:
    """What ``generate_latest`` needs of a registry: ``collect()``."""

    def __init__(self, metrics: list[Metric]) -> None:
        self._metrics = metrics

    def collect(self) -> list[Metric]:
        return self._metrics


class SharedMetrics:
    """This worker's side: publish its exposition, and answer a scrape for all."""

    def __init__(self, directory: Path, render: Callable[[], bytes]) -> None:
        self.directory = directory
        self.render = render
        self.path = directory / f"{os.getpid()}.prom"

    @classmethod
    def from_env(cls, render: Callable[[], bytes]) -> SharedMetrics | None:
        where = os.environ.get(ENV)
        return cls(Path(where), render) if where else None

    def publish(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_bytes(self.render())
        tmp.replace(self.path)

    async def run(self) -> None:
        """Publish every :data:`SHARE_INTERVAL_S` until cancelled (a failed write is
        logged and retried)."""
        while True:
            try:
                self.publish()
            except OSError as exc:
                log.warning("sharing this worker's metrics in %s: %s", self.directory, exc)
            await asyncio.sleep(SHARE_INTERVAL_S)

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            self.path.unlink()

    def others(self) -> list[str]:
        """The other live workers' expositions."""
        now = time.time()
        texts = []
        for path in self.directory.glob("*.prom"):
            if path == self.path:
                continue
            try:
                if now - path.stat().st_mtime > STALE_AFTER_S:
                    continue
                texts.append(path.read_text())
            except OSError:  # the worker removed it meanwhile
                continue
        return texts

    def render_all(self) -> bytes:
        """This worker's registry now, merged with the other workers' latest."""
        return merge([self.render().decode(), *self.others()])
