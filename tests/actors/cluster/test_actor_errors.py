"""How remote errors reach the caller (actors/cluster/remote_errors.py, the snapshot's resume), on
wrappers and calls built the way Ray builds them, without a cluster."""

from __future__ import annotations

import pytest

ray_exceptions = pytest.importorskip("ray.exceptions")

from lifemem_ray.actors.cluster.remote_errors import raise_own, raise_remote, remote_cause
from lifemem_ray.core.errors import IdConflictError, InvalidArgumentError, ShardUnavailableError


def wrapped(cause: BaseException | None) -> BaseException:
    return ray_exceptions.RayTaskError("add_many", "Traceback (most recent call last): ...", cause)


def test_remote_cause_is_the_remote_error_or_the_error_itself():
    conflict = IdConflictError("id 'a' is stored with other content")
    assert remote_cause(wrapped(conflict)) is conflict
    plain = ValueError("not from Ray")
    assert remote_cause(plain) is plain
    keyboard = wrapped(KeyboardInterrupt())  # not an Exception: the wrapper stays
    assert remote_cause(keyboard) is keyboard
    # The Ray layer's own errors share the root too (the core's: tests/core/test_errors.py).
    from lifemem_ray.actors.cluster.remote_errors import OverloadedError
    from lifemem_ray.core.errors import LifeMemError

    assert issubclass(OverloadedError, LifeMemError)


def test_raise_remote_raises_the_cause_in_place_of_the_wrapper():
    with pytest.raises(ShardUnavailableError, match="shard 1") as info:
        try:
            raise wrapped(ShardUnavailableError("shard 1 restarting"))
        except ray_exceptions.RayTaskError as exc:
            raise_remote(exc)
    assert info.value.__suppress_context__  # the wrapper is not chained onto it
    with pytest.raises(ValueError, match="plain"):
        raise_remote(ValueError("plain"))


def test_raise_own_raises_the_librarys_error_and_leaves_a_bug_wrapped_with_its_traceback():
    refused = InvalidArgumentError("as_of: 99 is not a version of this store (its watermark is 3)")
    with pytest.raises(InvalidArgumentError) as info:
        raise_own(wrapped(refused))
    assert info.value is refused and info.value.__suppress_context__
    bug = wrapped(KeyError("cluster 7"))  # not the library's: the remote traceback stays for the report
    with pytest.raises(ray_exceptions.RayTaskError) as info:
        raise_own(bug)
    assert info.value is bug
    with pytest.raises(ValueError, match="not from Ray"):
        raise_own(ValueError("not from Ray"))


def test_a_failed_snapshot_raises_its_own_error_when_the_resume_fails_too(tmp_path, monkeypatch, caplog):
    """A pause that timed out, then a coordinator that cannot resume: the caller sees the
    timeout (what went wrong first), the failed resume is logged."""
    from lifemem_ray.actors.cluster import deployment as dep

    class Call:
        def __init__(self, name: str) -> None:
            self.name = name

        def remote(self, *args):
            return self.name

    class Coordinator:
        deployment, pause, resume, snapshot_routing = Call("deployment"), Call("pause"), Call("resume"), Call("routing")

    def get(ref, timeout=None):
        if ref == "deployment":
            return {"shards": []}
        if ref == "pause":
            raise ray_exceptions.GetTimeoutError("the pause did not return in time")
        if ref == "resume":
            raise RuntimeError("the coordinator is gone")
        return []

    monkeypatch.setattr(dep, "find_coordinator", lambda namespace: Coordinator())
    monkeypatch.setattr(dep.ray, "get", get)
    with caplog.at_level("WARNING", logger=dep.__name__), pytest.raises(ray_exceptions.GetTimeoutError, match="pause"):
        dep.snapshot(tmp_path / "snap", "ns", timeout_s=1)
    assert "ingest could not be resumed" in caplog.text and "the coordinator is gone" in caplog.text
