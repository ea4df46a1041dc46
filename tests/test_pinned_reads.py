"""Reads pinned to a memory version (issue 27.4): a retrieve as of a version sees only what was
committed then, while writes go on; through the engine, the Ray client (blocking and async),
REST and MCP. Real stores (LMDB, FAISS, the embedding model) and a real 2-shard deployment."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest
import ray
from front_harness import serve_front
from mcp import Client

from lifemem_ray.actors.cluster.async_client import AsyncMemoryClient
from lifemem_ray.core.errors import InvalidArgumentError
from lifemem_ray.core.model import Outcome, Step, Trajectory
from lifemem_ray.engine.memory import Memory
from lifemem_ray.engine.versions import (
    MAX_OVERFETCH,
    check_version,
    format_version,
    parse_version,
    search_as_of,
    visible,
)
from lifemem_ray.lab.synthetic import generate
from lifemem_ray.service.mcp_server import build_mcp_server
from lifemem_ray.service.principal import Principal


def _trajectory(id: str, task: str, env: str = "shop") -> Trajectory:
    return Trajectory(
        env=env,
        task=task,
        steps=(Step(action="search[mug]", observation="3 results"), Step(action="buy", observation="done")),
        outcome=Outcome(success=True, reward=1.0),
        id=id,
    )


def _ids(found: Any) -> set[str]:
    return {hit.id for hit in found.trajectories}


# -- tokens and the filter, numpy in and out ------------------------------------------------------
def test_tokens_round_trip_and_bad_ones_are_refused_by_name():
    assert parse_version(format_version([7, 0, 12]), 3) == [7, 0, 12]
    for bad in ("", "v2:1", "v1:", "v1:1.x", "v1:-1", 12, None, "v1:" + "1." * 2000 + "1"):
        with pytest.raises(InvalidArgumentError, match="as_of"):
            parse_version(bad, 1)
    with pytest.raises(InvalidArgumentError, match="2 shard"):
        parse_version("v1:3.4", 1)


# Digits Python's int() and str.isdigit() take but no token holds (issue 32.9): full-width,
# Arabic-Indic, Devanagari, mathematical bold; a superscript (isdigit, not int).
NOT_ASCII_DIGITS = ("\uff11\uff12", "\u0661\u0662", "\u0967", "\U0001d7cf", "\u00b2")


def test_a_version_takes_ascii_digits_only():
    for digits in NOT_ASCII_DIGITS:
        assert digits.isdigit()  # what made them pass
        for bad in (f"v1:{digits}", f"v1:12.{digits}", f"v1:{digits}.3"):
            with pytest.raises(InvalidArgumentError, match="ASCII digits"):
                parse_version(bad, len(bad.split(".")))
            with pytest.raises(InvalidArgumentError, match=r"^pin: "):
                check_version(bad, "pin")
    assert parse_version("v1:0012.3", 2) == [12, 3]


def test_the_filter_keeps_ids_below_the_watermark_whatever_their_namespace():
    ids = np.array([(3 << 40) | 5, (3 << 40) | 9, -1, (1 << 40) | 2])
    assert visible(ids, 6).tolist() == [True, False, False, True]


def test_a_pinned_search_asks_for_more_until_k_visible_ones():
    calls: list[int] = []
    # 40 candidates, best first; only every 10th one was committed before the watermark
    ids = np.array([[i if i % 10 == 0 else 1000 + i for i in range(40)]], dtype=np.int64)
    scores = -np.arange(40, dtype=np.float32)[None, :]

    def search(n: int) -> tuple[np.ndarray, np.ndarray]:
        calls.append(n)
        return scores[:, :n], ids[:, :n]

    got_scores, got_ids = search_as_of(search, 3, 1000, available=40)
    assert got_ids.tolist() == [[0, 10, 20]] and got_scores.tolist() == [[0.0, -10.0, -20.0]]
    assert calls == [3, 12, 40]
    _, padded = search_as_of(search, 5, 1000, available=40)  # only 4 visible at all: padded
    assert padded.tolist() == [[0, 10, 20, 30, -1]]
    assert MAX_OVERFETCH >= 40

    # A scope of 6 trajectories in a large index: its row comes back padded at once, and the
    # search stops there instead of growing to the whole index.
    small = np.array([[0, 1000, 1001, 10, 1002, 1003, -1, -1]], dtype=np.int64)
    calls.clear()

    def scoped(n: int) -> tuple[np.ndarray, np.ndarray]:
        calls.append(n)
        got = np.full((1, n), -1, dtype=np.int64)
        got[:, : min(n, 6)] = small[:, : min(n, 6)]
        return np.zeros((1, n), dtype=np.float32), got

    _, few = search_as_of(scoped, 4, 1000, available=1_000_000)
    assert few.tolist() == [[0, 10, -1, -1]] and calls == [4, 16]


# -- the engine ------------------------------------------------------------------------------------------
@pytest.fixture
def store(tmp_path):
    with Memory.open(tmp_path / "store") as memory:
        memory.add_many(list(generate(10, seed=9, envs=["shop"], length_scale=0.1, id_prefix="seed")))
        yield memory


def test_the_engine_reads_as_of_a_version_while_newer_writes_are_there(store):
    store.add(_trajectory("old", "buy a blue ceramic coffee mug"))
    version = store.version()
    assert store.stats()["version"] == version and store.stats("default")["version"] == version
    for i in range(30):  # newer trajectories, closer to the query than the old one
        store.add(_trajectory(f"new-{i}", f"buy a blue ceramic coffee mug #{i}"))
    query = "buy a blue ceramic coffee mug #3"
    now = store.retrieve(query, "shop", k=4)
    pinned = store.retrieve(query, "shop", k=4, as_of=version)
    assert "new-3" in _ids(now) and "old" not in _ids(now)
    assert "old" in _ids(pinned) and not any(i.startswith("new-") for i in _ids(pinned))
    assert len(pinned.trajectories) == 4  # the filter asked for more candidates: still k answers
    assert store.version() != version
    assert store.retrieve(query, "shop", k=4, as_of=store.version()).trajectories[0].id == now.trajectories[0].id


def test_the_engine_refuses_a_version_of_another_layout(store):
    with pytest.raises(InvalidArgumentError, match="as_of"):
        store.retrieve("anything", "shop", as_of="v1:3.4")
    with pytest.raises(InvalidArgumentError, match="not a version of this store"):  # newer than it: not its own
        store.retrieve("anything", "shop", as_of="v1:9999999999999")


# -- a deployment, writes going on -------------------------------------------------------------------------
def test_a_deployment_answers_the_same_pinned_read_while_writes_go_on(deployment):
    client, _ = deployment(shards=2)
    client.add_many(list(generate(40, seed=11, envs=["shop"], length_scale=0.1, id_prefix="seed"))).result(120)
    version = client.version()
    assert client.stats()["version"] == version and len(parse_version(version, 2)) == 2
    queries = [t.task for t in generate(6, seed=12, envs=["shop"], length_scale=0.1, id_prefix="q")]
    first = [_ids(r) for r in client.retrieve_many(queries, ["shop"] * 6, 4, as_of=version)]
    stop, written, errors = threading.Event(), [], []

    def write() -> None:
        batch = 0
        while not stop.is_set() and batch < 30:
            more = list(generate(8, seed=100 + batch, envs=["shop"], length_scale=0.1, id_prefix=f"w{batch}"))
            try:
                client.add_many(more).result(120)
            except Exception as exc:
                errors.append(exc)
                return
            written.extend(t.id for t in more)
            batch += 1

    writer = threading.Thread(target=write)
    writer.start()
    try:
        while len(written) < 80 and writer.is_alive():
            again = [_ids(r) for r in client.retrieve_many(queries, ["shop"] * 6, 4, as_of=version)]
            assert again == first
            assert not set().union(*again) & set(written)
    finally:
        stop.set()
        writer.join(300)
    assert not errors and len(written) >= 80
    latest = client.version()
    unpinned = set().union(*(_ids(r) for r in client.retrieve_many(queries, ["shop"] * 6, 4)))
    assert unpinned & set(written)  # the newer trajectories are there for an unpinned read
    pinned_latest = [_ids(r) for r in client.retrieve_many(queries, ["shop"] * 6, 4, as_of=latest)]
    assert pinned_latest == [_ids(r) for r in client.retrieve_many(queries, ["shop"] * 6, 4)]

    async def through_async() -> list[set[str]]:
        memory = await AsyncMemoryClient.connect(client.namespace, config=client.config)
        try:
            assert await memory.version() == client.version()
            return [_ids(r) for r in await memory.retrieve_many(queries, ["shop"] * 6, 4, as_of=version)]
        finally:
            memory.close()

    assert asyncio.run(through_async()) == first
    with pytest.raises(InvalidArgumentError, match="1 shard"):
        client.retrieve(queries[0], "shop", as_of="v1:5")


def test_rest_and_mcp_take_a_version(ray_local, tmp_path):
    with serve_front(tmp_path / "store", f"pin-{tmp_path.name[-10:]}", [("rw", "default", "read,write")]) as front:
        client = front.client
        client.add(_trajectory("rest-old", "find a red wool scarf")).result(120)
        client.add_many(list(generate(12, seed=21, envs=["shop"], length_scale=0.1, id_prefix="pad"))).result(120)
        with front.http("rw") as rw:
            version = rw.get("/v1/stats").json()["version"]
            for i in range(12):
                client.add(_trajectory(f"rest-new-{i}", f"find a red wool scarf #{i}")).result(120)
            body = {"queries": [{"task": "find a red wool scarf #4", "env": "shop"}], "k": 3}
            now = rw.post("/v1/retrieve", json=body).json()
            pinned = rw.post("/v1/retrieve", json={**body, "as_of": version})
            assert pinned.status_code == 200, pinned.text
            now_ids = {h["id"] for h in now["results"][0]["trajectories"]}
            pinned_ids = {h["id"] for h in pinned.json()["results"][0]["trajectories"]}
            assert "rest-new-4" in now_ids and "rest-old" in pinned_ids
            assert not any(i.startswith("rest-new") for i in pinned_ids)
            bad = rw.post("/v1/retrieve", json={**body, "as_of": "v1:1"})
            assert bad.status_code == 422 and "as_of" in bad.text
            wide = version.replace("v1:", "v1:\uff10").replace(".", ".\u0660")  # leading zeros int() takes
            bad = rw.post("/v1/retrieve", json={**body, "as_of": wide})
            assert bad.status_code == 422 and bad.json()["error"]["where"] == "as_of", bad.text
            assert "ASCII digits" in bad.json()["error"]["message"]
        _mcp_reads_as_of(client, version)


def _mcp_reads_as_of(client: Any, version: str) -> None:
    principal = Principal("default", frozenset({"read", "write"}), "pin")
    server = build_mcp_server(lambda: client, lambda: principal)

    async def scenario() -> None:
        async with Client(server) as mcp:
            stats = (await mcp.call_tool("memory_stats", {})).structured_content
            assert stats["version"] == client.version()
            got = (
                await mcp.call_tool(
                    "retrieve_experience", {"task": "find a red wool scarf #4", "env": "shop", "k": 3, "as_of": version}
                )
            ).structured_content
            assert "rest-old" in {h["id"] for h in got["trajectories"]}
            assert not any(h["id"].startswith("rest-new") for h in got["trajectories"])
            wide = version.replace("v1:", "v1:\uff10")  # a full-width leading zero: the same number to int()
            refused = await mcp.call_tool("retrieve_experience", {"task": "scarf", "env": "shop", "as_of": wide})
            text = " ".join(getattr(block, "text", "") for block in refused.content)
            assert refused.is_error and "as_of" in text and "ASCII digits" in text

    asyncio.run(scenario())


def test_a_refused_call_reaches_client_callers_as_the_librarys_own_error(deployment):
    """Issue 32.9: a version a shard refuses (above its watermark), or query vectors it refuses,
    reach MemoryClient and AsyncMemoryClient callers as the library's own error with its
    message, not as Ray's RayTaskError led by the shard's traceback."""
    client, _ = deployment(shards=2)
    client.add_many(list(generate(12, seed=31, envs=["shop"], length_scale=0.1, id_prefix="own"))).result(120)
    above = "v1:9999999.9999999"  # of this layout, but above what each shard handed out
    many = client.config.cluster.one_round_max + 1  # the two-round path: ids first, then records
    nan = np.full(client.dim, np.nan, dtype=np.float32)
    refusals = [
        (r"^as_of: 9999999 is not a version of this store", lambda c: c.retrieve("scarf", "shop", as_of=above)),
        (
            r"^as_of: 9999999 is not a version",
            lambda c: c.retrieve_many(["scarf"] * many, ["shop"] * many, as_of=above),
        ),
        (r"^vectors\[0\]: contains NaN", lambda c: c.retrieve("scarf", "shop", vector=nan)),
        (r"^as_of: .*ASCII digits", lambda c: c.retrieve("scarf", "shop", as_of="v1:\uff11.2")),
        (r"^as_of: version 'v1:5' is of a memory with 1 shard", lambda c: c.retrieve("scarf", "shop", as_of="v1:5")),
    ]
    for match, call in refusals:
        with pytest.raises(InvalidArgumentError, match=match) as info:
            call(client)
        assert not isinstance(info.value, ray.exceptions.RayTaskError) and "Traceback" not in str(info.value)

    async def through_async() -> None:
        memory = await AsyncMemoryClient.connect(client.namespace, config=client.config)
        try:
            for match, call in refusals:
                with pytest.raises(InvalidArgumentError, match=match) as info:
                    await _awaited(call(memory))
                assert not isinstance(info.value, ray.exceptions.RayTaskError)
        finally:
            memory.close()

    asyncio.run(through_async())
    assert len(client.retrieve("scarf", "shop", as_of=client.version()).trajectories) > 0  # and a good one reads


async def _awaited(got: Any) -> Any:
    return await got
