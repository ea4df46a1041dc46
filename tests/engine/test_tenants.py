"""Tenants in the engine: two tenants with the same environments and the same ids never see
each other's trajectories, clusters or skills; clusters never mix tenants; the default
tenant's stored bytes are those of stores written before tenants."""

from __future__ import annotations

import dataclasses
from subprocess import CompletedProcess

import numpy as np
import pytest

from lifemem_ray.core.errors import InvalidTrajectoryError, TenantError
from lifemem_ray.core.model import Trajectory
from lifemem_ray.core.tenancy import DEFAULT_TENANT, check_tenant, id_key, scope
from lifemem_ray.engine.memory import Memory
from lifemem_ray.engine.memory_config import MemoryConfig
from lifemem_ray.engine.store import codec

CONFIG = MemoryConfig().replace({"evolution.init_size": 20, "evolution.batch_size": 32})


def _tenant_copy(trajs, tenant: str):
    return [dataclasses.replace(t, tenant=tenant) for t in trajs]


@pytest.fixture
def two_tenants(tmp_path, synthetic):
    """One store holding the same 200 trajectories (same ids, envs, vectors) for the default
    tenant and for "acme", plus 60 more of acme alone."""
    trajs, vecs = synthetic
    mem = Memory.open(tmp_path / "m", CONFIG)
    mem.add_many(trajs[:200], vecs[:200])
    acme = _tenant_copy(trajs[:260], "acme")
    results = mem.add_many(acme, vecs[:260])
    assert {r.status for r in results} == {"added"}, "the same ids under another tenant are new, not duplicates"
    assert [r.id for r in results] == [t.id for t in trajs[:260]], "results name the caller's ids"
    yield mem, trajs, vecs
    mem.close()


def test_tenant_names_are_checked():
    assert check_tenant("acme-1.prod_x") == "acme-1.prod_x"
    for bad in ("", "-x", "a b", "a\x00b", "x" * 65, 3):
        with pytest.raises(TenantError, match="tenant"):
            check_tenant(bad)
    with pytest.raises(InvalidTrajectoryError, match="tenant"):
        Trajectory.from_dict({"env": "e", "task": "t", "steps": [{"action": "a"}], "tenant": "no spaces"})


def test_the_default_tenant_keeps_the_stored_bytes_and_ids(synthetic):
    trajs, _ = synthetic
    t = trajs[0]
    assert t.tenant == DEFAULT_TENANT and "tenant" not in t.to_dict()
    assert scope(DEFAULT_TENANT, t.env) == t.env and id_key(DEFAULT_TENANT, t.id) == t.id
    plain = codec.encode_trajectory(t, ["A"], 1.0)
    assert b"tenant" not in plain
    other = dataclasses.replace(t, tenant="acme")
    assert other.fingerprint != t.fingerprint, "the content hash includes a tenant other than the default"
    back = codec.decode_trajectory(codec.encode_trajectory(other, ["A"], 1.0))[0]
    assert back.tenant == "acme" and back == other
    assert Trajectory.from_dict(other.to_dict()) == other


def test_retrieval_stays_within_the_tenant(two_tenants):
    mem, trajs, vecs = two_tenants
    mine = mem.retrieve(trajs[5].task, trajs[5].env, k=8, vector=vecs[5])
    theirs = mem.retrieve(trajs[5].task, trajs[5].env, k=8, vector=vecs[5], tenant="acme")
    assert mine.trajectories and theirs.trajectories
    assert all(h.trajectory.tenant == DEFAULT_TENANT for h in mine.trajectories)
    assert all(h.trajectory.tenant == "acme" for h in theirs.trajectories)
    assert all(h.env == trajs[5].env for h in theirs.trajectories), "hits name the environment, not the scope"
    # acme's own 60 (ids 200..259) are never found by the default tenant, pooled or not.
    acme_only = {t.id for t in trajs[200:260]}
    for r in mem.retrieve_many([t.task for t in trajs[200:260]], [None] * 60, k=10, vectors=vecs[200:260]):
        assert not acme_only & {h.id for h in r.trajectories}
        assert all(h.trajectory.tenant == DEFAULT_TENANT for h in r.trajectories)
    pooled = mem.retrieve_many(
        [t.task for t in trajs[200:260]], [None] * 60, k=10, vectors=vecs[200:260], tenant="acme"
    )
    assert all(h.trajectory.tenant == "acme" for r in pooled for h in r.trajectories)
    assert any(acme_only & {h.id for h in r.trajectories} for r in pooled)
    # An unknown tenant sees nothing at all.
    assert mem.retrieve(trajs[5].task, None, vector=vecs[5], tenant="nobody").trajectories == []


