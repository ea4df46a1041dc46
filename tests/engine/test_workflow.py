"""Workflow tokens, categories and vectors: per-environment examples, stability, real-data separation."""

from __future__ import annotations

import os
import random
import string
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lifemem_ray.core.model import Step, Trajectory
from lifemem_ray.engine.clustering.workflow import (
    CATEGORIES,
    action_tokens,
    canonical_token,
    step_tokens,
    workflow_features,
    workflow_summary,
    workflow_vector,
    workflow_vectors,
)


def shared_data_dir() -> Path:
    root = os.environ.get("LIFEMEM_SHARED_DIR")
    base = Path(root) if root else Path(__file__).resolve().parents[3] / "shared"
    return base / "data" / "lifemem-trainset"


def _traj(env: str, *actions: str) -> Trajectory:
    return Trajectory(env=env, task="t", steps=tuple(Step(action=a, thought="" if a else "hm") for a in actions))


MINIWOB_CODE = (
    "```# Type the flight from\n"
    "agent.click_xpath(\"//*[@id='flight-from']\")\n"
    'agent.type("Abilene, TX")\n'
    'agent.press("enter")\n'
    "for _ in range(2):\n"
    "    agent.click_xpath(\"//*[@title='Prev']\")```"
)


@pytest.mark.parametrize(
    ("env", "actions", "expected"),
    [
        ("hotpotqa", ["Action 1: Search[Foo]", "Action 2: Lookup[x]", "Action 3: Finish[y]"],
         ["search", "lookup", "finish"]),
        ("webshop", ["search[red mug]", "click[B08MTG1BR3]", "click[Features]", "click[< Prev]", "click[Next >]",
                     "click[Back to Search]", "click[large]", "click[Buy Now]"],
         ["search", "click", "click:info", "click:prev", "click:next", "click:back", "click", "click:buy"]),
        ("taubench", ['Action:\n{"name": "get_order_details", "arguments": {"order_id": "#W1"}}',
                      "I've finished the task. Here is the result."],
         ["get_order_details", "respond"]),
        ("toolqa", ["LoadDB[coffee]", "SQLInterpreter[SELECT Open FROM coffee_data;]", "FilterDB[Date=2003]",
                    "GetValue[Open]", "Calculate[1+2]", "Action 4: Finish[2009-01-06]\nSQLInterpreter[SELECT 1;]", ""],
         ["loaddb", "sqlinterpreter", "filterdb", "getvalue", "calculate", "finish", "think"]),
        ("apibank", ["[ToolSearcher(keywords='hospital')]", "[GetNearbyHospital(location='x')]", "[Finish()]"],
         ["toolsearcher", "getnearbyhospital", "finish"]),
        ("lifelong", ["OK.", "Action: Operation\n```sql\nSELECT * FROM t;\n```",
                      "Action: Operation\n```sql\nUPDATE t SET a = 1;\n```", "Action: Operation\n```sql\ninsert into t values (1);```",
                      "Action: Operation\n```sql\nDELETE FROM t;\n```", "Action: Answer\nFinal Answer: [(1,)]"],
         ["ack", "sql:select", "sql:update", "sql:insert", "sql:delete", "answer"]),
        ("mind2web", ["Action: `CLICK [110]` ([svg]   -> CLICK)", "Action: `TYPE [6383] [NAPA VALLEY]` (x -> TYPE)",
                      "Action: `SELECT [12] [Pickup]` (x)"],
         ["click", "type", "select"]),
        ("miniwob", [MINIWOB_CODE], ["click_xpath", "type", "press", "click_xpath"]),
        ("scienceworld", ["open door to kitchen", "look around", "focus on substance in metal pot",
                          "move metal pot to stove", "wait1", "pick up thermometer"],
         ["open", "look", "focus", "move", "wait", "pick"]),
    ],
)  # fmt: skip
def test_tokens_per_environment(env: str, actions: list[str], expected: list[str]) -> None:
    assert action_tokens(_traj(env, *actions)) == expected


