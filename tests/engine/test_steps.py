"""Abstract steps: verb frames and argument roles across the environments' action syntaxes."""

from __future__ import annotations

import doctest

import numpy as np
import pytest

import lifemem_ray.engine.clustering.skills
import lifemem_ray.engine.clustering.steps
import lifemem_ray.lab.cluster_metrics
from lifemem_ray.core.model import Step, Trajectory
from lifemem_ray.engine.clustering.steps import abstract_step, features_id, featurize, goal_words
from lifemem_ray.engine.clustering.workflow import canonical_token, step_tokens

GOAL = goal_words("Your task is to measure the temperature of water. First, focus on the water.")


@pytest.mark.parametrize(
    ("action", "frame", "roles"),
    [
        ("use thermometer in inventory on water", "use _ in _ on _", ("lit:thermometer", "lit:inventory", "goal")),
        ("teleport to kitchen", "teleport to _", ("lit:kitchen",)),
        ("focus on water", "focus on _", ("goal",)),
        ("look around", "look around", ()),
        ("move east", "move _", ("dir",)),
        ("take soapbar 4 from countertop 1", "take _ from _", ("lit:soapbar", "lit:countertop")),
        ("put soapbar 4 in/on garbagecan 1", "put _ in/on _", ("lit:soapbar", "lit:garbagecan")),
        ("book_flight(card_id='card_6789', travel_class='business', seats=2)", "book_flight(card_id,seats,travel_class)", ("id", "number", "lit")),
        ('{"name": "get_order_details", "arguments": {"order_id": "#W1"}}', "get_order_details(order_id)", ("id",)),
        ("Action: Operation\n```sql\nSELECT a, SUM(b) FROM t JOIN u ON t.x = u.x GROUP BY a;\n```", "sql:select+join+groupby+sum", ()),
        ("Action 2: Search[water]", "search[_]", ("goal",)),
        ("I have booked the flight for you.", "respond", ()),
    ],
)  # fmt: skip
def test_frames_and_roles(action, frame, roles):
    step = abstract_step(action, GOAL)
    assert (step.frame, step.roles) == (frame, roles)


def test_movement_is_navigation_and_objects_are_manipulated():
    assert step_tokens("move east") == ("go",) and canonical_token("go") == "NAVIGATE"
    assert canonical_token(step_tokens("move metal pot to stove")[0]) == "MANIPULATE"
    assert canonical_token(step_tokens("open door to kitchen")[0]) == "NAVIGATE"
    assert canonical_token(step_tokens("open fridge 1")[0]) == "MANIPULATE"
    assert canonical_token(step_tokens("pick up thermometer")[0]) == "MANIPULATE"
    assert canonical_token(step_tokens("Operation: UPDATE with WHERE")[0]) == "MODIFY"


def test_roles_depend_on_the_goal_and_shapes_drop_literals():
    a = abstract_step("focus on orange juice", goal_words("measure the temperature of orange juice"))
    b = abstract_step("focus on milk", goal_words("measure the temperature of milk"))
    assert a.key == b.key == "focus on _|goal"
    c = abstract_step("pick up thermometer", frozenset())
    d = abstract_step("pick up metal pot", frozenset())
    assert c.shape == d.shape == "pick up _|lit" and c.key != d.key


def test_featurizers_are_deterministic_unit_vectors_and_named():
    t = Trajectory(env="sw", task="boil water", steps=(Step(action="teleport to kitchen"), Step(action="pick up pot")))
    tokens, roles = featurize(t, "roles")
    _, plain = featurize(t, "tokens")
    assert tokens == ["teleport", "pick"]
    assert abs(float(np.linalg.norm(roles)) - 1.0) < 1e-3 and not np.array_equal(roles, plain)
    assert np.array_equal(featurize(t, "roles")[1], roles) and not roles.flags.writeable
    assert features_id("roles").startswith("roles-v")
    with pytest.raises(ValueError, match="workflow features"):
        featurize(t, "bag-of-words")


@pytest.mark.timeout(60)  # a quadratic parse of these would hang here, not merely run slow
def test_hostile_actions_are_parsed_without_error():
    for action in (
        "a" * 100_000,
        "go " + "ab1" * 30_000,
        "(" * 5000,
        "f(" + "[" * 3000 + ")",
        '{"name": "x", "arguments": ' + "[" * 3000,
    ):
        step = abstract_step(action, GOAL)
        assert len(step.roles) <= 8 and len(step.frame) < 400


@pytest.mark.parametrize(
    "module",
    [lifemem_ray.engine.clustering.steps, lifemem_ray.engine.clustering.skills, lifemem_ray.lab.cluster_metrics],
)
def test_docstring_examples_run(module):
    assert doctest.testmod(module).failed == 0
