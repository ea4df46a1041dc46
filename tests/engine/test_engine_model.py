"""The domain model (lifemem_ray.engine.clustering.clusters), the stored format (lifemem_ray.engine.store.codec), the typed
interfaces (lifemem_ray.engine.protocols) and the one id rule on every ingest path."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from support.common import unit

from lifemem_ray.core.errors import IdConflictError
from lifemem_ray.core.model import Outcome, Step, Trajectory
from lifemem_ray.engine.clustering.clusters import (
    ClusterRecord,
    check_against_members,
    fold_member,
    merged,
    new_cluster_record,
    unfold_member,
)
from lifemem_ray.engine.ingest import pack_trajectories
from lifemem_ray.engine.memory import Memory
from lifemem_ray.engine.store import codec


def _traj(i: int, task: str | None = None, env: str = "shop") -> Trajectory:
    return Trajectory(
        env=env,
        task=task or f"task number {i}",
        steps=(Step(action="search[x]", observation=f"obs {i}"), Step(action="click[Buy Now]")),
        outcome=Outcome(success=i % 2 == 0, reward=1.0),
        id=f"{env}-{i}",
        initial_observation="home",
        metadata={"k": i},
    )


def _record(dim: int = 8, wdim: int = 4) -> ClusterRecord:
    rng = np.random.default_rng(3)
    record = new_cluster_record(7, dim, wdim, "new", 1.0)
    for n in range(5):
        fold_member(
            record,
            unit(rng.standard_normal(dim)),
            unit(rng.standard_normal(wdim)),
            "shop" if n % 2 else "web",
            [True, False, None][n % 3],
            f"flow {n % 2}",
            2.0,
        )
    record.description, record.skill = "Workflow: x. Example goal: buy", "1. search"
    return record


# -- the domain model ------------------------------------------------------------------------
def test_fold_then_unfold_returns_the_cluster_to_its_state():
    record = _record()
    before = record.copy()
    vec, wvec = unit(np.ones(8)), unit(np.arange(4.0) + 1)
    fold_member(record, vec, wvec, "alfworld", True, "a new flow", 3.0)
    assert (
        record.count == before.count + 1 and record.envs["alfworld"] == 1 and record.successes == before.successes + 1
    )
    unfold_member(record, vec, wvec, "alfworld", True, "a new flow", 4.0)
    assert (record.count, record.envs, record.flows, record.successes, record.failures) == (
        before.count,
        before.envs,
        before.flows,
        before.successes,
        before.failures,
    )
    assert np.allclose(record.tsum, before.tsum) and np.allclose(record.wsum, before.wsum)
    assert record.mrl == pytest.approx(before.mrl) and record.version == before.version + 2


def test_unfolding_the_last_member_empties_the_sums():
    record = new_cluster_record(1, 4, 4, "new", 0.0)
    vec = unit(np.ones(4))
    fold_member(record, vec, vec, "e", None, "f", 0.0)
    unfold_member(record, vec, vec, "e", None, "f", 0.0)
    assert (
        record.count == 0
        and not record.tsum.any()
        and not record.wsum.any()
        and not record.live
        and record.envs == {}
        and record.flows == {}
    )


def test_merged_equals_folding_every_member_into_one_cluster():
    rng = np.random.default_rng(0)
    a, b, both = (new_cluster_record(i, 6, 3, "new", 0.0) for i in (1, 2, 3))
    for n in range(7):
        vec, wvec = unit(rng.standard_normal(6)), unit(rng.standard_normal(3))
        fold_member(a if n < 4 else b, vec, wvec, f"env{n % 2}", n % 2 == 0, f"f{n % 3}", 0.0)
        fold_member(both, vec, wvec, f"env{n % 2}", n % 2 == 0, f"f{n % 3}", 0.0)
    out = merged(a, b, 1.0)
    assert (out.id, out.count, out.envs, out.flows, out.successes, out.failures) == (
        1,
        7,
        both.envs,
        both.flows,
        both.successes,
        both.failures,
    )
    assert np.allclose(out.tsum, both.tsum) and np.allclose(out.wsum, both.wsum) and a.count == 4  # inputs untouched


def test_the_invariant_verify_checks():
    record = _record()
    assert check_against_members(record, 5, 5, record.tsum.copy(), record.wsum.copy()) == []
    assert "count 5, members 4" in check_against_members(record, 4, 5, record.tsum, record.wsum)[0]
    off = record.wsum.copy()
    off[0] += 0.5
    problems = check_against_members(record, 5, 5, record.tsum, off)
    assert any("running sums" in p for p in problems) and any("R " in p for p in problems)


def test_verify_finds_a_cluster_whose_sums_were_changed_behind_the_engine(tmp_path, synthetic):
    trajs, vecs = synthetic
    with Memory.open(tmp_path / "m") as m:
        m.add_many(trajs[:60], vecs[:60])
        assert m.verify()["ok"]
        with m.store.read() as txn:
            record = m.store.get_cluster(txn, m.clusters()[0].id)
        record.count += 1
        m.store.write(lambda txn: m.store.put_cluster(txn, record))
        report = m.verify()
        assert not report["ok"] and any(f"cluster {record.id}: count" in p for p in report["problems"])


def test_verify_compares_the_index_with_the_store_by_id_not_only_by_count(tmp_path, synthetic):
    trajs, vecs = synthetic
    with Memory.open(tmp_path / "m") as m:
        m.add_many(trajs[:60], vecs[:60])
        index = m._state.index
        env = trajs[0].env
        with m.store.read() as txn:
            vid = m.store.lookup_id(txn, trajs[0].id)
        # One stored trajectory dropped from the index, a stray id put in its place: same count.
        assert index.remove(np.array([vid], dtype=np.int64)) == 1
        index.add(env, np.array([10**9], dtype=np.int64), vecs[:1])
        report = m.verify()
        assert not report["ok"] and not any("index holds" in p for p in report["problems"])
        assert f"index of env {env}: lacks 1 stored trajectory vid(s) ({vid})" in report["problems"]
        assert f"index of env {env}: holds 1 id(s) no stored trajectory of it has ({10**9})" in report["problems"]


# -- the codec -------------------------------------------------------------------------------
def test_cluster_records_round_trip_byte_for_byte():
    record = _record()
    record.split_into, record.parent, record.no_split_until = [3, 4], 2, 9
    raw = codec.encode_cluster(record)
    back = codec.decode_cluster(raw)
    assert codec.encode_cluster(back) == raw
    assert (
        back.id == 7
        and back.split_into == [3, 4]
        and back.no_split_until == 9
        and np.array_equal(back.wsum, record.wsum)
    )


def _old_cluster_bytes(r: ClusterRecord, with_nsu: bool) -> bytes:
    """A cluster record as the writers before lifemem_ray.engine.store.codec packed it."""
    d = {
        "id": r.id,
        "n": r.count,
        "ts": r.tsum.astype(np.float64).tobytes(),
        "ws": r.wsum.astype(np.float64).tobytes(),
        "envs": r.envs,
        "flows": r.flows,
        "ok": r.successes,
        "ko": r.failures,
        "d": r.description,
        "db": r.description_by,
        "dn": r.description_n,
        "s": r.skill,
        "sb": r.skill_by,
        "sn": r.skill_n,
        "v": r.version,
        "born": r.born,
        "parent": r.parent,
        "c": r.created,
        "u": r.updated,
        "split_into": r.split_into,
    }
    if with_nsu:
        d["nsu"] = r.no_split_until
    return msgpack.packb(d, use_bin_type=True)


def test_older_stored_records_still_decode_and_the_bytes_written_are_unchanged():
    record = _record()
    assert codec.encode_cluster(record) == _old_cluster_bytes(record, with_nsu=True)
    old = codec.decode_cluster(_old_cluster_bytes(record, with_nsu=False))  # before refused splits were remembered
    assert old.no_split_until == 0 and old.count == record.count and old.description == record.description
    traj = _traj(4)
    legacy = msgpack.packb(
        {
            "id": traj.id,
            "env": traj.env,
            "task": traj.task,
            "io": traj.initial_observation,
            "steps": [[s.thought, s.action, s.observation] for s in traj.steps],
            "out": [traj.outcome.success, traj.outcome.reward],
            "meta": dict(traj.metadata),
            "fp": traj.fingerprint,
            "wf": ["SEARCH"],
            "t": 5.0,
        },
        use_bin_type=True,
    )
    assert codec.encode_trajectory(traj, ["SEARCH"], 5.0) == legacy
    fields = codec.record_fields(legacy)
    assert (fields.id, fields.env, fields.success, fields.tokens, fields.added) == (
        traj.id,
        "shop",
        True,
        ["SEARCH"],
        5.0,
    )
    assert codec.decode_trajectory(legacy)[0] == traj == codec.fields_to_trajectory(fields)
    brief = codec.decode_brief(msgpack.packb([["A", "B"], False, "web", "find it", "t-1"], use_bin_type=True))
    assert (brief.tokens, brief.success, brief.env, brief.task, brief.id) == (
        ["A", "B"],
        False,
        "web",
        "find it",
        "t-1",
    )
    assert codec.encode_brief(brief) == msgpack.packb([["A", "B"], False, "web", "find it", "t-1"], use_bin_type=True)


def test_vectors_round_trip():
    vec, wvec = unit(np.arange(1.0, 9.0)), unit(np.arange(1.0, 5.0))
    code, v, w = codec.decode_vectors(codec.encode_vectors(3, vec, wvec), 8, 4)
    assert code == 3 and np.array_equal(v, vec.astype(np.float32)) and np.allclose(w, wvec, atol=1e-3)


# -- one id rule on every ingest path ----------------------------------------------------------
def test_prepared_items_refuse_an_in_batch_repeat_with_other_content(tmp_path):
    trajs = [_traj(i) for i in range(6)]
    other = _traj(2, task="a different task under the same id")
    vecs = unit(np.random.default_rng(1).standard_normal((7, 384)))
    with Memory.open(tmp_path / "m") as m:
        with pytest.raises(IdConflictError, match="shop-2"):
            m.shard.add_items(pack_trajectories([*trajs, other], vecs, 384, m.features))
        assert len(m) == 0, "nothing of the refused request is stored"
        with pytest.raises(IdConflictError, match="shop-2"):  # the same rule as add_many
            m.add_many([*trajs, other], vecs)
        results = m.shard.add_items(pack_trajectories([*trajs, trajs[2]], vecs, 384, m.features))
        assert [r.status for r in results][-1] == "duplicate" and results[-1].cluster_id == results[2].cluster_id
        assert len(m) == 6
        with pytest.raises(IdConflictError, match="already stored"):
            m.shard.add_items(pack_trajectories([other], vecs[:1], 384, m.features))
        assert m.get("shop-2") == trajs[2]


def test_a_shard_commit_reports_what_is_stored_and_stores_nothing_twice(tmp_path, synthetic):
    trajs, vecs = synthetic
    with Memory.open(tmp_path / "m") as m:
        m.add_many(trajs[:60], vecs[:60])
        batch = pack_trajectories(trajs[55:65], vecs[55:65], m.dim, m.features)
        found = m.shard.candidates(batch.vecs, batch.wvecs, batch.envs)
        target = int(found.neighbour_ids[0, 0])
        from lifemem_ray.engine.clustering.evolution import Placement

        results, states = m.shard.commit(batch, [Placement(cluster=target, op="join", by="offline")] * len(batch))
        assert [r.status for r in results] == ["duplicate"] * 5 + ["added"] * 5 and target in states
        again, _ = m.shard.commit(batch, [Placement(cluster=target, op="join", by="offline")] * len(batch))
        assert [r.status for r in again] == ["duplicate"] * 10 and len(m) == 65 and m.verify()["ok"]