@pytest.mark.parametrize(
    ("token", "category"),
    [
        ("search", "SEARCH"), ("toolsearcher", "SEARCH"), ("find_user_id_by_email", "SEARCH"),
        ("diagnosis_search", "SEARCH"),
        ("lookup", "INSPECT"), ("look", "INSPECT"), ("examine", "INSPECT"), ("get_order_details", "INSPECT"),
        ("getnearbyhospital", "INSPECT"), ("click:info", "INSPECT"),
        ("go", "NAVIGATE"), ("open", "NAVIGATE"), ("click:back", "NAVIGATE"), ("click:next", "NAVIGATE"),
        ("press", "NAVIGATE"),
        ("type", "INPUT"), ("fill", "INPUT"),
        ("click", "SELECT"), ("select", "SELECT"), ("click_xpath", "SELECT"), ("focus", "SELECT"),
        ("sql:select", "QUERY"), ("sqlinterpreter", "QUERY"), ("filterdb", "QUERY"), ("getvalue", "QUERY"),
        ("loaddb", "QUERY"),
        ("sql:update", "MODIFY"), ("sql:insert", "MODIFY"), ("sql:delete", "MODIFY"),
        ("cancel_pending_order", "MODIFY"), ("modify_pending_order_items", "MODIFY"),
        ("exchange_delivered_order_items", "MODIFY"), ("return_delivered_order_items", "MODIFY"),
        ("calculate", "COMPUTE"), ("premiumcalculator", "COMPUTE"),
        ("finish", "ANSWER"), ("answer", "ANSWER"), ("respond", "ANSWER"), ("submit", "ANSWER"),
        ("click:buy", "COMMIT"), ("book_appointment", "COMMIT"),
        ("think", "THINK"), ("ack", "OTHER"), ("zzz-unknown", "OTHER"),
    ],
)  # fmt: skip
def test_canonical_tokens(token: str, category: str) -> None:
    assert canonical_token(token) == category
    assert category in CATEGORIES


def test_tokens_are_robust_on_any_text() -> None:
    rnd = random.Random(7)
    alphabet = string.printable + "[](){}`\"'.:é中\u200b"
    for _ in range(3000):
        text = "".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 120)))
        toks = step_tokens(text)
        assert toks and all(isinstance(t, str) and 0 < len(t) <= 48 for t in toks)
    for text in ["x" * 100_000, "[" * 5000, "```" * 2000, "agent." * 1000 + "(", "Action:" * 500, "\x00\ud800"]:
        toks = step_tokens(text)
        assert 1 <= len(toks) <= 16


def test_features_are_log_scaled() -> None:
    once = workflow_features(["search", "finish"])
    looped = workflow_features(["search"] * 50 + ["finish"])
    assert looped["t1:search"] < 5 * once["t1:search"]
    assert looped["t2:search>finish"] == once["t2:search>finish"]  # runs collapse in bigrams
    assert "tL:search" in looped and "tL:search" not in once
    assert workflow_features([]) == {}


def test_vectors_unit_norm_and_empty() -> None:
    v = workflow_vector(["search", "click", "click:buy"])
    assert v.dtype == np.float32 and v.shape == (256,)
    assert abs(float(np.linalg.norm(v)) - 1.0) < 1e-5
    e = workflow_vector([])
    assert abs(float(np.linalg.norm(e)) - 1.0) < 1e-6 and np.array_equal(e, workflow_vector([]))
    assert workflow_vector(["a"], dim=64).shape == (64,)
    assert workflow_vectors([]).shape == (0, 256)
    batch = workflow_vectors([_traj("e", "search[x]"), _traj("e", "click[y]")])
    assert batch.shape == (2, 256) and np.array_equal(batch[0], workflow_vector(["search"]))


