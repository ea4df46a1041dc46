"""The deployment's embedders: texts routed to replicas by hash, their figures, one embedder's
cache serving a deployment (the service itself: tests/engine/test_embedding_service.py)."""

from __future__ import annotations

import numpy as np
import pytest
from test_embedding_service import fake_vector

from lifemem_ray.actors.cluster.ray_shards import embed_plan, embedding_totals, gather_rows, route_texts


def test_texts_go_to_the_replica_their_hash_names_in_bounded_calls_and_come_back_in_order():
    texts = [f"task {i % 7}" for i in range(40)]
    routed = route_texts(texts, 3)
    assert sorted(i for r in routed for i in r) == list(range(40))
    replica_of = {texts[i]: r for r, at in enumerate(routed) for i in at}
    assert len(replica_of) == 7  # a text always on one replica
    assert all(route_texts([t], 3)[replica_of[t]] == [0] for t in replica_of)  # whatever the call holds
    plan = embed_plan(texts, 3, chunk=5)
    assert all(0 < len(at) <= 5 for _, at in plan)
    answers = [np.vstack([fake_vector(texts[i]) for i in at]) for _, at in plan]
    np.testing.assert_array_equal(gather_rows(texts, plan, answers), np.vstack([fake_vector(t) for t in texts]))
    assert embed_plan([], 3, 5) == [(0, [])]


def test_replica_figures_add_up_and_an_unreachable_replica_is_named():
    one = {"backend": "torch", "texts": 4, "hits": 1, "misses": 3, "batches": 1, "mean_batch_texts": 3.0}
    two = {"backend": "torch", "texts": 2, "hits": 1, "misses": 1, "batches": 1, "mean_batch_texts": 1.0}
    total = embedding_totals([one, two, TimeoutError("no answer")])
    assert (total["hits"], total["misses"], total["batches"], total["texts"]) == (2, 4, 2, 6)
    assert total["hit_rate"] == pytest.approx(2 / 6) and total["mean_batch_texts"] == 2.0
    assert total["backend"] == "torch" and "TimeoutError" in total["replicas"][2]["error"]


def test_a_deployment_serves_a_repeated_text_from_one_embedders_cache(ray_local, deployment):
    from lifemem_ray.lab.synthetic import generate

    # The client's own query-vector cache off, so that the repeated retrieval reaches an embedder.
    overrides = {"cluster.embedders": 2, "embedding.backend": "torch", "cluster.client_vector_cache": 0}
    client, _ = deployment(shards=1, **overrides)
    trajectory = next(iter(generate(1, seed=5, length_scale=0.1)))
    client.retrieve(trajectory.task, trajectory.env)
    client.retrieve(trajectory.task, trajectory.env)
    stats = client.stats()["embedding"]
    assert (stats["misses"], stats["hits"]) == (1, 1), stats
    assert stats["batches"] == 1 and stats["backend"] == "torch" and len(stats["replicas"]) == 2
    # The add of the same task, embedded by the coordinator, meets the same replica's cache.
    assert client.add(trajectory).result(timeout=120).status in (
        "added",
        "pending",
    )  # pending: memory not yet initialised
    stats = client.stats()["embedding"]
    assert (stats["misses"], stats["hits"], stats["batches"]) == (1, 2, 1), stats
