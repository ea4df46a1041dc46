"""The only place that touches Ray's private API: each function says why no public API serves.

Ray moves its internals between releases, so every use is here, behind a function with a plain
answer, and ``tests/test_ray_internals.py`` calls each one against a running Ray: an upgrade
that moves one fails there, by name, instead of somewhere in a deployment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lifemem_ray.core.errors import UsageError

__all__ = [
    "actor_alive",
    "address_file",
    "metrics_report_interval_s",
    "named_actor_states",
    "serve_http_address",
    "session_dir",
]


def address_file() -> Path:
    """Where Ray keeps the address of the cluster the last ``ray start`` started (its
    ``ray_current_cluster`` file, under ``RAY_TMPDIR`` when set). Private: Ray documents the
    behaviour ("the latest cluster started") but not the path."""
    from ray._common.utils import get_ray_address_file

    return Path(get_ray_address_file(None))


def session_dir() -> Path:
    """This process's Ray session folder (where a head ``lifemem-ray serve`` started records its
    pid). Private: the runtime context exposes no session path."""
    import ray

    node: Any = ray._private.worker._global_node  # Any: Ray declares it `= None`; ray.init() sets it
    if node is None:
        raise UsageError("ray_internals.session_dir: this process is not connected to Ray; call ray.init() first")
    return Path(node.get_session_dir_path())


def actor_alive(handle: Any) -> bool:
    """Whether the GCS reports the actor behind ``handle`` as alive (not restarting, not dead).
    Private: the public state API (``ray.util.state``) goes through the dashboard, which a
    deployment runs without."""
    from ray._private.state import actors as actor_table

    return actor_table(handle._actor_id.hex()).get("State") == "ALIVE"


def serve_http_address() -> tuple[str, int]:
    """Where the running Ray Serve's HTTP proxy listens. Private: Serve's public API starts a
    proxy on an address but does not say which one is running."""
    from ray.serve.context import _get_global_client

    client = _get_global_client()  # raises RayServeException when no Serve controller runs
    if client is None:
        raise UsageError("ray_internals.serve_http_address: Ray Serve is not running; start the front door first")
    options = client.http_config
    return options.host, int(options.port)


def metrics_report_interval_s() -> float:
    """How often Ray's metrics agent reports (``RAY_metrics_report_interval_ms``). Private: the
    value lives in Ray's system config."""
    import ray

    return float(ray._config.metrics_report_interval_ms()) / 1000.0


def named_actor_states(namespace: str, names: list[str]) -> dict[str, str]:
    """Ray's state of each of ``names`` in ``namespace`` (``ALIVE``, ``RESTARTING``,
    ``PENDING_CREATION``, ``DEPENDENCIES_UNREADY``; ``MISSING`` where the namespace has no live
    actor of that name). The name is resolved in its namespace first: Ray's actor table does not
    say an actor's namespace, and other deployments (other namespaces) reuse the same names.
    Private, like :func:`actor_alive`: the GCS actor table, which the public state API reaches
    only through the dashboard."""
    import ray
    from ray._private.state import actors as actor_table

    states: dict[str, str] = {}
    for name in names:
        try:
            handle = ray.get_actor(name, namespace=namespace)
        except ValueError:  # no live actor of this name in the namespace
            states[name] = "MISSING"
            continue
        states[name] = str(actor_table(handle._actor_id.hex()).get("State") or "MISSING")
    return states
