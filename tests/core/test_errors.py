"""One exception root: every error the library raises on purpose is a LifeMemError."""

from __future__ import annotations

import inspect

import lifemem_ray.core.errors as errors


def test_every_error_class_derives_from_the_root():
    classes = [getattr(errors, name) for name in errors.__all__]
    assert all(inspect.isclass(c) and issubclass(c, errors.LifeMemError) for c in classes)
    from lifemem_ray.core.errors import IdConflictError
    from lifemem_ray.core.importers import RecordError
    from lifemem_ray.engine.memory_config import ConfigError
    from lifemem_ray.engine.store.storage import StoreLockedError

    for cls in (ConfigError, RecordError, IdConflictError, StoreLockedError):
        assert issubclass(cls, errors.LifeMemError), cls


# Every raise of library code is checked by tests/actors/test_error_discipline_library.py (an AST walk;
# the checker: tests/docs_and_packaging/test_error_discipline.py).


def test_an_error_carries_its_location_as_data_through_nesting_and_pickling():
    import pickle

    from lifemem_ray.core.errors import InvalidTrajectoryError, join_where
    from lifemem_ray.core.model import Trajectory

    try:
        Trajectory.from_dict({"env": "shop", "task": "buy", "steps": [{"action": 3}]})
    except InvalidTrajectoryError as exc:
        caught = exc
    assert (caught.where, caught.problem) == ("steps[0].action", "expected a string, got int")
    outer = InvalidTrajectoryError(caught.problem, where=join_where("trajectories[4]", caught.where))
    assert str(outer) == "trajectories[4].steps[0].action: expected a string, got int"
    assert type(outer) is InvalidTrajectoryError and caught.where == "steps[0].action"  # the original unchanged
    travelled = pickle.loads(pickle.dumps(outer))  # as a Ray task's error travels
    assert (travelled.where, travelled.problem, str(travelled)) == (outer.where, outer.problem, str(outer))
    plain = errors.LifeMemError("no location")
    assert (plain.where, plain.problem, str(plain)) == (None, "no location", "no location")


def test_a_pydantic_refusal_becomes_the_projects_error_with_the_field_as_data():
    from lifemem_ray.core.errors import ConfigError, InvalidArgumentError
    from lifemem_ray.core.validation import validated
    from lifemem_ray.episodes import EpisodeOptions

    try:
        validated(EpisodeOptions, {"k": 4, "max_pending": 0}, where="env_config['memory']")
    except ConfigError as exc:
        assert exc.where == "env_config['memory'].max_pending"
        assert exc.problem == "must be within 1..100000, got 0"
    for bad, field in (({"k": True}, "k"), ({"tenant": "bad tenant"}, "tenant"), ({"colour": 1}, "colour")):
        try:
            validated(EpisodeOptions, bad, where="EpisodeMemory", error=InvalidArgumentError)
        except InvalidArgumentError as exc:
            assert exc.where == f"EpisodeMemory.{field}", (bad, exc)
        else:
            raise AssertionError(f"{bad} was accepted")
    assert validated(EpisodeOptions, {"ack_timeout_s": 5}).ack_timeout_s == 5.0
