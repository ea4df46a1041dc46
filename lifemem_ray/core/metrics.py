"""The memory's Prometheus metrics, recorded through Ray's metrics API (``ray.util.metrics``).

Every metric is declared once in :data:`CATALOGUE`: its name (``lifemem_`` prefixed), kind,
description, tag keys with the values each may take, and a histogram's bucket boundaries.
Ray's per-node metrics agent exports them on its Prometheus endpoint with a ``ray_`` prefix
(``lifemem_latency_seconds`` is scraped as ``ray_lifemem_latency_seconds_bucket`` ...); the
Grafana dashboard ``cluster_configs/grafana-lifemem.json`` queries those names. Every series
also carries Ray's own labels (``WorkerId``, ``NodeAddress``, ``SessionName`` ...): sum or max
over them. Two properties of Ray's exporter shape the rest: a histogram's ``_sum`` is estimated
from bucket midpoints (quantiles and counts are exact, averages are not), and a gauge series is
dropped two report intervals after its process last set it, so each process sets its gauges'
last values again on a timer.

Recording is a no-op where Ray is not initialised in the process: the engine runs without
Ray, and this module never starts Ray nor imports it (it looks at ``sys.modules``). Tags are
checked either way: a tag value outside the catalogue is a programming error
(:class:`~lifemem_ray.core.errors.MetricTagError`, a ``ValueError`` naming the metric).

Tag values are bounded so that the number of series stays small whatever users send: no
trajectory, tenant or environment names, no request paths (HTTP answers are counted by route
template, see :data:`ROUTES`), HTTP methods outside :data:`METHODS` counted as ``OTHER``.
The ``deployment`` tag is the Ray namespace of a deployment (set by its operator) and
``shard`` a shard's index (below ``cluster.shards``' bound).

>>> observe_latency("retrieve", "engine", 0.004)   # without Ray: checked, then nothing
>>> count_http("/v1/retrieve", "POST", 200)
>>> observe_latency("retrieve", "gpu", 0.004)
Traceback (most recent call last):
...
lifemem_ray.core.errors.MetricTagError: metric lifemem_latency_seconds: tag layer='gpu' is not one of client, engine, http
"""

from __future__ import annotations

import math
import re
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from lifemem_ray.core.errors import MetricTagError
from lifemem_ray.llm.prompts import MEMORY_OPERATIONS, OPERATIONS

__all__ = [
    "CATALOGUE",
    "EXPORT_PREFIX",
    "LATENCY_BOUNDARIES",
    "LATENCY_OPERATIONS",
    "LAYERS",
    "METHODS",
    "MetricSpec",
    "ROUTES",
    "count_http",
    "count_llm_call",
    "count_llm_fallbacks",
    "count_llm_refusals",
    "count_llm_tokens",
    "enabled",
    "exported_name",
    "observe_batch",
    "observe_latency",
    "set_queue_depth",
    "set_shard_sizes",
]

EXPORT_PREFIX = "ray_"  # what Ray's Prometheus exporter puts before every name (its namespace "ray")

LAYERS = ("client", "engine", "http")
LATENCY_OPERATIONS = ("add", "retrieve")
TOKEN_KINDS = ("completion", "prompt")
METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")
OTHER_METHOD = "OTHER"  # any other method a client sent (counted, never an error: clients choose it)
# Route templates of the HTTP front door. A path parameter may have any name ("{trajectory_id}"
# counts as "{id}"); "other" is any path no route matched (404s of scanners, typos).
ROUTES = (
    "/healthz",
    "/v1/trajectories",
    "/v1/trajectories/{id}",
    "/v1/retrieve",
    "/v1/stats",
    "/v1/clusters",
    "/v1/operations/{id}",
    "/v1/tenants/{id}",
    "/mcp",
    "/openapi.json",
    "/docs",
    "/docs/oauth2-redirect",
    "/redoc",
    "other",
)
MAX_SHARDS = 1_024  # cluster.shards' bound (config.BOUNDS)
_PARAM = re.compile(r"\{[^{}/]*\}")

LATENCY_BOUNDARIES = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
BATCH_BOUNDARIES = tuple(float(2**i) for i in range(17))  # 1 .. 65,536 (cluster.batch_size's bound)


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


def exported_name(name: str) -> str:
    """The name Ray's exporter gives a metric (its ``ray_`` namespace before ours)."""
    return EXPORT_PREFIX + name


def _shard_index(value: str) -> bool:
    return value.isdigit() and int(value) < MAX_SHARDS and str(int(value)) == value


def _status(value: str) -> bool:
    return value.isdigit() and 100 <= int(value) <= 599


