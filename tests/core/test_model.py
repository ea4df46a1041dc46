"""The trajectory model rejects malformed input with the field's name."""

from __future__ import annotations

import pytest

from lifemem_ray.core.model import InvalidTrajectoryError, Outcome, Step, Trajectory


def test_round_trip_and_stable_id():
    t = Trajectory(
        env="shop",
        task="buy",
        steps=(Step(action="search[x]", thought="t", observation="o"),),
        outcome=Outcome(True, 1),
    )
    assert t.id.startswith("h-") and t.id == t.fingerprint
    again = Trajectory.from_dict(t.to_dict())
    assert again == t and again.id == t.id and hash(again) == hash(t)
    assert again.outcome.reward == 1.0 and isinstance(again.outcome.reward, float)
    # The id does not depend on metadata; it does on content.
    assert Trajectory(env="shop", task="buy", steps=t.steps, outcome=t.outcome, metadata={"a": 1}).id == t.id
    assert Trajectory(env="shop", task="buy!", steps=t.steps, outcome=t.outcome).id != t.id


@pytest.mark.parametrize(
    "record, message",
    [
        ({"task": "t", "steps": [{"action": "a"}]}, "env: missing"),
        ({"env": "e", "steps": [{"action": "a"}]}, "task: missing"),
        ({"env": "e", "task": "t", "steps": []}, "steps: a trajectory needs at least one step"),
        ({"env": "e", "task": "t", "steps": "abc"}, "steps: expected a list"),
        ({"env": "e", "task": "t", "steps": [{"action": 3}]}, r"steps\[0\].action: expected a string"),
        ({"env": "e", "task": "t", "steps": [{"action": "a", "oops": 1}]}, r"steps\[0\]: unknown field"),
        ({"env": "e", "task": "t", "steps": [{"action": ""}]}, r"steps\[0\]: step has neither"),
        ({"env": "e", "task": "t", "steps": [{"action": "a"}], "outcome": {"success": "yes"}}, "outcome.success"),
        (
            {"env": "e", "task": "t", "steps": [{"action": "a"}], "outcome": {"reward": float("nan")}},
            "outcome.reward: must be finite",
        ),
        (
            {"env": "e", "task": "t", "steps": [{"action": "a"}], "metadata": {"x": {1, 2}}},
            "metadata.x: unsupported type",
        ),
        ({"env": "e", "task": "t", "steps": [{"action": "a"}], "metadata": []}, "metadata: expected an object"),
        ({"env": " e", "task": "t", "steps": [{"action": "a"}]}, "env: ' e' must be"),
        ({"env": "e", "task": "", "steps": [{"action": "a"}]}, "task: empty"),
        ({"env": "e", "task": "t\ud800", "steps": [{"action": "a"}]}, "task: not valid Unicode"),
        ({"env": "e", "task": "t", "steps": [{"action": "a"}], "id": "   "}, "id: must not be blank"),
        ({"env": "e", "task": "t", "steps": [{"action": "a"}], "extra": 1}, "unknown field"),
    ],
)
def test_malformed_records(record, message):
    with pytest.raises(InvalidTrajectoryError, match=message):
        Trajectory.from_dict(record)


def test_env_fallback_and_render():
    t = Trajectory.from_dict(
        {"env": None, "task": "t", "steps": [{"action": "Action 1: Search[x]", "thought": "Thought 1: hm"}]}, env="wiki"
    )
    assert t.env == "wiki"
    text = t.render()
    assert "Action 1: Search[x]" in text and "Action 1: Action 1" not in text
    assert (
        len(Trajectory(env="e", task="t", steps=tuple(Step(action="a" * 100) for _ in range(50))).render(max_chars=500))
        <= 500
    )


def test_render_text_from_plain_fields_matches_render():
    from lifemem_ray.core.model import render_text

    t = Trajectory(
        env="e",
        task="  ",
        initial_observation="You are in a room.",
        steps=(
            Step(thought="Thought 1: look", action="go north", observation=""),
            Step(thought="  ", action="a", observation="obs 2"),
            Step(thought="think", action="ACTION 3: x", observation="Observation: y"),
        ),
        outcome=Outcome(success=False),
    )
    fields = [(s.thought, s.action, s.observation) for s in t.steps]
    for cut in (None, 30, 45, 80, 10_000):
        assert render_text(t.query_text, fields, t.outcome.success, cut) == t.render(cut)
    text = t.render()
    assert text.startswith("Task: You are in a room.") and "Thought 1: Thought 1" not in text
    assert "Observation 2: obs 2" in text and "Thought 2" not in text and text.endswith("Outcome: failure")


def test_metadata_text_follows_the_text_rules_and_the_size_bounds():
    from lifemem_ray.core.model import MAX_METADATA_ITEMS, MAX_STEPS, MAX_TEXT_CHARS

    def make(**kw):
        fields = {"env": "e", "task": "t", "steps": (Step(action="a"),)}
        fields.update(kw)
        return Trajectory(**fields)

    for metadata, message in (
        ({"a": "x\x00y"}, "metadata.a: contains a NUL"),
        ({"k\x00": 1}, "contains a NUL"),
        ({"a": "x" * (MAX_TEXT_CHARS + 1)}, "more than the"),
        ({"a": list(range(MAX_METADATA_ITEMS + 1))}, "keys and items"),
    ):
        with pytest.raises(InvalidTrajectoryError, match=message):
            make(metadata=metadata)
    with pytest.raises(InvalidTrajectoryError, match="steps:"):
        make(steps=tuple(Step(action="a") for _ in range(MAX_STEPS + 1)))
    with pytest.raises(InvalidTrajectoryError, match="task:"):
        make(task="x" * (MAX_TEXT_CHARS + 1))
    assert make(metadata={"a": "x" * 1000, "b": list(range(100))}).metadata["b"][-1] == 99
