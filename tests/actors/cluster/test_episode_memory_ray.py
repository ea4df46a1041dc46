"""The episode memory over a deployment's async client (tests/episodes/test_episode_memory.py holds the
rest)."""

from __future__ import annotations

import asyncio
from typing import Any

from test_episode_memory import BIG, NAN, Hostile, Recording, _made_valid, _play, _read_back, _still_valid

from lifemem_ray.core.model import MAX_TEXT_CHARS
from lifemem_ray.episodes.episode_memory import AsyncEpisodeMemory, EpisodeRecord
from lifemem_ray.episodes.memory_wrapper import MemoryWrapper


def test_hostile_episode_data_through_a_deployment(deployment):
    """The wrapper over a deployment's MemoryClient, and the verl loop's calls
    (AsyncEpisodeMemory over AsyncMemoryClient: a one-step record of the row, its reward)."""
    from lifemem_ray.actors.client.awaiting import AsyncMemoryClient

    client, _ = deployment(shards=1)
    recording = Recording(client)
    with MemoryWrapper(Hostile(reward=NAN, observation="row\x00count"), recording, env_name="hostile-ray") as env:
        _play(env, "Answer: 3 \ud800")
    with MemoryWrapper(Hostile(task="t" * BIG), recording, env_name="hostile-ray") as env:
        _play(env, "Answer: 3")
    assert recording.added and len(recording.added) == 2
    first, second = (_read_back(client, t) for t in recording.added)
    assert first.outcome.reward is None and first.steps[0].observation == "row\ufffdcount"
    assert first.steps[0].action == "Answer: 3 \ufffd" and len(second.task) == MAX_TEXT_CHARS
    for t in (first, second):
        _still_valid(t)

    async def verl_row() -> tuple[Any, Any]:
        episodes = AsyncEpisodeMemory(await AsyncMemoryClient.connect(client.namespace, config=client.config))
        task = "how many\x00 apples \udc80"
        _, found = await episodes.recall(task, "hostile-verl")  # asked with the task made valid
        assert found is not None
        record = EpisodeRecord("hostile-verl", task, "user: " + task)
        record.step("#### 42\x00", "")
        result = episodes.storable(record, None, NAN, metadata={"source": "verl", "data_source": "gsm\udc80"})
        assert result.trajectory is not None
        await episodes.submit(result.trajectory)
        return result, await episodes.settle()

    result, counts = asyncio.run(verl_row())
    assert counts.acknowledged == 1 and counts.recall_failures == 0
    assert counts.made_valid == _made_valid("nul", "surrogate", "reward")
    row = _read_back(client, result.trajectory)
    _still_valid(row)
    assert row.task == "how many\ufffd apples \ufffd" and row.steps[0].action == "#### 42\ufffd"
    assert row.outcome.reward is None and row.metadata["data_source"] == "gsm\ufffd"
