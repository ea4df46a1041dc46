"""The engine end to end on real LMDB files and real FAISS, with precomputed vectors."""

from __future__ import annotations

import json

import numpy as np
import pytest
from support.common import purity, unit

from lifemem_ray.core.errors import IdConflictError
from lifemem_ray.core.model import Outcome, Step, Trajectory
from lifemem_ray.engine.ingest import prepare_items
from lifemem_ray.engine.memory import Memory
from lifemem_ray.engine.memory_config import MemoryConfig
from lifemem_ray.engine.store.storage import StoreError


def traj(
    i: int,
    env: str = "shop",
    actions: tuple[str, ...] = ("search[x]", "click[B1]", "click[Buy Now]"),
    task: str | None = None,
) -> Trajectory:
    return Trajectory(
        env=env,
        task=task or f"task number {i} in {env}",
        steps=tuple(Step(action=a, observation=f"obs {i}") for a in actions),
        outcome=Outcome(success=True),
        id=f"{env}-{i}",
    )


def rand_vecs(n: int, dim: int = 384, seed: int = 0) -> np.ndarray:
    return unit(np.random.default_rng(seed).standard_normal((n, dim)))


def test_first_trajectories_wait_for_the_initial_partition(tmp_path):
    with Memory.open(tmp_path / "m") as m:
        trajs = [traj(i) for i in range(7)]
        vecs = rand_vecs(7)
        first = m.add_many(trajs[:3], vecs[:3])
        assert [r.status for r in first] == ["pending"] * 3
        assert m.stats()["pending"] == 3 and m.stats()["clusters"] == 0
        # Pending trajectories are stored and retrievable already.
        assert m.get("shop-1") == trajs[1]
        assert len(m.retrieve("anything", "shop", vector=vecs[0]).trajectories) == 3
        rest = m.add_many(trajs[3:], vecs[3:])
        assert all(r.status == "added" and r.cluster_id is not None for r in rest)
        stats = m.stats()
        assert stats["pending"] == 0 and stats["trajectories"] == 7
        assert all(m.cluster_of(t.id) is not None for t in trajs)
        assert m.verify()["ok"], m.verify()["problems"]


def test_add_is_idempotent_and_conflicts_are_rejected_whole(tmp_path):
    with Memory.open(tmp_path / "m") as m:
        trajs = [traj(i) for i in range(8)]
        vecs = rand_vecs(8)
        m.add_many(trajs, vecs)
        again = m.add_many(trajs, vecs)
        assert {r.status for r in again} == {"duplicate"}
        assert len(m) == 8
        # Same id twice inside one batch: stored once.
        res = m.add_many([traj(100), traj(100)], rand_vecs(2, seed=3))
        assert [r.status for r in res] == ["added", "duplicate"] and res[0].cluster_id == res[1].cluster_id
        changed = Trajectory(env="shop", task="another task", steps=(Step(action="search[y]"),), id="shop-1")
        with pytest.raises(IdConflictError, match="shop-1"):
            m.add_many([traj(200), changed], rand_vecs(2, seed=4))
        assert m.get("shop-200") is None, "nothing of a rejected batch is stored"
        assert len(m) == 9


def test_content_hash_id_makes_identical_content_idempotent(tmp_path):
    a = Trajectory(env="web", task="t", steps=(Step(action="click"),))
    b = Trajectory(env="web", task="t", steps=(Step(action="click"),), metadata={"source_line": 3})
    assert a.id == b.id and a.id.startswith("h-")
    with Memory.open(tmp_path / "m") as m:
        v = rand_vecs(1)
        assert m.add(a, v[0]).status == "pending"
        assert m.add(b, v[0]).status == "duplicate"


def test_one_batch_starting_a_new_workflow_opens_one_cluster(tmp_path):
    config = MemoryConfig()
    with Memory.open(tmp_path / "m", config) as m:
        base = [traj(i, "shop") for i in range(10)]
        m.add_many(base, rand_vecs(10))
        before = {c.id for c in m.clusters()}
        # Ten trajectories of an unseen workflow in one batch, similar tasks.
        centre = rand_vecs(1, seed=9)[0]
        vecs = unit(centre + 0.05 * rand_vecs(10, seed=10))
        new = [
            traj(i, "sql", ("Action: Operation\n```sql\nSELECT 1;\n```", "Action: Answer\nFinal Answer: [1]"))
            for i in range(10)
        ]
        res = m.add_many(new, vecs)
        opened = {r.cluster_id for r in res} - before
        assert len(opened) == 1
        assert len({r.cluster_id for r in res}) == 1


