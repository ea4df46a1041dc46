"""Issue 23, finding 4: Ray's address file left by a head that is gone. Before, `lifemem-ray
serve --store DIR` and `lifemem-ray stop --ray` retried the dead address for their whole
timeout (killed at 300 s and 120 s) printing only Ray's "Failed to connect to GCS", and serve
never started its own head. Now the address is probed first: `stop` says there is nothing to
stop, other commands name the dead address and the file or variable that named it, and
`serve --store` starts its own head, all within seconds.

Each command runs with RAY_TMPDIR pointing at a folder of the test's own, so the address file
it reads is the test's stale one, never the machine's."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from lifemem_ray.actors.cluster.ray_address import RayAddress, address_file, answers, named_address

ROOT = Path(__file__).resolve().parents[1]
QUICK_S = 60  # a command facing a dead address answers well within this (it used to hang for minutes)


def _dead_address() -> str:
    """A loopback address where nothing listens (a port just freed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def stale_tmp() -> Iterator[tuple[Path, str]]:
    """A short RAY_TMPDIR (Ray's socket paths must stay under 107 characters) whose address file
    names a dead head."""
    root = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))
    dead = _dead_address()
    (root / "ray").mkdir()
    (root / "ray" / "ray_current_cluster").write_text(dead + "\n")
    try:
        yield root, dead
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _cli(tmp: Path, *args: str, timeout: float = QUICK_S) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
    env.update(RAY_TMPDIR=str(tmp), PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "lifemem_ray.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


# -- the address, without Ray --------------------------------------------------------------------
def test_named_address_follows_rays_order(tmp_path):
    file = tmp_path / "ray_current_cluster"
    assert named_address(None, {}, file) == RayAddress(None, "")
    file.write_text("10.1.2.3:6379\n")
    assert named_address(None, {}, file) == RayAddress("10.1.2.3:6379", str(file))
    assert named_address("auto", {}, file).from_file
    assert named_address(None, {"RAY_ADDRESS": "10.9.9.9:1"}, file) == RayAddress("10.9.9.9:1", "RAY_ADDRESS")
    assert named_address("10.0.0.1:7", {"RAY_ADDRESS": "10.9.9.9:1"}, file) == RayAddress("10.0.0.1:7", "--address")
    assert not named_address("10.0.0.1:7", {}, file).from_file


def test_answers_probes_one_connection():
    assert not answers(_dead_address())
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        assert answers(f"127.0.0.1:{listening.getsockname()[1]}")
        assert answers(f"ray://127.0.0.1:{listening.getsockname()[1]}")
    assert not answers("no-port-here")


def test_the_address_file_is_where_ray_keeps_it(monkeypatch, tmp_path):
    """Guards the one use of Ray's private helper: it must follow RAY_TMPDIR as Ray does."""
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    assert address_file() == tmp_path / "ray" / "ray_current_cluster"


# -- the commands ------------------------------------------------------------------------------
def test_stop_with_a_stale_address_file_says_nothing_to_stop(stale_tmp):
    tmp, dead = stale_tmp
    for extra in ([], ["--json"]):
        done = _cli(tmp, "stop", "--ray", *extra)
        assert done.returncode == 0, done.stderr[-2000:]
        out = done.stdout
        assert "nothing to stop" in out or json.loads(out)["stopped"] is False
        assert dead in out and "ray_current_cluster" in out, out


def test_commands_name_the_dead_address_and_who_named_it(stale_tmp):
    tmp, dead = stale_tmp
    done = _cli(tmp, "stats", "--namespace", "nowhere")
    assert done.returncode == 1 and dead in done.stderr and "ray_current_cluster" in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    other = _dead_address()
    done = _cli(tmp, "stats", "--address", other, "--namespace", "nowhere")
    assert done.returncode == 1 and other in done.stderr and "--address" in done.stderr, done.stderr[-2000:]
    store = tmp / "store"
    done = _cli(tmp, "serve", "--store", str(store), "--address", other)  # told to join: says so, starts nothing
    assert done.returncode == 1 and other in done.stderr and "--address" in done.stderr, done.stderr[-2000:]
    assert (tmp / "ray" / "ray_current_cluster").read_text().strip() == dead  # no head was started


@pytest.mark.slow
def test_serve_passes_over_a_stale_address_file_and_starts_its_own_head(stale_tmp, tmp_path):
    tmp, dead = stale_tmp
    store = tmp_path / "store"
    try:
        done = _cli(tmp, "serve", "--store", str(store), "--shards", "1", "--namespace", "stale", "--json", timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert len(json.loads(done.stdout)["shards"]) == 1
        live = (tmp / "ray" / "ray_current_cluster").read_text().strip()
        assert live != dead and answers(live)
        stats = _cli(tmp, "stats", "--namespace", "stale", "--json", timeout=120)
        assert stats.returncode == 0 and json.loads(stats.stdout)["trajectories"] == 0, stats.stderr[-2000:]
    finally:
        stopped = _cli(tmp, "stop", "--namespace", "stale", "--ray", timeout=180)
    assert stopped.returncode == 0 and "stopped the local Ray head" in stopped.stdout, (
        stopped.stdout + stopped.stderr[-2000:]
    )
