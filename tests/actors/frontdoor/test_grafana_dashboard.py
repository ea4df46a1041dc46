"""cluster_configs/grafana-lifemem.json queries the metrics lifemem_ray.core.metrics declares, under the
names Ray exports them with (tests/actors/cluster/test_metrics.py scrapes those names from a real deployment)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lifemem_ray.actors.frontdoor import http_metrics
from lifemem_ray.core import metrics

DASHBOARD = Path(__file__).resolve().parents[3] / "cluster_configs" / "grafana-lifemem.json"
HISTOGRAM_SERIES = ("_bucket", "_count", "_sum")
NAME = re.compile(r"\b(ray_[A-Za-z_:][A-Za-z0-9_:]*)")
BY = re.compile(r"\bby\s*\(([^)]*)\)")
MATCHER = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"([^"]*)"')


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict) -> list[dict]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def spec_of(exported: str) -> tuple[metrics.MetricSpec, str]:
    """The catalogue entry behind a scraped name, and which of its series it is."""
    assert exported.startswith(metrics.EXPORT_PREFIX), exported
    name = exported[len(metrics.EXPORT_PREFIX) :]
    if name in http_metrics.CATALOGUE:
        return http_metrics.CATALOGUE[name], ""
    for suffix in HISTOGRAM_SERIES:
        base = name.removesuffix(suffix)
        if base != name and base in http_metrics.CATALOGUE and http_metrics.CATALOGUE[base].kind == "histogram":
            return http_metrics.CATALOGUE[base], suffix
    raise AssertionError(
        f"{exported}: not a metric of lifemem_ray.core.http_metrics.CATALOGUE (nor a histogram's series)"
    )


def expressions(dashboard: dict) -> list[tuple[str, str]]:
    out = [(p["title"], t["expr"]) for p in panels(dashboard) for t in p["targets"]]
    out += [(f"variable {v['name']}", v["definition"]) for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return out


def test_the_dashboard_is_a_grafana_dashboard_on_a_prometheus_datasource_variable(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels(dashboard):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"] and all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"])
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]


def test_every_query_names_catalogued_metrics_and_their_tags(dashboard):
    used: set[str] = set()
    for where, expr in expressions(dashboard):
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), (where, expr)
        names = NAME.findall(expr)
        assert names, (where, expr)
        specs = [spec_of(n) for n in names]
        used.update(spec.name for spec, _ in specs)
        labels = {key for spec, _ in specs for key in spec.tag_keys} | (
            {"le"} if any(s == "_bucket" for _, s in specs) else set()
        )
        for group in BY.findall(expr):
            for label in filter(None, (x.strip() for x in group.split(","))):
                assert label in labels, f"{where}: groups by {label!r}, not a tag of {names}"
        for label, op, value in MATCHER.findall(expr):
            assert label in labels, f"{where}: matches {label!r}, not a tag of {names}"
            tag = next(t for spec, _ in specs for t in spec.tags if t.key == label)
            if op == "=" and tag.check is None:
                assert value in tag.values, f"{where}: {label}={value!r} is never recorded"
        if "histogram_quantile" in expr:
            assert all(s == "_bucket" for _, s in specs) and re.search(r"by \([^)]*\ble\b", expr), (where, expr)
    assert used == set(http_metrics.CATALOGUE), f"metrics without a panel: {sorted(set(http_metrics.CATALOGUE) - used)}"


def test_latency_panels_show_p50_and_p99_by_layer(dashboard):
    latency = [
        t["expr"] for p in panels(dashboard) for t in p["targets"] if "ray_lifemem_latency_seconds_bucket" in t["expr"]
    ]
    for operation in metrics.LATENCY_OPERATIONS:
        mine = [e for e in latency if f'operation="{operation}"' in e]
        assert any(e.startswith("histogram_quantile(0.5,") for e in mine) and any(
            e.startswith("histogram_quantile(0.99,") for e in mine
        )
        assert all("layer" in BY.search(e).group(1) for e in mine)
