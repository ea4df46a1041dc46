"""A real front door for tests: a 2-shard deployment, Ray Serve on a free loopback port and
the REST/MCP application in front of it, with one API key per role. Used by the REST tests
and the front door's hardening tests (one module at a time: Serve's HTTP address is fixed
while it runs, so each module shuts Serve down at its end)."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.service.auth import KeyRing, new_key
from support.common import SMALL_ACTORS


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Front:
    """The running front door: its URL and port, a key per role, and the deployment's client."""

    def __init__(
        self, url: str, port: int, keys: dict[str, str], client: Any, namespace: str, config: DeploymentConfig
    ) -> None:
        self.url, self.port, self.keys, self.client, self.namespace, self.config = (
            url,
            port,
            keys,
            client,
            namespace,
            config,
        )

    def http(self, role: str | None = None, timeout: float = 300) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.keys[role]}"} if role else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)


@contextlib.contextmanager
def serve_front(store: Path, namespace: str, roles: list[tuple[str, str, str]], **overrides: Any) -> Iterator[Front]:
    """Deploy 2 shards in ``store``, start Serve and the front door with a key per
    ``(role, tenant, scopes)``; wait for /healthz; stop everything at the end."""
    from ray import serve

    from lifemem_ray.actors.client.blocking import MemoryClient
    from lifemem_ray.actors.cluster import deployment as dep
    from lifemem_ray.actors.frontdoor.app import start_http, stop_http

    config = DeploymentConfig().replace(
        {"cluster.namespace": namespace, "cluster.batch_wait_ms": 5, **SMALL_ACTORS, **overrides}
    )
    dep.deploy(store, config, shards=2)
    keys, entries = {}, []
    for role, tenant, scopes in roles:
        keys[role], entry = new_key(tenant, scopes, name=role.replace("_", "-"))
        entries.append(entry)
    port = free_port()
    try:
        url = start_http(namespace, config, KeyRing.from_entries(entries), host="127.0.0.1", port=port)["url"]
        deadline = time.monotonic() + 240
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=10).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the front door did not answer /healthz within 240 s"
            time.sleep(0.5)
        yield Front(url, port, keys, MemoryClient(namespace, config), namespace, config)
    finally:
        stop_http(namespace)
        serve.shutdown()
        dep.stop(namespace)
