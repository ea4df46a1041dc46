"""Conflicting ids through a deployment: the client and Ray Data bulk loads refuse the whole
request (the engine's side: tests/engine/test_conflicts.py)."""

from __future__ import annotations

import numpy as np
import pytest
from test_conflicts import _batch, _gen, _other_content

from lifemem_ray.core.errors import IdConflictError
from lifemem_ray.core.importers import write_jsonl


def test_client_refuses_the_whole_request(deployment):
    client, _ = deployment(shards=2, **{"evolution.init_size": 2})
    first, first_vecs = _batch(8, seed=1, dim=384)
    client.add_many(first, first_vecs).result()
    fresh, fresh_vecs = _batch(4, seed=2, dim=384)
    bad = _other_content(first[2])
    with pytest.raises(IdConflictError, match=repr(bad.id)):
        client.add_many([fresh[0], bad, fresh[1]], np.stack([fresh_vecs[0], first_vecs[2], fresh_vecs[1]])).result()
    repeat = _other_content(fresh[2])
    with pytest.raises(IdConflictError, match=repr(repeat.id)):
        client.add_many([fresh[2], fresh[3], repeat], np.stack([fresh_vecs[2], fresh_vecs[3], fresh_vecs[2]])).result()
    assert client.stats()["trajectories"] == 8


def test_bulk_load_refuses_the_batch(deployment, tmp_path):
    from lifemem_ray.actors.client.bulk import bulk_load

    client, _ = deployment(shards=2)
    first = _gen(6, 1, ["shop"])
    write_jsonl(first, tmp_path / "a.jsonl")
    assert bulk_load(client, [str(tmp_path / "a.jsonl")], batch_size=64)["added"] == 6
    fresh = _gen(4, 2, ["shop"])
    write_jsonl([fresh[0], _other_content(first[1]), fresh[1]], tmp_path / "b.jsonl")
    with pytest.raises(IdConflictError, match=repr(first[1].id)):
        bulk_load(client, [str(tmp_path / "b.jsonl")], batch_size=64)
    assert client.stats()["trajectories"] == 6
