"""The MCP tools over a Ray deployment (the tools themselves: tests/service/test_mcp.py)."""

from __future__ import annotations

import asyncio

from mcp import Client
from test_mcp import _check_schemas, _record, _structured

from lifemem_ray.lab.synthetic import generate
from lifemem_ray.service.mcp_server import build_mcp_server
from lifemem_ray.service.principal import Principal


def test_tools_over_a_ray_deployment(deployment):
    """The tools over the Ray MemoryClient (what the Serve ingress mounts): an add is answered
    after the coordinator acknowledged it, and the tenant travels to the shards."""
    client, _info = deployment(shards=2)
    trajectories = list(generate(8, seed=31, length_scale=0.1))
    principals = {
        "x": Principal("tenant-x", frozenset({"read", "write"}), "x"),
        "y": Principal("tenant-y", frozenset({"read", "write"}), "y"),
    }
    acting: list[Principal] = [principals["x"]]
    server = build_mcp_server(lambda: client, lambda: acting[0])

    async def scenario() -> None:
        async with Client(server) as mcp:
            tools = _check_schemas(await mcp.list_tools())
            for t in trajectories:
                answer = _structured(await mcp.call_tool("add_trajectory", _record(t)), tools["add_trajectory"])
                assert answer["id"] == t.id and answer["status"] in ("added", "pending")
            target = trajectories[0]
            got = _structured(
                await mcp.call_tool("retrieve_experience", {"task": target.task, "env": target.env}),
                tools["retrieve_experience"],
            )
            assert target.id in {h["id"] for h in got["trajectories"]}
            stats = _structured(await mcp.call_tool("memory_stats", {}), tools["memory_stats"])
            assert stats["trajectories"] == len(trajectories)
            acting[0] = principals["y"]
            other = _structured(
                await mcp.call_tool("retrieve_experience", {"task": target.task, "env": None, "k": 8}),
                tools["retrieve_experience"],
            )
            assert other["trajectories"] == [] and other["skills"] == []
            assert _structured(await mcp.call_tool("memory_stats", {}), tools["memory_stats"])["trajectories"] == 0

    asyncio.run(scenario())
