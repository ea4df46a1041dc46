"""Metrics on Ray: the sink that records through ``ray.util.metrics``, and the Ray layer's own.

:class:`RaySink` is the :class:`~lifemem_ray.core.metrics.MetricsSink` the actors hand to the
engine (each shard's ``Memory``) and to the LLM client (the coordinator's decider), and record
their own metrics with (:data:`RECORDER`): the coordinator's micro-batches and queue, the
shards' sizes, the client's latency, the embedder actors' cache and model calls. Ray's per-node metrics agent exports them on its
Prometheus endpoint with a ``ray_`` prefix (``lifemem_latency_seconds`` is scraped as
``ray_lifemem_latency_seconds_bucket`` ...); the Grafana dashboard
``cluster_configs/grafana-lifemem.json`` queries those names. Every series also carries Ray's
own labels (``WorkerId``, ``NodeAddress``, ``SessionName`` ...): sum or max over them.

Two properties of Ray's exporter shape the rest: a histogram's ``_sum`` is estimated from
bucket midpoints (quantiles and counts are exact, averages are not), and a gauge series is
dropped two report intervals after its process last set it, so each process sets its gauges'
last values again on a timer. Where Ray is not initialised in the process, a record is dropped
(after its tags were checked). The ``deployment`` tag is the Ray namespace of a deployment (set
by its operator) and ``shard`` a shard's index (below ``cluster.shards``' bound).
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

from lifemem_ray.actors.cluster.cluster_config import ClusterConfig
from lifemem_ray.core.metrics import LATENCY, MetricSpec, Recorder, Tag
from lifemem_ray.llm.llm_metrics import SPECS as LLM_SPECS

__all__ = [
    "BATCH_SIZE",
    "CATALOGUE",
    "EMBEDDING_BATCH_SIZE",
    "EMBEDDING_TEXTS",
    "QUEUE_DEPTH",
    "RECORDER",
    "RaySink",
    "count_embedding_texts",
    "enabled",
    "observe_batch",
    "observe_embedding_batch",
    "set_queue_depth",
    "set_shard_sizes",
]

MAX_SHARDS = int(ClusterConfig.BOUNDS["shards"][1])
BATCH_BOUNDARIES = tuple(float(2**i) for i in range(17))  # 1 .. 65,536 (cluster.batch_size's bound)
EMBEDDING_BATCH_BOUNDARIES = tuple(float(2**i) for i in range(13))  # 1 .. 4,096 (embedding.batch_size's bound)


def _shard_index(value: str) -> bool:
    return value.isdigit() and int(value) < MAX_SHARDS and str(int(value)) == value


_DEPLOYMENT = Tag(
    "deployment",
    check=lambda v: 0 < len(v) <= 256 and v.isprintable(),
    described="a Ray namespace (1-256 printable characters)",
)
_SHARD = Tag("shard", check=_shard_index, described=f"a shard index 0..{MAX_SHARDS - 1}")

BATCH_SIZE = MetricSpec(
    "lifemem_coordinator_batch_size",
    "histogram",
    "Trajectories per micro-batch the coordinator planned and committed",
    (_DEPLOYMENT,),
    BATCH_BOUNDARIES,
)
QUEUE_DEPTH = MetricSpec(
    "lifemem_coordinator_queue_depth",
    "gauge",
    "Trajectories accepted by the coordinator and not yet acknowledged (queued or in a micro-batch; "
    "bounded by cluster.max_pending)",
    (_DEPLOYMENT,),
)
SHARD_TRAJECTORIES = MetricSpec(
    "lifemem_shard_trajectories", "gauge", "Trajectories stored on a shard", (_DEPLOYMENT, _SHARD)
)
SHARD_CLUSTERS = MetricSpec("lifemem_shard_clusters", "gauge", "Live clusters on a shard", (_DEPLOYMENT, _SHARD))
EMBEDDING_TEXTS = MetricSpec(
    "lifemem_embedding_texts_total",
    "counter",
    "Distinct texts of each call to an embedder actor, by where their vector came from: source=cache (its cache) "
    "or model (computed); the hit rate is cache over both",
    (_DEPLOYMENT, Tag("source", ("cache", "model"))),
)
EMBEDDING_BATCH_SIZE = MetricSpec(
    "lifemem_embedding_batch_size",
    "histogram",
    "Texts per model call of an embedder actor (a dynamic batch gathered from concurrent calls; "
    "at most embedding.batch_size)",
    (_DEPLOYMENT,),
    EMBEDDING_BATCH_BOUNDARIES,
)

# Every metric recorded below the front door (the front door adds its answers: http_metrics).
CATALOGUE: dict[str, MetricSpec] = {
    spec.name: spec
    for spec in (
        LATENCY,
        *LLM_SPECS,
        BATCH_SIZE,
        QUEUE_DEPTH,
        SHARD_TRAJECTORIES,
        SHARD_CLUSTERS,
        EMBEDDING_TEXTS,
        EMBEDDING_BATCH_SIZE,
    )
}


def enabled() -> bool:
    """Whether records go anywhere: Ray is imported and initialised in this process."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