def test_evolution_groups_by_workflow(tmp_path, synthetic):
    trajs, vecs = synthetic
    with Memory.open(tmp_path / "m") as m:
        m.add_many(trajs, vecs)
        assert m.verify()["ok"]
        assert purity(m) >= 0.85
        stats = m.stats()
        # Far fewer clusters than trajectories, and environments are not mixed by the offline policy here.
        assert 12 <= stats["clusters"] <= 100
        assert set(stats["per_env"]) == {t.env for t in trajs}


def test_split_when_large_and_diverse(tmp_path):
    config = MemoryConfig().replace(
        {"evolution.split_min_size": 20, "policy.join_threshold": 0.0, "policy.density_ratio": 0.0}
    )
    with Memory.open(tmp_path / "m", config) as m:
        # Everything joins (threshold 0) one cluster although there are two workflows.
        a = [traj(i, "shop", ("search[x]", "click[B1]", "click[Buy Now]")) for i in range(15)]
        b = [
            traj(100 + i, "shop", ("look around", "open door to kitchen", "focus on water", "wait1")) for i in range(15)
        ]
        items = [x for pair in zip(a, b, strict=True) for x in pair]
        centre = rand_vecs(1, seed=5)[0]
        res = m.add_many(items, unit(centre + 0.01 * rand_vecs(30, seed=6)))
        assert m.stats()["splits"] >= 1
        clusters = m.clusters()
        assert all(c.born == "split" for c in clusters)
        # The split separated the two workflows exactly.
        for c in clusters:
            firsts = {m.get(i).steps[0].action for i in m.members(c.id)}
            assert len(firsts) == 1
        assert all(c.skill for c in clusters), "each child gets its own skill"
        assert m.verify()["ok"], m.verify()["problems"]
        # The log records the moves.
        parent = res[0].cluster_id
        assert parent not in {c.id for c in clusters}


def test_homogeneous_large_cluster_is_not_split(tmp_path):
    config = MemoryConfig().replace({"evolution.split_min_size": 20})
    with Memory.open(tmp_path / "m", config) as m:
        items = [traj(i) for i in range(60)]
        centre = rand_vecs(1, seed=5)[0]
        m.add_many(items, unit(centre + 0.01 * rand_vecs(60, seed=6)))
        assert m.stats()["splits"] == 0
        assert m.clusters()[0].count == 60 and m.clusters()[0].mrl >= 0.95


def test_skill_redistilled_when_cluster_grows(tmp_path):
    config = MemoryConfig().replace({"evolution.skill_refresh_growth": 1.0})
    with Memory.open(tmp_path / "m", config) as m:
        centre = rand_vecs(1, seed=5)[0]
        m.add_many([traj(i) for i in range(6)], unit(centre + 0.01 * rand_vecs(6, seed=1)))
        cid = m.clusters()[0].id
        with m.store.read() as txn:
            first = m.store.get_cluster(txn, cid)
        assert first.skill and first.skill_n == 6
        m.add_many([traj(i) for i in range(6, 11)], unit(centre + 0.01 * rand_vecs(5, seed=2)))
        with m.store.read() as txn:
            assert m.store.get_cluster(txn, cid).skill_n == 6  # 11 < 6 * 2: not yet
        m.add_many([traj(i) for i in range(11, 13)], unit(centre + 0.01 * rand_vecs(2, seed=3)))
        with m.store.read() as txn:
            assert m.store.get_cluster(txn, cid).skill_n == 13


