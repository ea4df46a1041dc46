"""Which Ray cluster a command joins, and how it fails or ends (issue 23, finding 4; issue 32, item 6).

Issue 32, item 6: with no address given, commands joined through Ray's ``address="auto"``,
which also scans the process table and so found other people's clusters (other containers or
network namespaces sharing it); ``serve`` then retried an unreachable GCS for minutes and
ignored SIGTERM. Now a command joins only a cluster named to it (``--address``,
``RAY_ADDRESS``, or our record of the head ``serve`` started here), a join that cannot
complete fails within a bound naming the address and who named it, and SIGINT/SIGTERM end it.

Issue 23, finding 4: Ray's address file left by a head that is gone made commands retry the
dead address for minutes; it is now never joined (only named as a hint).

Each command runs with RAY_TMPDIR pointing at a folder of the test's own, so the address file
and head record it reads are the test's, never the machine's. Fake clusters listen on 127.0.0.2
(loopback; Ray dials 127.0.0.1 as this node's outward address instead, which is not loopback)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lifemem_ray.actors.cluster.ray_address import (
    ClusterNotNamed,
    HeadRecord,
    RayAddress,
    address_file,
    answers,
    head_record_path,
    named_address,
    record_head,
    speaks_grpc,
    this_netns,
)
from lifemem_ray.core.errors import InvalidArgumentError

ROOT = Path(__file__).resolve().parents[3]
QUICK_S = 60  # what fails here fails within seconds; before the fix these commands hung for minutes
FAKE_HOST = "127.0.0.2"
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def _dead_address() -> str:
    """A loopback address where nothing listens (a port just freed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def ray_tmp() -> Iterator[Path]:
    """A short RAY_TMPDIR (Ray's socket paths must stay under 107 characters), empty: no address
    file, no head record."""
    root = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))
    (root / "ray").mkdir()
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def stale_tmp(ray_tmp: Path) -> tuple[Path, str]:
    """``ray_tmp`` whose Ray address file names a dead head."""
    dead = _dead_address()
    (ray_tmp / "ray" / "ray_current_cluster").write_text(dead + "\n")
    return ray_tmp, dead


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "LIFEMEM_RAY_JOIN_TIMEOUT_S")}
    env.update(RAY_TMPDIR=str(tmp), PYTHONPATH=str(ROOT), **extra)
    return env


def _cli(tmp: Path, *args: str, timeout: float = QUICK_S, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lifemem_ray.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(tmp, **extra),
    )


@contextlib.contextmanager
def plain_listener() -> Iterator[str]:
    """A TCP listener that accepts and never says anything (not a Ray cluster); its address."""
    server = socket.socket()
    server.bind((FAKE_HOST, 0))
    server.listen(64)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"{FAKE_HOST}:{server.getsockname()[1]}"
    finally:
        server.close()
        for conn in held:
            conn.close()


