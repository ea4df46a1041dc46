"""Removals through a deployment survive a shard killed mid-way (the engine's side:
tests/engine/test_deletion.py)."""

from __future__ import annotations

import os
import signal

import pytest
from test_deletion import _acme


@pytest.mark.usefixtures("ray_local")
def test_removals_through_ray_survive_a_shard_sigkill(deployment, synthetic):
    """A shard killed before a removal reaches it: the coordinator's call waits for the restarted
    actor (its calls are retried) and the removal is applied; one killed after an acknowledged
    removal reopens its store without the removed trajectories."""
    import ray

    trajs, vecs = synthetic
    client, _ = deployment(shards=2, **{"evolution.init_size": 20})
    client.add_many(_acme(trajs[:200]), vecs[:200]).result(timeout=300)
    client.add_many(trajs[:100], vecs[:100]).result(timeout=300)
    victims = [t.id for t in trajs[:60]]
    os.kill(ray.get(client.shards[0].info.remote())["pid"], signal.SIGKILL)
    assert client.remove(victims[:30], tenant="acme") == 30
    assert client.remove(victims, tenant="acme") == 30, "resent with more ids: only those still stored count"
    os.kill(ray.get(client.shards[1].info.remote())["pid"], signal.SIGKILL)
    assert client.stats("acme")["trajectories"] == 140 and client.stats()["trajectories"] == 240
    got = client.retrieve_many([t.task for t in trajs[:60]], [None] * 60, k=10, vectors=vecs[:60], tenant="acme")
    assert not set(victims) & {h.id for r in got for h in r.trajectories}
    report = client.verify()
    assert report["ok"], [s["problems"][:3] for s in report["shards"]]