def test_retrieve_is_restricted_to_the_environment_and_returns_k(tmp_path):
    with Memory.open(tmp_path / "m") as m:
        centre = rand_vecs(1, seed=1)[0]
        shop = [traj(i, "shop") for i in range(30)]
        qa = [traj(i, "qa", ("Search[x]", "Finish[y]")) for i in range(6)]
        # The qa vectors are far from the query; the shop ones close: a global search would return shop only.
        m.add_many(shop, unit(centre + 0.05 * rand_vecs(30, seed=2)))
        m.add_many(qa, rand_vecs(6, seed=3))
        res = m.retrieve("q", "qa", k=4, vector=centre)
        assert len(res.trajectories) == 4 and {h.env for h in res.trajectories} == {"qa"}
        scores = [h.score for h in res.trajectories]
        assert scores == sorted(scores, reverse=True)
        assert res.skills and {s.cluster_id for s in res.skills} <= {h.cluster_id for h in res.trajectories}
        assert len({s.cluster_id for s in res.skills}) == len(res.skills)
        assert m.retrieve("q", "unknown-env", vector=centre).trajectories == []
        small = m.retrieve("q", "qa", k=10, vector=centre)
        assert len(small.trajectories) == 6


def test_retrieval_context_respects_the_token_budget(tmp_path):
    long_obs = "word " * 4000
    with Memory.open(tmp_path / "m") as m:
        items = [
            Trajectory(
                env="e",
                task=f"t{i}",
                steps=tuple(Step(action=f"act{j}", observation=long_obs) for j in range(5)),
                id=f"e{i}",
            )
            for i in range(8)
        ]
        m.add_many(items, rand_vecs(8))
        for budget in (200, 1000, 3000):
            res = m.retrieve("t1", "e", k=4, vector=rand_vecs(1)[0], token_budget=budget)
            assert res.tokens <= budget
            assert "Example 1" in res.context
        full = m.retrieve("t1", "e", k=4, vector=rand_vecs(1)[0], token_budget=3000)
        assert full.context.count("[Example") == 4, "the budget is shared, not eaten by the first exemplar"


def test_bad_inputs_get_clear_errors(tmp_path):
    with Memory.open(tmp_path / "m") as m:
        with pytest.raises(ValueError, match=r"vectors: expected shape \(2, 384\)"):
            m.add_many([traj(1), traj(2)], rand_vecs(2, dim=10))
        bad = rand_vecs(2)
        bad[1, 3] = np.nan
        with pytest.raises(ValueError, match=r"vectors\[1\]: contains NaN"):
            m.add_many([traj(1), traj(2)], bad)
        with pytest.raises(ValueError, match=r"vectors\[0\]: zero vector"):
            m.add_many([traj(1)], np.zeros((1, 384)))
        with pytest.raises(TypeError, match=r"trajectories\[1\]"):
            m.add_many([traj(1), {"env": "x"}], rand_vecs(2))
        with pytest.raises(ValueError, match="tasks"):
            m.retrieve("  ", "shop")
        with pytest.raises(ValueError, match="k:"):
            m.retrieve("x", "shop", k=0, vector=rand_vecs(1)[0])
        assert len(m) == 0


def test_reopen_rebuilds_or_reloads_the_index(tmp_path, synthetic):
    trajs, vecs = synthetic
    path = tmp_path / "m"
    with Memory.open(path) as m:
        m.add_many(trajs[:300], vecs[:300])
        expected = m.retrieve(trajs[7].task, trajs[7].env, vector=vecs[7]).to_dict()
        clusters = [c.to_dict() for c in m.clusters()]
    assert (path / "index").is_dir()
    with Memory.open(path) as m:  # saved index is fresh: reloaded
        assert m.retrieve(trajs[7].task, trajs[7].env, vector=vecs[7]).to_dict() == expected
        assert [c.to_dict() for c in m.clusters()] == clusters
        m.add_many(trajs[300:310], vecs[300:310])
    # A stale index cache (from an older generation) is ignored and rebuilt.
    import shutil

    shutil.copytree(path / "index", tmp_path / "old-index")
    with Memory.open(path) as m:
        m.add_many(trajs[310:320], vecs[310:320])
    shutil.rmtree(path / "index")
    shutil.copytree(tmp_path / "old-index", path / "index")
    with Memory.open(path) as m:
        assert len(m.index) == 320
        assert m.verify()["ok"]


