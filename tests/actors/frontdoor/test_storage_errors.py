"""Issue 32.7: the memory's storage failing, seen through the front door. A durable folder that
is read-only, full, or not a folder at all, and a shard's store folder that is full, answer a
tenant 503 with Retry-After and one sentence naming which storage is unavailable, never a
server path (the replica's log keeps the full message); an add answered 202 polls as failed
with the same error, the MCP tool says the same, reads go on, and the memory takes writes
again once the storage is back.

Against a real 2-shard deployment with ``cluster.durable_uri`` behind Serve on loopback. The
read-only and full cases mount small tmpfs folders (root with mount rights: this sandbox and
CI); without them only the "a file where the durable folder was" case runs. The error shapes
themselves are unit-tested without Ray first."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.front_harness import Front, serve_front

from lifemem_ray.actors.frontdoor.error_answers import error_detail
from lifemem_ray.core.errors import ShardUnavailableError, StoreError
from lifemem_ray.engine.store.shared_log import LogForkedError, SharedLogError
from lifemem_ray.lab.synthetic import generate
from lifemem_ray.service.mcp_server import _problem
from lifemem_ray.service.public_errors import DURABLE_UNAVAILABLE, SERVER_PATH, STORAGE_UNAVAILABLE

RETRY_AFTER_S = 7  # http.retry_after_s of this module's front door
TMPFS_MB = 48  # each mounted folder: room for the deployment's stores and logs, quickly filled
ROLES = [("acme", "acme", "read,write")]
SERVER = "/srv/lifemem/prod-7"  # a server path in the unit tests' messages


# -- the answers, without Ray ------------------------------------------------------------------
def test_a_storage_failure_answers_503_with_retry_after_and_no_path(caplog):
    failures = [
        (
            SharedLogError(
                f"shared log {SERVER}/ns/shard-00: appending entry 6 failed (OSError: [Errno 30] Read-only file "
                f"system: '{SERVER}/ns/shard-00/log/.6.txn'); check that the shared storage is reachable"
            ),
            DURABLE_UNAVAILABLE,
        ),
        (
            LogForkedError(f"shared log s3://bucket{SERVER}/shard-01: entry 9 was written by another writer"),
            DURABLE_UNAVAILABLE,
        ),
        (
            StoreError(f"no space left on the device (or a write error) in {SERVER}/shard-00: ENOSPC"),
            STORAGE_UNAVAILABLE,
        ),
        (StoreError(f"{SERVER}/shard-01: opened read-only"), STORAGE_UNAVAILABLE),
    ]
    for exc, sentence in failures:
        with caplog.at_level("WARNING", logger="lifemem_ray.actors.frontdoor.error_answers"):
            status, detail, headers = error_detail(exc, RETRY_AFTER_S)
        assert (status, headers) == (503, {"Retry-After": str(RETRY_AFTER_S)}), exc
        assert (detail["type"], detail["message"], detail["where"]) == ("unavailable", sentence, None)
        assert f"retry after {RETRY_AFTER_S} s" in detail["what_to_do"]
        assert "/srv" not in json.dumps(detail) and "s3:" not in json.dumps(detail)
        assert str(exc) in caplog.text  # the operator reads what failed, where


def test_other_server_side_answers_show_no_path():
    gone = ShardUnavailableError(
        f'a shard is unavailable for retrieval: ActorDiedError: ... File "{SERVER}/actors/shard_actor.py", line 117'
    )
    status, detail, _ = error_detail(gone, 2)
    assert status == 503 and SERVER_PATH in detail["message"] and "/srv" not in detail["message"]
    status, detail, _ = error_detail(OSError(f"[Errno 5] Input/output error: '{SERVER}/x' and s3://bucket/p"), 2)
    assert status == 500 and "/srv" not in detail["message"] and "s3:" not in detail["message"]
    assert detail["message"].count(SERVER_PATH) == 2


def test_mcp_tool_errors_show_no_path():
    durable = str(_problem(SharedLogError(f"shared log {SERVER}: reading entry 3 failed")))
    assert DURABLE_UNAVAILABLE in durable and "/srv" not in durable
    local = str(_problem(StoreError(f"no space left on the device in {SERVER}/shard-00")))
    assert STORAGE_UNAVAILABLE in local and "/srv" not in local
    other = str(_problem(RuntimeError(f"cannot open {SERVER}/shard-00/data.mdb")))
    assert "/srv" not in other and SERVER_PATH in other


# -- a real deployment -------------------------------------------------------------------------
@dataclass
class Storage:
    """The running front door and the folders under it."""

    front: Front
    root: Path  # every server path of the deployment lies below it
    store: Path  # the shards' store folders
    durable: Path  # cluster.durable_uri
    mounted: bool  # store and durable are tmpfs mounts of TMPFS_MB each


def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


def _can_mount(probe: Path) -> bool:
    """Whether this process may mount a tmpfs (root with mount rights)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    probe.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(probe)], capture_output=True).returncode:
        return False
    _run("umount", str(probe))
    return True


