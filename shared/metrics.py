"""A minimal Prometheus metrics registry: counters, gauges, histograms, text exposition.

Every service serves `/metrics` in the Prometheus text format (version 0.0.4). This
module is the small, dependency-free registry they share:

    registry = Registry()
    seen = registry.counter("trainmover_heartbeats_total", "Heartbeats received", ["job"])
    seen.inc(job="job1")
    text = registry.render()          # the body of GET /metrics

Label values are escaped as the format requires; a metric's label names are fixed at
creation, and every sample must give exactly those labels.
"""

from __future__ import annotations

import bisect
import math
import re
import threading
from collections.abc import Iterable, Sequence

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")

DEFAULT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

LabelKey = tuple[str, ...]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        if not _NAME.match(name):
            raise ValueError(f"invalid metric name {name!r}")
        for label in labels:
            if not _LABEL.match(label) or label == "le":
                raise ValueError(f"invalid label name {label!r} for {name}")
        self.name = name
        self.help = help_text
        self.label_names = tuple(labels)
        # Metrics are updated from the event loop and read by a scrape, possibly from
        # another thread (a benchmark or a test); a lock keeps a scrape consistent.
        self._lock = threading.Lock()

    def _key(self, labels: dict[str, str]) -> LabelKey:
        if set(labels) != set(self.label_names):
            raise ValueError(
                f"{self.name} takes labels {list(self.label_names)}, got {sorted(labels)}"
            )
        return tuple(str(labels[n]) for n in self.label_names)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {_escape(self.help)}", f"# TYPE {self.name} {self.kind}"]

    def samples(self) -> list[str]:
        raise NotImplementedError


class _Valued(_Metric):
    """One number per label set (what counters and gauges share)."""

    def __init__(
        self, name: str, help_text: str, labels: Sequence[str] = (), start_at_zero: bool = False
    ) -> None:
        super().__init__(name, help_text, labels)
        self._values: dict[LabelKey, float] = {(): 0.0} if start_at_zero and not labels else {}

    def _add(self, amount: float, labels: dict[str, str]) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        with self._lock:
            return self._values.get(self._key(labels), 0.0)

    def samples(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        return [f"{self.name}{_labels(self.label_names, k)} {_number(v)}" for k, v in items]


class Counter(_Valued):
    """A value that only goes up (events, requests, heartbeats)."""

    kind = "counter"

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        # An unlabelled series exists from the start, at zero (Prometheus convention).
        super().__init__(name, help_text, labels, start_at_zero=True)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError(f"counter {self.name} cannot decrease")
        self._add(amount, labels)


class Gauge(_Valued):
    """A value that goes up and down (machines up, queue depth)."""

    kind = "gauge"

    def set(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = float(value)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        self._add(amount, labels)

    def dec(self, amount: float = 1.0, **labels: str) -> None:
        self._add(-amount, labels)

    def remove(self, **labels: str) -> None:
        """Drops a label set (e.g. a job no longer watched) from the exposition."""
        with self._lock:
            self._values.pop(self._key(labels), None)


class Histogram(_Metric):
    """Observations counted into cumulative buckets, with their sum and count."""

    kind = "histogram"

    def __init__(
        self,
        name: str,
        help_text: str,
        labels: Sequence[str] = (),
        buckets: Iterable[float] = DEFAULT_BUCKETS,
    ) -> None:
        super().__init__(name, help_text, labels)
        self.buckets = tuple(sorted(float(b) for b in buckets if not math.isinf(b)))
        self._counts: dict[LabelKey, list[int]] = {}
        self._sums: dict[LabelKey, float] = {}
        if not labels:  # exists from the start, empty (Prometheus convention)
            self._counts[()] = [0] * (len(self.buckets) + 1)
            self._sums[()] = 0.0

    def observe(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            counts = self._counts.setdefault(key, [0] * (len(self.buckets) + 1))
            # One slot per bucket plus +Inf; cumulated at render time.
            counts[bisect.bisect_left(self.buckets, value)] += 1
            self._sums[key] = self._sums.get(key, 0.0) + value

    def count(self, **labels: str) -> int:
        with self._lock:
            return sum(self._counts.get(self._key(labels), []))

    def samples(self) -> list[str]:
        out = []
        with self._lock:
            items = sorted((k, list(v), self._sums[k]) for k, v in self._counts.items())
        for key, counts, total in items:
            running = 0
            for bound, n in zip((*self.buckets, math.inf), counts, strict=True):
                running += n
                le = f'le="{_number(bound)}"'
                out.append(f"{self.name}_bucket{_labels(self.label_names, key, le)} {running}")
            out.append(f"{self.name}_sum{_labels(self.label_names, key)} {_number(total)}")
            out.append(f"{self.name}_count{_labels(self.label_names, key)} {running}")
        return out


class Registry:
    """The metrics of one service, rendered together for `/metrics`."""

    def __init__(self) -> None:
        self._metrics: dict[str, _Metric] = {}

    def _add(self, metric: _Metric) -> None:
        if metric.name in self._metrics:
            raise ValueError(f"metric {metric.name} registered twice")
        self._metrics[metric.name] = metric

    def counter(self, name: str, help_text: str, labels: Sequence[str] = ()) -> Counter:
        metric = Counter(name, help_text, labels)
        self._add(metric)
        return metric

    def gauge(self, name: str, help_text: str, labels: Sequence[str] = ()) -> Gauge:
        metric = Gauge(name, help_text, labels)
        self._add(metric)
        return metric

    def histogram(
        self,
        name: str,
        help_text: str,
        labels: Sequence[str] = (),
        buckets: Iterable[float] = DEFAULT_BUCKETS,
    ) -> Histogram:
        metric = Histogram(name, help_text, labels, buckets)
        self._add(metric)
        return metric

    def render(self) -> str:
        """The registry in the Prometheus text exposition format."""
        lines: list[str] = []
        for metric in self._metrics.values():
            lines += metric.header()
            lines += metric.samples()
        return "\n".join(lines) + "\n"


def parse_text(text: str) -> dict[str, float]:
    """Parses exposition text into {'name{labels}': value}; for tests and benchmarks."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        sample, _, value = line.rpartition(" ")
        out[sample] = float(value)
    return out
