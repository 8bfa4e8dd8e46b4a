"""The services' Prometheus metrics, on `prometheus_client`.

Each service keeps its metrics in its own `Registry` (a prometheus_client
CollectorRegistry, so tests and several services can live in one process) and serves
`render(registry)` at /metrics:

    registry = Registry()
    seen = registry.counter("trainmover_heartbeats_total", "Heartbeats received", ["job"])
    seen.labels(job="job1").inc()
    body = render(registry)           # the body of GET /metrics

The names and labels each service declares are the public contract
(trainmover.metric_names); `Registry.declared` lists them for the contract tests.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.parser import text_string_to_metric_families

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
"""The text format every Prometheus reads (what `render` writes)."""

# `<name>_created` series double every counter and histogram; nothing here reads them.
prometheus_client.disable_created_metrics()


class Registry(CollectorRegistry):
    """One service's metrics, with the names and labels it declared."""

    def __init__(self) -> None:
        super().__init__(auto_describe=True)
        self.declared: dict[str, tuple[str, ...]] = {}

    def _declare(self, name: str, labels: Sequence[str]) -> None:
        if name in self.declared:
            raise ValueError(f"metric {name} registered twice")
        self.declared[name] = tuple(labels)

    def counter(self, name: str, help_text: str, labels: Sequence[str] = ()) -> Counter:
        self._declare(name, labels)
        return Counter(name, help_text, labels, registry=self)

    def gauge(self, name: str, help_text: str, labels: Sequence[str] = ()) -> Gauge:
        self._declare(name, labels)
        return Gauge(name, help_text, labels, registry=self)

    def histogram(
        self,
        name: str,
        help_text: str,
        labels: Sequence[str] = (),
        buckets: Iterable[float] = Histogram.DEFAULT_BUCKETS,
    ) -> Histogram:
        self._declare(name, labels)
        return Histogram(name, help_text, labels, registry=self, buckets=tuple(buckets))


def render(registry: CollectorRegistry) -> bytes:
    """The registry in the Prometheus text exposition format."""
    return prometheus_client.generate_latest(registry)


def parse_text(text: str) -> dict[str, float]:
    """Exposition text as {'name{labels}': value}, label names sorted; for tests and benchmarks."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return out