def test_skills_come_from_the_tenants_own_clusters(two_tenants):
    mem, trajs, vecs = two_tenants
    acme_skills = {c.skill for c in mem.clusters(tenant="acme")}
    for tenant in (DEFAULT_TENANT, "acme"):
        own = {c.id: c.skill for c in mem.clusters(tenant=tenant)}
        for r in mem.retrieve_many(
            [t.task for t in trajs[:40]], [t.env for t in trajs[:40]], k=6, vectors=vecs[:40], tenant=tenant
        ):
            assert {h.cluster_id for h in r.trajectories} <= set(own)
            assert {s.cluster_id for s in r.skills} <= set(own)
            assert all(s.text == own[s.cluster_id] for s in r.skills)
    assert acme_skills


def test_clusters_never_mix_tenants(two_tenants):
    mem, trajs, _ = two_tenants
    default, acme = mem.clusters(), mem.clusters(tenant="acme")
    assert {c.tenant for c in default} == {DEFAULT_TENANT} and {c.tenant for c in acme} == {"acme"}
    assert not {c.id for c in default} & {c.id for c in acme}
    assert sum(c.count for c in default) == 200 and sum(c.count for c in acme) == 260
    assert all(set(c.envs) <= {t.env for t in trajs} for c in acme), "envs are named without the tenant"
    assert len(mem.clusters(tenant=None)) == len(default) + len(acme)
    env = trajs[0].env
    assert all(env in c.envs for c in mem.clusters(env, tenant="acme"))
    for c in acme:
        members = mem.members(c.id, tenant="acme")
        assert len(members) == c.count and all(mem.get(i, tenant="acme").tenant == "acme" for i in members)
        assert mem.members(c.id) == [], "another tenant's cluster has no members for me"
    report = mem.verify(deep=True)
    assert report["ok"], report["problems"]


def test_same_ids_are_independent_per_tenant(two_tenants):
    mem, trajs, vecs = two_tenants
    assert mem.get(trajs[0].id).tenant == DEFAULT_TENANT
    assert mem.get(trajs[0].id, tenant="acme").tenant == "acme"
    assert mem.get(trajs[210].id) is None, "an id of acme alone is invisible to the default tenant"
    # The same id with other content under acme conflicts only with acme's own.
    changed = dataclasses.replace(trajs[210], task="something else entirely")
    assert mem.add(changed, vecs[210]).status in ("added", "pending")
    assert mem.cluster_of(trajs[0].id) != mem.cluster_of(trajs[0].id, tenant="acme")
    # A crafted id cannot reach another tenant's key.
    for call in (lambda: mem.get(id_key("acme", trajs[210].id)), lambda: mem.remove([id_key("acme", trajs[210].id)])):
        with pytest.raises(TenantError, match="NUL"):
            call()
    with pytest.raises(TenantError, match="NUL"):
        mem.retrieve("x", "acme\x00" + trajs[0].env, vector=vecs[0])
    assert mem.get(trajs[210].id, tenant="acme") is not None


def test_stats_per_tenant(two_tenants):
    mem, trajs, _ = two_tenants
    everything = mem.stats()
    assert everything["trajectories"] == 460
    assert (
        everything["per_tenant"]["acme"]["trajectories"] == 260
        and everything["per_tenant"][DEFAULT_TENANT]["trajectories"] == 200
    )
    acme = mem.stats("acme")
    assert acme["trajectories"] == 260 and acme["tenant"] == "acme" and "per_tenant" not in acme
    assert not {"path", "llm", "splits", "merges", "maintenance_queued", "generation", "purging"} & set(acme), (
        "a tenant's view holds nothing of the store as a whole"
    )
    assert sum(v["trajectories"] for v in acme["per_env"].values()) == 260
    assert set(acme["per_env"]) <= {t.env for t in trajs}
    assert all("\x00" not in name for name in acme["index"]["envs"])
    assert mem.stats("nobody")["trajectories"] == 0 and mem.stats("nobody")["clusters"] == 0


def test_remove_is_per_tenant(two_tenants):
    mem, trajs, vecs = two_tenants
    victims = [t.id for t in trajs[:30]]
    assert mem.remove(victims, tenant="acme") == 30
    assert mem.remove(victims, tenant="acme") == 0, "removing again is harmless"
    assert all(mem.get(i) is not None for i in victims), "the default tenant's trajectories of the same ids stay"
    assert all(mem.get(i, tenant="acme") is None for i in victims)
    assert mem.stats("acme")["trajectories"] == 230 and mem.stats()["trajectories"] == 430
    report = mem.verify()
    assert report["ok"], report["problems"]
    got = mem.retrieve_many(
        [t.task for t in trajs[:30]], [t.env for t in trajs[:30]], k=10, vectors=vecs[:30], tenant="acme"
    )
    assert not set(victims) & {h.id for r in got for h in r.trajectories}