def test_vectors_are_stable_across_processes() -> None:
    code = (
        "from lifemem_ray.engine.clustering.workflow import workflow_vector;"
        "import sys; sys.stdout.write(workflow_vector(['loaddb','filterdb','getvalue','finish']).tobytes().hex())"
    )
    outs = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(
            subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
        )
    outs.add(workflow_vector(["loaddb", "filterdb", "getvalue", "finish"]).tobytes().hex())
    assert len(outs) == 1


def test_same_workflow_closer_than_different() -> None:
    def cos(a: list[str], b: list[str]) -> float:
        return float(workflow_vector(a) @ workflow_vector(b))

    shop = ["search", "click", "click", "click", "click:buy"]
    shop_loop = ["search", "click", "click:prev", "click", "click", "click", "click:buy"]
    qa2 = ["search", "search", "finish"]
    qa4 = ["search", "search", "search", "search", "finish"]
    sql = ["loaddb", "sqlinterpreter", "finish"]
    filt = ["loaddb", "filterdb", "getvalue", "calculate", "finish"]
    assert cos(qa2, qa4) > 0.9
    assert cos(shop, shop_loop) > 0.8
    assert cos(sql, ["loaddb", "sqlinterpreter", "sqlinterpreter", "finish"]) > 0.8
    assert cos(qa2, shop) < 0.5 and cos(sql, filt) < cos(sql, sql[:2] + sql[1:])
    assert cos(qa2, ["toolsearcher", "toolsearcher", "finish"]) > cos(qa2, shop)  # categories align envs


def test_summary() -> None:
    assert workflow_summary(["search", "click", "click", "click", "click:buy"]) == "search -> click x3 -> click:buy"
    assert workflow_summary([]) == "(empty)"
    long = workflow_summary([f"t{i}" for i in range(40)], max_runs=6)
    assert long == "t0 -> t1 -> t2 -> t3 -> ... (35 more) -> t39"


# --------------------------------------------------------------------------- real data

REAL = shared_data_dir()


@pytest.fixture(scope="module")
def real() -> tuple[list[Trajectory], np.ndarray]:
    if not REAL.is_dir():
        pytest.skip(f"shared data not found at {REAL}")
    from lifemem_ray.core.importers import read_jsonl

    trajs, _ = read_jsonl(sorted(REAL.glob("*.jsonl")))
    return trajs, workflow_vectors(trajs)


def test_real_within_env_beats_between_env(real) -> None:
    trajs, vecs = real
    envs = sorted({t.env for t in trajs})
    sims = vecs @ vecs.T
    for env in envs:
        mine = np.array([t.env == env for t in trajs])
        block = sims[np.ix_(mine, mine)]
        n = int(mine.sum())
        within = (block.sum() - np.trace(block)) / (n * (n - 1))
        between = sims[np.ix_(mine, ~mine)].mean()
        assert within > between + 0.3, (env, within, between)


def test_real_toolqa_passes_are_separable(real) -> None:
    trajs, vecs = real
    rows = [(i, t.metadata["source_line"] <= 215) for i, t in enumerate(trajs) if t.env == "toolqa"]
    first = np.array([i for i, p in rows if p])
    second = np.array([i for i, p in rows if not p])
    c1, c2 = vecs[first].mean(0), vecs[second].mean(0)
    correct = int((vecs[first] @ c1 > vecs[first] @ c2).sum() + (vecs[second] @ c2 > vecs[second] @ c1).sum())
    assert correct / len(rows) > 0.9
    assert np.linalg.norm(c1) > np.linalg.norm(vecs[[i for i, _ in rows]].mean(0))  # each pass more coherent


def test_real_tokens_cover_every_step(real) -> None:
    trajs, _ = real
    for t in trajs:
        assert len(action_tokens(t)) >= len(t.steps)
    shop = {tok for t in trajs if t.env == "webshop" for tok in action_tokens(t)}
    assert shop <= {"search", "click", "click:buy", "click:next", "click:prev", "click:back", "click:info"}
