"""The client bounds retrieve's arguments as the engine does (tests/engine/test_hardening.py)."""

from __future__ import annotations

import pytest
from test_hardening import K_MESSAGE, _data

from lifemem_ray.engine.retrieval import MAX_TASK_CHARS


def test_client_retrieve_bounds(deployment):
    client, _ = deployment(shards=1)
    trajs, vecs = _data(20)
    client.add_many(trajs, vecs).result()
    assert len(client.retrieve(trajs[0].task, trajs[0].env, 1024, vector=vecs[0]).trajectories) >= 1
    for k in (0, 1025, 10**9):
        with pytest.raises(ValueError) as info:
            client.retrieve(trajs[0].task, trajs[0].env, k, vector=vecs[0])
        assert str(info.value).startswith(K_MESSAGE)
    with pytest.raises(ValueError, match=r"tasks\[0\]: .* characters, at most"):
        client.retrieve("x" * (MAX_TASK_CHARS + 1), "shop", 1, vector=vecs[0])
