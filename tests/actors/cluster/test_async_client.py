"""AsyncMemoryClient against a real deployment (real Ray, LMDB, FAISS): the blocking client's
answers, awaited; many coroutines at once; idempotent adds and ids in doubt; a shard that does
not answer; the coordinator killed mid-add. One deployment serves the module; the fault tests
come last and leave it serving."""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import time

import pytest
import ray
from support.common import SMALL_ACTORS

from lifemem_ray.actors.client.awaiting import AsyncMemoryClient
from lifemem_ray.actors.client.blocking import MemoryClient
from lifemem_ray.actors.client.rules import AddRequest, InDoubtLedger
from lifemem_ray.actors.cluster import deployment as dep
from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.actors.cluster.remote_errors import ShardUnavailableError
from lifemem_ray.core.errors import IdConflictError
from lifemem_ray.core.model import Step, Trajectory
from lifemem_ray.engine.ingest_rules import AddResult
from lifemem_ray.lab.synthetic import generate, text_vectors


@pytest.fixture(scope="module")
def memory(ray_local, tmp_path_factory):
    """A two-shard deployment and the blocking client on it (the reference answers)."""
    ns = f"async-client-{os.getpid()}"
    config = DeploymentConfig().replace({**SMALL_ACTORS, "cluster.namespace": ns, "cluster.batch_wait_ms": 5})
    dep.deploy(tmp_path_factory.mktemp("async-memory"), config, shards=2)
    yield MemoryClient(ns, config)
    dep.stop(ns)


@pytest.fixture(scope="module")
def data():
    trajs = list(generate(400, seed=33, length_scale=0.1))
    return trajs, text_vectors([t.task for t in trajs])


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 300))  # a hang fails the test instead of the session


async def connect(sync: MemoryClient, **overrides) -> AsyncMemoryClient:
    return await AsyncMemoryClient.connect(sync.namespace, config=sync.config.replace(overrides))


def same_hits(a, b) -> None:
    assert [(h.id, round(h.score, 5)) for h in a.trajectories] == [(h.id, round(h.score, 5)) for h in b.trajectories]
    assert [s.text for s in a.skills] == [s.text for s in b.skills] and a.context == b.context


def test_add_many_then_retrieve_many_awaited(memory, data):
    trajs, vecs = data
    queries = list(range(200, 240))

    async def scenario():
        client = await connect(memory)
        results = await client.add_many(trajs[:200], vecs[:200])
        single = await client.add(trajs[200], vecs[200])
        await client.maintain()  # splits and skills done: both clients see one state
        one_round = await client.retrieve_many(
            [trajs[i].task for i in queries[:5]], [trajs[i].env for i in queries[:5]], 4, vectors=vecs[queries[:5]]
        )
        two_rounds = await client.retrieve_many(
            [trajs[i].task for i in queries], [trajs[i].env for i in queries], 4, vectors=vecs[queries]
        )
        embedded = await client.retrieve(trajs[3].task, trajs[3].env)  # the deployment's embedder
        return results, single, one_round, two_rounds, embedded

    results, single, one_round, two_rounds, embedded = run(scenario())
    assert len(results) == 200 and {r.status for r in results} == {"added"}
    assert isinstance(single, AddResult) and single.status == "added"
    expected = memory.retrieve_many(
        [trajs[i].task for i in queries], [trajs[i].env for i in queries], 4, vectors=vecs[queries]
    )
    assert len(two_rounds) == len(expected)
    for a, b in zip(expected, two_rounds, strict=True):
        same_hits(a, b)
    for a, b in zip(expected[:5], one_round, strict=True):
        same_hits(a, b)
    assert embedded.trajectories and all(h.env == trajs[3].env for h in embedded.trajectories)


