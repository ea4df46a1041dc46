"""API keys as the deployment's settings load them (file, environment, bounds, the keys command)
and the front door's application refusing requests without a valid key (the keys themselves:
tests/service/test_auth.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.common import ROOT

from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.core.errors import ConfigError
from lifemem_ray.service.auth import ENV_KEYS, KeyRing, new_key
from lifemem_ray.service.principal import SCOPES


def test_keys_come_from_the_config_file_and_the_environment(tmp_path):
    key_a, entry_a = new_key("acme", ["read", "write"], name="a")
    key_b, entry_b = new_key("globex", ["read"], name="b")
    config = tmp_path / "server.toml"
    config.write_text(
        f'[http]\nport = 8123\n\n[[http.api_keys]]\nname = "a"\nsha256 = "{entry_a.sha256}"\ntenant = "acme"\n'
        'scopes = ["read", "write"]\n'
    )
    loaded = DeploymentConfig.load(config, environ={})
    assert loaded.http.port == 8123
    ring = KeyRing.from_config(loaded.http, environ={ENV_KEYS: json.dumps([entry_b.to_dict()])})
    assert (
        ring.authenticate(f"Bearer {key_a}").tenant == "acme"
        and ring.authenticate(f"Bearer {key_b}").tenant == "globex"
    )
    # A file path in the variable, and the generic LIFEMEM_HTTP_API_KEYS (JSON) too.
    keyfile = tmp_path / "keys.json"
    keyfile.write_text(json.dumps([entry_b.to_dict()]))
    ring = KeyRing.from_config(DeploymentConfig().http, environ={ENV_KEYS: str(keyfile)})
    assert ring.authenticate(f"Bearer {key_b}").tenant == "globex"
    generic = DeploymentConfig.load(environ={"LIFEMEM_HTTP_API_KEYS": json.dumps([entry_a.to_dict()])})
    assert KeyRing.from_config(generic.http, environ={}).authenticate(f"Bearer {key_a}").key_id == "a"
    with pytest.raises(ConfigError, match=r"LIFEMEM_HTTP_API_KEYS: .*not JSON"):
        DeploymentConfig.load(environ={"LIFEMEM_HTTP_API_KEYS": "[oops"})
    with pytest.raises(ConfigError, match=f"{ENV_KEYS}: neither a JSON list nor a readable file"):
        KeyRing.from_config(DeploymentConfig().http, environ={ENV_KEYS: str(tmp_path / "missing.json")})
    with pytest.raises(ConfigError, match=r"http.api_keys\[0\]\.sha256"):
        DeploymentConfig.load(environ={"LIFEMEM_HTTP_API_KEYS": json.dumps([{**entry_a.to_dict(), "sha256": "short"}])})


def test_keys_mode_without_any_key_is_refused_and_no_auth_acts_as_the_default_tenant():
    with pytest.raises(ConfigError, match="no API key is configured: make one with `lifemem-ray keys new"):
        KeyRing.from_config(DeploymentConfig().http, environ={})
    open_ring = KeyRing.from_config(DeploymentConfig().replace({"http.auth": "none"}).http, environ={})
    who = open_ring.authenticate(None)
    assert who.tenant == "default" and who.scopes == frozenset(SCOPES)
    with pytest.raises(ConfigError, match=r"http\.auth: must be one of keys, none"):
        DeploymentConfig().replace({"http.auth": "open"})


def test_http_settings_have_bounds():
    for key, bad in (
        ("port", 0),
        ("port", 70_000),
        ("replicas", 0),
        ("max_body_bytes", 10),
        ("max_batch_items", 0),
        ("max_queries", 10**9),
        ("operations_ttl_s", float("inf")),
        ("retry_after_s", 0),
    ):
        with pytest.raises(ConfigError, match=f"http.{key}"):
            DeploymentConfig().replace({f"http.{key}": bad})


def test_keys_new_command_prints_a_key_and_an_entry_that_the_server_accepts(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "lifemem_ray.cli",
            "keys",
            "new",
            "--tenant",
            "acme",
            "--scopes",
            "read,write",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    ring = KeyRing.from_entries([data["entry"]])
    assert ring.authenticate(f"Bearer {data['key']}").scopes == frozenset({"read", "write"})
    text = subprocess.run(
        [sys.executable, "-m", "lifemem_ray.cli", "keys", "new", "--tenant", "acme", "--scopes", "read"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    ).stdout
    toml = text[text.index("[[http.api_keys]]") :]
    (tmp_path / "c.toml").write_text(toml)
    assert len(DeploymentConfig.load(tmp_path / "c.toml", environ={}).http.api_keys) == 1
    bad = subprocess.run(
        [sys.executable, "-m", "lifemem_ray.cli", "keys", "new", "--tenant", "acme", "--scopes", "read,root"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert bad.returncode == 1 and "--scopes: unknown scope(s) ['root']" in bad.stderr


class _NoMemory:
    """A front service without a deployment: what build_app needs to build its routes."""

    def __init__(self) -> None:
        from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig

        self.config = DeploymentConfig()
        self.http = self.config.http
        self.body_parsed = False

    def require(self, principal, scope, what=""):
        principal.require(scope, what)

    def retrieve(self, *args):
        self.body_parsed = True
        return []

    def health(self):
        return {"ok": True, "coordinator": True, "shards": [], "detail": None}


def _front_app(mode: str, entries=()):
    from fastapi.testclient import TestClient

    from lifemem_ray.actors.frontdoor.app import build_app

    service = _NoMemory()
    return service, TestClient(build_app(service, KeyRing.from_entries(list(entries), mode)))


def test_a_request_without_a_valid_key_is_refused_before_its_body_is_read():
    key, entry = new_key("acme", "read")
    service, client = _front_app("keys", [entry.to_dict()])
    with client:
        r = client.post("/v1/retrieve", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer"), r.text
        r = client.post(
            "/v1/retrieve",
            content=b"{not json",
            headers={"content-type": "application/json", "authorization": "Bearer lmk_wrong"},
        )
        assert r.status_code == 401
        assert client.get("/healthz").status_code == 200 and client.get("/openapi.json").status_code == 200
        assert client.get("/v1/nothing-here").status_code == 404
        r = client.post("/v1/retrieve", json={"queries": [{"task": "t"}]}, headers={"authorization": f"Bearer {key}"})
        assert r.status_code == 200 and service.body_parsed


def test_a_keyless_front_door_answers_loopback_host_names_only():
    _, client = _front_app("none")
    with client:
        assert client.get("/healthz", headers={"host": "127.0.0.1:8000"}).status_code == 200
        assert client.get("/healthz", headers={"host": "localhost:8000"}).status_code == 200
        assert client.get("/healthz", headers={"host": "attacker.example:8000"}).status_code == 400, "DNS rebinding"


def test_a_route_the_metrics_do_not_know_fails_when_the_app_is_built(monkeypatch):
    """Every route's answers are counted by template: a route added to the app but not to
    http_metrics.ROUTES fails at build time, not at each answer ('metrics failed')."""
    from lifemem_ray.actors.frontdoor import app as front_app
    from lifemem_ray.actors.frontdoor import http_metrics
    from lifemem_ray.core.errors import MetricTagError

    _front_app("keys", [new_key("acme", "read")[1].to_dict()])  # today's routes are all known
    monkeypatch.setattr(http_metrics, "ROUTES", tuple(r for r in http_metrics.ROUTES if r != "/v1/stats"))
    with pytest.raises(MetricTagError, match=r"routes \['/v1/stats'\] are not in http_metrics.ROUTES"):
        _front_app("keys", [new_key("acme", "read")[1].to_dict()])
    assert front_app.check_routes is http_metrics.check_routes
