"""The shard keeper's policy, the refusal of calls to a shard that is down, scheduled
checkpoints and the durable settings, without Ray (tests/actors/cluster/test_multinode.py runs the keeper on
a Ray cluster of several nodes, tests/multihost on separate hosts)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from lifemem_ray.actors.cluster.checkpoints import CheckpointSchedule, shard_log_uri
from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.actors.cluster.ray_shards import RayShards
from lifemem_ray.actors.cluster.remote_errors import ShardUnavailableError
from lifemem_ray.actors.cluster.shard_keeper import ShardSight, next_step
from lifemem_ray.core.errors import ConfigError, StoreError


def sight(state: str = "RESTARTING", node_alive: bool = False, down_for_s: float = 0.0) -> ShardSight:
    return ShardSight(1, state, "node-a", node_alive, down_for_s)


@pytest.mark.parametrize(
    ("seen", "seeing", "durable", "expected"),
    [
        (sight("ALIVE", True), [], True, ("ok", None)),
        (sight("RESTARTING", True), [], True, ("wait", None)),  # Ray restarts it on its live node
        (sight("DEAD", True), [], False, ("restart", "node-a")),  # Ray gave up: started again there
        (sight("MISSING", True), [], False, ("restart", "node-a")),
        (sight(down_for_s=5.0), ["node-b"], False, ("restart", "node-b")),  # its disk came back on node-b
        (sight(down_for_s=5.0), [], True, ("wait", None)),  # not yet declared lost
        (sight(down_for_s=31.0), [], True, ("rebuild", "node-c")),
        (sight(down_for_s=31.0), [], False, ("wait", None)),  # no durable address: only its disk brings it back
        (sight(down_for_s=31.0), ["node-b"], True, ("restart", "node-b")),  # its own files beat a rebuild
    ],
)
def test_next_step(seen, seeing, durable, expected):
    assert next_step(seen, seeing=seeing, durable=durable, lost_after_s=30.0, candidate="node-c") == expected


def test_no_rebuild_without_a_node_to_rebuild_on():
    assert next_step(sight(down_for_s=99.0), seeing=[], durable=True, lost_after_s=30.0, candidate=None) == (
        "wait",
        None,
    )


def test_a_shard_marked_down_is_refused_at_once_and_a_waiting_call_stops():
    shards = RayShards(["lifemem-shard-0"], "ns", call_timeout_s=600.0, check_s=0.05)
    shards.mark(0, "its node is gone; retry shortly")
    with pytest.raises(ShardUnavailableError, match=r"shard 0 .*during known: its node is gone"):
        asyncio.run(shards.call(0, "known", [], []))

    class Pending:  # an actor method whose answer never comes (its node died)
        def remote(self, *args):
            return asyncio.get_running_loop().create_future()

    class Handle:
        known = Pending()

    async def call_then_mark() -> None:
        shards.mark(0, None)
        shards._handles[0] = Handle()
        waiting = asyncio.ensure_future(shards.call(0, "known", [], []))
        await asyncio.sleep(0.1)
        shards.mark(0, "being rebuilt; retry shortly")
        await waiting

    with pytest.raises(ShardUnavailableError, match="being rebuilt"):
        asyncio.run(asyncio.wait_for(call_then_mark(), timeout=10))
    assert 0 not in shards._handles  # looked up again next time


def test_a_look_leaves_a_shard_being_created_on_its_live_node_alone(monkeypatch, tmp_path):
    """A deployment's first call starts the keeper while its shards may still be pending
    creation: marking them down then made the deployment's own first call fail (seen on CI).
    A shard whose node is gone is marked down; one Ray restarts on its live node once it has
    been restarting for cluster.restart_wait_s."""
    from lifemem_ray.actors.cluster import shard_keeper

    states = {"s0": "PENDING_CREATION", "s1": "DEPENDENCIES_UNREADY", "s2": "RESTARTING", "s3": "PENDING_CREATION"}
    monkeypatch.setattr(shard_keeper, "named_actor_states", lambda namespace, names: {n: states[n] for n in names})
    monkeypatch.setattr(shard_keeper, "alive_nodes", lambda: [{"NodeID": "live", "Resources": {}}])
    monkeypatch.setattr(shard_keeper, "nodes_seeing", lambda nodes, paths, timeout_s: [[]])

    class Routing:
        def get_meta(self, key):
            return ["live", "live", "live", "gone"] if key == "nodes" else None

    marked: dict[int, str | None] = {}
    config = DeploymentConfig()
    keeper = shard_keeper.ShardKeeper(
        ["s0", "s1", "s2", "s3"], tmp_path, config, 8, Routing(), lambda i, why: marked.__setitem__(i, why)
    )
    assert keeper.look() == []
    assert set(marked) == {3}, "a restart on a live node is waited for, cluster.restart_wait_s"
    assert "its node gone" in str(marked[3]) and "is gone" in str(marked[3])
    config.cluster.restart_wait_s = 0.0  # past the wait: refused
    keeper.look()
    assert set(marked) == {2, 3} and "its actor is restarting" in str(marked[2])


def test_checkpoints_are_scheduled_and_failures_retried():
    calls: list[int] = []
    done = threading.Event()

    def checkpoint() -> dict:
        calls.append(1)
        if len(calls) == 1:
            raise StoreError("shared log: storage unreachable (test)")
        done.set()
        return {"seq": 7}

    schedule = CheckpointSchedule(checkpoint, 0.05, "test-checkpoints")
    try:
        assert done.wait(10)
    finally:
        schedule.stop()
    status = schedule.status()
    assert status["last"]["seq"] == 7 and status["last_error"] is None and len(calls) >= 2


def test_shard_log_uris_are_apart_per_namespace_and_shard():
    assert shard_log_uri("/shared/lm/", "a", 0) == "/shared/lm/a/shard-00"
    assert shard_log_uri("s3://b/p", "a/b", 12) == "s3://b/p/a%2Fb/shard-12"


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("cluster.durable_uri", "relative/path"),
        ("cluster.durable_uri", "/x\n"),
        ("cluster.node_lost_after_s", 0.5),
        ("cluster.snapshots_kept", 0),
        ("cluster.health_check_s", 0.0),
        ("store.shared_log_endpoint_url", "ftp://x"),
    ],
)
def test_durable_settings_are_bounded(key, value):
    with pytest.raises(ConfigError, match=key.split(".")[1]):
        DeploymentConfig().replace({key: value}).validate()


def test_durable_settings_load_from_toml(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[cluster]\ndurable_uri = "s3://bucket/lm"\nsnapshot_every_s = 60\nsnapshots_kept = 5\n')
    config = DeploymentConfig.load(path)
    assert (config.cluster.durable_uri, config.cluster.snapshot_every_s, config.cluster.snapshots_kept) == (
        "s3://bucket/lm",
        60.0,
        5,
    )
