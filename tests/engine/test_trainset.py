"""The paper's released trajectories, end to end: import, embed, cluster, retrieve."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from lifemem_ray.core.importers import read_jsonl
from lifemem_ray.engine.memory import Memory


@pytest.fixture(scope="module")
def trainset(trainset_dir, embedder):
    trajs, report = read_jsonl(sorted(trainset_dir.glob("*.jsonl")))
    assert report.invalid == 0 and report.read == 1202
    vecs = embedder.embed([t.query_text for t in trajs])
    return trajs, vecs


def test_ingest_and_retrieve_real_trajectories(tmp_path, trainset, embedder):
    trajs, vecs = trainset
    held = [i for i in range(len(trajs)) if i % 10 == 9]
    train = [i for i in range(len(trajs)) if i % 10 != 9]
    with Memory.open(tmp_path / "m", embedder=embedder) as m:
        results = m.add_many([trajs[i] for i in train], vecs[train])
        assert Counter(r.status for r in results)["duplicate"] >= 10  # miniwob's exact copies
        assert m.verify()["ok"]
        stats = m.stats()
        assert set(stats["per_env"]) == {t.env for t in trajs}
        assert stats["clusters"] < len(train) / 5, "clusters consolidate many trajectories"
        # toolqa's two passes (SQLInterpreter vs FilterDB/GetValue) are different workflows.
        agree = total = 0
        for c in m.clusters("toolqa"):
            passes = Counter(
                "sql" if m.get(i).metadata["source_line"] <= 215 else "filter"
                for i in m.members(c.id)
                if m.get(i).env == "toolqa"
            )
            agree += passes.most_common(1)[0][1]
            total += sum(passes.values())
        assert agree / total >= 0.95
        # Retrieval: same environment always, and better than plain nearest neighbours.
        queries = [trajs[i] for i in held]
        got = m.retrieve_many([q.query_text for q in queries], [q.env for q in queries], 4, vectors=vecs[held])
        lifemem = np.mean(
            [np.mean([h.env == q.env for h in r.trajectories]) for q, r in zip(queries, got, strict=True)]
        )
        top = np.argsort(-(vecs[held] @ vecs[train].T), axis=1)[:, :4]
        baseline = np.mean(
            [np.mean([trajs[train[j]].env == q.env for j in row]) for q, row in zip(queries, top, strict=True)]
        )
        assert lifemem == 1.0 and lifemem > baseline
        assert all(r.skills for r in got)
        # Retrieval by text (the embedding model inside) gives the same as by vector.
        by_text = m.retrieve(queries[0].query_text, queries[0].env)
        assert [h.id for h in by_text.trajectories] == [h.id for h in got[0].trajectories]
