"""The REST front door on a real Ray Serve (loopback), over real HTTP, in front of a real
2-shard deployment: every route, keys and scopes, tenants kept apart, idempotent retries,
202 and polling, the error shapes (401, 403, 404, 409, 413, 422, 503) and the OpenAPI document."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.front_harness import Front, free_port, serve_front

from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.core.errors import ConfigError
from lifemem_ray.lab.synthetic import generate
from lifemem_ray.service.auth import KeyRing, new_key

pytestmark = pytest.mark.usefixtures("ray_local")

ROOT = Path(__file__).resolve().parents[3]
MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
def front(ray_local, tmp_path_factory) -> Iterator[Front]:
    """Serve (two replicas) on a free loopback port, once for the module, shut down at the end."""
    namespace = f"http-{tmp_path_factory.getbasetemp().name[-12:]}"
    roles = [
        ("acme", "acme", "read,write"),
        ("acme_ro", "acme", "read"),
        ("globex", "globex", "read,write"),
        ("admin", "ops", "read,write,admin"),
    ]
    with serve_front(
        tmp_path_factory.mktemp("http") / "store",
        namespace,
        roles,
        **{
            "cluster.max_pending": 200,
            "cluster.overload_timeout_s": 1.0,
            "http.max_body_bytes": MAX_BODY,
            "http.max_batch_items": 50,
            "http.max_queries": 8,
            "http.retry_after_s": 3,
            "http.replicas": 2,
        },
    ) as running:  # operations are polled through either replica
        yield running


def _records(n: int, seed: int, prefix: str, envs: list[str] | None = None) -> list[dict[str, Any]]:
    return [
        t.to_dict() for t in generate(n, seed=seed, envs=envs or ["shop", "sql"], length_scale=0.1, id_prefix=prefix)
    ]


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, (response.status_code, response.text[:2000])
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"type", "message", "where", "what_to_do"}, body
    assert body["error"]["message"] and body["error"]["what_to_do"]
    return body["error"]


def test_openapi_lists_the_routes_and_health_needs_no_key(front):
    doc = httpx.get(f"{front.url}/openapi.json", timeout=60).json()
    from lifemem_ray import __version__

    assert doc["info"]["version"] == __version__, "the API's version is the package's one version"
    assert {
        "/v1/trajectories",
        "/v1/retrieve",
        "/v1/stats",
        "/v1/clusters",
        "/v1/trajectories/{trajectory_id}",
        "/v1/tenants/{tenant}",
        "/v1/operations/{operation}",
        "/healthz",
    } <= set(doc["paths"])
    assert (
        set(doc["paths"]["/v1/trajectories"]) == {"post"}
        and "delete" in doc["paths"]["/v1/trajectories/{trajectory_id}"]
    )
    assert "Trajectory" in json.dumps(doc["paths"]["/v1/trajectories"]["post"]) or "Trajectory" in json.dumps(
        doc["components"]
    )
    health = httpx.get(f"{front.url}/healthz", timeout=60)
    assert health.status_code == 200 and health.json() == {
        "ok": True,
        "coordinator": True,
        "shards": [True, True],
        "detail": None,
    }
    _error(httpx.get(f"{front.url}/v1/nothing-here", timeout=60), 404)


def test_keys_and_scopes(front):
    with front.http() as anon:
        for method, path in (
            ("GET", "/v1/stats"),
            ("POST", "/v1/retrieve"),
            ("GET", "/v1/clusters"),
            ("DELETE", "/v1/trajectories/x"),
        ):
            r = anon.request(method, path, json={"queries": [{"task": "t"}]} if method == "POST" else None)
            assert _error(r, 401)["type"] == "unauthorized" and r.headers["www-authenticate"].startswith("Bearer")
        r = anon.get("/v1/stats", headers={"Authorization": "Bearer lmk_not-a-key"})
        assert "not valid" in _error(r, 401)["message"]
    with front.http("acme_ro") as ro:
        err = _error(ro.post("/v1/trajectories", json={"trajectories": _records(1, 1, "ro")}), 403)
        assert "'write' scope" in err["message"] and "acme-ro" in err["message"]
        assert "'write' scope" in _error(ro.delete("/v1/trajectories/anything"), 403)["message"]
        assert "'admin' scope" in _error(ro.delete("/v1/tenants/acme"), 403)["message"]
        assert "'admin' scope" in _error(ro.get("/v1/stats", params={"tenant": "*"}), 403)["message"]
        assert "'admin' scope" in _error(ro.get("/v1/stats", params={"tenant": "globex"}), 403)["message"]
        assert ro.get("/v1/stats").status_code == 200
    with front.http("acme") as rw:
        assert "'admin' scope" in _error(rw.delete("/v1/tenants/globex"), 403)["message"]


def test_add_answers_after_acknowledgement_and_retries_are_idempotent(front):
    records = _records(12, 2, "idem")
    with front.http("acme") as rw:
        before = rw.get("/v1/stats").json()["trajectories"]
        first = rw.post("/v1/trajectories", json={"trajectories": records})
        assert first.status_code == 200, first.text
        items = first.json()["items"]
        assert [i["id"] for i in items] == [r["id"] for r in records]
        assert {i["status"] for i in items} <= {"added", "pending"} and "added" in {i["status"] for i in items}
        again = rw.post("/v1/trajectories", json={"trajectories": records}).json()["items"]
        assert {i["status"] for i in again} == {"duplicate"}
        assert rw.get("/v1/stats").json()["trajectories"] == before + 12
        # The same id with other content: 409, and nothing of that request is stored.
        changed = {**records[3], "task": records[3]["task"] + " (edited)"}
        fresh = _records(2, 3, "fresh")
        err = _error(rw.post("/v1/trajectories", json={"trajectories": [fresh[0], changed, fresh[1]]}), 409)
        assert err["type"] == "conflict" and records[3]["id"] in err["message"]
        assert rw.get("/v1/stats").json()["trajectories"] == before + 12
        # A record without an id gets its content hash: resending it is idempotent too.
        anonymous = {k: v for k, v in _records(1, 4, "anon")[0].items() if k != "id"}
        a = rw.post("/v1/trajectories", json={"trajectories": [anonymous]}).json()["items"][0]
        b = rw.post("/v1/trajectories", json={"trajectories": [anonymous]}).json()["items"][0]
        assert a["id"] == b["id"] and a["id"].startswith("h-") and b["status"] == "duplicate"


def test_retrieve_answers_trajectories_skills_and_context(front):
    records = _records(16, 5, "ret", envs=["shop"])
    with front.http("acme") as rw:
        assert rw.post("/v1/trajectories", json={"trajectories": records}).status_code == 200
        r = rw.post(
            "/v1/retrieve",
            json={
                "queries": [{"task": records[0]["task"], "env": "shop"}, {"task": records[1]["task"], "env": None}],
                "k": 3,
                "context": True,
                "full": True,
            },
        )
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert len(results) == 2 and results[0]["env"] == "shop" and results[1]["env"] is None
        hits = results[0]["trajectories"]
        assert 1 <= len(hits) <= 3 and records[0]["id"] in {h["id"] for h in hits}
        assert all(set(h) >= {"id", "env", "task", "score", "cluster_id", "trajectory"} for h in hits)
        assert hits[0]["trajectory"]["steps"] and results[0]["context"]
        assert isinstance(results[0]["skills"], list)
        lean = rw.post(
            "/v1/retrieve", json={"queries": [{"task": records[0]["task"], "env": "shop"}], "skills": False}
        ).json()
        assert lean["results"][0]["skills"] == [] and "context" not in lean["results"][0]
        assert "trajectory" not in lean["results"][0]["trajectories"][0]


def test_validation_errors_name_the_field(front):
    good = _records(3, 6, "val")
    with front.http("acme") as rw:
        bad_step = [good[0], {**good[1], "steps": [{"action": 7}]}]
        err = _error(rw.post("/v1/trajectories", json={"trajectories": bad_step}), 422)
        assert err["where"] == "trajectories[1].steps[0].action" and err["type"] == "validation_error"
        no_env = [{k: v for k, v in good[2].items() if k != "env"}]
        assert _error(rw.post("/v1/trajectories", json={"trajectories": no_env}), 422)["where"] == "trajectories[0].env"
        extra = [{**good[0], "colour": "red"}]
        err = _error(rw.post("/v1/trajectories", json={"trajectories": extra}), 422)
        assert err["where"] == "trajectories[0]" and "colour" in err["message"]
        assert _error(rw.post("/v1/trajectories", json={"trajectories": [3]}), 422)["where"] == "trajectories[0]"
        assert _error(rw.post("/v1/trajectories", json={"trajectory": good}), 422)["where"] in (
            "trajectories",
            "trajectory",
        )
        err = _error(rw.post("/v1/trajectories", json={"trajectories": _records(51, 7, "many")}), 422)
        assert err["where"] == "trajectories" and "http.max_batch_items" in err["message"]
        assert _error(rw.post("/v1/retrieve", json={"queries": [{"env": "shop"}]}), 422)["where"] == "queries[0].task"
        assert _error(rw.post("/v1/retrieve", json={"queries": [{"task": "t"}], "k": 0}), 422)["where"] == "k"
        assert (
            _error(rw.post("/v1/retrieve", json={"queries": [{"task": "t", "env": " "}]}), 422)["where"]
            == "queries[0].env"
        )
        err = _error(rw.post("/v1/retrieve", json={"queries": [{"task": "t"}] * 9}), 422)
        assert err["where"] == "queries" and "http.max_queries" in err["message"]
        r = rw.post("/v1/trajectories", content=b"{not json", headers={"content-type": "application/json"})
        assert _error(r, 422)["type"] == "validation_error"
        # The tenant comes from the key: a record naming another tenant is refused, naming its own is fine.
        err = _error(rw.post("/v1/trajectories", json={"trajectories": [{**good[0], "tenant": "globex"}]}), 403)
        assert err["where"] == "trajectories[0].tenant"
        assert rw.post("/v1/trajectories", json={"trajectories": [{**good[0], "tenant": "acme"}]}).status_code == 200


def test_bodies_over_the_limit_get_413(front):
    big = {"trajectories": [{**_records(1, 8, "big")[0], "task": "x" * (MAX_BODY + 10)}]}
    with front.http("acme") as rw:
        err = _error(rw.post("/v1/trajectories", json=big), 413)
        assert err["type"] == "too_large" and "http.max_body_bytes" in err["message"]

        def chunks() -> Iterator[bytes]:  # no Content-Length: the streamed size is what counts
            payload = json.dumps(big).encode()
            for i in range(0, len(payload), 8192):
                yield payload[i : i + 8192]

        r = rw.post("/v1/trajectories", content=chunks(), headers={"content-type": "application/json"})
        assert _error(r, 413)["type"] == "too_large"
        assert rw.get("/v1/stats").status_code == 200  # the replica serves on


def test_wait_false_answers_202_and_the_operation_is_pollable(front):
    records = _records(6, 9, "later")
    with front.http("acme") as rw, front.http("globex") as other:
        r = rw.post("/v1/trajectories", params={"wait": "false"}, json={"trajectories": records})
        assert r.status_code == 202, r.text
        op = r.json()
        assert op["status"] == "pending" and op["ids"] == [x["id"] for x in records]
        deadline = time.monotonic() + 120
        while (got := rw.get(f"/v1/operations/{op['operation']}").json())["status"] == "pending":
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert got["status"] == "done" and [i["id"] for i in got["items"]] == op["ids"], got
        assert {i["status"] for i in got["items"]} <= {"added", "pending"}
        # The body flag does the same; another tenant cannot see the operation.
        r = rw.post("/v1/trajectories", json={"trajectories": records, "wait": False})
        assert r.status_code == 202
        assert _error(other.get(f"/v1/operations/{r.json()['operation']}"), 404)["type"] == "not_found"
        assert _error(rw.get("/v1/operations/no-such-operation"), 404)["where"] == "operation"
        # An add that fails after the 202 (an id stored with other content) reads failed, with the error.
        changed = {**records[0], "task": records[0]["task"] + " (edited)"}
        op = rw.post("/v1/trajectories", params={"wait": "false"}, json={"trajectories": [changed]}).json()["operation"]
        deadline = time.monotonic() + 120
        while (got := rw.get(f"/v1/operations/{op}").json())["status"] == "pending":
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert got["status"] == "failed" and got["items"] is None and got["error"]["type"] == "conflict", got


def test_two_tenants_never_see_each_other(front):
    # The same records (same ids, same tasks) for both tenants: any leak would be a top hit.
    records = _records(10, 10, "both", envs=["retail"])
    with front.http("acme") as a, front.http("globex") as g, front.http("admin") as admin:
        for c in (a, g):
            assert {
                i["status"] for i in c.post("/v1/trajectories", json={"trajectories": records}).json()["items"]
            } <= {"added", "pending"}
        g_only = _records(4, 11, "gonly", envs=["airline"])
        assert g.post("/v1/trajectories", json={"trajectories": g_only}).status_code == 200
        # Retrieval: globex's own records only (ids of its own airline env never reach acme).
        for c, forbidden in ((a, {r["id"] for r in g_only}), (g, set())):
            hits = c.post(
                "/v1/retrieve", json={"queries": [{"task": r["task"], "env": None} for r in g_only[:2]], "k": 32}
            ).json()
            ids = {h["id"] for res in hits["results"] for h in res["trajectories"]}
            assert not ids & forbidden
        assert {r["id"] for r in g_only[:2]} <= {
            h["id"]
            for res in g.post(
                "/v1/retrieve", json={"queries": [{"task": r["task"], "env": "airline"} for r in g_only[:2]], "k": 4}
            ).json()["results"]
            for h in res["trajectories"]
        }
        assert (
            a.post("/v1/retrieve", json={"queries": [{"task": g_only[0]["task"], "env": "airline"}]}).json()["results"][
                0
            ]["trajectories"]
            == []
        )
        # Clusters and stats: per tenant; the admin sees every tenant with tenant=*.
        a_envs = {e for c in a.get("/v1/clusters").json()["clusters"] for e in c["envs"]}
        g_clusters = g.get("/v1/clusters", params={"env": "airline"}).json()
        assert "airline" not in a_envs and g_clusters["total"] >= 1 and not g_clusters["truncated"]
        assert a.get("/v1/clusters", params={"env": "airline"}).json()["total"] == 0
        sa, sg = a.get("/v1/stats").json(), g.get("/v1/stats").json()
        assert "airline" not in sa["per_env"] and sg["per_env"]["airline"]["trajectories"] == 4
        everyone = admin.get("/v1/stats", params={"tenant": "*"}).json()
        assert everyone["trajectories"] >= sa["trajectories"] + sg["trajectories"]
        assert admin.get("/v1/stats", params={"tenant": "globex"}).json()["trajectories"] == sg["trajectories"]
        # Deletion: globex deleting an id only acme holds is a 404; each tenant deletes its own copy.
        a_only = _records(1, 15, "aonly")
        assert a.post("/v1/trajectories", json={"trajectories": a_only}).status_code == 200
        assert _error(g.delete(f"/v1/trajectories/{a_only[0]['id']}"), 404)["type"] == "not_found"
        victim = records[0]["id"]
        assert a.delete(f"/v1/trajectories/{victim}").json() == {"id": victim, "deleted": True}
        assert _error(a.delete(f"/v1/trajectories/{victim}"), 404)["where"] == "trajectory_id"
        assert a.get("/v1/stats").json()["trajectories"] == sa["trajectories"]  # one added, one deleted
        slashed = {
            **_records(1, 19, "slash", envs=["retail"])[0],
            "id": "runs/2026/ep 7",
        }  # ids may hold '/' and spaces
        assert a.post("/v1/trajectories", json={"trajectories": [slashed]}).json()["items"][0]["id"] == "runs/2026/ep 7"
        assert a.delete("/v1/trajectories/runs/2026/ep%207").json() == {"id": "runs/2026/ep 7", "deleted": True}
        assert g.get("/v1/stats").json()["trajectories"] == sg["trajectories"]  # globex's copy of that id stays
        hits = g.post("/v1/retrieve", json={"queries": [{"task": records[0]["task"], "env": "retail"}], "k": 4}).json()
        assert victim in {h["id"] for h in hits["results"][0]["trajectories"]}


def test_admin_purges_a_tenant(front):
    with front.http("admin") as admin, front.http("globex") as g:
        g.post("/v1/trajectories", json={"trajectories": _records(3, 12, "purge")})
        held = g.get("/v1/stats").json()["trajectories"]
        assert held >= 3
        assert admin.delete("/v1/tenants/globex").json() == {"tenant": "globex", "removed": held}
        assert g.get("/v1/stats").json()["trajectories"] == 0
        assert g.get("/v1/clusters").json()["total"] == 0
        assert _error(admin.delete("/v1/tenants/not a tenant"), 422)["type"] == "validation_error"


def test_overload_answers_503_with_retry_after(front):
    """The coordinator paused and its queue (cluster.max_pending = 200) filled by adds answered
    202: a waiting add is refused with 503 and Retry-After; the accepted ones finish on resume."""
    import ray

    with front.http("acme") as rw:
        ray.get(front.client.coordinator.pause.remote())
        try:
            accepted = []
            for n, (count, seed) in enumerate(((40, 13), (50, 14), (50, 15), (50, 16))):  # 190 queued
                r = rw.post(
                    "/v1/trajectories", params={"wait": "false"}, json={"trajectories": _records(count, seed, f"q{n}")}
                )
                assert r.status_code == 202
                accepted.append(r.json()["operation"])
            time.sleep(1.0)  # the accepted adds reach the coordinator's queue
            refused = rw.post("/v1/trajectories", json={"trajectories": _records(50, 17, "q-over")})
            err = _error(refused, 503)
            assert (
                err["type"] == "unavailable"
                and "max_pending" in err["message"]
                and refused.headers["retry-after"] == "3"
            )
        finally:
            ray.get(front.client.coordinator.resume.remote())
        for op in accepted:
            deadline = time.monotonic() + 120
            while (got := rw.get(f"/v1/operations/{op}").json())["status"] == "pending":
                assert time.monotonic() < deadline
                time.sleep(0.2)
            assert got["status"] == "done", got


def test_no_auth_mode_refuses_a_non_loopback_host(front):
    from lifemem_ray.actors.frontdoor.app import start_http

    open_config = DeploymentConfig().replace({"http.auth": "none"})
    ring = KeyRing.from_config(open_config.http, environ={})
    with pytest.raises(ConfigError, match="loopback only"):
        start_http(front.namespace, open_config, ring, host="0.0.0.0", port=free_port())
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "lifemem_ray.cli",
            "serve",
            "--http",
            "--host",
            "0.0.0.0",
            "--set",
            "http.auth=none",
            "--namespace",
            front.namespace,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 1 and "loopback only" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "lifemem_ray.cli", "serve", "--http", "--namespace", front.namespace],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 1 and "no API key is configured" in out.stderr


def test_mcp_is_mounted_at_mcp_behind_the_same_keys(front):
    import asyncio

    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    r = httpx.post(f"{front.url}/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"}, timeout=60)
    assert _error(r, 401)["type"] == "unauthorized" and r.headers["www-authenticate"].startswith("Bearer")
    record = _records(1, 16, "mcp", envs=["web_forms"])[0]

    async def scenario() -> None:
        async def session(role: str) -> Any:
            http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {front.keys[role]}"}, timeout=120)
            return http, Client(streamable_http_client(f"{front.url}/mcp", http_client=http), mode="auto", cache=None)

        http_a, client_a = await session("acme")
        http_ro, client_ro = await session("acme_ro")
        async with http_a, client_a as a, http_ro, client_ro as ro:
            tools = {t.name: t for t in (await a.list_tools()).tools}
            assert {"add_trajectory", "retrieve_experience", "memory_stats"} <= set(tools)
            args = {k: record[k] for k in ("id", "env", "task", "steps", "outcome")}
            added = await a.call_tool("add_trajectory", args)
            assert not added.is_error and added.structured_content["tenant"] == "acme"
            refused = await ro.call_tool("add_trajectory", args)
            assert refused.is_error and "'write' scope" in refused.content[0].text
            got = await ro.call_tool("retrieve_experience", {"task": record["task"], "env": "web_forms", "k": 2})
            assert record["id"] in {h["id"] for h in got.structured_content["trajectories"]}

    asyncio.run(scenario())
    # The same trajectory over REST: the MCP add stored it for acme, and not for globex.
    with front.http("acme") as a, front.http("globex") as g:
        assert a.post("/v1/trajectories", json={"trajectories": [record]}).json()["items"][0]["status"] == "duplicate"
        assert g.get("/v1/clusters", params={"env": "web_forms"}).json()["total"] == 0


def test_answers_and_latencies_reach_rays_prometheus_endpoint(front, ray_metrics_url):
    """The front door counts every answer by route template, method and status, and observes
    the latency of acknowledged adds and retrievals (layer http), in the replicas' processes."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> list:
        body = urllib.request.urlopen(ray_metrics_url, timeout=10).read().decode()
        return [(x.name, dict(x.labels), x.value) for f in text_string_to_metric_families(body) for x in f.samples]

    def value(samples: list, name: str, labels: tuple) -> float:
        return sum(v for n, got, v in samples if n == name and all(got.get(k) == want for k, want in labels))

    wanted = [
        ("ray_lifemem_http_responses_total", (("route", "/v1/retrieve"), ("method", "POST"), ("status", "200"))),
        ("ray_lifemem_http_responses_total", (("route", "/v1/stats"), ("method", "GET"), ("status", "401"))),
        (
            "ray_lifemem_http_responses_total",
            (("route", "/v1/trajectories/{id}"), ("method", "DELETE"), ("status", "404")),
        ),
        ("ray_lifemem_latency_seconds_count", (("operation", "add"), ("layer", "http"))),
        ("ray_lifemem_latency_seconds_count", (("operation", "retrieve"), ("layer", "http"))),
    ]
    deadline = time.monotonic() + 90
    while True:  # the node's metrics agent may still be starting
        try:
            before = {w: value(scrape(), *w) for w in wanted}
            break
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(1.0)
    with front.http("acme") as rw, front.http() as anon:
        assert rw.post("/v1/trajectories", json={"trajectories": _records(2, 18, "metric")}).status_code == 200
        assert rw.post("/v1/retrieve", json={"queries": [{"task": "buy a lamp", "env": "shop"}]}).status_code == 200
        assert anon.get("/v1/stats").status_code == 401
        assert rw.delete("/v1/trajectories/never-stored").status_code == 404
    while True:
        samples = scrape()
        missing = [w for w in wanted if value(samples, *w) <= before[w]]
        if not missing:
            break
        assert time.monotonic() < deadline, f"not exported within 90 s: {missing}"
        time.sleep(1.0)