def test_remove_updates_clusters(tmp_path, synthetic):
    trajs, vecs = synthetic
    with Memory.open(tmp_path / "m") as m:
        m.add_many(trajs[:100], vecs[:100])
        victims = [t.id for t in trajs[:40]]
        assert m.remove([*victims, "no-such-id"]) == 40
        assert len(m) == 60 and m.get(victims[0]) is None
        report = m.verify()
        assert report["ok"], report["problems"]
        res = m.retrieve(trajs[0].task, trajs[0].env, vector=vecs[0])
        assert all(h.id not in victims for h in res.trajectories)


def test_export_round_trips(tmp_path, synthetic):
    from lifemem_ray.core.importers import read_jsonl

    trajs, vecs = synthetic
    with Memory.open(tmp_path / "m") as m:
        m.add_many(trajs[:50], vecs[:50])
        out = m.export(tmp_path / "out.jsonl")
        assert out["trajectories"] == 50
    back, _report = read_jsonl([tmp_path / "out.jsonl"])
    assert sorted(back, key=lambda t: t.id) == sorted(trajs[:50], key=lambda t: t.id)
    clusters = [json.loads(line) for line in (tmp_path / "out.clusters.jsonl").read_text().splitlines()]
    assert sum(c["count"] for c in clusters) == 50
    assert sorted(i for c in clusters for i in c["members"]) == sorted(t.id for t in trajs[:50])


def test_read_only_and_second_writer(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "m"
    probe = (
        "import sys\n"
        "from lifemem_ray.engine.memory import Memory\n"
        "from lifemem_ray.engine.store.storage import StoreLockedError\n"
        "with Memory.open(sys.argv[1], read_only=True) as ro:\n"
        "    print('readers see', len(ro))\n"
        "try:\n"
        "    Memory.open(sys.argv[1])\n"
        "except StoreLockedError as exc:\n"
        "    print('writer refused:', exc)\n"
    )
    with Memory.open(path) as m:
        m.add_many([traj(i) for i in range(6)], rand_vecs(6))
        out = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True, timeout=120)
        assert "readers see 6" in out.stdout, out.stderr
        assert "writer refused:" in out.stdout and "open for writing by another process" in out.stdout
        with pytest.raises(StoreError, match="already open in this process"):
            Memory.open(path, read_only=True)
    with Memory.open(path, read_only=True) as ro:
        assert len(ro) == 6
        with pytest.raises(StoreError, match="read-only"):
            ro.add(traj(99), rand_vecs(1)[0])
    with pytest.raises(StoreError, match="no memory store"):
        Memory.open(tmp_path / "missing", read_only=True)


def test_store_map_grows_by_itself(tmp_path):
    config = MemoryConfig().replace({"store.map_size_mb": 1})
    big = "x" * 20000
    with Memory.open(tmp_path / "m", config) as m:
        items = [
            Trajectory(env="e", task=f"t{i}", steps=(Step(action="a", observation=big),), id=f"t{i}")
            for i in range(300)
        ]
        m.add_many(items, rand_vecs(300))
        assert m.store.info()["map_size"] > 1 << 20
        assert len(m) == 300 and m.verify()["ok"]


def test_background_maintenance(tmp_path):
    config = MemoryConfig().replace(
        {
            "evolution.background_maintenance": True,
            "evolution.split_min_size": 20,
            "policy.join_threshold": 0.0,
            "policy.density_ratio": 0.0,
        }
    )
    with Memory.open(tmp_path / "m", config) as m:
        a = [traj(i, "shop", ("search[x]", "click[B1]", "click[Buy Now]")) for i in range(15)]
        b = [
            traj(100 + i, "shop", ("look around", "open door to kitchen", "focus on water", "wait1")) for i in range(15)
        ]
        m.add_many(a + b, unit(rand_vecs(1)[0] + 0.01 * rand_vecs(30, seed=6)))
    with Memory.open(tmp_path / "m", config) as m:  # queued work is durable: finished now if close() left any
        m.maintain()
        assert m.stats()["maintenance_queued"] == 0
        assert m.stats()["splits"] >= 1
        assert m.verify()["ok"]


def test_closed_memory_refuses_work(tmp_path):
    m = Memory.open(tmp_path / "m")
    m.close()
    with pytest.raises(StoreError, match="closed"):
        m.add(traj(1), rand_vecs(1)[0])


