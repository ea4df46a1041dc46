"""WebSearchEnv: ReAct-style HotpotQA over an offline corpus (the shared file, or a tiny one written here)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from lifemem_ray.lab.envs import EnvUnavailable, Task, TaskError, make_env
from lifemem_ray.lab.envs.websearch import WebSearchEnv, answer_f1, normalize_answer

SHARED = Path(os.environ.get("LIFEMEM_SHARED_DIR", Path(__file__).resolve().parents[4] / "shared"))
HOTPOT = SHARED / "data" / "hotpotqa" / "distractor-dev-100.jsonl"

TINY = [
    {
        "id": "q1",
        "question": "Which city is the Glass Museum of the founder of Acme Widgets in?",
        "answer": "Springfield",
        "type": "bridge",
        "level": "easy",
        "supporting_facts": [["Acme Widgets", 1], ["Jane Roe (inventor)", 0]],
        "context": [
            [
                "Acme Widgets",
                [
                    "Acme Widgets is a maker of widgets.",
                    " It was founded by Jane Roe in 1950.",
                    " Acme sells widgets worldwide.",
                ],
            ],
            ["Jane Roe (inventor)", ["Jane Roe founded the Glass Museum in Springfield.", " She died in 1999."]],
            ["Springfield Zoo", ["The Springfield Zoo houses 300 animals."]],
        ],
    },
    {
        "id": "q2",
        "question": "Are Acme Widgets and Beta Gadgets both widget makers?",
        "answer": "no",
        "type": "comparison",
        "level": "medium",
        "supporting_facts": [["Acme Widgets", 0], ["Beta Gadgets", 0]],
        "context": [
            [
                "Acme Widgets",
                [
                    "Acme Widgets is a maker of widgets.",
                    " It was founded by Jane Roe in 1950.",
                    " Acme sells widgets worldwide.",
                ],
            ],
            ["Beta Gadgets", ["Beta Gadgets makes gadgets, not widgets."]],
        ],
    },
    {
        "id": "q3",
        "question": "How many animals live in the Springfield Zoo?",
        "answer": "300",
        "type": "bridge",
        "level": "hard",
        "supporting_facts": [["Springfield Zoo", 0]],
        "context": [["Springfield Zoo", ["The Springfield Zoo houses 300 animals."]], ["Cats", ["Cats are animals."]]],
    },
]


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in TINY) + "\n", encoding="utf-8")
    env = WebSearchEnv(corpus_path=str(path), train_fraction=2 / 3)
    try:
        yield env
    finally:
        env.close()


@pytest.fixture(scope="module")
def hotpot():
    if not HOTPOT.is_file():
        pytest.skip(f"shared HotpotQA sample not found at {HOTPOT}")
    env = WebSearchEnv(corpus_path=str(HOTPOT))
    try:
        yield env
    finally:
        env.close()


def test_tiny_split_and_gold(tiny):
    train, test = tiny.tasks("train"), tiny.tasks("test")
    assert len(train) == 2 and len(test) == 1
    assert {t.id for t in train + test} == {"q1", "q2", "q3"}
    for task in train + test:
        assert task.env == "websearch" and task.instruction
        obs, info = tiny.reset(task)
        assert task.instruction in obs and info["valid_actions"] is None
        for action in tiny.gold_actions(task):
            r = tiny.step(action)
        assert r.done and r.reward == 1.0 and r.info["success"] is True and r.info["f1"] == 1.0
    types = {t.id: (t.metadata["task_type"], t.metadata["level"]) for t in train + test}
    assert types["q2"] == ("comparison", "medium")


def test_tiny_search_lookup_semantics(tiny):
    task = next(t for t in tiny.tasks("train") + tiny.tasks("test") if t.id == "q1")
    tiny.reset(task)
    assert tiny.step("Lookup[Roe]").observation.startswith("No page")
    assert tiny.step("Search[acme widgets]").observation.startswith("Acme Widgets is a maker")  # exact, any case
    assert tiny.step("Lookup[widgets]").observation == "(Result 1 / 2) Acme Widgets is a maker of widgets."
    assert tiny.step("Lookup[widgets]").observation == "(Result 2 / 2) Acme sells widgets worldwide."
    assert tiny.step("Lookup[1950]").observation.startswith("(Result 1 / 1) It was founded")  # a new keyword restarts
    assert tiny.step("Lookup[1950]").observation == "No more results."
    r = tiny.step("Search[Jane Roe]")  # the title without its qualifier
    assert r.observation.startswith("[Jane Roe (inventor)] Jane Roe founded")
    r = tiny.step("Search[museum of glass history]")
    assert r.observation.startswith("Could not find museum of glass history. Similar: [")
    assert "Jane Roe (inventor)" in r.observation
    tiny.reset(task)  # eight steps were the limit
    r = tiny.step("Thought: it is Springfield.\nAction 7: Finish[the Springfield!]")
    assert r.done and r.info["success"] is True


def test_tiny_invalid_and_limits(tiny, tmp_path):
    task = tiny.tasks("test")[0]
    env = WebSearchEnv(corpus_path=tiny.corpus_path, train_fraction=2 / 3, max_steps=3)
    env.reset(task)
    r = env.step("open the page please")
    assert r.observation.startswith("Invalid action") and not r.done and r.reward == 0.0
    assert env.step(None).observation.startswith("Invalid action")  # type: ignore[arg-type]
    r = env.step("Search[]")
    assert r.done and r.info["success"] is False  # the step limit
    with pytest.raises(RuntimeError, match="reset"):
        env.step("Finish[x]")
    env.reset(task)
    r = env.step("Finish[three hundred]")
    assert r.done and r.reward == 0.0 and r.info["success"] is False and r.info["f1"] == 0.0
    with pytest.raises(TaskError):
        env.reset(Task(env="sql", id="x", instruction="q"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "1"}\n', encoding="utf-8")
    with pytest.raises(TaskError, match=r"bad\.jsonl:1"):
        WebSearchEnv(corpus_path=str(bad))


def test_missing_corpus_names_env_var(tmp_path, monkeypatch):
    with pytest.raises(EnvUnavailable, match="does not exist"):
        WebSearchEnv(corpus_path=str(tmp_path / "none.jsonl"))
    monkeypatch.setenv("LIFEMEM_HOTPOTQA", str(tmp_path / "none.jsonl"))
    with pytest.raises(EnvUnavailable, match="LIFEMEM_HOTPOTQA"):
        WebSearchEnv()


def test_normalisation_and_f1():
    assert normalize_answer("The  Springfield!") == "springfield"
    assert answer_f1("Bath Maine", "Bath, Maine") == 1.0
    assert answer_f1("yes", "no") == 0.0
    assert 0 < answer_f1("the city of Bath", "Bath, Maine") < 1


def test_shared_tasks_deterministic_and_split(hotpot):
    train, test = hotpot.tasks("train"), hotpot.tasks("test")
    assert len(train) == 70 and len(test) == 30
    ids = [t.id for t in train + test]
    assert len(set(ids)) == 100
    again = WebSearchEnv(corpus_path=str(HOTPOT))
    assert [t.id for t in again.tasks("train")] == [t.id for t in train]
    assert [t.id for t in WebSearchEnv(corpus_path=str(HOTPOT), seed=1).tasks("test")] != [t.id for t in test]
    assert hotpot.tasks("train", limit=5, seed=3) == hotpot.tasks("train", limit=5, seed=3)
    assert {t.metadata["task_type"] for t in train + test} == {"bridge", "comparison"}
    assert len(hotpot.corpus.pages) == 1000


def test_shared_gold_replays(hotpot):
    for task in hotpot.tasks("train", limit=15) + hotpot.tasks("test", limit=10):
        obs, _ = hotpot.reset(task)
        assert task.instruction in obs
        for action in hotpot.gold_actions(task):
            r = hotpot.step(action)
            if action.startswith("Search["):
                assert not r.observation.startswith("Could not find"), action
        assert r.done and r.info["success"] is True, task.id


def test_shared_search_every_title_exact(hotpot):
    corpus = hotpot.corpus
    assert all(corpus.find(t)[:2] == (t, True) for t in corpus.titles)


def test_registry_builds_it(tmp_path):
    path = tmp_path / "tiny.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in TINY), encoding="utf-8")
    env = make_env("websearch", corpus_path=str(path))
    try:
        assert isinstance(env, WebSearchEnv)
    finally:
        env.close()
