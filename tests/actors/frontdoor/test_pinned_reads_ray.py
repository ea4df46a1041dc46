"""Pinned reads through a real 2-shard deployment, its clients, REST and MCP (the engine's side:
tests/engine/test_pinned_reads.py)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest
import ray
from mcp import Client
from support.front_harness import serve_front
from test_pinned_reads import _ids, _trajectory

from lifemem_ray.actors.client.awaiting import AsyncMemoryClient
from lifemem_ray.core.errors import InvalidArgumentError
from lifemem_ray.engine.versions import (
    parse_version,
)
from lifemem_ray.lab.synthetic import generate
from lifemem_ray.service.mcp_server import build_mcp_server
from lifemem_ray.service.principal import Principal


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