def test_trusted_decode_of_stored_records_equals_the_validated_one():
    from lifemem_ray.engine.store.codec import decode_trajectory as record_to_trajectory
    from lifemem_ray.engine.store.codec import encode_trajectory as trajectory_to_record

    traj = Trajectory(
        env="web",
        task="find a red mug",
        steps=(Step(action="search[red mug]", thought="look", observation="3 hits"),),
        outcome=Outcome(success=True, reward=1.0),
        id="t1",
        initial_observation="home page",
        metadata={"k": [1, "x"]},
    )
    raw = trajectory_to_record(traj, ["SEARCH"], 0.0)
    checked, extra = record_to_trajectory(raw)
    fast, fast_extra = record_to_trajectory(raw, trusted=True)
    assert fast == checked == traj and fast_extra == extra
    assert fast.fingerprint == traj.fingerprint and fast.render() == traj.render()


def test_candidate_arrays_merge_keeps_the_best_across_stores_in_store_order():
    from lifemem_ray.engine.clustering.evolution import CandidateArrays

    pad = -np.inf
    a = CandidateArrays(
        np.array([[5, -1, 7]]),
        np.array([[0.9, pad, 0.5]], np.float32),
        np.array([[5]]),
        np.array([[0.8]], np.float32),
        {},
    )
    b = CandidateArrays(
        np.array([[9, 8, -1]]),
        np.array([[0.9, 0.7, pad]], np.float32),
        np.zeros((1, 0), np.int64),
        np.zeros((1, 0), np.float32),
        {},
    )
    merged = CandidateArrays.merge([a, b], k=3, m=2)
    assert [c for c, _ in merged.neighbours[0]] == [5, 9, 8]  # equal scores: the first store first
    assert [c for c, _ in merged.extra[0]] == [5]
    assert a.to_set().neighbours == [[(5, pytest.approx(0.9)), (7, pytest.approx(0.5))]]


def test_candidates_match_between_the_list_and_array_forms(tmp_path, synthetic):
    trajs, vecs = synthetic
    with Memory.open(tmp_path / "m") as memory:
        memory.add_many(trajs[:400], vecs[:400])
        items = prepare_items(trajs[400:460], vecs[400:460], memory.dim, memory.features)
        arrays = memory.shard.candidates(
            np.stack([it.vec for it in items]), np.stack([it.wvec for it in items]), [it.env for it in items]
        )
        found = memory._ingest.candidates(items)  # the list form the engine plans with
        assert found.neighbours == arrays.to_set().neighbours and found.extra == arrays.to_set().extra
        assert all(row for row in found.neighbours) and set(found.clusters) == set(arrays.clusters)
        live = {c.id for c in memory.clusters()}
        assert {c for row in found.neighbours for c, _ in row} <= live


def test_hits_then_records_is_what_search_records_returns(tmp_path, synthetic):
    """The two halves a sharded client calls (ids first, then only the winners' records)
    give the same hits and skills as the one-call form; padding and removed ids give None."""
    trajs, vecs = synthetic
    with Memory.open(tmp_path / "m") as m:
        m.add_many(trajs[:120], vecs[:120])
        m.maintain()
        envs = [t.env for t in trajs[120:140]] + ["unknown-env"]
        queries = np.vstack([vecs[120:140], vecs[:1]])
        scores, ids = m.shard.search_hits(envs, 4, queries)
        assert scores.shape == ids.shape == (21, 4) and (ids[-1] == -1).all()
        records, skills = m.shard.hit_records(ids)
        assert len(records) == ids.size and all(r is None for r in records[-4:])
        one_call = m.shard.search_records(envs, 4, queries)
        for q, (hits, texts) in enumerate(one_call):
            row = [(float(s), *r) for s, r in zip(scores[q], records[4 * q : 4 * q + 4], strict=True) if r is not None]
            assert [(round(s, 6), c, raw) for s, c, raw in hits] == [(round(s, 6), c, raw) for s, c, raw in row]
            assert bool(texts) == bool(hits) and all(skills[c] == text for c, text in texts.items())
        gone = int(ids[0, 0])
        with m.store.read() as txn:
            victim = m.store.trajectory(txn, gone)[0].id
        assert m.remove([victim]) == 1  # removed between the two halves: its record is None
        assert m.shard.hit_records(np.array([gone, -1]))[0] == [None, None]


