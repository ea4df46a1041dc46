"""How a remote task's own error is recovered from Ray's wrapper (actors/errors.py), on
wrappers built the way Ray builds them, without a cluster."""

from __future__ import annotations

import pytest

ray_exceptions = pytest.importorskip("ray.exceptions")

from lifemem_ray.actors.errors import raise_remote, remote_cause  # noqa: E402
from lifemem_ray.errors import IdConflictError, ShardUnavailableError  # noqa: E402


def wrapped(cause: BaseException | None) -> BaseException:
    return ray_exceptions.RayTaskError("add_many", "Traceback (most recent call last): ...", cause)


def test_remote_cause_is_the_remote_error_or_the_error_itself():
    conflict = IdConflictError("id 'a' is stored with other content")
    assert remote_cause(wrapped(conflict)) is conflict
    plain = ValueError("not from Ray")
    assert remote_cause(plain) is plain
    keyboard = wrapped(KeyboardInterrupt())  # not an Exception: the wrapper stays
    assert remote_cause(keyboard) is keyboard


def test_raise_remote_raises_the_cause_in_place_of_the_wrapper():
    with pytest.raises(ShardUnavailableError, match="shard 1") as info:
        try:
            raise wrapped(ShardUnavailableError("shard 1 restarting"))
        except ray_exceptions.RayTaskError as exc:
            raise_remote(exc)
    assert info.value.__suppress_context__  # the wrapper is not chained onto it
    with pytest.raises(ValueError, match="plain"):
        raise_remote(ValueError("plain"))
