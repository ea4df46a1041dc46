"""The client's retrieval path (issue 26): query vectors kept and shared by the client
(:class:`~lifemem_ray.actors.client.query_vectors.QueryVectors`), and query vectors sent to
the shards as raw bytes (:func:`~lifemem_ray.actors.cluster.ray_shards.pack_queries`). The
answers stay those of the embedder actors and of a search with the vectors themselves."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable

import numpy as np
import pytest
import ray

from lifemem_ray.actors.client.awaiting import AsyncMemoryClient
from lifemem_ray.actors.client.calls import Blocking, Script, adrive, drive
from lifemem_ray.actors.client.query_vectors import QueryVectors
from lifemem_ray.actors.cluster.ray_shards import pack_queries, unpack_queries
from lifemem_ray.core.errors import InvalidArgumentError, LifeMemError
from lifemem_ray.core.tenancy import DEFAULT_TENANT, search_targets
from lifemem_ray.lab.synthetic import generate, text_vectors

DIM = 8


def blocking(embed: Callable[[list[str]], np.ndarray]) -> Callable[[list[str]], Script[np.ndarray]]:
    """``embed`` as the script QueryVectors takes: one blocking call."""

    def script(texts: list[str]) -> Script[np.ndarray]:
        return (yield Blocking(lambda: embed(texts)))

    return script


def awaited(embed: Callable[[list[str]], Awaitable[np.ndarray]]) -> Callable[[list[str]], Script[np.ndarray]]:
    """An awaitable ``embed`` as the script QueryVectors takes (carried out by ``adrive``)."""

    def script(texts: list[str]) -> Script[np.ndarray]:
        return (yield Blocking(lambda: None, lambda: embed(texts)))

    return script


class Embedder:
    """A stand-in for the client's call to the embedder actors: counts the texts it gets, may
    wait on a gate (to hold a call in flight) and may fail."""

    def __init__(self, gate: threading.Event | None = None, fail: bool = False) -> None:
        self.calls: list[list[str]] = []
        self.gate = gate
        self.fail = fail
        self.lock = threading.Lock()

    def vectors(self, texts: list[str]) -> np.ndarray:
        return text_vectors(texts, DIM)

    def __call__(self, texts: list[str]) -> np.ndarray:
        with self.lock:
            self.calls.append(list(texts))
        if self.gate is not None:
            self.gate.wait(30)
        if self.fail:
            raise RuntimeError("the embedder is down")
        return self.vectors(texts)


def test_a_text_met_again_is_served_by_the_client_with_the_same_vector():
    embed = Embedder()
    vectors = QueryVectors(16)
    first = drive(vectors.vectors(["a", "b", "a"], blocking(embed)))
    again = drive(vectors.vectors(["b", "c", "a"], blocking(embed)))
    assert embed.calls == [["a", "b"], ["c"]]  # a repeated text is sent once, a known one never again
    np.testing.assert_array_equal(first, embed.vectors(["a", "b", "a"]))
    np.testing.assert_array_equal(again, embed.vectors(["b", "c", "a"]))
    stats = vectors.stats()
    assert stats["hits"] == 2 and stats["sent"] == 3 and stats["entries"] == 3


def test_a_known_vector_is_looked_up_without_embedding():
    """What a rollout worker's add sends along: the vector its retrieval computed, or None."""
    embed = Embedder()
    vectors = QueryVectors(16)
    assert vectors.known("a") is None
    drive(vectors.vectors(["a"], blocking(embed)))
    np.testing.assert_array_equal(vectors.known("a"), embed.vectors(["a"])[0])
    assert vectors.known("b") is None and embed.calls == [["a"]]
    assert QueryVectors(0).known("a") is None


def test_the_least_recently_used_text_is_forgotten_first():
    embed = Embedder()
    vectors = QueryVectors(2)
    drive(vectors.vectors(["a"], blocking(embed)))
    drive(vectors.vectors(["b"], blocking(embed)))
    drive(vectors.vectors(["a"], blocking(embed)))  # a is the most recent now
    drive(vectors.vectors(["c"], blocking(embed)))  # b goes
    drive(vectors.vectors(["a", "b"], blocking(embed)))
    assert embed.calls == [["a"], ["b"], ["c"], ["b"]]


