"""A deployment whose coordinator is gone for good (as after its head node was lost) while its
shards live: ``status`` says so with the shards' counts and the command that recovers,
``serve`` adopts the live shards (nothing live is ended, nothing acknowledged lost), clients
opened before find the new coordinator by name, a failed start ends nothing it did not start,
``stop`` ends the orphans, and every client wait is bounded."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator

import pytest
import ray
from support.common import SMALL_ACTORS

from lifemem_ray.actors.client.awaiting import AsyncMemoryClient
from lifemem_ray.actors.client.blocking import MemoryClient
from lifemem_ray.actors.cluster import deployment as dep
from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.actors.cluster.status import deployment_status, status_table
from lifemem_ray.core.errors import (
    CoordinatorUnavailableError,
    DeploymentExistsError,
    DeploymentNotFoundError,
    EmbeddingError,
    ShardUnavailableError,
)
from lifemem_ray.lab.synthetic import generate, text_vectors


def _batch(n: int, seed: int):
    trajs = list(generate(n, seed=seed, envs=["shop", "sql"], length_scale=0.2, id_prefix=f"c{seed}-"))
    return trajs, text_vectors([t.task for t in trajs])


def _pids(namespace: str, names: list[str]) -> dict[str, int]:
    return {n: ray.get(ray.get_actor(n, namespace=namespace).info.remote())["pid"] for n in names}


WATCH_OFF = {
    "cluster.replace_dead_actors": False
}  # Ray restarts it instead; killed for good here, nothing brings it back


def test_a_coordinator_that_died_is_started_anew_by_the_shards_and_clients_find_it(deployment, tmp_path):
    client, _ = deployment(shards=2, store=tmp_path / "store", **{"cluster.health_check_s": 0.5})
    trajs, vecs = _batch(60, 4)
    client.add_many(trajs[:20], vecs[:20]).result(timeout=300)
    aio = asyncio.run(AsyncMemoryClient.connect(client.namespace, config=client.config))
    old = client.coordinator._actor_id
    ray.kill(client.coordinator, no_restart=True)  # as when it died with its node
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if ray.get_actor("lifemem-coordinator", namespace=client.namespace)._actor_id != old:
                break
        except ValueError:
            pass
        time.sleep(0.5)
    else:
        pytest.fail("no new coordinator within 120 s")
    # The clients opened before find the new one by name; it rebuilt its routes from the shards.
    assert [r.status for r in client.add_many(trajs[20:40], vecs[20:40]).result(timeout=300)] == ["added"] * 20
    assert asyncio.run(_add_and_count(aio, trajs[40:60], vecs[40:60])) == (["added"] * 20, 60)
    assert client.stats()["trajectories"] == 60 and client.verify()["ok"]


@pytest.mark.slow  # about 40 s (three CLI runs against the deployment): in .ci/run's slow step, off the default run
def test_a_lost_coordinator_is_told_by_status_and_serve_adopts_the_live_shards(deployment, tmp_path):
    store = tmp_path / "store"
    client, info = deployment(shards=2, store=store, **WATCH_OFF)
    trajs, vecs = _batch(80, 1)
    client.add_many(trajs[:40], vecs[:40]).result(timeout=300)
    namespace, config = client.namespace, client.config
    aio = asyncio.run(AsyncMemoryClient.connect(namespace, config=config))
    pids = _pids(namespace, info["shards"])

    ray.kill(client.coordinator, no_restart=True)  # gone for good, as when its node was lost
    status = deployment_status(namespace)
    assert status["coordinator"] == "down" and status["store"] == str(store.resolve())
    assert sum(s["trajectories"] for s in status["shards"]) == 40 and all(s["health"] == "up" for s in status["shards"])
    assert status["recover"] == f"lifemem-ray serve --store {store.resolve()} --namespace {namespace}"
    assert "coordinator: down" in status_table(status) and status["recover"] in status_table(status)
    hits = client.retrieve("q", "shop", vector=vecs[0])  # the shards still answer reads
    assert hits.trajectories
    with pytest.raises(DeploymentNotFoundError):  # an add finds no coordinator by name, and says so
        client.add_many(trajs[40:50], vecs[40:50]).result(timeout=60)

    dep.deploy(store, DeploymentConfig().replace({"cluster.namespace": namespace, **SMALL_ACTORS, **WATCH_OFF}))
    assert _pids(namespace, info["shards"]) == pids, "the live shards were adopted, not restarted"
    # The clients opened before find the new coordinator by name.
    assert [r.status for r in client.add_many(trajs[40:60], vecs[40:60]).result(timeout=300)] == ["added"] * 20
    results = asyncio.run(_add_and_count(aio, trajs[60:80], vecs[60:80]))
    assert results == (["added"] * 20, 80)
    assert client.stats()["trajectories"] == 80 and client.verify()["ok"]


async def _add_and_count(aio: AsyncMemoryClient, trajs, vecs) -> tuple[list[str], int]:
    results = await aio.add_many(trajs, vecs)
    stats = await aio.stats()
    return [r.status for r in results], stats["trajectories"]


def test_a_failed_start_ends_nothing_it_did_not_start_and_stop_ends_orphans(deployment, tmp_path):
    client, info = deployment(shards=2, store=tmp_path / "first", **WATCH_OFF)
    trajs, vecs = _batch(20, 2)
    client.add_many(trajs, vecs).result(timeout=300)
    namespace = client.namespace
    pids = _pids(namespace, info["shards"])
    ray.kill(client.coordinator, no_restart=True)
    other = DeploymentConfig().replace({"cluster.namespace": namespace, **SMALL_ACTORS})
    with pytest.raises(DeploymentExistsError, match=r"serves .*first"):
        dep.deploy(tmp_path / "second", other, shards=2)
    assert _pids(namespace, info["shards"]) == pids, "the other store's live shards were left alone"
    assert deployment_status(namespace)["coordinator"] == "down"
    assert dep.stop(namespace)  # the orphans are this namespace's deployment: stop ends them
    assert not ray.util.list_named_actors(all_namespaces=True) or all(
        a["namespace"] != namespace for a in ray.util.list_named_actors(all_namespaces=True)
    )
    with pytest.raises(DeploymentNotFoundError):
        deployment_status(namespace)


def test_every_client_wait_is_bounded(deployment, tmp_path):
    client, _ = deployment(shards=1, store=tmp_path / "store")
    trajs, vecs = _batch(10, 3)
    bounded = MemoryClient(client.namespace, client.config.replace({"cluster.call_timeout_s": 2}))
    ray.get(client.coordinator.pause.remote())  # the coordinator takes no batch: an add's answer never comes
    try:
        future = bounded.add_many(trajs, vecs)
        with pytest.raises(TimeoutError):
            future.result()  # no timeout given: cluster.call_timeout_s bounds it
        assert bounded.in_doubt, "an add without an answer is in doubt, not forgotten"
    finally:
        ray.get(client.coordinator.resume.remote())
    assert [r.status for r in future.result(timeout=120)] == ["added"] * 10


@contextlib.contextmanager
def _hung(pid: int) -> Iterator[None]:
    """The process stopped (SIGSTOP) for the block, as a node that hangs, then continued."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _pid(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60)