def test_many_concurrent_retrieves_are_all_answered(memory, data):
    trajs, vecs = data
    memory.add_many(trajs[:200], vecs[:200]).result(timeout=300)  # stored once whichever test ran first
    memory.maintain()
    picks = [i * 7 % 200 for i in range(32)]

    async def scenario():
        client = await connect(memory)
        started = time.monotonic()
        answers = await asyncio.gather(
            *(client.retrieve(trajs[i].task, trajs[i].env, 4, vector=vecs[i]) for i in picks)
        )
        return answers, time.monotonic() - started

    answers, _seconds = run(scenario())
    assert len(answers) == 32
    for i, got in zip(picks, answers, strict=True):
        assert got.trajectories, f"query {i} got nothing"
        same_hits(memory.retrieve(trajs[i].task, trajs[i].env, 4, vector=vecs[i]), got)


def test_a_re_add_is_idempotent_and_ids_in_doubt_read_added(memory, data):
    trajs, vecs = data
    batch, batch_vecs = trajs[240:260], vecs[240:260]
    changed = Trajectory(env=batch[0].env, task="other content", steps=(Step(action="x"),), id=batch[0].id)
    before = memory.stats()["trajectories"]

    async def scenario():
        client = await connect(memory)
        first = await client.add_many(batch, batch_vecs)
        again = await client.add_many(batch, batch_vecs)
        with pytest.raises(IdConflictError, match=batch[0].id):
            await client.add(changed, batch_vecs[0])
        # An answer lost (as when the coordinator died): this client's own earlier commit reads "added".
        fingerprints = _fingerprints(client, batch[:5], batch_vecs[:5])
        client.in_doubt.remember({t.id: fp for t, fp in zip(batch[:5], fingerprints, strict=True)})
        in_doubt = await client.add_many(batch[:10], batch_vecs[:10])
        future = client.add_many(batch[10:12], batch_vecs[10:12])
        return first, again, in_doubt, await future, await future  # awaited twice: the same answer

    first, again, in_doubt, once, twice = run(scenario())
    assert {r.status for r in first} == {"added"} and {r.status for r in again} == {"duplicate"}
    assert [r.status for r in in_doubt] == ["added"] * 5 + ["duplicate"] * 5
    assert once == twice and {r.status for r in once} == {"duplicate"}
    assert memory.stats()["trajectories"] == before + len(batch)  # each stored once


def _fingerprints(client: AsyncMemoryClient, trajs, vecs) -> list[str]:
    from lifemem_ray.engine.ingest import pack_trajectories

    return pack_trajectories(trajs, vecs, client.dim, client.config.evolution.workflow_features).fingerprints


def test_stats_and_the_other_calls_match_the_blocking_client(memory, data):
    trajs, vecs = data
    memory.add_many(trajs[:200], vecs[:200]).result(timeout=300)

    async def scenario():
        client = await connect(memory)
        await client.maintain()
        return (
            await client.stats(),
            await client.stats(tenant="default"),
            await client.clusters(limit=3),
            await client.cluster_count(),
            await client.verify(),
            await client.stored_conflicts([trajs[0].id], ["not-its-fingerprint"]),
        )

    stats, tenant_stats, top3, count, report, conflicts = run(scenario())
    expected = memory.stats()
    for key in ("trajectories", "clusters", "per_env", "per_tenant", "splits"):
        assert stats[key] == expected[key], key
    assert stats["coordinator"]["counters"] and "llm" in stats and len(stats["shards"]) == 2
    assert tenant_stats["tenant"] == "default" and tenant_stats["trajectories"] == expected["trajectories"]
    assert [c.id for c in top3] == [c.id for c in memory.clusters(limit=3)] and count == memory.cluster_count()
    assert report["ok"] and conflicts == [True]


def test_remove_through_the_async_client(memory, data):
    trajs, vecs = data
    memory.add_many(trajs[300:310], vecs[300:310]).result(timeout=300)

    async def scenario():
        client = await connect(memory)
        removed = await client.remove([t.id for t in trajs[300:305]])
        return removed, await client.remove([t.id for t in trajs[300:305]])

    assert run(scenario()) == (5, 0)  # idempotent: the second finds nothing