def test_tenants_before_the_initial_partition(tmp_path, synthetic):
    trajs, vecs = synthetic
    with Memory.open(tmp_path / "m", CONFIG) as mem:
        mem.add_many(trajs[:8], vecs[:8])
        mem.add_many(_tenant_copy(trajs[:8], "acme"), vecs[:8])
        assert mem.stats("acme")["pending"] == 8 and mem.stats()["pending"] == 16
        hits = mem.retrieve(trajs[0].task, trajs[0].env, vector=vecs[0], tenant="acme").trajectories
        assert hits and all(h.trajectory.tenant == "acme" for h in hits)
        # The initial partition takes both tenants' pending trajectories, and keeps them apart.
        mem.add_many(_tenant_copy(trajs[8:40], "acme"), vecs[8:40])
        assert mem.initialised
        for c in mem.clusters(tenant=None):
            members = mem.members(c.id, tenant=c.tenant)
            assert len(members) == c.count
        assert sum(c.count for c in mem.clusters()) == 8 and sum(c.count for c in mem.clusters(tenant="acme")) == 40
        assert mem.verify()["ok"]


def test_global_neighbour_scope_stays_within_the_tenant(tmp_path, synthetic):
    trajs, vecs = synthetic
    config = CONFIG.replace({"evolution.neighbour_scope": "global"})
    with Memory.open(tmp_path / "m", config) as mem:
        mem.add_many(trajs[:150], vecs[:150])
        mem.add_many(_tenant_copy(trajs[:150], "acme"), vecs[:150])
        assert {c.tenant for c in mem.clusters(tenant=None)} == {DEFAULT_TENANT, "acme"}
        for c in mem.clusters(tenant="acme"):
            assert all(mem.get(i, tenant="acme") is not None for i in mem.members(c.id, tenant="acme"))
        assert sum(c.count for c in mem.clusters(tenant="acme")) == 150
        assert mem.verify()["ok"]


def test_export_and_reimport_keep_tenants(tmp_path, two_tenants):
    from lifemem_ray.core.importers import read_jsonl

    mem, trajs, vecs = two_tenants
    mem.export(tmp_path / "out.jsonl")
    back, _ = read_jsonl([tmp_path / "out.jsonl"])
    assert (
        sum(1 for t in back if t.tenant == "acme") == 260 and sum(1 for t in back if t.tenant == DEFAULT_TENANT) == 200
    )
    with Memory.open(tmp_path / "again", CONFIG) as again:
        by_key = {id_key(t.tenant, t.id): i for i, t in enumerate(trajs[:260])}
        again.add_many(back, np.stack([vecs[by_key[t.id]] for t in back]))
        assert again.stats("acme")["trajectories"] == 260 and again.stats(DEFAULT_TENANT)["trajectories"] == 200


def test_snapshot_and_absorb_keep_tenants(tmp_path, two_tenants):
    mem, trajs, vecs = two_tenants
    mem.shard.snapshot(str(tmp_path / "snap"))
    with Memory.open(tmp_path / "restored", CONFIG) as restored:
        restored.absorb(tmp_path / "snap")
        assert restored.stats("acme")["trajectories"] == 260 and restored.stats(DEFAULT_TENANT)["trajectories"] == 200
        assert {c.tenant for c in restored.clusters(tenant="acme")} == {"acme"}
        got = restored.retrieve(trajs[210].task, trajs[210].env, vector=vecs[210], tenant="acme")
        assert got.trajectories and all(h.trajectory.tenant == "acme" for h in got.trajectories)
        assert restored.get(trajs[210].id) is None and restored.get(trajs[210].id, tenant="acme") is not None
        assert restored.verify(deep=True)["ok"]


# -- the command line ---------------------------------------------------------------------------
def _cli(*args: str) -> CompletedProcess[str]:
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    return subprocess.run(
        [sys.executable, "-m", "lifemem_ray.cli", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(root)},
    )