_DEPLOYMENT = Tag("deployment", check=lambda v: 0 < len(v) <= 256 and v.isprintable(), described="a Ray namespace (1-256 printable characters)")
_SHARD = Tag("shard", check=_shard_index, described=f"a shard index 0..{MAX_SHARDS - 1}")
_LLM_OPERATION = Tag("operation", OPERATIONS)

CATALOGUE: dict[str, MetricSpec] = {
    spec.name: spec
    for spec in (
        MetricSpec("lifemem_latency_seconds", "histogram",
                   "Seconds an add or retrieve call took until it answered (one observation per call, a batch or one "
                   "item; errors are not observed): engine = the engine's own work (Memory.add_many / retrieve_many in "
                   "process; in a deployment each shard's commit and search), client = MemoryClient until the add "
                   "is acknowledged, http = the REST front door",
                   (Tag("operation", LATENCY_OPERATIONS), Tag("layer", LAYERS)), LATENCY_BOUNDARIES),
        MetricSpec("lifemem_http_responses_total", "counter", "HTTP answers of the front door by route template, method and status",
                   (Tag("route", ROUTES), Tag("method", METHODS + (OTHER_METHOD,)),
                    Tag("status", check=_status, described="an HTTP status 100..599"))),
        MetricSpec("lifemem_coordinator_batch_size", "histogram", "Trajectories per micro-batch the coordinator planned and committed",
                   (_DEPLOYMENT,), BATCH_BOUNDARIES),
        MetricSpec("lifemem_coordinator_queue_depth", "gauge",
                   "Trajectories accepted by the coordinator and not yet acknowledged (queued or in a micro-batch; "
                   "bounded by cluster.max_pending)", (_DEPLOYMENT,)),
        MetricSpec("lifemem_llm_calls_total", "counter", "LLM calls (one prompt each, however many attempts) by operation",
                   (_LLM_OPERATION,)),
        MetricSpec("lifemem_llm_tokens_total", "counter",
                   "LLM tokens by operation and kind (prompt, completion; estimated as characters / 4 where the server "
                   "reports no usage)", (_LLM_OPERATION, Tag("kind", TOKEN_KINDS))),
        MetricSpec("lifemem_llm_fallbacks_total", "counter",
                   "Decisions the offline policy made because the LLM's answer failed or was refused: items for "
                   "assign, one per call for partition, split, describe and distil", (Tag("operation", MEMORY_OPERATIONS),)),
        MetricSpec("lifemem_llm_refusals_total", "counter",
                   "Generated texts (cluster descriptions, skills) refused by the provenance rule: a token that is not "
                   "plain prose and occurs in none of the trajectories the text was generated from, or an instruction "
                   "aimed at the operator (the offline text stands in)", (Tag("operation", MEMORY_OPERATIONS),)),
        MetricSpec("lifemem_shard_trajectories", "gauge", "Trajectories stored on a shard", (_DEPLOYMENT, _SHARD)),
        MetricSpec("lifemem_shard_clusters", "gauge", "Live clusters on a shard", (_DEPLOYMENT, _SHARD)),
    )
}

_created: dict[str, Any] = {}  # name -> ray.util.metrics object, made on first use in this process
_lock = threading.Lock()
# Ray's metrics agent forgets a gauge series two report intervals after its last report, and a
# process reports a gauge only when it is set: the last value of every gauge series set here is
# set again on a timer (a few series per process), so a quiet shard or an idle queue stays visible.
_gauges: dict[tuple[str, tuple[str, ...]], float] = {}
_refresher: threading.Thread | None = None