@pytest.fixture(scope="module")
def storage(ray_local, tmp_path_factory) -> Iterator[Storage]:
    root = tmp_path_factory.mktemp("storage")
    store, durable = root / "store", root / "durable"
    store.mkdir()
    durable.mkdir()
    mounted: list[Path] = []
    if _can_mount(root / "probe"):
        for folder in (store, durable):
            _run("mount", "-t", "tmpfs", "-o", f"size={TMPFS_MB}m", "tmpfs", str(folder))
            mounted.append(folder)
    overrides = {
        "cluster.durable_uri": str(durable),
        "cluster.snapshot_every_s": 0,  # no checkpoint runs into a case
        "http.retry_after_s": RETRY_AFTER_S,
    }
    try:
        namespace = f"storage-{root.name[-10:]}"
        with serve_front(store, namespace, ROLES, **overrides) as front:
            with front.http("acme") as api:
                added = api.post("/v1/trajectories", json={"trajectories": _records("base")})
                assert added.status_code == 200, added.text
            yield Storage(front, root, store, durable, bool(mounted))
    finally:
        for folder in reversed(mounted):
            subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def _records(prefix: str, n: int = 6) -> list[dict[str, Any]]:
    return [t.to_dict() for t in generate(n, seed=len(prefix), envs=["shop"], length_scale=0.1, id_prefix=prefix)]


def _fill(folder: Path) -> Path:
    """A file that takes every free byte of ``folder``'s file system; its path."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        chunk = b"\0" * (1 << 20)
        while chunk:
            try:
                os.write(fd, chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                chunk = chunk[: len(chunk) // 2]  # the last bytes too
    finally:
        os.close(fd)
    return filler


@contextlib.contextmanager
def durable_not_a_folder(s: Storage) -> Iterator[None]:
    """A file where the deployment's durable folder (``<durable_uri>/<namespace>``) was."""
    folder = s.durable / s.front.namespace
    away = folder.with_name(folder.name + ".away")
    folder.rename(away)
    folder.write_text("not a folder")
    try:
        yield
    finally:
        folder.unlink()
        away.rename(folder)


@contextlib.contextmanager
def durable_read_only(s: Storage) -> Iterator[None]:
    _run("mount", "-o", "remount,ro", str(s.durable))
    try:
        yield
    finally:
        _run("mount", "-o", "remount,rw", str(s.durable))


@contextlib.contextmanager
def full(folder: Path) -> Iterator[None]:
    """``folder``'s file system without a free byte."""
    filler = _fill(folder)
    try:
        yield
    finally:
        filler.unlink()