class FakeGcs:
    """An HTTP/2 server that greets like a gRPC server (so the probes pass) and never answers a
    call: Ray's handshake never completes. ``called`` is set once a client sent a call."""

    def __init__(self) -> None:
        self.server = socket.socket()
        self.server.bind((FAKE_HOST, 0))
        self.server.listen(64)
        self.address = f"{FAKE_HOST}:{self.server.getsockname()[1]}"
        self.called = threading.Event()
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn = self.server.accept()[0]
            except OSError:
                return
            self.held.append(conn)
            threading.Thread(target=self._greet, args=(conn,), daemon=True).start()

    def _greet(self, conn: socket.socket) -> None:
        seen, acked = b"", False
        try:
            conn.sendall(b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")  # our SETTINGS
            while chunk := conn.recv(65536):
                seen += chunk
                if not acked and len(seen) >= len(H2_PREFACE) + 9:  # the client's greeting: acknowledge it
                    conn.sendall(b"\x00\x00\x00\x04\x01\x00\x00\x00\x00")
                    acked = True
                if len(seen) > len(H2_PREFACE) + 9:
                    self.called.set()  # more than the greeting: a call (which is never answered)
        except OSError:
            return

    def close(self) -> None:
        self.server.close()
        for conn in self.held:
            conn.close()


@pytest.fixture
def fake_gcs() -> Iterator[FakeGcs]:
    fake = FakeGcs()
    try:
        yield fake
    finally:
        fake.close()


@contextlib.contextmanager
def found_by_rays_search(address: str, tmp: Path) -> Iterator[None]:
    """A process that Ray's ``address="auto"`` search takes for a running raylet whose GCS is at
    ``address`` (its program name contains "raylet" and it has ``--gcs-address=ADDRESS``), as
    another container's cluster looks through a shared process table."""
    from ray._private import services

    bait = subprocess.Popen(
        [str(tmp / "raylet"), "-c", "import time; time.sleep(300)", f"--gcs-address={address}"],
        executable=sys.executable,
        stdin=subprocess.DEVNULL,
    )
    try:
        services.find_gcs_addresses.cache_clear()
        deadline = time.monotonic() + 10
        while address not in services.find_gcs_addresses() and time.monotonic() < deadline:
            services.find_gcs_addresses.cache_clear()
            time.sleep(0.1)
        assert address in services.find_gcs_addresses(), "Ray's search does not see the stand-in cluster"
        yield
    finally:
        bait.kill()
        bait.wait()


def _record(tmp: Path, pid: int, port: int, **changes: object) -> Path:
    path = tmp / "ray" / "lifemem-ray-head.json"
    fields = {"netns": this_netns(), "uid": os.getuid(), **changes}
    record_head(HeadRecord(pid, f"10.0.0.9:{port}", port, ["ray", "start"], **fields), path)  # type: ignore[arg-type]
    return path


# -- the rule, without Ray -------------------------------------------------------------------------
def test_named_address_follows_the_rule_and_never_rays_file(tmp_path, stale_tmp, monkeypatch):
    tmp, _ = stale_tmp
    monkeypatch.setenv("RAY_TMPDIR", str(tmp))
    missing = tmp_path / "no-record.json"
    assert named_address(None, {}, missing) == RayAddress(None, ""), "Ray's address file names no cluster to join"
    assert named_address(None, {"RAY_ADDRESS": "10.9.9.9:1"}, missing) == RayAddress("10.9.9.9:1", "RAY_ADDRESS")
    given = named_address("10.0.0.1:7", {"RAY_ADDRESS": "10.9.9.9:1"}, missing)
    assert given == RayAddress("10.0.0.1:7", "--address") and not given.ours
    for word in ("auto", "local"):
        with pytest.raises(ClusterNotNamed, match="HOST:PORT"):
            named_address(word, {}, missing)
        with pytest.raises(ClusterNotNamed, match="RAY_ADDRESS"):
            named_address(None, {"RAY_ADDRESS": word}, missing)
    with pytest.raises(InvalidArgumentError, match="not HOST:PORT"):
        named_address("headnode", {}, missing)


def test_our_head_record_counts_only_while_its_ray_start_runs_here(ray_tmp):
    stand_in = subprocess.Popen(  # a process whose command line is a `ray start` on port 4321
        [sys.executable, "-c", "import time; time.sleep(120)", "start", "--head", "--port=4321"],
        stdin=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30  # until it has exec'd (a forked child shows its parent's command line)
        while b"--port=4321" not in Path(f"/proc/{stand_in.pid}/cmdline").read_bytes() and time.monotonic() < deadline:
            time.sleep(0.01)
        path = _record(ray_tmp, stand_in.pid, 4321)
        found = named_address(None, {}, path)
        assert found.address == "10.0.0.9:4321" and found.ours and f"pid {stand_in.pid}" in found.source
        assert named_address(None, {"RAY_ADDRESS": "10.9.9.9:1"}, path).source == "RAY_ADDRESS"
        assert named_address(None, {}, path, own_head_counts=False).address is None
        for changes in ({"netns": "net:[1]"}, {"uid": os.getuid() + 1}):
            assert named_address(None, {}, _record(ray_tmp, stand_in.pid, 4321, **changes)).address is None
        assert named_address(None, {}, _record(ray_tmp, stand_in.pid, 4322)).address is None, "another port"
        assert named_address(None, {}, _record(ray_tmp, os.getpid(), 4321)).address is None, "not a ray start"
    finally:
        stand_in.kill()
        stand_in.wait()
    assert named_address(None, {}, _record(ray_tmp, stand_in.pid, 4321)).address is None, "its head is gone"


def test_the_probes_tell_a_listener_from_a_grpc_server(fake_gcs):
    assert not answers(_dead_address()) and not speaks_grpc(_dead_address())
    with plain_listener() as address:
        assert answers(address) and answers(f"ray://{address}")
        assert not speaks_grpc(address), "a listener that says nothing is not a Ray cluster"
    assert answers(fake_gcs.address) and speaks_grpc(fake_gcs.address)
    assert not answers("no-port-here") and not speaks_grpc("no-port-here")


def test_the_address_file_is_where_ray_keeps_it_and_our_record_beside_it(monkeypatch, tmp_path):
    """Guards the one use of Ray's private helper: it must follow RAY_TMPDIR as Ray does."""
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    assert address_file() == tmp_path / "ray" / "ray_current_cluster"
    assert head_record_path() == tmp_path / "ray" / "lifemem-ray-head.json"


# -- the commands: never a cluster found by searching -----------------------------------------------
def test_commands_never_join_a_cluster_rays_search_finds(ray_tmp):
    """Before: with nothing named, retrieve and ingest joined what Ray's process scan found, a GCS
    that never answers, and hung for minutes; now they say at once that no cluster is named."""
    records = ray_tmp / "one.jsonl"
    records.write_text(json.dumps({"env": "shop", "task": "t", "steps": [{"action": "a"}]}) + "\n")
    with plain_listener() as elsewhere, found_by_rays_search(elsewhere, ray_tmp):
        for args in (
            ["retrieve", "a task", "--env", "shop", "--namespace", "ns"],
            ["ingest", str(records), "--namespace", "ns"],
        ):
            done = _cli(ray_tmp, *args)
            assert done.returncode == 1, done.stderr[-2000:]
            assert "no Ray cluster is named" in done.stderr and "--address" in done.stderr, done.stderr[-2000:]
            assert elsewhere not in done.stderr and "Traceback" not in done.stderr
        stop = _cli(ray_tmp, "stop", "--json")
        assert stop.returncode == 0 and json.loads(stop.stdout)["stopped"] is False, stop.stderr[-2000:]


def test_stop_with_a_stale_address_file_says_nothing_to_stop(stale_tmp):
    tmp, dead = stale_tmp
    for extra in ([], ["--json"]):
        done = _cli(tmp, "stop", "--ray", *extra)
        assert done.returncode == 0, done.stderr[-2000:]
        out = done.stdout
        assert "nothing to stop" in out or json.loads(out)["stopped"] is False
        assert dead in out and "ray_current_cluster" in out, out  # named as a hint, not joined


def test_commands_name_the_address_and_who_named_it(stale_tmp):
    tmp, dead = stale_tmp
    done = _cli(tmp, "stats", "--namespace", "nowhere")
    assert done.returncode == 1 and "no Ray cluster is named" in done.stderr, done.stderr[-2000:]
    assert f"--address {dead}" in done.stderr and "ray_current_cluster" in done.stderr, "the file is only a hint"
    assert "Traceback" not in done.stderr
    other = _dead_address()
    done = _cli(tmp, "stats", "--address", other, "--namespace", "nowhere")
    assert done.returncode == 1 and other in done.stderr and "--address" in done.stderr, done.stderr[-2000:]
    done = _cli(tmp, "stats", "--namespace", "nowhere", RAY_ADDRESS=other)
    assert done.returncode == 1 and other in done.stderr and "RAY_ADDRESS" in done.stderr, done.stderr[-2000:]
    store = tmp / "store"
    done = _cli(tmp, "serve", "--store", str(store), "--address", other)  # told to join: says so, starts nothing
    assert done.returncode == 1 and other in done.stderr and "--address" in done.stderr, done.stderr[-2000:]
    assert (tmp / "ray" / "ray_current_cluster").read_text().strip() == dead  # no head was started


# -- the commands: a join is bounded, and signals end it -------------------------------------------
def test_a_listener_that_is_not_ray_fails_at_once_naming_it(ray_tmp):
    """Before: `--address` of a plain TCP listener hung in Ray's retries for many minutes."""
    with plain_listener() as address:
        done = _cli(ray_tmp, "stats", "--address", address, "--namespace", "nowhere")
    assert done.returncode == 1, done.stderr[-2000:]
    assert address in done.stderr and "--address" in done.stderr and "not a Ray cluster" in done.stderr


def test_a_join_that_never_completes_fails_within_the_bound_naming_it(ray_tmp, fake_gcs):
    """The address greets like a GCS but never answers Ray's handshake: the join is given up
    after LIFEMEM_RAY_JOIN_TIMEOUT_S (Ray alone retries for minutes)."""
    done = _cli(
        ray_tmp, "retrieve", "t", "--env", "shop", "--address", fake_gcs.address, LIFEMEM_RAY_JOIN_TIMEOUT_S="5"
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert fake_gcs.called.is_set(), "the probes passed and Ray tried to join"
    assert fake_gcs.address in done.stderr and "--address" in done.stderr and "handshake" in done.stderr
    assert "LIFEMEM_RAY_JOIN_TIMEOUT_S" in done.stderr


@pytest.mark.parametrize(
    ("args", "signum", "code", "said"),
    [
        (["retrieve", "t", "--env", "shop"], signal.SIGTERM, 143, "terminated (SIGTERM)"),
        (["stats"], signal.SIGINT, 130, "interrupted"),
        (["run", "--quiet"], signal.SIGTERM, 143, "terminated (SIGTERM)"),
    ],
)
def test_sigterm_and_sigint_end_a_command_waiting_for_a_join(ray_tmp, fake_gcs, args, signum, code, said):
    """Before: Ray's retries held the main thread and its SIGTERM handler waited for them."""
    command = subprocess.Popen(
        [sys.executable, "-m", "lifemem_ray.cli", *args, "--address", fake_gcs.address],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(ray_tmp),
        cwd=ray_tmp,
    )
    try:
        assert fake_gcs.called.wait(QUICK_S), "the command did not reach Ray's join"
        command.send_signal(signum)
        _, err = command.communicate(timeout=QUICK_S)
    finally:
        command.kill()
        command.wait()
    assert command.returncode == code and f"lifemem-ray {args[0]}: {said}" in err, err[-2000:]


# -- serve: its own head, never another's; and gone again when serve is interrupted ---------------
def _running_with(tmp: Path) -> list[int]:
    """Pids of this user's processes started with RAY_TMPDIR=tmp (a head and its Ray processes)."""
    mark = f"RAY_TMPDIR={tmp}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if mark in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:
                pass
    return [p for p in pids if p != os.getpid()]


def _end(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_serve_starts_its_own_head_and_later_commands_find_it(stale_tmp, tmp_path):
    """Nothing named, another cluster visible to Ray's search and a stale address file: serve
    starts a head of its own; stats finds it through our record; stop --ray ends it."""
    tmp, dead = stale_tmp
    store = tmp_path / "store"
    try:
        with plain_listener() as elsewhere, found_by_rays_search(elsewhere, tmp):
            done = _cli(
                tmp, "serve", "--store", str(store), "--shards", "1", "--namespace", "own", "--json", timeout=300
            )
        assert done.returncode == 0, done.stderr[-3000:]
        assert len(json.loads(done.stdout)["shards"]) == 1
        record = json.loads((tmp / "ray" / "lifemem-ray-head.json").read_text())
        assert answers(record["address"]) and record["address"] != dead
        stats = _cli(tmp, "stats", "--namespace", "own", "--json", timeout=120)
        assert stats.returncode == 0 and json.loads(stats.stdout)["trajectories"] == 0, stats.stderr[-2000:]
        stopped = _cli(tmp, "stop", "--namespace", "own", "--ray", timeout=180)
        assert stopped.returncode == 0 and "stopped the local Ray head" in stopped.stdout, (
            stopped.stdout + stopped.stderr[-2000:]
        )
        assert not (tmp / "ray" / "lifemem-ray-head.json").exists() and not answers(record["address"])
    finally:
        _end(_running_with(tmp))


@pytest.mark.slow
@pytest.mark.parametrize("signal_after", ["ray_current_cluster", "lifemem-ray-head.json"])
def test_sigterm_while_serve_waits_stops_the_head_it_started(ray_tmp, tmp_path, signal_after):
    """SIGTERM once serve's head is up (Ray's address file: serve is joining it) or once serve
    recorded it (serve is deploying): serve ends, and the head it started goes with it (by its
    pid), leaving nothing of it running."""
    serve = subprocess.Popen(
        [sys.executable, "-m", "lifemem_ray.cli", "serve", "--store", str(tmp_path / "store"), "--shards", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(ray_tmp),
    )
    current = ray_tmp / "ray" / "ray_current_cluster"  # `ray start` writes it once its GCS runs
    waited = ray_tmp / "ray" / signal_after
    try:
        deadline = time.monotonic() + 240
        while not waited.exists() and serve.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert waited.exists() and serve.poll() is None, "serve's head did not come up"
        head = current.read_text().strip() if waited == current else json.loads(waited.read_text())["address"]
        serve.send_signal(signal.SIGTERM)
        _, err = serve.communicate(timeout=120)
        assert serve.returncode == 143 and "terminated (SIGTERM)" in err, err[-3000:]
        assert "which this command started" in err, err[-3000:]
        assert not answers(head), "the head serve started still answers"
        assert _running_with(ray_tmp) == [], "processes of serve's head are left running"
        assert not (ray_tmp / "ray" / "lifemem-ray-head.json").exists()
    finally:
        serve.kill()
        serve.wait()
        _end(_running_with(ray_tmp))