def test_a_dead_shard_answers_503_with_retry_after(front):
    """A shard gone for good (killed without restart; the last test of the deployment but one):
    reads and /healthz answer 503 with Retry-After, in the one error shape; nothing hangs."""
    import ray

    ray.kill(front.client.shards[1], no_restart=True)
    with front.http("acme") as rw:
        for r in (
            rw.post("/v1/retrieve", json={"queries": [{"task": "book a flight", "env": "airline"}]}),
            rw.get("/v1/stats"),
        ):
            err = _error(r, 503)
            assert (
                err["type"] == "unavailable"
                and r.headers["retry-after"] == "3"
                and "retry after 3 s" in err["what_to_do"]
            )
        health = rw.get("/healthz")
        assert health.status_code == 503 and health.headers["retry-after"] == "3"
        assert health.json()["coordinator"] is True and health.json()["shards"] == [True, False]


def test_cli_serve_http_replaces_the_front_door_and_stop_removes_it(front, ray_local):
    """`lifemem-ray serve --http` in front of the running deployment (keys from LIFEMEM_API_KEYS),
    then `lifemem-ray stop`: the deployment and its front door go. Runs last of the Serve tests."""
    import os

    key, entry = new_key("acme", "read", name="cli-key")
    port = int(front.url.rsplit(":", 1)[1])
    remote = ["--address", ray_local.get_runtime_context().gcs_address, "--namespace", front.namespace]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LIFEMEM_API_KEYS": json.dumps([entry.to_dict()])}
    out = subprocess.run(
        [sys.executable, "-m", "lifemem_ray.cli", "serve", "--http", "--port", str(port), *remote, "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    info = json.loads(out.stdout)
    assert info["http"]["url"] == front.url and info["http"]["keys"] == 1 and len(info["shards"]) == 2
    with httpx.Client(base_url=front.url, timeout=120) as http:
        deadline = time.monotonic() + 120
        # The new replica takes over: its key is known (404: no such operation), the old keys are not.
        while http.get("/v1/operations/none", headers={"Authorization": f"Bearer {key}"}).status_code != 404:
            assert time.monotonic() < deadline
            time.sleep(0.5)
        assert (
            http.get("/v1/operations/none", headers={"Authorization": f"Bearer {front.keys['acme']}"}).status_code
            == 401
        )
        other = subprocess.run(
            [sys.executable, "-m", "lifemem_ray.cli", "serve", "--http", "--port", str(free_port()), *remote],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=ROOT,
            env=env,
        )
        assert other.returncode == 1 and "already runs on this cluster with its HTTP proxy at" in other.stderr
        stop = subprocess.run(
            [sys.executable, "-m", "lifemem_ray.cli", "stop", *remote, "--json"],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=ROOT,
            env=env,
        )
        assert stop.returncode == 0 and json.loads(stop.stdout)["http"] is True, stop.stderr[-3000:]
        assert http.get("/healthz").status_code == 404  # Serve answers, the front door is gone


def test_the_operations_table_is_bounded_and_forgets(monkeypatch):
    """Operations kept for polling: at most operations_max (the oldest finished go first; full of
    pending ones, a new one is refused), each forgotten after the TTL, a stalled one reads failed."""
    from lifemem_ray.actors.frontdoor import operations as ops_module
    from lifemem_ray.core.errors import OverloadedError

    now = [1000.0]
    monkeypatch.setattr(ops_module.time, "time", lambda: now[0])
    table = ops_module.Operations(max_kept=2, ttl_s=60, max_items=1_000)
    a = table.create("acme", ["x"], deadline_s=10)
    b = table.create("acme", ["y"], deadline_s=10)
    with pytest.raises(OverloadedError, match="operations_max"):
        table.create("acme", ["z"], deadline_s=10)
    table.finish(a, [{"id": "x", "status": "added", "cluster_id": 1}])
    c = table.create("globex", ["z"], deadline_s=10)  # the finished one made room
    assert table.get(a, "acme") is None and table.count() == 2
    assert table.get(c, "acme") is None and table.get(c, "globex")["status"] == "pending"  # another tenant's: unseen
    now[0] += 11
    stalled = table.get(b, "acme")
    assert stalled["status"] == "failed" and "send the same trajectories again" in stalled["error"]["what_to_do"]
    table.finish(b, [])  # a late answer does not overwrite what the poller was told
    assert table.get(b, "acme")["status"] == "failed"
    now[0] += 60
    assert table.get(c, "globex") is None and table.count() == 0 and table.item_count() == 0


def test_the_operations_table_bounds_the_answers_it_keeps():
    """At most http.operations_max_items trajectory answers over all operations: the oldest
    finished ones make room; a table full of pending ones refuses (503), as does one operation
    larger than the bound."""
    from lifemem_ray.actors.frontdoor import operations as ops_module
    from lifemem_ray.core.errors import OverloadedError

    table = ops_module.Operations(max_kept=100, ttl_s=600, max_items=10)
    a = table.create("acme", [f"a{i}" for i in range(6)], deadline_s=60)
    with pytest.raises(OverloadedError, match=r"http\.operations_max_items"):
        table.create("acme", [f"b{i}" for i in range(6)], deadline_s=60)  # 12 > 10, nothing finished yet
    table.finish(a, [{"id": f"a{i}", "status": "added", "cluster_id": 1} for i in range(6)])
    b = table.create("acme", [f"b{i}" for i in range(6)], deadline_s=60)  # the finished one made room
    assert table.get(a, "acme") is None and table.get(b, "acme")["status"] == "pending" and table.item_count() == 6
    with pytest.raises(OverloadedError, match="at most 10"):
        table.create("acme", [f"c{i}" for i in range(11)], deadline_s=60)
    with pytest.raises(ConfigError, match=r"http\.operations_max_items"):
        DeploymentConfig().replace({"http.operations_max_items": 5_000, "http.max_batch_items": 10_000})


@pytest.mark.parametrize("failure", ["gone", "silent"])
def test_health_without_a_deployment_names_no_namespace_or_internals(monkeypatch, failure, caplog):
    """/healthz needs no key: a failed check says what kind of failure, the log says the rest."""
    import ray

    from lifemem_ray.actors.cluster.remote_errors import DeploymentNotFoundError
    from lifemem_ray.actors.frontdoor import front_service as http_service

    def find(namespace: str):
        if failure == "gone":
            raise DeploymentNotFoundError(f"no lifemem deployment in Ray namespace {namespace!r}")
        raise ray.exceptions.GetTimeoutError("Get timed out: ObjectRef(00ffab12) not ready")

    monkeypatch.setattr(http_service, "find_coordinator", find)
    service = http_service.FrontService("tenant-secret-ns", DeploymentConfig())
    try:
        with caplog.at_level("WARNING", logger=http_service.__name__):
            answer = service.health()
    finally:
        service.close()
    assert answer["ok"] is False and answer["coordinator"] is False and answer["shards"] == []
    assert answer["detail"] == ("no deployment is serving" if failure == "gone" else "the coordinator did not answer")
    assert "tenant-secret-ns" not in json.dumps(answer) and "ObjectRef" not in json.dumps(answer)
    assert "tenant-secret-ns" in caplog.text  # an operator still finds it


def test_a_removal_that_outlasts_its_timeout_answers_503_and_goes_on(monkeypatch):
    """Deletions and purges are bounded by http.delete_timeout_s like reads and adds: the caller
    gets a 503 telling it to send again; the removal itself is not called back."""
    import threading

    from lifemem_ray.actors.frontdoor import front_service as http_service
    from lifemem_ray.core.errors import OverloadedError
    from lifemem_ray.service.principal import Principal

    release, finished = threading.Event(), threading.Event()

    class SlowClient:
        def remove(self, ids, tenant):
            release.wait(30)
            finished.set()
            return len(ids)

        def purge_tenant(self, tenant):
            return 3

    service = http_service.FrontService("ns", DeploymentConfig().replace({"http.delete_timeout_s": 0.2}))
    monkeypatch.setattr(service, "memory", SlowClient())
    admin = Principal(tenant="acme", scopes=frozenset({"read", "write", "admin"}))
    try:
        with pytest.raises(OverloadedError, match=r"http\.delete_timeout_s") as info:
            service.delete("t-1", admin)
        assert "send it again" in str(info.value) and not finished.is_set()
        release.set()
        assert finished.wait(10)  # the removal went on and finished
        assert service.purge("acme", admin) == 3  # within the bound: the count
    finally:
        service.close()


def test_cluster_listing_asks_the_shards_for_at_most_the_limit(monkeypatch):
    """GET /v1/clusters: the shards send at most http.max_clusters_listed clusters; the total
    is counted apart only when the listing is cut."""
    from types import SimpleNamespace

    from lifemem_ray.actors.frontdoor import front_service as http_service
    from lifemem_ray.service.principal import Principal

    asked: list[tuple[str, Any]] = []

    class Client:
        def clusters(self, env, tenant, limit=None):
            asked.append(("clusters", limit))
            sizes = [9, 7, 5, 3, 1] if env is None else [4]
            return [SimpleNamespace(count=n, to_dict=lambda n=n: {"count": n}) for n in sizes][:limit]

        def cluster_count(self, env, tenant):
            asked.append(("count", env))
            return 5

    service = http_service.FrontService("ns", DeploymentConfig().replace({"http.max_clusters_listed": 3}))
    monkeypatch.setattr(service, "memory", Client())
    reader = Principal(tenant="acme", scopes=frozenset({"read"}))
    try:
        cut = service.clusters(reader, None)
        assert cut == {"clusters": [{"count": 9}, {"count": 7}, {"count": 5}], "total": 5, "truncated": True}
        assert asked == [("clusters", 3), ("count", None)]
        asked.clear()
        assert service.clusters(reader, "airline") == {"clusters": [{"count": 4}], "total": 1, "truncated": False}
        assert asked == [("clusters", 3)]  # not cut: no count asked
    finally:
        service.close()