def test_capacity_zero_sends_every_call_as_it_is():
    embed = Embedder()
    vectors = QueryVectors(0)
    drive(vectors.vectors(["a", "a"], blocking(embed)))
    drive(vectors.vectors(["a"], blocking(embed)))
    assert embed.calls == [["a", "a"], ["a"]]


def test_one_text_asked_by_many_threads_at_once_is_embedded_once():
    gate = threading.Event()
    embed = Embedder(gate)
    vectors = QueryVectors(16)
    out: list[np.ndarray] = []
    threads = [
        threading.Thread(target=lambda: out.append(drive(vectors.vectors(["prompt"], blocking(embed)))))
        for _ in range(8)
    ]
    for t in threads:
        t.start()
    while vectors.stats()["shared"] < 7:  # the other seven wait for the first one's call
        threading.Event().wait(0.01)
    gate.set()
    for t in threads:
        t.join(30)
    assert embed.calls == [["prompt"]]
    assert len(out) == 8 and all(np.array_equal(o, embed.vectors(["prompt"])) for o in out)


def test_when_the_call_in_flight_fails_each_waiting_thread_tries_on_its_own():
    gate = threading.Event()
    failing = Embedder(gate, fail=True)
    working = Embedder()
    vectors = QueryVectors(16)
    errors: list[BaseException] = []

    def first() -> None:
        try:
            drive(vectors.vectors(["prompt"], blocking(failing)))
        except RuntimeError as exc:
            errors.append(exc)

    owner = threading.Thread(target=first)
    owner.start()
    while not failing.calls:
        threading.Event().wait(0.01)
    answer: list[np.ndarray] = []
    waiter = threading.Thread(target=lambda: answer.append(drive(vectors.vectors(["prompt"], blocking(working)))))
    waiter.start()
    while vectors.stats()["shared"] < 1:
        threading.Event().wait(0.01)
    gate.set()
    owner.join(30)
    waiter.join(30)
    assert len(errors) == 1  # the caller whose call failed gets its error
    assert working.calls == [["prompt"]]  # the waiting one sent the text itself
    np.testing.assert_array_equal(answer[0], working.vectors(["prompt"]))
    assert drive(vectors.vectors(["prompt"], blocking(failing))).shape == (1, DIM)  # cached from the second call
    assert failing.calls == [["prompt"]]


async def until(condition: Callable[[], bool]) -> None:
    """Wait until ``condition()`` holds (what the coroutines under test reached)."""
    while not condition():  # noqa: ASYNC110 - polls the code under test's counters, no event to wait on
        await asyncio.sleep(0.01)


def test_coroutines_share_one_call_and_a_cancelled_one_leaves_nobody_waiting():
    async def scenario() -> tuple[list[list[str]], list[np.ndarray], list[list[str]]]:
        gate = asyncio.Event()
        calls: list[list[str]] = []

        async def embed(texts: list[str]) -> np.ndarray:
            calls.append(list(texts))
            await gate.wait()
            return text_vectors(texts, DIM)

        vectors = QueryVectors(16)
        tasks = [asyncio.create_task(adrive(vectors.vectors(["prompt"], awaited(embed)))) for _ in range(4)]
        await until(lambda: vectors.stats()["shared"] == 3)
        gate.set()
        answers = await asyncio.gather(*tasks)
        shared_calls = list(calls)
        # A call cancelled in flight: the coroutine waiting on it embeds on its own.
        calls.clear()
        gate.clear()
        owner = asyncio.create_task(adrive(vectors.vectors(["other"], awaited(embed))))
        await until(lambda: bool(calls))
        waiter = asyncio.create_task(adrive(vectors.vectors(["other"], awaited(embed))))
        await until(lambda: vectors.stats()["shared"] == 4)
        owner.cancel()
        await asyncio.sleep(0.05)
        gate.set()
        answers.append(await asyncio.wait_for(waiter, 30))
        return shared_calls, answers, calls

    shared_calls, answers, calls = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert shared_calls == [["prompt"]]
    assert all(np.array_equal(a, text_vectors(["prompt"], DIM)) for a in answers[:4])
    assert calls == [["other"], ["other"]]
    np.testing.assert_array_equal(answers[4], text_vectors(["other"], DIM))