CASES: dict[str, tuple[Callable[[Storage], Any], str, bool]] = {  # name: (failure, sentence, needs mounts)
    "durable-not-a-folder": (durable_not_a_folder, DURABLE_UNAVAILABLE, False),
    "durable-read-only": (durable_read_only, DURABLE_UNAVAILABLE, True),
    "durable-full": (lambda s: full(s.durable), DURABLE_UNAVAILABLE, True),
    "store-full": (lambda s: full(s.store), STORAGE_UNAVAILABLE, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_failing_storage_answers_503_with_retry_after_and_no_server_path(storage: Storage, case: str):
    failure, sentence, needs_mounts = CASES[case]
    if needs_mounts and not storage.mounted:
        pytest.skip("needs tmpfs mounts (root with mount rights)")
    records = _records(case)
    with storage.front.http("acme") as api:
        with failure(storage):
            answers = _answers_while_failing(storage, api, records, case)
            for what, answer in answers.items():
                _no_server_path(storage, what, answer)
            for what in ("add", "delete"):
                add = answers[what]
                assert add.status_code == 503, (what, add.status_code, add.text)
                assert add.headers.get("retry-after") == str(RETRY_AFTER_S), (what, dict(add.headers))
                error = add.json()["error"]
                assert (error["type"], error["message"]) == ("unavailable", sentence), (what, error)
                assert f"retry after {RETRY_AFTER_S} s" in error["what_to_do"]
            assert answers["retrieve"].status_code == 200, answers["retrieve"].text  # reads go on
            polled = answers["operation"].json()
            assert polled["status"] == "failed" and polled["error"]["message"] == sentence, polled
            assert answers["mcp"].is_error and sentence in answers["mcp"].content[0].text
        _writes_again(api, records)


def _answers_while_failing(s: Storage, api: httpx.Client, records: list[dict[str, Any]], case: str) -> dict[str, Any]:
    """What a tenant gets from each route that writes (and a read) while the storage fails."""
    out: dict[str, Any] = {
        "add": api.post("/v1/trajectories", json={"trajectories": records}),
        "delete": api.delete("/v1/trajectories/" + _records("base")[0]["id"]),
        "retrieve": api.post("/v1/retrieve", json={"queries": [{"task": records[0]["task"], "env": "shop"}]}),
    }
    accepted = api.post("/v1/trajectories?wait=false", json={"trajectories": _records(f"{case}-later", 2)})
    assert accepted.status_code == 202, accepted.text
    out["accepted"] = accepted
    deadline = time.monotonic() + 180
    while True:
        polled = api.get(f"/v1/operations/{accepted.json()['operation']}")
        if polled.json().get("status") != "pending" or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    out["operation"] = polled
    out["mcp"] = asyncio.run(_mcp_add(s, records[0]))
    return out


async def _mcp_add(s: Storage, record: dict[str, Any]) -> Any:
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {s.front.keys['acme']}"}, timeout=180)
    client = Client(streamable_http_client(f"{s.front.url}/mcp", http_client=http), mode="auto", cache=None)
    async with http, client as mcp:
        args = {k: record[k] for k in ("id", "env", "task", "steps", "outcome")}
        return await mcp.call_tool("add_trajectory", {**args, "id": f"{record['id']}-mcp"})


def _no_server_path(s: Storage, what: str, answer: Any) -> None:
    """Neither the answer's body nor its headers name a folder of the server."""
    if isinstance(answer, httpx.Response):
        text = answer.text + json.dumps(dict(answer.headers))
    else:
        text = " ".join(getattr(block, "text", "") for block in answer.content)
    for path in {str(s.root), str(s.store), str(s.durable), str(s.durable / s.front.namespace), "pytest-of-"}:
        assert path not in text, f"{what} shows the server path {path}: {text[:600]}"


def _writes_again(api: httpx.Client, records: list[dict[str, Any]]) -> None:
    """Once the storage is back, the same batch is taken (a resend after a 503 is the client's move)."""
    deadline = time.monotonic() + 120
    while True:
        again = api.post("/v1/trajectories", json={"trajectories": records})
        if again.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert again.status_code == 200, again.text
    assert {item["status"] for item in again.json()["items"]} <= {"added", "duplicate"}