def test_a_call_to_a_hung_actor_fails_with_the_librarys_error_within_its_bound(deployment, tmp_path):
    client, _ = deployment(shards=1, store=tmp_path / "store")
    trajs, vecs = _batch(10, 5)
    client.add_many(trajs, vecs).result(timeout=300)
    bounded = MemoryClient(client.namespace, client.config.replace({"cluster.call_timeout_s": 2}))
    aio = asyncio.run(AsyncMemoryClient.connect(client.namespace, config=bounded.config))
    assert bounded.embedders, "the deployment has an embedder"
    with _hung(_pid(bounded.shards[0])):
        with pytest.raises(ShardUnavailableError):
            bounded.retrieve(trajs[0].task, None, vector=vecs[0])
        with pytest.raises(ShardUnavailableError):
            asyncio.run(aio.retrieve(trajs[0].task, None, vector=vecs[0]))
    with _hung(_pid(bounded.embedders[0])), pytest.raises(EmbeddingError, match="call_timeout_s"):
        bounded.embed(["a task"])
    with _hung(_pid(bounded.coordinator)):
        with pytest.raises(CoordinatorUnavailableError, match="call_timeout_s"):
            bounded.stats()
        with pytest.raises(CoordinatorUnavailableError, match="call_timeout_s"):
            asyncio.run(aio.stats())
    # Once they answer again, so do the same clients.
    assert bounded.retrieve(trajs[0].task, None, vector=vecs[0]).trajectories
    assert bounded.embed(["a task"]).shape == (1, client.dim)
    assert bounded.stats()["trajectories"] == 10