def enabled() -> bool:
    """Whether records go anywhere: Ray is imported and initialised in this process."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def _tags(spec: MetricSpec, values: tuple[str, ...]) -> dict[str, str]:
    if len(values) != len(spec.tags):
        raise MetricTagError(f"metric {spec.name}: {len(values)} tag values for the tags {list(spec.tag_keys)}")
    for tag, value in zip(spec.tags, values):
        if not isinstance(value, str) or not tag.admits(value):
            raise MetricTagError(f"metric {spec.name}: tag {tag.key}={value!r} is not one of {tag.describe()}")
    return dict(zip(spec.tag_keys, values))


def _metric(spec: MetricSpec) -> Any:
    got = _created.get(spec.name)
    if got is None:
        from ray.util import metrics as ray_metrics

        with _lock:
            got = _created.get(spec.name)
            if got is None:
                if spec.kind == "histogram":
                    got = ray_metrics.Histogram(spec.name, spec.description, list(spec.boundaries), spec.tag_keys)
                elif spec.kind == "counter":
                    got = ray_metrics.Counter(spec.name, spec.description, spec.tag_keys)
                else:
                    got = ray_metrics.Gauge(spec.name, spec.description, spec.tag_keys)
                _created[spec.name] = got
    return got


def _record(name: str, value: float, *tags: str) -> None:
    """Check the tags, then record where Ray runs: observe (histogram), add (counter, > 0) or set (gauge)."""
    spec = CATALOGUE[name]
    labels = _tags(spec, tags)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise MetricTagError(f"metric {name}: value {value!r} is not a finite number >= 0")
    if not enabled() or (spec.kind == "counter" and value == 0):
        return
    metric = _metric(spec)
    if spec.kind == "histogram":
        metric.observe(float(value), tags=labels)
    elif spec.kind == "counter":
        metric.inc(float(value), tags=labels)
    else:
        metric.set(float(value), tags=labels)
        _keep_gauge(name, tags, float(value))


def _keep_gauge(name: str, tags: tuple[str, ...], value: float) -> None:
    global _refresher
    with _lock:
        _gauges[(name, tags)] = value
        if _refresher is None or not _refresher.is_alive():
            _refresher = threading.Thread(target=_refresh_gauges, name="lifemem-metrics-gauges", daemon=True)
            _refresher.start()


def _refresh_period() -> float:
    """Half of Ray's report interval (``RAY_metrics_report_interval_ms``, 10 s by default), within 0.5-5 s."""
    try:
        import ray

        interval_s = ray._config.metrics_report_interval_ms() / 1000.0
    except Exception:  # an internal of Ray: without it, its default
        interval_s = 10.0
    return min(5.0, max(0.5, interval_s / 2))


def _refresh_gauges() -> None:
    period = _refresh_period()
    while True:
        time.sleep(period)
        if not enabled():
            continue
        with _lock:
            values = list(_gauges.items())
        for (name, tags), value in values:
            spec = CATALOGUE[name]
            _metric(spec).set(value, tags=dict(zip(spec.tag_keys, tags)))


# -- what the layers call ---------------------------------------------------------------------


def observe_latency(operation: str, layer: str, seconds: float) -> None:
    """One answered ``add`` or ``retrieve`` call of ``layer`` (engine, client, http) took ``seconds``."""
    _record("lifemem_latency_seconds", seconds, operation, layer)


def count_http(route: str, method: str, status: int) -> None:
    """One HTTP answer. ``route`` is the matched route's template (``/v1/trajectories/{id}``, any
    parameter name; a trailing ``/`` ignored) or ``"other"`` when none matched; ``method`` is the
    request's (unknown methods count as ``OTHER``)."""
    template = _PARAM.sub("{id}", route) if isinstance(route, str) else route
    if isinstance(template, str) and len(template) > 1:
        template = template.rstrip("/") or "/"
    verb = method.upper() if isinstance(method, str) else method
    if isinstance(verb, str) and verb not in METHODS:
        verb = OTHER_METHOD
    if isinstance(status, bool) or not isinstance(status, int):
        raise MetricTagError(f"metric lifemem_http_responses_total: status {status!r} is not an int")
    _record("lifemem_http_responses_total", 1, template, verb, str(status))


def observe_batch(deployment: str, size: int) -> None:
    """The coordinator of ``deployment`` finished a micro-batch of ``size`` trajectories."""
    _record("lifemem_coordinator_batch_size", size, deployment)


def set_queue_depth(deployment: str, depth: int) -> None:
    """Trajectories the coordinator of ``deployment`` holds unacknowledged now."""
    _record("lifemem_coordinator_queue_depth", depth, deployment)


def count_llm_call(operation: str) -> None:
    """One logical LLM call of ``operation`` (a prompt; retries are the same call)."""
    _record("lifemem_llm_calls_total", 1, operation)


def count_llm_tokens(operation: str, prompt: int, completion: int) -> None:
    """Tokens of one LLM answer (as ``LLMClient.usage`` counts them)."""
    _record("lifemem_llm_tokens_total", prompt, operation, "prompt")
    _record("lifemem_llm_tokens_total", completion, operation, "completion")


def count_llm_fallbacks(operation: str, n: int = 1) -> None:
    """``n`` decisions of ``operation`` the offline policy made in place of a failed or refused LLM answer."""
    _record("lifemem_llm_fallbacks_total", n, operation)


def count_llm_refusals(operation: str, n: int = 1) -> None:
    """``n`` generated texts of ``operation`` refused by the provenance rule (:mod:`lifemem_ray.llm.provenance`)."""
    _record("lifemem_llm_refusals_total", n, operation)


def set_shard_sizes(deployment: str, shard: int, trajectories: int, clusters: int) -> None:
    """What shard ``shard`` of ``deployment`` holds now."""
    _record("lifemem_shard_trajectories", trajectories, deployment, str(shard))
    _record("lifemem_shard_clusters", clusters, deployment, str(shard))
