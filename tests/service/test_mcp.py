"""The MCP server through the official SDK's own client, over both transports (issue 16.3):

* stdio: ``lifemem-ray mcp --store DIR`` spawned as an agent host would, on the engine alone;
* Streamable HTTP (stateless, JSON answers) served by uvicorn on loopback behind a small bearer-key
  middleware that sets a principal per key, as the Serve ingress does: two tenants never see each
  other's trajectories and a read-only key cannot add.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx2
import jsonschema
import pytest
import uvicorn
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from starlette.middleware import Middleware

from lifemem_ray.engine.memory import Memory
from lifemem_ray.lab.synthetic import generate
from lifemem_ray.service.mcp_server import build_mcp_server, streamable_http_app
from lifemem_ray.service.principal import Principal, acting_as, current

TOOLS = {"add_trajectory", "retrieve_experience", "memory_stats"}


def _record(trajectory: Any, **extra: Any) -> dict[str, Any]:
    """A trajectory as add_trajectory's arguments (the native record, its tenant left to the key)."""
    record = trajectory.to_dict()
    record.pop("tenant", None)
    record["metadata"] = {**record["metadata"], **extra}
    return record


def _text(result: Any) -> str:
    return " ".join(getattr(block, "text", "") for block in result.content)


def _check_schemas(tools: Any) -> dict[str, Any]:
    by_name = {t.name: t for t in tools.tools}
    assert set(by_name) == TOOLS
    for tool in by_name.values():
        assert tool.output_schema and tool.output_schema.get("type") == "object", tool.name
        assert tool.input_schema.get("type") == "object", tool.name
    retrieve = by_name["retrieve_experience"].annotations
    assert retrieve.read_only_hint is True and retrieve.idempotent_hint is True
    assert by_name["add_trajectory"].annotations.read_only_hint is False
    return by_name


def _structured(result: Any, tool: Any) -> dict[str, Any]:
    """The structured answer of a successful call, checked against the tool's advertised schema."""
    assert not result.is_error, _text(result)
    jsonschema.validate(result.structured_content, tool.output_schema)
    return result.structured_content


# -- stdio ---------------------------------------------------------------------------------------


def _command() -> tuple[str, list[str]]:
    script = Path(sys.executable).with_name("lifemem-ray")
    return (str(script), []) if script.exists() else (sys.executable, ["-m", "lifemem_ray.cli"])


def _stdio(store: Path, *args: str) -> StdioServerParameters:
    command, prefix = _command()
    return StdioServerParameters(
        command=command,
        args=[*prefix, "mcp", "--store", str(store), *args],
        env={"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"},
    )


def test_stdio_server_adds_retrieves_and_reports_errors(tmp_path):
    store = tmp_path / "store"
    trajectories = list(generate(8, seed=5, length_scale=0.1))

    async def session() -> None:
        async with Client(_stdio(store, "--create", "--tenant", "acme"), read_timeout_seconds=120) as client:
            tools = _check_schemas(await client.list_tools())
            for t in trajectories:
                answer = _structured(await client.call_tool("add_trajectory", _record(t)), tools["add_trajectory"])
                assert answer["id"] == t.id and answer["status"] in ("added", "pending") and answer["tenant"] == "acme"
            again = _structured(
                await client.call_tool("add_trajectory", _record(trajectories[0])), tools["add_trajectory"]
            )
            assert again["status"] == "duplicate"

            target = trajectories[-1]
            got = _structured(
                await client.call_tool("retrieve_experience", {"task": target.task, "env": target.env, "k": 3}),
                tools["retrieve_experience"],
            )
            hits = {h["id"]: h for h in got["trajectories"]}
            assert target.id in hits and hits[target.id]["score"] > 0.99
            first = hits[target.id]
            assert [s["action"] for s in first["steps"]] == [s.action for s in target.steps]
            assert f"Task: {target.task}" in got["context"] and target.steps[0].action in got["context"]
            assert "rendered" not in first, (
                "the rendered text is the context's, within its token budget: not sent twice"
            )
            assert got["context"] and got["k"] == 3

            stats = _structured(await client.call_tool("memory_stats", {}), tools["memory_stats"])
            assert stats["tenant"] == "acme" and stats["trajectories"] == len(trajectories)
            assert sum(e["trajectories"] for e in stats["per_env"].values()) == len(trajectories)

            bad_step = await client.call_tool(
                "add_trajectory", {"task": "t", "env": "e", "steps": [{"observation": "o"}]}
            )
            assert (
                bad_step.is_error
                and "steps[0]" in _text(bad_step)
                and "neither an action nor a thought" in _text(bad_step)
            )
            no_env = await client.call_tool("add_trajectory", {"task": "t", "steps": [{"action": "a"}]})
            assert no_env.is_error and "env" in _text(no_env) and "Field required" in _text(no_env)
            # The record forms REST and ingest accept: an integer id, a bare true/false outcome.
            native = _structured(
                await client.call_tool(
                    "add_trajectory",
                    {
                        "task": "count the rows",
                        "env": "e",
                        "id": 7,
                        "outcome": True,
                        "steps": [{"action": "SELECT COUNT(*) FROM t"}],
                    },
                ),
                tools["add_trajectory"],
            )
            assert native["id"] == "7" and native["status"] in ("added", "pending")
            bool_id = await client.call_tool(
                "add_trajectory", {"task": "t", "env": "e", "id": True, "steps": [{"action": "a"}]}
            )
            assert bool_id.is_error and "id" in _text(bool_id)
            bad_k = await client.call_tool("retrieve_experience", {"task": "t", "k": 0})
            assert bad_k.is_error and "k: expected an integer within [1, " in _text(bad_k)

    asyncio.run(session())
    # The server closed the store when its stdin closed: it opens again, for writing, with every add.
    memory = Memory.open(store)
    try:
        assert memory.stats(tenant="acme")["trajectories"] == len(trajectories) + 1
        assert memory.get("7", tenant="acme").outcome.success is True
        assert memory.stats(tenant="default")["trajectories"] == 0
    finally:
        memory.close()