def test_paused_gc_restores_the_collector_state():
    import gc

    from lifemem_ray.engine.retrieval import paused_gc

    assert gc.isenabled()
    with paused_gc():
        assert not gc.isenabled()
        with paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner block leaves it as it found it
    assert gc.isenabled()
    gc.disable()
    try:
        with paused_gc():
            pass
        assert not gc.isenabled()  # a caller that disabled it keeps it disabled
    finally:
        gc.enable()
    with pytest.raises(RuntimeError), paused_gc():
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_retrieved_exemplars_decode_their_trajectory_on_demand(tmp_path, synthetic):
    from lifemem_ray.engine.retrieval import RetrievedTrajectory, assemble
    from lifemem_ray.engine.store.codec import encode_trajectory as trajectory_to_record

    trajs, _vecs = synthetic
    raw = [trajectory_to_record(t, ["w"], 0.0) for t in trajs[:3]]
    got = assemble(
        "q", trajs[0].env, [(0.5, 7, raw[1]), (0.9, 3, raw[0]), (0.1, None, raw[2])], {3: "skill"}, 2, 4, 3000
    )
    first, second = got.trajectories
    assert (first.id, first.score, first.cluster_id, second.id) == (trajs[0].id, 0.9, 3, trajs[1].id)
    assert first._fields is None and first._trajectory is None  # only the bytes are kept
    assert first.render(200) == trajs[0].render(200)
    assert first.trajectory == trajs[0] and first.trajectory.fingerprint == trajs[0].fingerprint
    assert first.render(200) == trajs[0].render(200)  # the same once decoded
    assert first == RetrievedTrajectory(trajs[0].id, trajs[0].env, trajs[0].task, 0.9, 3, trajs[0])
    assert first != second and [s.cluster_id for s in got.skills] == [3]
    with pytest.raises(TypeError):
        RetrievedTrajectory("a", "e", "t", 0.1, None)


def test_clusters_can_be_listed_largest_first_up_to_a_limit(tmp_path, synthetic):
    trajs, vecs = synthetic
    with Memory.open(tmp_path / "m") as m:
        m.add_many(trajs[:300], vecs[:300])
        every = m.clusters()
        assert len(every) >= 3 and m.cluster_count() == len(every)
        top = m.clusters(limit=2)
        assert [c.id for c in top] == [c.id for c in every[:2]] and top[0].count >= top[1].count
        env = trajs[0].env
        assert m.cluster_count(env) == len(m.clusters(env)) <= len(every)
        assert m.clusters(limit=10**6) == every and m.cluster_count(tenant="nobody") == 0
        for bad in (0, -1, True, 2.0):
            with pytest.raises(ValueError, match="limit"):
                m.clusters(limit=bad)


def test_in_batch_neighbours_come_from_the_items_environment(tmp_path):
    """With evolution.neighbour_scope = "env", an item's neighbours earlier in its batch are of
    its environment, as its stored neighbours are: two environments doing the very same thing,
    interleaved in one batch (no centroid candidates), keep apart."""
    steps = (Step(action="search[shoes]"), Step(action="click[item 3]"), Step(action="buy[now]"))
    trajs = [
        Trajectory(env=env, task=f"buy shoes, order {i}", id=f"{env}-{i}", steps=steps, outcome=Outcome(success=True))
        for i in range(20)
        for env in ("shop-a", "shop-b")
    ]
    vecs = unit(np.tile(np.random.default_rng(0).normal(size=(1, 384)), (len(trajs), 1)))
    config = MemoryConfig().replace(
        {"evolution.neighbour_scope": "env", "evolution.centroid_candidates": 0, "evolution.init_size": 2}
    )
    with Memory.open(tmp_path / "m", config) as m:
        m.add_many(trajs[:2], vecs[:2])  # initialised: one trajectory of each
        m.add_many(trajs[2:], vecs[2:])  # one batch, the two environments interleaved
        assert all(len(c.envs) == 1 for c in m.clusters()), [c.envs for c in m.clusters()]
