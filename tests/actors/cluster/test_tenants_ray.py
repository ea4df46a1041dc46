"""Tenants kept apart through a deployment: the Ray client and the command line against it (the
engine's side: tests/engine/test_tenants.py)."""

from __future__ import annotations

import pytest
from test_tenants import _cli_round, _tenant_copy

from lifemem_ray.core.tenancy import DEFAULT_TENANT


# -- through a 2-shard Ray deployment ---------------------------------------------------------
@pytest.mark.usefixtures("ray_local")
def test_tenants_and_deletion_through_the_ray_client(deployment, synthetic):
    trajs, vecs = synthetic
    client, _ = deployment(shards=2, **{"evolution.init_size": 20})
    assert {r.status for r in client.add_many(trajs[:300], vecs[:300]).result(timeout=300)} == {"added"}
    acme = client.add_many(_tenant_copy(trajs[:360], "acme"), vecs[:360]).result(timeout=300)
    assert {r.status for r in acme} == {"added"} and [r.id for r in acme] == [t.id for t in trajs[:360]]
    again = client.add_many(_tenant_copy(trajs[:10], "acme"), vecs[:10]).result(timeout=300)
    assert {r.status for r in again} == {"duplicate"}

    # Retrieval (one round for a few queries, two rounds for many), scoped and pooled.
    acme_only = {t.id for t in trajs[300:360]}
    for n in (8, 60):
        tasks, envs = [t.task for t in trajs[300 : 300 + n]], [t.env for t in trajs[300 : 300 + n]]
        for tenant, query_envs in (
            (DEFAULT_TENANT, envs),
            (DEFAULT_TENANT, [None] * n),
            ("acme", envs),
            ("acme", [None] * n),
        ):
            got = client.retrieve_many(tasks, query_envs, k=8, vectors=vecs[300 : 300 + n], tenant=tenant)
            assert all(h.trajectory.tenant == tenant for r in got for h in r.trajectories)
            own = {c.id: c.skill for c in client.clusters(tenant=tenant)}
            assert {s.cluster_id for r in got for s in r.skills} <= set(own)
            if tenant == DEFAULT_TENANT:
                assert not acme_only & {h.id for r in got for h in r.trajectories}
    assert client.retrieve(trajs[0].task, None, vector=vecs[0], tenant="nobody").trajectories == []

    # Clusters and stats per tenant.
    default_clusters, acme_clusters = client.clusters(), client.clusters(tenant="acme")
    assert {c.tenant for c in acme_clusters} == {"acme"} and {c.tenant for c in default_clusters} == {DEFAULT_TENANT}
    assert sum(c.count for c in acme_clusters) + client.stats("acme")["pending"] == 360
    assert client.stats("acme")["trajectories"] == 360 and client.stats()["trajectories"] == 660
    assert not {"llm", "splits", "coordinator", "per_tenant"} & set(client.stats("acme"))
    assert client.stats()["per_tenant"]["acme"]["trajectories"] == 360
    assert "coordinator" not in client.stats("acme")

    # Removal while the other tenant keeps adding: serialised with the micro-batches.
    more = [client.add_many(trajs[300 + i : 310 + i], vecs[300 + i : 310 + i]) for i in range(0, 60, 10)]
    victims = [t.id for t in trajs[:50]]
    assert client.remove(victims, tenant="acme") == 50
    assert client.remove(victims, tenant="acme") == 0, "resending a removal is safe"
    assert all(r.status == "added" for f in more for r in f.result(timeout=300))
    got = client.retrieve_many(
        [t.task for t in trajs[:50]], [t.env for t in trajs[:50]], k=10, vectors=vecs[:50], tenant="acme"
    )
    assert not set(victims) & {h.id for r in got for h in r.trajectories}
    mine = client.retrieve_many([t.task for t in trajs[:50]], [t.env for t in trajs[:50]], k=10, vectors=vecs[:50])
    assert set(victims) & {h.id for r in mine for h in r.trajectories}, (
        "the default tenant's trajectories of those ids stay"
    )
    assert client.stats("acme")["trajectories"] == 310 and client.stats()["trajectories"] == 670

    # Purging a tenant.
    assert client.purge_tenant("acme") == 310
    assert client.purge_tenant("acme") == 0
    assert client.clusters(tenant="acme") == [] and client.stats("acme")["trajectories"] == 0
    assert client.stats()["trajectories"] == 360
    with pytest.raises(ValueError, match="tenant"):
        client.remove(["x"], tenant="not a tenant")
    report = client.verify(deep=True)
    assert report["ok"], [s["problems"][:3] for s in report["shards"]]


@pytest.mark.usefixtures("ray_local")
def test_cli_tenants_and_delete_remote(deployment, ray_local, tmp_path):
    from lifemem_ray.core.importers import write_jsonl
    from lifemem_ray.lab.synthetic import generate

    client, _ = deployment(shards=2, **{"evolution.init_size": 20})
    data = tmp_path / "train.jsonl"
    write_jsonl(generate(30, seed=3, envs=["shop", "sql"], length_scale=0.1), data)
    _cli_round(["--address", ray_local.get_runtime_context().gcs_address, "--namespace", client.namespace], data)
    assert client.verify()["ok"]