def _read_line(stream: Any, deadline: float) -> bytes:
    while time.monotonic() < deadline:
        ready, _, _ = select.select([stream], [], [], 0.5)
        if ready:
            return stream.readline()
    raise AssertionError("no answer from the MCP server in time")


def test_stdio_server_closes_the_store_on_sigterm(tmp_path):
    store = tmp_path / "store"
    command, prefix = _command()
    proc = subprocess.Popen(
        [command, *prefix, "mcp", "--store", str(store), "--create"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )
    try:
        hello = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "initialize",
            "params": {
                "protocolVersion": "2025-06-18",
                "capabilities": {},
                "clientInfo": {"name": "test", "version": "0"},
            },
        }
        proc.stdin.write((json.dumps(hello) + "\n").encode())
        proc.stdin.flush()
        answer = json.loads(_read_line(proc.stdout, time.monotonic() + 120))
        assert answer["id"] == 1 and answer["result"]["serverInfo"]["name"] == "lifemem"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, proc.stderr.read().decode()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert b"SIGTERM received" in proc.stderr.read()
    Memory.open(store).close()  # not left locked


def test_stdio_server_refuses_a_bad_tenant_before_serving(tmp_path):
    command, prefix = _command()
    done = subprocess.run(
        [command, *prefix, "mcp", "--store", str(tmp_path / "s"), "--tenant", "no spaces"],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 1 and "--tenant" in done.stderr and done.stdout == ""


def test_stdio_server_refuses_a_folder_without_a_store_unless_told_to_create_one(tmp_path):
    command, prefix = _command()
    mistyped = tmp_path / "stroe"
    done = subprocess.run(
        [command, *prefix, "mcp", "--store", str(mistyped)],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 1 and done.stdout == ""
    assert f"{mistyped}: no memory store here" in done.stderr and "--create" in done.stderr
    assert not mistyped.exists()


# -- Streamable HTTP ---------------------------------------------------------------------------------

KEYS = {
    "key-a": Principal("tenant-a", frozenset({"read", "write"}), "a"),
    "key-b": Principal("tenant-b", frozenset({"read", "write"}), "b"),
    "key-a-ro": Principal("tenant-a", frozenset({"read"}), "a-ro"),
}


class BearerKeys:
    """The test's stand-in for the ingress's auth: a principal per bearer key, set with
    ``acting_as`` around the request; 401 without a known key."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = dict(scope["headers"]).get(b"authorization", b"").decode()
        principal = KEYS.get(header.removeprefix("Bearer "))
        if principal is None:
            body = b'{"error": "send Authorization: Bearer <key>"}'
            await send(
                {"type": "http.response.start", "status": 401, "headers": [(b"content-type", b"application/json")]}
            )
            await send({"type": "http.response.body", "body": body})
            return
        with acting_as(principal):
            await self.app(scope, receive, send)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def http_memory(tmp_path_factory, embedder) -> Iterator[tuple[str, Memory]]:
    """One engine store behind the MCP app on a loopback port (uvicorn in a thread)."""
    memory = Memory.open(tmp_path_factory.mktemp("mcp-http") / "store", embedder=embedder)
    app = streamable_http_app(build_mcp_server(lambda: memory, current), middleware=[Middleware(BearerKeys)])
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}/mcp", memory
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        memory.close()


@contextlib.asynccontextmanager
async def _http_client(url: str, key: str, mode: str) -> AsyncIterator[Client]:
    async with (
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=120) as http,
        Client(streamable_http_client(url, http_client=http), mode=mode, cache=None) as client,
    ):
        yield client


# "auto" speaks the SDK's newest protocol revision (one self-contained POST per request),
# "legacy" the initialize handshake: the SDK runs the tool in different tasks for each.
@pytest.mark.parametrize("mode", ["auto", "legacy"])
def test_http_tenants_never_see_each_other(http_memory, mode):
    url, _memory = http_memory
    # The same tasks (and ids) for both tenants, told apart by their metadata: any leak would be a top hit.
    trajectories = list(generate(8, seed=11 if mode == "auto" else 12, length_scale=0.1))

    async def scenario() -> None:
        async with _http_client(url, "key-a", mode) as a, _http_client(url, "key-b", mode) as b:
            tools = _check_schemas(await a.list_tools())
            before = {
                k: _structured(await c.call_tool("memory_stats", {}), tools["memory_stats"])["trajectories"]
                for k, c in (("a", a), ("b", b))
            }
            for t in trajectories:
                for owner, client in (("tenant-a", a), ("tenant-b", b)):
                    # A "tenant" argument is not one: the key decides.
                    args = {**_record(t, owner=owner), "tenant": "tenant-b" if owner == "tenant-a" else "tenant-a"}
                    answer = _structured(await client.call_tool("add_trajectory", args), tools["add_trajectory"])
                    assert answer["id"] == t.id and answer["tenant"] == owner
            for owner, client in (("tenant-a", a), ("tenant-b", b)):
                for t in trajectories[:3]:
                    got = _structured(
                        await client.call_tool("retrieve_experience", {"task": t.task, "env": None, "k": 32}),
                        tools["retrieve_experience"],
                    )
                    assert got["trajectories"], owner
                    assert {h["metadata"].get("owner") for h in got["trajectories"]} == {owner}
                    assert t.id in {h["id"] for h in got["trajectories"]}
                stats = _structured(await client.call_tool("memory_stats", {}), tools["memory_stats"])
                assert stats["tenant"] == owner
                assert stats["trajectories"] == before[owner[-1]] + len(trajectories)

    asyncio.run(scenario())


def test_http_read_only_key_cannot_add(http_memory):
    url, memory = http_memory
    t = next(iter(generate(1, seed=21, length_scale=0.1)))

    async def scenario() -> None:
        async with _http_client(url, "key-a-ro", "auto") as ro:
            before = (await ro.call_tool("memory_stats", {})).structured_content["trajectories"]
            refused = await ro.call_tool("add_trajectory", _record(t))
            assert refused.is_error and "lacks the 'write' scope" in _text(refused) and "tenant-a" in _text(refused)
            got = await ro.call_tool("retrieve_experience", {"task": t.task, "env": t.env})
            assert not got.is_error and t.id not in {h["id"] for h in got.structured_content["trajectories"]}
            assert (await ro.call_tool("memory_stats", {})).structured_content["trajectories"] == before

    asyncio.run(scenario())
    assert memory.get(t.id, tenant="tenant-a") is None


def test_http_is_stateless_with_json_answers(http_memory):
    """A lone request, without initialize or a session id, is answered in JSON: any replica can
    take any request."""
    url, _memory = http_memory

    async def scenario() -> None:
        async with httpx2.AsyncClient(headers={"Authorization": "Bearer key-a"}) as http:
            for n, method in enumerate(("tools/list", "tools/call")):
                params = {"name": "memory_stats", "arguments": {}} if method == "tools/call" else {}
                answer = await http.post(
                    url,
                    json={"jsonrpc": "2.0", "id": n, "method": method, "params": params},
                    headers={"Accept": "application/json, text/event-stream", "MCP-Protocol-Version": "2025-06-18"},
                )
                assert answer.status_code == 200, answer.text
                assert answer.headers["content-type"].startswith("application/json")
                assert "mcp-session-id" not in answer.headers
                result = answer.json()["result"]
                if method == "tools/list":
                    assert all(t.get("outputSchema") for t in result["tools"])
                else:
                    assert result["structuredContent"]["tenant"] == "tenant-a"

    asyncio.run(scenario())


def test_tools_refuse_a_call_without_a_principal(tmp_path, embedder):
    """A mount that forgot to authenticate gets a tool error, not another tenant's data."""
    memory = Memory.open(tmp_path / "store", embedder=embedder)
    try:

        async def scenario() -> None:
            async with Client(build_mcp_server(lambda: memory, current)) as client:
                refused = await client.call_tool("memory_stats", {})
                assert refused.is_error and "Authorization: Bearer" in _text(refused)

        asyncio.run(scenario())
    finally:
        memory.close()


# -- over a Ray deployment ---------------------------------------------------------------------------