class RaySink:
    """Records through ``ray.util.metrics`` (one metric object per spec, made on first use in
    this process); gauges' last values are set again on a timer (see the module)."""

    def __init__(self) -> None:
        self._created: dict[str, Any] = {}  # spec name -> ray.util.metrics object
        self._gauges: dict[
            tuple[str, tuple[tuple[str, str], ...]], tuple[MetricSpec, float]
        ] = {}  # last value per series
        self._lock = threading.Lock()
        self._refresher: threading.Thread | None = None

    def record(self, spec: MetricSpec, value: float, labels: dict[str, str]) -> None:
        if not enabled():
            return
        metric = self._metric(spec)
        if spec.kind == "histogram":
            metric.observe(value, tags=labels)
        elif spec.kind == "counter":
            metric.inc(value, tags=labels)
        else:
            metric.set(value, tags=labels)
            self._keep_gauge(spec, labels, value)

    def _metric(self, spec: MetricSpec) -> Any:
        got = self._created.get(spec.name)
        if got is None:
            from ray.util import metrics as ray_metrics

            with self._lock:
                got = self._created.get(spec.name)
                if got is None:
                    if spec.kind == "histogram":
                        got = ray_metrics.Histogram(spec.name, spec.description, list(spec.boundaries), spec.tag_keys)
                    elif spec.kind == "counter":
                        got = ray_metrics.Counter(spec.name, spec.description, spec.tag_keys)
                    else:
                        got = ray_metrics.Gauge(spec.name, spec.description, spec.tag_keys)
                    self._created[spec.name] = got
        return got

    def _keep_gauge(self, spec: MetricSpec, labels: dict[str, str], value: float) -> None:
        with self._lock:
            self._gauges[(spec.name, tuple(sorted(labels.items())))] = (spec, value)
            if self._refresher is None or not self._refresher.is_alive():
                self._refresher = threading.Thread(
                    target=self._refresh_gauges, name="lifemem-metrics-gauges", daemon=True
                )
                self._refresher.start()

    def _refresh_gauges(self) -> None:
        period = _refresh_period()
        while True:
            time.sleep(period)
            if not enabled():
                continue
            with self._lock:
                values = list(self._gauges.items())
            for (_, labels), (spec, value) in values:
                self._metric(spec).set(value, tags=dict(labels))


def _refresh_period() -> float:
    """Half of Ray's report interval (10 s by default), within 0.5-5 s."""
    from lifemem_ray.actors.cluster import ray_internals

    try:
        interval_s = ray_internals.metrics_report_interval_s()
    except Exception:  # noqa: BLE001 - an internal of Ray (tests/actors/cluster/test_ray_internals.py says which): without it, its default
        interval_s = 10.0
    return min(5.0, max(0.5, interval_s / 2))


SINK = RaySink()  # this process's: every actor and client of the process records through it
RECORDER = Recorder(SINK)


def observe_batch(deployment: str, size: int) -> None:
    """The coordinator of ``deployment`` finished a micro-batch of ``size`` trajectories."""
    RECORDER.record(BATCH_SIZE, size, deployment)


def set_queue_depth(deployment: str, depth: int) -> None:
    """Trajectories the coordinator of ``deployment`` holds unacknowledged now."""
    RECORDER.record(QUEUE_DEPTH, depth, deployment)


def set_shard_sizes(deployment: str, shard: int, trajectories: int, clusters: int) -> None:
    """What shard ``shard`` of ``deployment`` holds now."""
    RECORDER.record(SHARD_TRAJECTORIES, trajectories, deployment, str(shard))
    RECORDER.record(SHARD_CLUSTERS, clusters, deployment, str(shard))


def count_embedding_texts(deployment: str, cached: int, computed: int) -> None:
    """An embedder actor of ``deployment`` served ``cached`` distinct texts from its cache and
    computed ``computed`` with the model."""
    RECORDER.record(EMBEDDING_TEXTS, cached, deployment, "cache")
    RECORDER.record(EMBEDDING_TEXTS, computed, deployment, "model")


def observe_embedding_batch(deployment: str, size: int) -> None:
    """An embedder actor of ``deployment`` made one model call of ``size`` texts."""
    RECORDER.record(EMBEDDING_BATCH_SIZE, size, deployment)
