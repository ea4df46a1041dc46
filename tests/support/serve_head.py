"""A Ray head that a command-line test starts with ``lifemem-ray serve --store`` and must stop:
in a ``RAY_TMPDIR`` of the test's own (so the machine's Ray address file and sessions are never
touched), found again by the pid ``serve`` records, ended by that pid alone; and whether it
runs with Ray's token authentication on. Used by tests/docs_and_packaging/test_wheel.py and tests/actors/cluster/test_ray_range.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from support.wheel_env import clean_env

HEAD_MARKER = "lifemem-ray-head.json"  # what `lifemem-ray serve` writes in its head's session folder: the head's pid


def short_ray_tmpdir() -> Path:
    """A new, short folder for ``RAY_TMPDIR`` (Ray's socket paths must stay under 107
    characters), so a Ray head started with it keeps its address file and sessions there,
    never in the machine's ``/tmp/ray``."""
    return Path(tempfile.mkdtemp(prefix="rw", dir="/tmp"))


def plant_dead_address(ray_tmpdir: Path) -> str:
    """Write, as Ray's address file under ``ray_tmpdir``, a loopback address where nothing
    listens; returns it.

    Why: with no address file, ``ray.init(address="auto")`` falls back to joining any Ray
    cluster running on the machine (Ray's legacy process scan), so ``lifemem-ray serve --store``
    would join, say, another test session's cluster instead of starting its own head. A dead
    address in the file is what a crashed head leaves, and ``serve`` then starts a head of its
    own (tests/actors/cluster/test_ray_address.py covers that path)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    (ray_tmpdir / "ray").mkdir(parents=True, exist_ok=True)
    (ray_tmpdir / "ray" / "ray_current_cluster").write_text(dead + "\n")
    return dead


# A Ray client that sends no token (RAY_AUTH_MODE=disabled): a token-authenticated cluster refuses it.
_TOKENLESS_CLIENT = """
import sys, ray
try:
    ray.init(address=sys.argv[1], logging_level="ERROR")
except Exception as exc:
    print("refused", type(exc).__name__)
else:
    print("accepted")
"""


def tokenless_client_answer(python: Path, address: str) -> str:
    """What a Ray client run by ``python`` that sends no token gets from the cluster at
    ``address``: ``"refused ConnectionError"`` from one with token authentication on (after
    Ray's connection retries, about 20 s), ``"accepted"`` from one without."""
    env = {k: v for k, v in clean_env().items() if not k.startswith("RAY_AUTH")}
    env["RAY_AUTH_MODE"] = "disabled"
    done = subprocess.run(
        [str(python), "-c", _TOKENLESS_CLIENT, address],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd="/",
        stdin=subprocess.DEVNULL,
    )
    return (done.stdout.strip().splitlines() or [done.stderr[-500:]])[-1]


def ray_address(ray_tmpdir: Path) -> str | None:
    """The address of the Ray head last started with ``RAY_TMPDIR=ray_tmpdir`` (Ray's own
    address file there), or None."""
    try:
        return (ray_tmpdir / "ray" / "ray_current_cluster").read_text().strip() or None
    except OSError:
        return None


def serve_head_pids(ray_tmpdir: Path) -> list[int]:
    """The pids of the Ray heads ``lifemem-ray serve`` started with ``RAY_TMPDIR=ray_tmpdir``
    (from the marker it writes in each head's session folder)."""
    pids = []
    for marker in sorted((ray_tmpdir / "ray").glob(f"session_2*/{HEAD_MARKER}")):
        pids.append(int(json.loads(marker.read_text())["pid"]))
    return pids


def end_head(pid: int, grace_s: float = 30.0) -> bool:
    """End a Ray head ``lifemem-ray serve`` started (``ray start --block`` in a session of its
    own, pid ``pid``): SIGTERM, then after ``grace_s`` SIGKILL to its process group, which holds
    that head's Ray processes and nothing else. Whether it was still running."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.5)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return True
