"""Workflow featurizer versions: a store of an older featurizer is migrated on a writable open,
one of another featurizer is refused, and items packed with another featurizer are refused."""

from __future__ import annotations

import numpy as np
import pytest
from support.common import unit

from lifemem_ray.engine.clustering.steps import features_id, featurize
from lifemem_ray.engine.ingest import pack_trajectories
from lifemem_ray.engine.memory import Memory
from lifemem_ray.engine.memory_config import MemoryConfig
from lifemem_ray.engine.store.migrate import LEGACY_FEATURES, stored_features
from lifemem_ray.engine.store.storage import StoreError
from lifemem_ray.lab.synthetic import generate, text_vectors


@pytest.fixture
def data():
    trajs = list(generate(80, seed=4, length_scale=0.1))
    return trajs, text_vectors([t.task for t in trajs])


def test_a_store_of_the_old_featurizer_is_recomputed_on_a_writable_open(tmp_path, data):
    trajs, vecs = data
    with Memory.open(tmp_path / "m", MemoryConfig()) as memory:
        memory.add_many(trajs, vecs)
        clusters = {c.id: c.count for c in memory.clusters()}
        # Make it look like a store written before featurizers were recorded: other vectors, no meta key.
        with memory.store.read() as txn:
            vids = [vid for vid, _, _ in memory.store.iter_trajectories(txn)]
        stale = unit(np.random.default_rng(0).standard_normal((len(vids), 256)))
        memory.store.write(
            lambda txn: [memory.store.rewrite_workflow(txn, v, w, ["old"]) for v, w in zip(vids, stale, strict=True)]
        )
        memory.store.write(lambda txn: txn.delete(b"workflow_features", db=memory.store.db["meta"]))
    with Memory.open(tmp_path / "m", MemoryConfig(), read_only=True) as reader:  # searches work; nothing is rewritten
        assert stored_features(reader.store) == LEGACY_FEATURES
    with Memory.open(tmp_path / "m", MemoryConfig()) as memory:
        assert stored_features(memory.store) == features_id("roles")
        assert memory.verify()["ok"], memory.verify()["problems"]
        assert {c.id: c.count for c in memory.clusters()} == clusters  # membership is kept
        with memory.store.read() as txn:
            vid = memory.store.lookup_id(txn, trajs[0].id)
            _, _, wvec = memory.store.vectors(txn, vid)
            tokens = memory.store.brief(txn, vid)[0]
        expected_tokens, expected = featurize(trajs[0])
        assert np.allclose(wvec, expected, atol=1e-3) and tokens == expected_tokens


def test_another_featurizer_is_refused_with_what_to_set(tmp_path, data):
    trajs, vecs = data
    with Memory.open(tmp_path / "m", MemoryConfig()) as memory:
        memory.add_many(trajs[:10], vecs[:10])
    with pytest.raises(StoreError, match=r"evolution\.workflow_features = 'roles'"):
        Memory.open(tmp_path / "m", MemoryConfig().replace({"evolution.workflow_features": "tokens"}))


def test_items_packed_with_another_featurizer_are_refused(tmp_path, data):
    trajs, vecs = data
    batch = pack_trajectories(trajs[:5], vecs[:5], 384, "tokens")
    with Memory.open(tmp_path / "m", MemoryConfig()) as memory:
        with pytest.raises(ValueError, match="workflow vectors"):
            memory.shard.check_features(batch.features)
        memory.shard.check_features(pack_trajectories(trajs[:5], vecs[:5], 384, "roles").features)
