"""Metrics without a metrics system: what the memory records, checked, handed to an injected sink.

Every metric is declared once as a :class:`MetricSpec`: its name (``lifemem_`` prefixed), kind,
description, tag keys with the values each may take, and a histogram's bucket boundaries. This
module declares the one metric every layer records, :data:`LATENCY` (adds and retrievals by
layer); each layer declares its own beside its code the same way (the LLM's calls and tokens in
:mod:`lifemem_ray.llm.llm_metrics`, the coordinator's batches and the shards' sizes in
:mod:`lifemem_ray.actors.cluster.ray_metrics`, the front door's answers in
:mod:`lifemem_ray.actors.frontdoor.http_metrics`).

A :class:`Recorder` is what code calls: it checks the tags and the value against the spec (a tag
value outside it is a programming error, :class:`~lifemem_ray.core.errors.MetricTagError`, a
``ValueError`` naming the metric) and hands the record to its :class:`MetricsSink`. The engine
and the LLM client take a sink when they are built and default to :class:`NullSink`, which
drops every record: the engine knows nothing of where metrics go. In a Ray deployment the
actors give them the sink of :mod:`lifemem_ray.actors.cluster.ray_metrics`, which records
through ``ray.util.metrics``.

Tag values are bounded so that the number of series stays small whatever users send: no
trajectory, tenant or environment names.

>>> recorder = Recorder()                          # a NullSink: checked, then dropped
>>> recorder.observe_latency("retrieve", "engine", 0.004)
>>> recorder.observe_latency("retrieve", "gpu", 0.004)
Traceback (most recent call last):
...
lifemem_ray.core.errors.MetricTagError: metric lifemem_latency_seconds: tag layer='gpu' is not one of client, engine, http
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from lifemem_ray.core.errors import MetricTagError

__all__ = [
    "EXPORT_PREFIX",
    "LATENCY",
    "LATENCY_BOUNDARIES",
    "LATENCY_OPERATIONS",
    "LAYERS",
    "MetricSpec",
    "MetricsSink",
    "NullSink",
    "Recorder",
    "Tag",
    "exported_name",
]

EXPORT_PREFIX = "ray_"  # what Ray's Prometheus exporter puts before every name (its namespace "ray")

LAYERS = ("client", "engine", "http")
LATENCY_OPERATIONS = ("add", "retrieve")
LATENCY_BOUNDARIES = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)


@dataclass(frozen=True)
class Tag:
    """A tag key and the values it may take: a fixed set, or a check for a bounded family."""

    key: str
    values: tuple[str, ...] = ()
    check: Callable[[str], bool] | None = None
    described: str = ""  # what the check admits, for error messages

    def admits(self, value: str) -> bool:
        return value in self.values if self.check is None else self.check(value)

    def describe(self) -> str:
        return ", ".join(sorted(self.values)) if self.check is None else self.described


@dataclass(frozen=True)
class MetricSpec:
    """One declared metric."""

    name: str
    kind: str  # counter | gauge | histogram
    description: str
    tags: tuple[Tag, ...]
    boundaries: tuple[float, ...] = ()

    @property
    def tag_keys(self) -> tuple[str, ...]:
        return tuple(t.key for t in self.tags)

    def exported(self) -> list[str]:
        """The names Prometheus scrapes for it (a histogram's three series)."""
        base = exported_name(self.name)
        return [f"{base}_bucket", f"{base}_count", f"{base}_sum"] if self.kind == "histogram" else [base]

    def labels(self, values: tuple[str, ...]) -> dict[str, str]:
        """The tags as labels; :class:`MetricTagError` for a value the spec does not admit."""
        if len(values) != len(self.tags):
            raise MetricTagError(f"metric {self.name}: {len(values)} tag values for the tags {list(self.tag_keys)}")
        for tag, value in zip(self.tags, values, strict=True):
            if not isinstance(value, str) or not tag.admits(value):
                raise MetricTagError(f"metric {self.name}: tag {tag.key}={value!r} is not one of {tag.describe()}")
        return dict(zip(self.tag_keys, values, strict=True))


def exported_name(name: str) -> str:
    """The name Ray's exporter gives a metric (its ``ray_`` namespace before ours)."""
    return EXPORT_PREFIX + name


LATENCY = MetricSpec(
    "lifemem_latency_seconds",
    "histogram",
    "Seconds an add or retrieve call took until it answered (one observation per call, a batch or one item; errors are "
    "not observed): engine = the engine's own work (Memory.add_many / retrieve_many in process; in a deployment each "
    "shard's commit and search), client = MemoryClient until the add is acknowledged, http = the REST front door",
    (Tag("operation", LATENCY_OPERATIONS), Tag("layer", LAYERS)),
    LATENCY_BOUNDARIES,
)


class MetricsSink(Protocol):
    """Where checked records go: ``value`` of the metric ``spec`` with these labels (observed
    for a histogram, added for a counter, set for a gauge)."""

    def record(self, spec: MetricSpec, value: float, labels: dict[str, str]) -> None: ...


class NullSink:
    """Drops every record: the engine and the LLM client alone, without a metrics system."""

    def record(self, spec: MetricSpec, value: float, labels: dict[str, str]) -> None:
        return None


class Recorder:
    """What the layers call: each record checked against its spec, then given to ``sink``."""

    def __init__(self, sink: MetricsSink | None = None) -> None:
        self.sink: MetricsSink = sink if sink is not None else NullSink()

    def record(self, spec: MetricSpec, value: float, *tags: str) -> None:
        """Check the tags and the value (a finite number >= 0), then record; a counter's 0 is not recorded."""
        labels = spec.labels(tags)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise MetricTagError(f"metric {spec.name}: value {value!r} is not a finite number >= 0")
        if spec.kind == "counter" and value == 0:
            return
        self.sink.record(spec, float(value), labels)

    def observe_latency(self, operation: str, layer: str, seconds: float) -> None:
        """One answered ``add`` or ``retrieve`` call of ``layer`` (engine, client, http) took ``seconds``."""
        self.record(LATENCY, seconds, operation, layer)
