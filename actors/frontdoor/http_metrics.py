"""What the front door records: its answers by route template, method and status.

Tag values are bounded: routes by template (see :data:`ROUTES`), never a request's path; HTTP
methods outside :data:`METHODS` count as ``OTHER``.

>>> count_http("/v1/trajectories/{trajectory_id}", "delete", 204)   # counted as /v1/trajectories/{id}, DELETE
>>> count_http("/v1/trajectories/abc123", "DELETE", 204)
Traceback (most recent call last):
...
lifemem_ray.core.errors.MetricTagError: metric lifemem_http_responses_total: tag route='/v1/trajectories/abc123' is not one of /docs, /docs/oauth2-redirect, /healthz, /mcp, /openapi.json, /redoc, /v1/clusters, /v1/operations/{id}, /v1/retrieve, /v1/stats, /v1/tenants/{id}, /v1/trajectories, /v1/trajectories/{id}, other
"""

from __future__ import annotations

import re

from lifemem_ray.actors.cluster.ray_metrics import CATALOGUE as CLUSTER_CATALOGUE
from lifemem_ray.actors.cluster.ray_metrics import RECORDER
from lifemem_ray.core.errors import MetricTagError
from lifemem_ray.core.metrics import MetricSpec, Tag

__all__ = ["CATALOGUE", "HTTP_RESPONSES", "METHODS", "ROUTES", "check_routes", "count_http", "route_template"]

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
_PARAM = re.compile(r"\{[^{}/]*\}")


def _status(value: str) -> bool:
    return value.isdigit() and 100 <= int(value) <= 599


HTTP_RESPONSES = MetricSpec(
    "lifemem_http_responses_total",
    "counter",
    "HTTP answers of the front door by route template, method and status",
    (
        Tag("route", ROUTES),
        Tag("method", (*METHODS, OTHER_METHOD)),
        Tag("status", check=_status, described="an HTTP status 100..599"),
    ),
)
# Every metric a deployment records, the front door's included (what the dashboard may query).
CATALOGUE: dict[str, MetricSpec] = {**CLUSTER_CATALOGUE, HTTP_RESPONSES.name: HTTP_RESPONSES}


def route_template(route: str) -> str:
    """A route's template as counted: any path parameter as ``{id}``, no trailing ``/``."""
    template = _PARAM.sub("{id}", route)
    return (template.rstrip("/") or "/") if len(template) > 1 else template


def check_routes(paths: list[str]) -> None:
    """Every route of the application (``paths``: their templates) has its tag value in
    :data:`ROUTES`, checked when the application is built: a route added to the app and not
    here fails there, instead of each of its answers failing to be counted.

    Raises:
        MetricTagError: naming the routes missing from :data:`ROUTES`.
    """
    missing = sorted({route_template(p) for p in paths} - set(ROUTES))
    if missing:
        raise MetricTagError(
            f"front door routes {missing} are not in http_metrics.ROUTES (lifemem_http_responses_total's route "
            "tag): add them there (and to the dashboard if they matter)"
        )


def count_http(route: str, method: str, status: int) -> None:
    """One HTTP answer. ``route`` is the matched route's template (``/v1/trajectories/{id}``, any
    parameter name; a trailing ``/`` ignored) or ``"other"`` when none matched; ``method`` is the
    request's (unknown methods count as ``OTHER``)."""
    template = route_template(route) if isinstance(route, str) else route
    verb = method.upper() if isinstance(method, str) else method
    if isinstance(verb, str) and verb not in METHODS:
        verb = OTHER_METHOD
    if isinstance(status, bool) or not isinstance(status, int):
        raise MetricTagError(f"metric lifemem_http_responses_total: status {status!r} is not an int")
    RECORDER.record(HTTP_RESPONSES, 1, template, verb, str(status))