def test_a_new_connection_forgets_the_vectors_kept_from_the_last_deployment(monkeypatch):
    """An add sends the client's cached query vectors as its own: after a reconnect (the
    deployment served again, maybe with another model) none of the old ones may go along."""
    from lifemem_ray.actors.client.core import ClientCore
    from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig

    core = ClientCore("ns", DeploymentConfig())
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(core.connection.coordinator, "call", lambda method: {"dim": DIM, "shards": [], "embedders": []})
    core.connection.open()
    drive(core.query_vectors.vectors(["a"], blocking(Embedder())))
    core.connection.open()  # still connected: kept
    assert core.query_vectors.known("a") is not None
    core.connection.drop()
    core.connection.open()  # a new connection
    assert core.query_vectors.known("a") is None


def test_query_vectors_travel_as_raw_bytes_and_come_back_the_same():
    vecs = text_vectors(["a", "b", "c"], DIM)
    packed = pack_queries(vecs, 3, DIM)
    assert isinstance(packed, bytes)
    np.testing.assert_array_equal(unpack_queries(packed, 3, DIM), vecs)
    wrong_width = np.ones((3, DIM + 1), dtype=np.float32)
    assert pack_queries(wrong_width, 3, DIM) is wrong_width  # sent as it is: the shard refuses it as before
    as_float64 = vecs.astype(np.float64)
    assert pack_queries(as_float64, 3, DIM) is as_float64
    assert unpack_queries(vecs, 3, DIM) is vecs
    with pytest.raises(InvalidArgumentError, match=r"query vectors: 96 bytes for 2 queries of 8 float32") as info:
        unpack_queries(packed, 2, DIM)
    assert isinstance(info.value, LifeMemError)


# -- through a deployment ---------------------------------------------------------------------
def test_a_retrieve_by_text_gets_the_embedders_vector_and_the_shards_answer_bytes_as_arrays(deployment):
    client, _ = deployment(shards=2)
    trajs = list(generate(120, seed=7, length_scale=0.1))
    vecs = text_vectors([t.task for t in trajs])
    client.add_many(trajs, vecs).result(timeout=300)
    client.maintain()
    task, env = trajs[5].task, trajs[5].env
    first = client.retrieve(task, env, 4)
    sent = client.query_vectors.stats()["sent"]
    again = client.retrieve(task, env, 4)
    assert client.query_vectors.stats()["sent"] == sent  # served by the client: no embedder call
    by_vector = client.retrieve(task, env, 4, vector=client.embed([task])[0])
    for got in (first, again):
        assert [(h.id, h.score) for h in got.trajectories] == [(h.id, h.score) for h in by_vector.trajectories]
        assert got.context == by_vector.context
    # A shard answers the same to the raw bytes the clients send and to the array itself.
    targets = search_targets(DEFAULT_TENANT, [env])
    packed = pack_queries(vecs[5:6], 1, client.dim)
    as_array = ray.get([s.search_records.remote(targets, 4, vecs[5:6], True) for s in client.shards])
    assert sum(len(hits) for ((hits, _texts),) in as_array) >= 4  # real hits, not two empty answers
    assert ray.get([s.search_records.remote(targets, 4, packed, True) for s in client.shards]) == as_array
    with pytest.raises(ValueError, match=r"query vectors: 12 bytes for 1 queries"):
        ray.get(client.shards[0].search_records.remote(targets, 4, b"\0" * 12, True))

    async def by_the_async_client() -> tuple[list, dict]:
        memory = await AsyncMemoryClient.connect(client.namespace, config=client.config)
        found = await asyncio.gather(*(memory.retrieve(task, env, 4) for _ in range(4)))
        return found, memory.query_vectors.stats()

    found, stats = asyncio.run(asyncio.wait_for(by_the_async_client(), 300))
    assert stats["sent"] == 1 and stats["shared"] == 3  # four coroutines, one embedder call
    for got in found:
        assert [(h.id, h.score) for h in got.trajectories] == [(h.id, h.score) for h in by_vector.trajectories]