def _cli_json(*args: str) -> dict:
    import json

    out = _cli(*args, "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def _cli_round(where: list[str], data) -> None:
    """Ingest the same file as two tenants, then retrieve, stats, clusters and delete per tenant."""
    assert _cli_json("ingest", str(data), *where)["added"] == 30
    assert _cli_json("ingest", str(data), *where, "--tenant", "acme")["added"] == 30, (
        "the same ids for another tenant are new"
    )
    hits = _cli_json("retrieve", "buy running shoes", *where, "--env", "shop", "--tenant", "acme", "-k", "5")
    assert hits["trajectories"] and all(h["env"] == "shop" for h in hits["trajectories"])
    assert _cli_json("stats", *where)["trajectories"] == 60
    acme = _cli_json("stats", *where, "--tenant", "acme")
    assert acme["trajectories"] == 30 and set(acme["per_env"]) == {"shop", "sql"}
    clusters = _cli_json("clusters", *where, "--tenant", "acme")
    assert clusters and {c["tenant"] for c in clusters} == {"acme"} and sum(c["count"] for c in clusters) <= 30
    ids = [h["id"] for h in hits["trajectories"]]
    assert _cli_json("delete", *ids, *where, "--tenant", "acme")["removed"] == len(ids)
    assert _cli_json("delete", *ids, *where, "--tenant", "acme")["removed"] == 0
    assert _cli_json("stats", *where, "--tenant", "acme")["trajectories"] == 30 - len(ids)
    assert _cli_json("stats", *where, "--tenant", "default")["trajectories"] == 30
    assert _cli_json("delete", *where, "--tenant", "acme", "--purge-tenant")["removed"] == 30 - len(ids)
    assert _cli_json("stats", *where)["trajectories"] == 30
    bad = _cli("delete", *where, "--tenant", "acme")
    assert bad.returncode == 1 and "--purge-tenant" in bad.stderr
    bad = _cli("stats", *where, "--tenant", "no such tenant")
    assert bad.returncode == 1 and "--tenant" in bad.stderr and "Traceback" not in bad.stderr


def test_cli_tenants_and_delete_local(tmp_path):
    from lifemem_ray.core.importers import write_jsonl
    from lifemem_ray.lab.synthetic import generate

    data = tmp_path / "train.jsonl"
    write_jsonl(generate(30, seed=3, envs=["shop", "sql"], length_scale=0.1), data)
    _cli_round(["--store", str(tmp_path / "store")], data)
    missing = _cli("delete", "x", "--store", str(tmp_path / "nowhere"))
    assert missing.returncode == 1 and "no memory store" in missing.stderr


def test_in_batch_neighbours_are_of_the_same_tenant():
    from lifemem_ray.engine.clustering.evolution import _earlier_neighbours

    rng = np.random.default_rng(0)
    base = rng.normal(size=(1, 16)).astype(np.float32)
    vecs = np.repeat(base, 6, axis=0) + 0.01 * rng.normal(size=(6, 16)).astype(np.float32)
    tenants = np.asarray([0, 1, 0, 1, 0, 1], dtype=np.int32)
    _, plain = _earlier_neighbours(vecs, 2, 8)
    assert {int(j) for j in plain[5] if j >= 0} & {0, 2, 4}, (
        "without tenants, near-identical items of both are neighbours"
    )
    _, masked = _earlier_neighbours(vecs, 2, 8, tenants)
    for i in range(6):
        assert all(tenants[j] == tenants[i] for j in masked[i] if j >= 0)
    assert sorted(int(j) for j in masked[5] if j >= 0) == [1, 3]


def test_centroid_candidates_are_of_the_query_tenant():
    """Another tenant's clusters never take a centroid candidate's place (at ingest and merge)."""
    from lifemem_ray.engine.clustering.centroids import ClusterCentroids
    from lifemem_ray.engine.clustering.clusters import ClusterRecord

    rng = np.random.default_rng(1)
    base = rng.normal(size=8)

    def record(cid: int, tenant: str, jitter: float) -> ClusterRecord:
        vec = base + jitter * rng.normal(size=8)
        return ClusterRecord(id=cid, count=3, tsum=vec, wsum=np.ones(4), envs={scope(tenant, "web"): 3})

    centroids = ClusterCentroids(8, 4, 0.5)
    centroids.update([record(1, "acme", 0.01), record(2, "acme", 0.02), record(3, DEFAULT_TENANT, 0.5)])
    query = centroids.query(
        (base / np.linalg.norm(base))[None, :].astype(np.float32), (np.ones(4) / 2)[None, :].astype(np.float32)
    )
    ids, _ = centroids.search(query, 2)
    assert set(ids[0].tolist()) == {1, 2}, "unmasked, the nearest clusters win whoever's they are"
    ids, scores = centroids.search(query, 2, [DEFAULT_TENANT])
    assert ids[0].tolist() == [3, -1] and scores[0][1] == -np.inf
    ids, _ = centroids.search(query, 2, ["nobody"])
    assert ids[0].tolist() == [-1, -1]
