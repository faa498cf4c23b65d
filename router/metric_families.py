"""Metric families for the request path (:class:`HotFamily`): counters, gauges and
histograms exported in the Prometheus text format as prometheus_client's are, without
its per-call lock, label validation and created-timestamp series; and a collector whose
families a callable gives at scrape time (:class:`CallbackCollector`).  The event loop
is the only writer."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class _Value:
    """One labelled counter / gauge value.  The event loop is the only writer, so a
    plain float does (prometheus_client takes a lock and validates on every call)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = float(value)


class _Buckets:
    """One labelled histogram: ``counts[i]`` observations with ``bounds[i-1] < v <=
    bounds[i]`` (the last slot is +Inf), found by one bisection."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value


class HotFamily(Collector):
    """A counter, gauge or histogram family for the request path, exported in the
    Prometheus text format like prometheus_client's (``labels(...)``, ``remove(...)``,
    ``inc``/``dec``/``set``/``observe`` on the children), without its per-call lock,
    label validation and created-timestamp series."""

    def __init__(
        self,
        kind: str,
        name: str,
        doc: str,
        labelnames: tuple[str, ...] = (),
        buckets: tuple[float, ...] = (),
    ) -> None:
        if kind not in ("counter", "gauge", "histogram"):
            raise ValueError(f"unknown metric kind {kind!r}")
        self.kind = kind
        self.name = name
        self.doc = doc
        self.labelnames = labelnames
        self.buckets = tuple(sorted(buckets))
        self._children: dict[tuple[str, ...], Any] = {}
        if not labelnames:
            self.labels()  # exported from the start, as prometheus_client does

    def labels(self, *values: str) -> Any:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {values}")
            child = self._children[values] = (
                _Buckets(self.buckets) if self.kind == "histogram" else _Value()
            )
        return child

    def remove(self, *values: str) -> None:
        del self._children[values]

    def remove_where(self, label: str, value: str) -> int:
        """Drop every child whose ``label`` is ``value`` (a departed pod's series);
        returns how many."""
        i = self.labelnames.index(label)
        gone = [k for k in self._children if k[i] == value]
        for k in gone:
            del self._children[k]
        return len(gone)

    # the label-less family is its own only child
    def inc(self, amount: float = 1.0) -> None:
        self.labels().inc(amount)

    def dec(self, amount: float = 1.0) -> None:
        self.labels().dec(amount)

    def set(self, value: float) -> None:
        self.labels().set(value)

    def observe(self, value: float) -> None:
        self.labels().observe(value)

    def collect(self) -> Iterable[Metric]:
        names = list(self.labelnames)
        items = list(self._children.items())
        if self.kind == "histogram":
            hist = HistogramMetricFamily(self.name, self.doc, labels=names)
            for labels, h in items:
                total = 0
                cumulative = []
                for bound, n in zip([*h.bounds, float("inf")], h.counts, strict=True):
                    total += n
                    cumulative.append((floatToGoString(bound), total))
                hist.add_metric(list(labels), cumulative, h.sum)
            yield hist
            return
        cls = CounterMetricFamily if self.kind == "counter" else GaugeMetricFamily
        fam = cls(self.name, self.doc, labels=names)
        for labels, v in items:
            fam.add_metric(list(labels), v.value)
        yield fam

    def describe(self) -> Iterable[Metric]:
        return []


class CallbackCollector(Collector):
    """Families read from ``fn`` at each scrape."""

    def __init__(self, fn: Callable[[], Iterable[Metric]]) -> None:
        self._fn = fn

    def collect(self) -> Iterable[Metric]:
        return list(self._fn())
