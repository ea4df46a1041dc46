"""The coordinator's logic without Ray: BatchIngest and the Coordinator class over two
in-process engine shards (actors.shard.MemoryShard in temporary folders)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from lifemem_ray.actors.cluster.batching import BatchIngest, LocalShards, absorb_previous, route
from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.actors.cluster.coordinator import Coordinator
from lifemem_ray.actors.cluster.routing import RoutingTable
from lifemem_ray.actors.cluster.shard_actor import MemoryShard
from lifemem_ray.core.errors import EmbeddingError, IdConflictError, UnknownClusterError
from lifemem_ray.core.model import Step, Trajectory
from lifemem_ray.engine.clustering.evolution import ItemBatch, Placement
from lifemem_ray.engine.ingest import pack_trajectories
from lifemem_ray.engine.memory import Memory
from lifemem_ray.lab.synthetic import generate, text_vectors

DIM = 384
# No splits during a test (they run in the shards' background threads): partitions compare exactly.
CONFIG = {"evolution.split_min_size": 100_000}


@pytest.fixture(scope="module")
def data():
    trajs = list(generate(400, seed=5, length_scale=0.1))
    return trajs, text_vectors([t.task for t in trajs])


def make_config(**changes) -> DeploymentConfig:
    return DeploymentConfig().replace({**CONFIG, **changes}).validate()


@pytest.fixture
def cluster(tmp_path):
    """Two in-process shards and a routing table; closed after the test."""
    opened = []

    def make(config: DeploymentConfig, shards: int = 2):
        made = [MemoryShard(i, str(tmp_path / f"shard-{i:02d}"), config, DIM) for i in range(shards)]
        routing = RoutingTable(tmp_path / "coordinator")
        opened.append((made, routing))
        return LocalShards(made), routing

    yield make
    for made, routing in opened:
        for shard in made:
            shard.close()
        routing.close()


def packed(config: DeploymentConfig, trajs, vecs):
    return pack_trajectories(
        list(trajs), None if vecs is None else np.asarray(vecs), DIM, config.evolution.workflow_features
    )


def changed(traj: Trajectory) -> Trajectory:
    return Trajectory(env=traj.env, task="other content", steps=(Step(action="x"),), id=traj.id)


def partition(memories) -> set[frozenset[str]]:
    return {frozenset(m.members(c.id)) for m in memories for c in m.clusters()}


async def ingest_serially(ingest: BatchIngest, config, requests):
    """Each micro-batch (a list of requests: (trajectories, vectors) or a packed batch) through front and back."""
    out = []
    for micro in requests:
        batches = [r if isinstance(r, ItemBatch) else packed(config, *r) for r in micro]
        stage = await ingest.front(batches, [isinstance(r, ItemBatch) or r[1] is not None for r in micro])
        outcomes, _ = await ingest.back(stage)
        out.append(outcomes)
    return out


def test_duplicates_and_conflicts_across_requests_of_one_micro_batch(cluster, data):
    trajs, vecs = data
    config = make_config()
    shards, routing = cluster(config)
    ingest = BatchIngest(config, shards, routing, DIM)

    async def run():
        (first,) = await ingest_serially(ingest, config, [[(trajs[:60], vecs[:60])]])
        assert [r.status for r in first[0]] == ["added"] * 60
        # One micro-batch of three requests: (a) new ones plus a repeat of a stored id and of
        # an id in (b), (b) new ones, (c) new ones plus a stored id with other content.
        a = ([*trajs[60:70], trajs[3], trajs[75]], np.vstack([vecs[60:70], vecs[3], vecs[75]]))
        b = (trajs[70:80], vecs[70:80])
        c = ([*trajs[80:85], changed(trajs[10])], np.vstack([vecs[80:85], vecs[10]]))
        (outcomes,) = await ingest_serially(ingest, config, [[a, b, c]])
        return first, outcomes

    first, (ra, rb, rc) = asyncio.run(run())
    assert [r.status for r in ra] == ["added"] * 10 + ["duplicate", "added"]
    assert ra[10].cluster_id == first[0][3].cluster_id
    # (a) stored trajs[75] first; in (b) it is a duplicate of that, in the same cluster.
    assert [r.status for r in rb] == ["added"] * 5 + ["duplicate"] + ["added"] * 4
    assert rb[5].cluster_id == ra[11].cluster_id
    assert isinstance(rc, IdConflictError) and trajs[10].id in str(rc)
    assert sum(len(s.memory) for s in shards.shards) == 60 + 11 + 9, "nothing of the conflicting request was stored"
    assert ingest.counters["rejected"] == 1


def test_a_repeat_with_other_content_rejects_its_request_only(cluster, data):
    trajs, vecs = data
    config = make_config()
    shards, routing = cluster(config)
    ingest = BatchIngest(config, shards, routing, DIM)
    a = (trajs[:30], vecs[:30])
    b = ([trajs[30], changed(trajs[5])], vecs[30:32])
    (outcomes,) = asyncio.run(ingest_serially(ingest, config, [[a, b]]))
    assert {r.status for r in outcomes[0]} == {"added"}
    assert isinstance(outcomes[1], IdConflictError) and "repeated" in str(outcomes[1])
    assert sum(len(s.memory) for s in shards.shards) == 30


def test_a_zero_vector_rejects_its_request_and_a_rejected_first_occurrence_passes_on(cluster, data):
    trajs, vecs = data
    config = make_config()
    shards, routing = cluster(config)
    ingest = BatchIngest(config, shards, routing, DIM)
    # The client checks vectors when it packs a request; these come from elsewhere (an
    # embedder, a hand-made batch).
    bad = packed(config, trajs[20:30], vecs[20:30])
    bad.vecs[4] = 0.0
    nan = packed(config, trajs[40:42], vecs[40:42])
    nan.vecs[1, 0] = np.nan
    micro = [
        (trajs[:20], vecs[:20]),
        bad,  # a zero vector: rejected whole
        (trajs[25:27], vecs[25:27]),  # repeats two of the rejected request's ids: stored here
        nan,
    ]
    (outcomes,) = asyncio.run(ingest_serially(ingest, config, [micro]))
    assert {r.status for r in outcomes[0]} == {"added"}
    assert (
        isinstance(outcomes[1], ValueError) and trajs[24].id in str(outcomes[1]) and "zero vector" in str(outcomes[1])
    )
    assert [r.status for r in outcomes[2]] == ["added", "added"]
    assert isinstance(outcomes[3], ValueError) and "NaN" in str(outcomes[3])
    assert sum(len(s.memory) for s in shards.shards) == 22


def test_without_vectors_or_embedder_the_request_fails_with_a_clear_error(cluster, data):
    trajs, _vecs = data
    config = make_config()
    shards, routing = cluster(config)
    ingest = BatchIngest(config, shards, routing, DIM)

    async def run():
        stage = await ingest.front([packed(config, trajs[:3], None)], [False])
        with pytest.raises(EmbeddingError):
            await ingest.back(stage)

    asyncio.run(run())

    async def embed(texts):
        return text_vectors(texts)

    ingest.embed = embed
    (outcomes,) = asyncio.run(ingest_serially(ingest, config, [[(trajs[:3], None)]]))
    assert [r.status for r in outcomes[0]] == ["pending"] * 3 or [r.status for r in outcomes[0]] == ["added"] * 3


def test_route_joins_to_owners_new_clusters_to_the_least_loaded():
    placements = [
        Placement(7, "join", "offline"),
        Placement(-1, "join", "offline"),
        Placement(-1, "join", "offline"),
        Placement(-2, "join", "offline"),
        Placement(9, "join", "offline"),
    ]
    target = route(placements, {7: 1}, {9: 0}.get, [5, 3])
    # 7 to its owner (loads [5, 4]); -1 opens on shard 1 (4 < 5) and its second item follows it;
    # then loads [5, 6]: -2 opens on shard 0; 9 goes to its route.
    assert target == [1, 1, 1, 0, 0]
    with pytest.raises(UnknownClusterError):
        route([Placement(3, "join", "offline")], {}, {}.get, [0, 0])


@pytest.mark.parametrize("contrast", [0.0, 0.2])
def test_serial_micro_batches_cluster_as_the_engine(cluster, data, tmp_path, contrast):
    """Micro-batches of the coordinator's logic over two shards give the engine's partition
    when the engine gets the same batches (with the environment contrast on too: the shards'
    environment sums add up to the engine's)."""
    trajs, vecs = data
    config = make_config(**{"policy.env_contrast": contrast})
    shards, routing = cluster(config)
    ingest = BatchIngest(config, shards, routing, DIM)
    bounds = [(0, 5)] + [(a, a + 50) for a in range(5, 305, 50)]
    asyncio.run(ingest_serially(ingest, config, [[(trajs[a:b], vecs[a:b])] for a, b in bounds]))
    assert all(len(s.memory) > 20 for s in shards.shards), [len(s.memory) for s in shards.shards]
    with Memory.open(tmp_path / "single", make_config(**{"policy.env_contrast": contrast}), dim=DIM) as memory:
        for a, b in bounds:
            memory.add_many(trajs[a:b], vecs[a:b])
        expected = partition([memory])
    assert partition([s.memory for s in shards.shards]) == expected


def test_the_coordinator_pipelines_without_ray(cluster, data, tmp_path):
    """The Coordinator class over in-process shards: requests queued together are pipelined;
    repeats of the previous batch's ids are duplicates (or a conflict), stored once."""
    trajs, vecs = data
    config = make_config(**{"cluster.batch_size": 50, "cluster.batch_wait_ms": 0.0})
    shards, routing = cluster(config)
    routing.close()
    coordinator = Coordinator(str(tmp_path), config, ["s0", "s1"], [], DIM, shards=shards)

    def add(ts, vs):  # packed here, so the requests queue in this order
        return coordinator.add_batch(packed(config, ts, vs), True)

    async def run():
        await coordinator.add_many(trajs[:50], vecs[:50])  # initialises the memory
        calls = [add(trajs[a : a + 50], vecs[a : a + 50]) for a in (50, 100)]
        # Looked up while the batch before is planned: a conflict with it, then a repeat of it.
        calls.append(add([trajs[300], changed(trajs[120])], [vecs[300], vecs[120]]))
        calls.append(add(trajs[100:150], vecs[100:150]))
        calls += [add(trajs[a : a + 50], vecs[a : a + 50]) for a in (150, 200, 250)]
        return await asyncio.gather(*calls, return_exceptions=True)

    out = asyncio.run(run())
    coordinator.routing.close()
    assert {r.status for r in out[0]} == {"added"}
    assert isinstance(out[2], IdConflictError) and trajs[120].id in str(out[2])
    assert {r.status for r in out[1]} == {"added"} and {r.status for r in out[3]} == {"duplicate"}
    assert [r.cluster_id for r in out[1]] == [r.cluster_id for r in out[3]]
    assert all({r.status for r in part} == {"added"} for part in out[4:])
    stats = asyncio.run(coordinator.stats())
    assert stats["counters"]["pipelined"] >= 4, stats["counters"]
    assert sum(len(s.memory) for s in shards.shards) == 300
    pipelined = partition([s.memory for s in shards.shards])
    # The clustering is close to the engine's on the same batches.
    with Memory.open(tmp_path / "single", make_config(), dim=DIM) as memory:
        for a in range(0, 300, 50):
            memory.add_many(trajs[a : a + 50], vecs[a : a + 50])
        expected = partition([memory])
    assert abs(len(pipelined) - len(expected)) <= 2, (len(pipelined), len(expected))


def test_absorb_previous_adds_exact_neighbours_within_the_environment():
    from lifemem_ray.actors.cluster.batching import Committed
    from lifemem_ray.engine.clustering.evolution import CandidateSet, ItemBatch

    rng = np.random.default_rng(0)
    prev = rng.normal(size=(6, 8)).astype(np.float32)
    prev /= np.linalg.norm(prev, axis=1, keepdims=True)
    cur = prev[[0, 4]] + 0.01
    part = ItemBatch(
        ["x", "y"],
        ["a", "b"],
        ["", ""],
        [None, None],
        ["", ""],
        [b"", b""],
        cur,
        np.zeros((2, 4), np.float32),
        [[], []],
        ["", ""],
        "roles",
    )
    previous = Committed(
        vecs=prev, envs=["a", "a", "a", "b", "b", "b"], clusters=[10, 11, 12, 13, 14, 15], opened={"a": [10, 11]}
    )
    merged = CandidateSet([[(99, 0.5)], []], [[], [(20, 0.1)]], {})
    absorb_previous(part, merged, {}, previous, k=2, max_provisional=1)
    assert merged.neighbours[0][0][0] == 10 and len(merged.neighbours[0]) == 2
    assert merged.neighbours[1][0][0] == 14 and {c for c, _ in merged.neighbours[1]} <= {13, 14, 15}
    assert merged.extra[0] == [(11, 0.0)] and merged.extra[1] == [(20, 0.1)]


def test_the_client_offers_the_engines_user_operations():
    import inspect

    from lifemem_ray.actors.client.blocking import MemoryClient
    from lifemem_ray.engine.protocols import MemoryAPI

    assert isinstance(MemoryClient.__new__(MemoryClient), MemoryAPI)
    for name in (
        "add",
        "add_many",
        "retrieve",
        "retrieve_many",
        "clusters",
        "cluster_count",
        "verify",
        "maintain",
        "close",
    ):
        ours = list(inspect.signature(getattr(MemoryClient, name)).parameters)
        engine = list(inspect.signature(getattr(Memory, name)).parameters)
        assert ours == engine[: len(ours)] and all(
            p.default is not inspect.Parameter.empty
            for p in list(inspect.signature(getattr(Memory, name)).parameters.values())[len(ours) :]
        ), (name, ours, engine)


class _ResentCommits(LocalShards):
    """Every commit runs twice and answers the second time: the first attempt committed, its
    answer was lost with a shard that restarted, and Ray sent the commit again."""

    async def commit(self, shard, batch, placements, counters):
        await super().commit(shard, batch, placements, counters)
        return await super().commit(shard, batch, placements, counters)


def test_a_resent_commit_reports_its_items_added_and_counts_them(cluster, data):
    trajs, vecs = data
    config = make_config()
    local, routing = cluster(config)
    shards = _ResentCommits(local.shards)
    ingest = BatchIngest(config, shards, routing, DIM)
    first, second = asyncio.run(
        ingest_serially(ingest, config, [[(trajs[:40], vecs[:40])], [(trajs[40:80], vecs[40:80])]])
    )
    assert {r.status for r in second[0]} == {"added"}, "every id was new: the request's first attempt stored it"
    assert sum(len(s.memory) for s in shards.shards) == 80
    assert sum(ingest.loads) == sum(len(s.memory) for s in shards.shards) - sum(
        1 for r in first[0] if r.status != "added"
    )


def test_absorbing_the_previous_batch_adds_its_items_to_the_environment_sums():
    from lifemem_ray.actors.cluster.batching import Committed
    from lifemem_ray.engine.clustering.evolution import CandidateSet, ScopeSums

    part = ItemBatch.of([], "roles")
    part.envs = []
    previous = Committed(vecs=np.ones((3, 4), np.float32), wvecs=np.ones((3, 2), np.float32), envs=["a", "a", "b"])
    merged = CandidateSet([], [], {}, {"a": ScopeSums(2, np.zeros(4), np.zeros(2))})
    absorb_previous(part, merged, {}, previous, 4, 4, count_scopes=True)
    assert (
        merged.scopes["a"].count == 4
        and merged.scopes["a"].tsum.tolist() == [2.0] * 4
        and merged.scopes["b"].count == 1
    )
    untouched = CandidateSet([], [], {}, {})
    absorb_previous(part, untouched, {}, previous, 4, 4)  # the contrast off: the shards sent no sums, none are made up
    assert untouched.scopes == {}


def test_a_removal_that_fails_on_one_shard_keeps_the_loads_of_the_others(cluster, data, tmp_path):
    """The shard loads (where new clusters go) follow what each shard removed; the failing
    shard's error reaches the caller, and ingest is not left paused."""
    trajs, vecs = data
    config = make_config(**{"cluster.batch_wait_ms": 0.0})
    shards, routing = cluster(config)
    routing.close()
    coordinator = Coordinator(str(tmp_path), config, ["s0", "s1"], [], DIM, shards=shards)

    def broken_remove(*args):
        raise OSError("disk gone on shard 1")

    async def run():
        await coordinator.add_many(trajs[:120], vecs[:120])
        before = list(coordinator.ingest.loads)
        held = {i for i in (0, 1) if len(shards.shards[i].memory)}
        assert held == {0, 1}, "both shards should hold trajectories for this test"
        on_shard0 = [t.id for t in trajs[:120] if shards.shards[0].memory.get(t.id) is not None][:5]
        shards.shards[1].remove = broken_remove
        with pytest.raises(OSError, match="shard 1"):
            await coordinator.remove(on_shard0)
        after = list(coordinator.ingest.loads)
        more = await coordinator.add_many(trajs[120:130], vecs[120:130])  # not left paused
        return before, after, more

    before, after, more = asyncio.run(run())
    coordinator.routing.close()
    assert after == [before[0] - 5, before[1]]
    assert {r.status for r in more} == {"added"}


def test_a_resume_that_arrives_before_its_pause_leaves_nothing_held(cluster, data, tmp_path):
    """Ray does not order an async actor's calls: a snapshot's resume may start before its
    pause. Paired by token, the late pause then holds nothing and ingest goes on."""
    trajs, vecs = data
    config = make_config(**{"cluster.batch_wait_ms": 0.0})
    shards, routing = cluster(config)
    routing.close()
    coordinator = Coordinator(str(tmp_path), config, ["s0", "s1"], [], DIM, shards=shards)

    async def run():
        await coordinator.add_many(trajs[:40], vecs[:40])
        await coordinator.resume("t-1")  # its pause has not started
        await coordinator.pause("t-1")  # returns at once, holding nothing
        more = await asyncio.wait_for(coordinator.add_many(trajs[40:50], vecs[40:50]), timeout=60)
        await coordinator.pause("t-2")  # in order: holds until resumed
        held = coordinator._paused
        await coordinator.resume("t-2")
        return more, held, coordinator._paused

    more, held, after = asyncio.run(run())
    coordinator.routing.close()
    assert {r.status for r in more} == {"added"} and held and not after
