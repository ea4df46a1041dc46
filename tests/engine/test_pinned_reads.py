"""Reads pinned to a memory version (issue 27.4): a retrieve as of a version sees only what was
committed then, while writes go on; through the engine, the Ray client (blocking and async),
REST and MCP. Real stores (LMDB, FAISS, the embedding model) and a real 2-shard deployment."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

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
