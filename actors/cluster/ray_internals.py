"""The only place that touches Ray's private API: each function says why no public API serves.

Ray moves its internals between releases, so every use is here, behind a function with a plain
answer, and ``tests/actors/cluster/test_ray_internals.py`` calls each one against a running Ray: an upgrade
that moves one fails there, by name, instead of somewhere in a deployment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lifemem_ray.core.errors import InvalidArgumentError, UsageError

__all__ = [
    "actor_alive",
    "actor_state",
    "address_file",
    "dialled_address",
    "forget_dead_actor",
    "keep_python_signal_handlers",
    "keep_token_auth",
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


def dialled_address(address: str) -> str:
    """``address`` (``host:port``) as ``ray.init`` dials it: ``localhost``, ``127.0.0.1`` and
    ``::1`` become this node's IP, everything else stays. Private: Ray's
    ``canonicalize_bootstrap_address``, called only with a concrete address (given None or
    "auto" it would search this machine for a cluster, which is what its callers avoid).

    Args:
        address: a concrete ``host:port``.

    Returns:
        The ``host:port`` Ray will connect to.

    Raises:
        InvalidArgumentError: ``address`` is not ``host:port``, or is "auto" or "local".
    """
    from ray._private.services import canonicalize_bootstrap_address

    if address in ("auto", "local"):
        raise InvalidArgumentError(f"{address!r} is not a concrete host:port", where="ray_internals.dialled_address")
    try:
        dialled = canonicalize_bootstrap_address(address)
    except ValueError as exc:
        raise InvalidArgumentError(
            f"{address!r} is not host:port ({exc})", where="ray_internals.dialled_address"
        ) from None
    return str(dialled)


def keep_token_auth() -> bool:
    """Turn Ray's token authentication on in this process where a token exists and
    ``RAY_AUTH_MODE`` is not set: ``ray.init`` does so itself only for a cluster it found by
    searching ("auto"), never for an address it was given, so a client joining by address
    would otherwise send no token and be refused. Sets ``RAY_AUTH_MODE=token`` (inherited by
    child processes) and reloads Ray's config, as Ray does; an explicit ``RAY_AUTH_MODE`` is
    kept as it is. Private: ``ray._private.authentication``.

    Returns:
        Whether token authentication is on now.
    """
    import logging

    from ray._private.authentication import authentication_token_setup as setup

    quiet = logging.getLogger(setup.__name__)
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # Ray logs "token authentication is enabled" as a warning: not news here
    try:
        return bool(setup.maybe_enable_token_auth_if_token_available(warn_if_disabled=False))
    finally:
        quiet.setLevel(level)


def keep_python_signal_handlers() -> None:
    """Leave Ray's C++ failure-signal handler out of the core worker this process starts next:
    it takes SIGTERM, prints a stack trace, and can abort the process (exit -6) before Python's
    handler has run the command's cleanup. Private: ``RAY_DISABLE_FAILURE_SIGNAL_HANDLER`` is
    read once, when Ray is imported, into ``ray_constants``, which Ray reads when it starts a
    worker; setting the constant keeps it to this process (the variable would also reach
    every process started from here)."""
    from ray._private import ray_constants

    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True


def session_dir() -> Path:
    """This process's Ray session folder (where a head ``lifemem-ray serve`` started records its
    pid). Private: the runtime context exposes no session path."""
    import ray

    node: Any = ray._private.worker._global_node  # Any: Ray declares it `= None`; ray.init() sets it
    if node is None:
        raise UsageError(
            "this process is not connected to Ray; call ray.init() first", where="ray_internals.session_dir"
        )
    return Path(node.get_session_dir_path())


def actor_alive(handle: Any) -> bool:
    """Whether the GCS reports the actor behind ``handle`` as alive (not restarting, not dead).
    Private: the public state API (``ray.util.state``) goes through the dashboard, which a
    deployment runs without."""
    from ray._private.state import actors as actor_table

    return actor_table(handle._actor_id.hex()).get("State") == "ALIVE"


def actor_state(handle: Any) -> str | None:
    """The GCS's state of the actor behind ``handle`` (``ALIVE``, ``RESTARTING``, ``DEAD``...;
    None: not in its table), read from the GCS now, not from this process's own view of it.
    Private, as :func:`actor_alive`."""
    from ray._private.state import actors as actor_table

    state = actor_table(handle._actor_id.hex()).get("State")
    return None if state is None else str(state)


def forget_dead_actor(handle: Any) -> bool:
    """Make this process forget an actor the GCS reports dead, so that looking its name up
    again finds the actor now registered under it. A driver whose Ray connection predates a
    GCS restart never hears that the actors it knew died (measured on the multi-host harness:
    calls fail with ``ActorUnavailableError``, and ``ray.get_actor`` keeps answering the dead
    actor from its cache of names, for minutes); ``ray.kill`` of the dead actor clears that
    cache. Never kills a live one: returns False, doing nothing, unless the GCS says ``DEAD``."""
    import ray

    if actor_state(handle) != "DEAD":
        return False
    ray.kill(handle, no_restart=True)
    return True


def serve_http_address() -> tuple[str, int]:
    """Where the running Ray Serve's HTTP proxy listens. Private: Serve's public API starts a
    proxy on an address but does not say which one is running."""
    from ray.serve.context import _get_global_client

    client = _get_global_client()  # raises RayServeException when no Serve controller runs
    if client is None:
        raise UsageError(
            "Ray Serve is not running; start the front door first", where="ray_internals.serve_http_address"
        )
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
