"""Every use of Ray's private API, called against a running Ray: when an upgrade of Ray moves
one, this fails by name (the callers fall back, quietly, where they can: see each)."""

from __future__ import annotations

import os

import pytest

from lifemem_ray.actors.cluster import ray_internals

pytestmark = pytest.mark.usefixtures("ray_local")


def test_the_session_folder_is_this_ray_session(ray_local):
    folder = ray_internals.session_dir()
    assert folder.is_dir() and folder.name.startswith("session_") and (folder / "logs").is_dir()


def test_an_actor_reads_alive_and_then_not(ray_local):
    @ray_local.remote(num_cpus=0)
    class Probe:
        def ping(self) -> int:
            return os.getpid()

    probe = Probe.remote()
    ray_local.get(probe.ping.remote())
    assert ray_internals.actor_alive(probe)
    ray_local.kill(probe, no_restart=True)
    for _ in range(100):
        if not ray_internals.actor_alive(probe):
            break
        import time

        time.sleep(0.1)
    assert not ray_internals.actor_alive(probe)


def test_named_actor_states_stay_in_their_namespace(ray_local):
    """The same name in another namespace, alive or waiting for resources, is not this one's
    (a CI run once saw a shard of another deployment, pending creation, through this)."""

    @ray_local.remote(num_cpus=0)
    class Probe:
        def ping(self) -> int:
            return os.getpid()

    here = Probe.options(name="probe-shard", namespace="ns-here").remote()
    # Never placeable: it stays PENDING_CREATION under the same name in another namespace.
    elsewhere = Probe.options(name="probe-shard", namespace="ns-elsewhere", resources={"no-such-node": 1}).remote()
    ray_local.get(here.ping.remote())
    try:
        states = ray_internals.named_actor_states("ns-here", ["probe-shard", "probe-absent"])
        assert states == {"probe-shard": "ALIVE", "probe-absent": "MISSING"}
        assert ray_internals.named_actor_states("ns-elsewhere", ["probe-shard"])["probe-shard"] in (
            "PENDING_CREATION",
            "DEPENDENCIES_UNREADY",
        )
    finally:
        ray_local.kill(here, no_restart=True)
        ray_local.kill(elsewhere, no_restart=True)


def test_the_metrics_report_interval_is_read():
    assert 0.0 < ray_internals.metrics_report_interval_s() <= 3600.0


def test_the_address_file_follows_ray_tmpdir(monkeypatch, tmp_path):
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    assert ray_internals.address_file() == tmp_path / "ray" / "ray_current_cluster"


def test_serves_http_address_is_reachable_where_serve_keeps_it():
    """Without Serve running this raises; what is checked is that the private entry point
    exists where the front door looks (tests/actors/frontdoor/test_http.py reads it with Serve running)."""
    from ray.serve import context

    assert callable(getattr(context, "_get_global_client", None)), "ray.serve.context._get_global_client moved"


def test_an_address_is_dialled_as_ray_init_dials_it():
    """Ray dials localhost as this node's outward address; any other host as given. Never a search."""
    assert ray_internals.dialled_address("10.1.2.3:6379") == "10.1.2.3:6379"
    assert ray_internals.dialled_address("127.0.0.1:6379").endswith(":6379")
    for word in ("auto", "local", "no-port"):
        with pytest.raises(ValueError):
            ray_internals.dialled_address(word)


def test_token_authentication_is_kept_on_and_ray_leaves_sigterm_to_python(ray_local):
    """The session's Ray runs with token authentication, so this process has it on (an explicit
    RAY_AUTH_MODE is kept as it is); the constant Ray reads for its failure-signal handler is
    where it is set."""
    from ray._private import ray_constants

    assert ray_internals.keep_token_auth() is True
    before = ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER
    try:
        ray_internals.keep_python_signal_handlers()
        assert ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER is True
    finally:
        ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = before