def test_a_shard_that_does_not_answer_is_unavailable_not_a_hang(memory, data):
    """The shard's process stopped (SIGSTOP): the call gives up after cluster.call_timeout_s
    with ShardUnavailableError; once it runs again, the same client is served."""
    trajs, vecs = data
    memory.add_many(trajs[:200], vecs[:200]).result(timeout=300)
    pid = ray.get(memory.shards[1].info.remote())["pid"]

    async def scenario():
        client = await connect(memory, **{"cluster.call_timeout_s": 1.0})
        await client.retrieve(trajs[0].task, trajs[0].env, vector=vecs[0])  # handles looked up
        os.kill(pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(ShardUnavailableError, match="call_timeout_s") as info:
                await client.retrieve(trajs[0].task, trajs[0].env, vector=vecs[0])
            waited = time.monotonic() - started
            concurrent = await asyncio.gather(
                *(client.stats() for _ in range(4)), return_exceptions=True
            )  # every waiter gets the error
        finally:
            os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 60
        while True:
            try:
                return (
                    info.value,
                    waited,
                    concurrent,
                    await client.retrieve(trajs[0].task, trajs[0].env, vector=vecs[0]),
                )
            except ShardUnavailableError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)

    error, waited, concurrent, after = run(scenario())
    assert "unavailable for retrieval" in str(error) and waited < 30
    assert all(isinstance(e, ShardUnavailableError) for e in concurrent), concurrent
    assert after.trajectories


def test_the_coordinator_killed_mid_add_resends_what_it_lost(memory, data):
    """Adds wait in a paused coordinator, which is then killed: their answers are lost, the
    futures send them again to the restarted coordinator, and every id is stored once
    (mirrors tests/actors/cluster/test_ray.py::test_an_actor_dies_mid_ingest[coordinator])."""
    trajs, vecs = data
    before = memory.stats()["trajectories"]
    fresh = trajs[310:400]

    async def scenario():
        client = await connect(memory)  # cluster.add_resends = 10: some 40 s of resends
        await client.coordinator.pause.remote()
        futures = [client.add_many(fresh[a : a + 30], vecs[310 + a : 340 + a]) for a in range(0, 90, 30)]
        await asyncio.sleep(0.5)  # the requests reached the coordinator and wait there
        ray.kill(client.coordinator, no_restart=False)
        results = await asyncio.gather(*(f.result() for f in futures))
        return results, [f.request.attempts for f in futures]

    results, attempts = run(scenario())
    assert all(n >= 1 for n in attempts), attempts  # each request was sent again
    statuses = {r.status for part in results for r in part}
    assert statuses <= {"added", "pending"}, statuses  # every id was new
    fresh_client = MemoryClient(memory.namespace, memory.config)
    assert fresh_client.stats()["trajectories"] == before + len(fresh)
    assert fresh_client.verify()["ok"]


def test_an_add_request_travels_and_keeps_its_own_doubts():
    """What a rollout worker hands the pool: the request pickles without the client's ledger
    and clock; its doubts then live in a ledger of its own."""
    import ray.exceptions as rx

    ledger = InDoubtLedger()
    request = AddRequest({"a": "fa", "b": "fb"}, ["a", "b"], ledger, resends=1, started=time.monotonic())
    travelled = pickle.loads(pickle.dumps(request))
    assert travelled.ledger is not ledger and travelled.started is None and travelled.sent == request.sent
    assert travelled.failed(rx.ActorDiedError()) == 0.5 and travelled.failed(rx.ActorDiedError()) is None
    assert len(travelled.ledger) == 2 and len(ledger) == 0
    settled = travelled.answered([AddResult("a", "duplicate", 1), AddResult("b", "added", 2)])
    assert [r.status for r in settled] == ["added", "added"] and len(travelled.ledger) == 0


def test_the_module_example_runs(memory, capsys):
    """The example of async_client's docstring, as written (only the namespace is this test's)."""
    import textwrap

    import lifemem_ray.actors.client.awaiting as module

    doc = module.__doc__ or ""
    code = textwrap.dedent(doc.split("::\n", 1)[1])
    exec(compile(code.replace('namespace="lifemem"', f'namespace="{memory.namespace}"'), "example", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert "AddResult(id='t1'" in printed[0] and int(printed[-1]) >= 1
