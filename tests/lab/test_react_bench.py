"""benchmarks/react_real.py without a model: the schema shim, the valid-action rule, the interval."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import react_real

SCHEMA = {
    "type": "object",
    "properties": {
        "thought": {"type": "string", "maxLength": 2000},
        "action": {"type": "string", "minLength": 1, "maxLength": 2000},
        "note": {"type": "string", "maxLength": 40},
    },
    "required": ["thought", "action"],
}


class _Inner:
    def __init__(self) -> None:
        self.sent: list[dict] = []
        self.chat = self
        self.completions = self

    async def create(self, **params):
        self.sent.append(params)
        return "answer"

    async def close(self) -> None:
        pass


def _send(mode: str, thought_chars: int = 0) -> tuple[dict, react_real.SchemaShim]:
    inner = _Inner()
    shim = react_real.SchemaShim(inner, mode, seed=7, thought_chars=thought_chars)  # type: ignore[arg-type]
    fmt = {"type": "json_object", "schema": SCHEMA}
    assert asyncio.run(shim.create(model="m", messages=[], response_format=fmt)) == "answer"
    assert SCHEMA["properties"]["thought"]["maxLength"] == 2000, "the agent's schema must not change"
    return inner.sent[0], shim


def test_safe_schema_drops_uncompilable_caps_and_caps_the_thought():
    sent, shim = _send("safe", thought_chars=240)
    props = sent["response_format"]["schema"]["properties"]
    assert props["thought"]["maxLength"] == 240
    assert "maxLength" not in props["action"] and props["action"]["minLength"] == 1
    assert props["note"]["maxLength"] == 40  # small caps compile: kept
    assert sent["seed"] == 7 and shim.caps_dropped == 2 and shim.requests == 1
    sent, _ = _send("safe")
    assert "maxLength" not in sent["response_format"]["schema"]["properties"]["thought"]


def test_as_is_and_none():
    sent, _ = _send("as-is", thought_chars=240)
    assert sent["response_format"]["schema"] == SCHEMA
    sent, _ = _send("none")
    assert sent["response_format"] == {"type": "json_object"}


def test_valid_action_rules():
    offered = {"action": "take coin", "offered": ["look around", "take coin"]}
    assert react_real.action_valid("twx-coin", offered, "You take the coin.")
    assert not react_real.action_valid("twx-coin", {**offered, "action": react_real.FALLBACK_ACTION}, "Unknown action.")
    op = "Action: Operation\n```sql\nSELECT 1;\n```"
    assert react_real.action_valid("sql", {"action": op, "offered": None}, "[(1,)]")
    assert not react_real.action_valid("sql", {"action": op, "offered": None}, "Error: no such table: x")
    assert react_real.action_valid(
        "sql", {"action": "Action: Answer\nFinal Answer: [1]", "offered": None}, "Answer submitted: incorrect."
    )
    assert not react_real.action_valid("sql", {"action": "SELECT 1", "offered": None}, "Invalid action: use ...")


def test_bootstrap_interval():
    low, high = react_real.bootstrap_ci([0.0, 1.0] * 10, 500)
    assert low is not None and high is not None and 0.2 < low < 0.5 < high < 0.8
    assert react_real.bootstrap_ci([1.0, 1.0], 100) == (1.0, 1.0)
    assert react_real.bootstrap_ci([], 100) == (None, None)


def test_settings_are_checked():
    with pytest.raises(ValueError, match="modes"):
        react_real.Settings(modes=["global-skills"]).validate()
    with pytest.raises(ValueError, match="thought_chars"):
        react_real.Settings(thought_chars=1000).validate()
