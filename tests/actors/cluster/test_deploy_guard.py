"""One deployment per store: a second `serve` of a served store is refused before it changes
anything, and leaves nothing running."""

from __future__ import annotations

import numpy as np
import pytest
from support.common import SMALL_ACTORS

from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.actors.cluster.placement import embedder_name, shard_name
from lifemem_ray.core.errors import DeploymentExistsError
from lifemem_ray.lab.synthetic import generate, text_vectors


def test_a_second_deployment_of_a_served_store_is_refused(deployment, tmp_path):
    import ray

    from lifemem_ray.actors.cluster import deployment as dep

    store = tmp_path / "served"
    client, _info = deployment(shards=1, store=store)
    trajs = list(generate(6, seed=1, envs=["shop"], length_scale=0.1))
    client.add_many(trajs, text_vectors([t.task for t in trajs])).result()
    other = DeploymentConfig().replace({"cluster.namespace": "second-serve", **SMALL_ACTORS})
    with pytest.raises(DeploymentExistsError, match="already served"):
        dep.deploy(store, other)
    for name in (dep.COORDINATOR, embedder_name(0), shard_name(0)):
        with pytest.raises(ValueError):
            ray.get_actor(name, namespace="second-serve")  # nothing of the refused start runs
    # The live deployment is untouched: it still answers, under its own namespace.
    assert client.stats()["trajectories"] == 6
    assert ray.get(dep.find_coordinator(client.namespace).deployment.remote())["namespace"] == client.namespace
    hit = client.retrieve(trajs[0].task, "shop", vector=np.asarray(text_vectors([trajs[0].task])[0]))
    assert hit.trajectories
