"""The README's tour runs as written: its code blocks, taken from the file itself, run in a
new folder (the checkout's ``lifemem_ray`` linked there, as the tour is run from the checkout)
with the installed ``lifemem-ray``: the engine in Python; the sharded memory on a Ray head
that ``serve`` starts (in a ``RAY_TMPDIR`` of the test's own, stopped by the tour's last
command, or by its pid if the tour failed); the front door with a key written where the tour
asks; the lifelong experiment. Slow (minutes): run by .ci/run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.serve_head import end_head, plant_dead_address, serve_head_pids, short_ray_tmpdir
from support.wheel_env import clean_env

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def sections() -> dict[str, list[tuple[str, str]]]:
    """The README's code blocks by the tour heading they stand under: (language, code)."""
    out: dict[str, list[tuple[str, str]]] = {}
    heading = ""
    for part in re.split(r"^(#{2,3} .*)$", (ROOT / "README.md").read_text(), flags=re.MULTILINE):
        if re.match(r"#{2,3} ", part):
            heading = part.lstrip("#").strip()
            continue
        out.setdefault(heading, []).extend((m.group(1), m.group(2)) for m in BLOCK.finditer(part))
    return out


def _tour_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "tour"
    folder.mkdir()
    (folder / "lifemem_ray").symlink_to(ROOT / "lifemem_ray")  # the tour names the shipped sample by its path
    return folder


def _run(script: str, folder: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, (
        f"the README's tour failed ({done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}"
    )
    return done


def _env(ray_tmpdir: Path | None = None) -> dict[str, str]:
    """The environment a user's shell has after the README's first command: the project's
    virtual environment first on PATH (``lifemem-ray``, ``python3``), no Ray address."""
    env = {k: v for k, v in clean_env().items() if k != "RAY_ADDRESS"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    if ray_tmpdir is not None:
        env["RAY_TMPDIR"] = str(ray_tmpdir)
    return env


def test_the_tour_lists_what_this_test_runs():
    found = sections()
    assert [lang for lang, _ in found["1. The engine, in Python (no Ray)"]] == ["python"]
    assert [lang for lang, _ in found["2. The sharded memory on Ray"]] == ["bash", "python"]
    assert [lang for lang, _ in found["3. The front door: REST and MCP"]] == ["bash"]
    assert [lang for lang, _ in found["4. A lifelong experiment"]] == ["bash"]


def test_the_engine_block_runs(tmp_path):
    folder = _tour_folder(tmp_path)
    (code,) = [c for _, c in sections()["1. The engine, in Python (no Ray)"]]
    _run(f"python3 - <<'PY'\n{code}PY\n", folder, _env(), 300)
    assert (folder / "my-memory" / "data.mdb").is_file()


def test_the_sharded_memory_and_the_front_door_blocks_run(tmp_path):
    """Sections 2 and 3 in one shell, as a user runs them: serve, ingest, retrieve, snapshot,
    the Python client, a key, the front door, curl, stop."""
    folder = _tour_folder(tmp_path)
    found = sections()
    (serve_block, client_block) = [c for _, c in found["2. The sharded memory on Ray"]]
    (front_block,) = [c for _, c in found["3. The front door: REST and MCP"]]
    script = serve_block + f"python3 - <<'PY'\n{client_block}PY\n" + "echo '--- front door'\n" + front_block
    ray_tmpdir = short_ray_tmpdir()
    plant_dead_address(ray_tmpdir)
    try:
        done = _run(script, folder, _env(ray_tmpdir), 900)
    finally:
        for pid in serve_head_pids(ray_tmpdir):  # the tour stops its head; if it failed first, this does
            end_head(pid)
    out = done.stdout
    assert "serving 2 shards" in out and "snapshot" in out.lower()
    assert "[4, 4]" in out, out[-3000:]
    front = out.split("--- front door", 1)[1]
    assert '"status":"added"' in front.replace(" ", "") and '"run-1"' in front, front[-3000:]
    assert (folder / "snap-1").is_dir() and (folder / "memory").is_dir()
    assert oct((folder / "acme.key").stat().st_mode & 0o777) == "0o600"
    assert not serve_head_pids(ray_tmpdir) or all(not _alive(p) for p in serve_head_pids(ray_tmpdir))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_the_lifelong_experiment_block_runs(tmp_path):
    folder = _tour_folder(tmp_path)
    (block,) = [c for _, c in sections()["4. A lifelong experiment"]]
    ray_tmpdir = short_ray_tmpdir()
    done = _run(block, folder, _env(ray_tmpdir), 1500)
    assert "| lifemem |" in done.stdout and (folder / "runs" / "lifelong" / "report.json").is_file()
