"""The generated-text rule through a Ray deployment: payloads are never stored or served (the rule
and the engine: tests/llm/test_generated_text.py)."""

from __future__ import annotations

import pytest
from support.openai_stub import OpenAIStub
from test_generated_text import (
    ENGINE_PAYLOADS,
    assert_nothing_of_a_payload,
    hostile,
    llm_overrides,
    marker_free_data,
)


@pytest.fixture(scope="module")
def data():
    return marker_free_data()


@pytest.mark.usefixtures("ray_local")
def test_payloads_are_never_stored_or_served_by_a_deployment(deployment, data):
    trajs, vecs = data
    with OpenAIStub(responder=hostile(ENGINE_PAYLOADS)) as stub:
        client, _ = deployment(shards=2, **llm_overrides(stub.base_url))
        client.add_many(trajs[:20], vecs[:20]).result(timeout=300)
        client.add_many(trajs[20:], vecs[20:]).result(timeout=300)
        client.maintain()
        clusters = client.clusters()
        served = client.retrieve_many([t.task for t in trajs[:12]], [t.env for t in trajs[:12]], 4, vectors=vecs[:12])
        stats = client.stats()
    assert len(clusters) >= 2 and all(r.skills for r in served)
    assert_nothing_of_a_payload(clusters, served)
    llm = stats["llm"]
    by_op = llm["by_operation"]  # the shards' and the coordinator's usage together
    assert llm["refused_generated"] >= 3 and llm["refused_generated"] == sum(
        v.get("refused_generated", 0) for v in by_op.values()
    )
    for op in ("assign", "partition", "describe", "distil"):
        assert by_op[op]["refused_generated"] >= 1, (op, by_op[op])
