"""The project as a user or a cluster node installs it: its sdist and wheel, built the way PyPA's
``build`` builds them (the wheel from the sdist, so a file the sdist forgets is missing from the
wheel too), and the wheel installed, not editable, into a fresh virtual environment.

Nothing here imports the project: a caller gets paths and runs the environment's own programs
(``bin/python``, ``bin/lifemem-ray``) from a folder of its own, with :func:`clean_env`, so what
runs is the installed wheel and never the checkout. ``tests/docs_and_packaging/test_wheel.py`` uses it; so can a
test that installs the same wheel on several simulated hosts.

>>> dists = build_dists(work / "dist")                                  # doctest: +SKIP
>>> venv = fresh_venv(dists.wheel, work / "venv", pins=["ray[data,serve]==2.59.0"])  # doctest: +SKIP
>>> run_in(venv, "lifemem-ray", "--version", cwd=work)                 # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "constraints" / "cpu.txt"
BUILD_TIMEOUT_S = 600  # sdist, then the wheel from it, each in an isolated build environment
INSTALL_TIMEOUT_S = 1800  # torch, Ray and the rest: minutes from the pip cache, longer from the index
# Variables that would let the checkout, another environment or another Ray cluster leak into the
# fresh one. RAY_AUTH_MODE too: Ray (2.59 on) sets it in a process that started a local cluster
# (a test session's), and the commands must run with what a user's shell has.
LEAKY_VARIABLES = (
    "PYTHONPATH",
    "PYTHONHOME",
    "PYTHONSTARTUP",
    "PYTHONSAFEPATH",
    "VIRTUAL_ENV",
    "CONDA_PREFIX",
    "RAY_ADDRESS",
    "RAY_AUTH_MODE",
    "__PYVENV_LAUNCHER__",
)


class WheelEnvError(RuntimeError):
    """A build or an install step failed; the message holds the command and its output's tail.

    A test helper's own error, deliberately not a ``LifeMemError``: it reports on the packaging
    and must not depend on the package it checks."""


@dataclass(frozen=True)
class Dists:
    """The two files ``build`` made: the source distribution and the wheel built from it."""

    sdist: Path
    wheel: Path


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without the variables that would put the checkout or another
    environment on the path (:data:`LEAKY_VARIABLES`), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in LEAKY_VARIABLES}
    env.update(extra)
    return env


def _run(
    cmd: Sequence[str | Path], *, cwd: Path, timeout: float, env: Mapping[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` from ``cwd`` with ``env`` (default: :func:`clean_env`), its output captured;
    with ``check``, a non-zero exit is a :class:`WheelEnvError` with what it printed."""
    done = subprocess.run(
        [str(c) for c in cmd],
        cwd=cwd,
        env=dict(env or clean_env()),
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    if check and done.returncode != 0:
        raise WheelEnvError(
            f"`{' '.join(map(str, cmd))}` (in {cwd}) exited with code {done.returncode}:\n"
            f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
        )
    return done


def build_dists(out_dir: Path, source: Path = ROOT) -> Dists:
    """Build ``source``'s sdist and, from it, the wheel into ``out_dir`` with PyPA's ``build``
    (each in an isolated build environment, as pip and PyPI's tooling do).

    Needs the ``build`` package in this interpreter (the ``test`` extra has it)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "build", "--outdir", out_dir, source], cwd=out_dir, timeout=BUILD_TIMEOUT_S)
    sdists, wheels = sorted(out_dir.glob("*.tar.gz")), sorted(out_dir.glob("*.whl"))
    if len(sdists) != 1 or len(wheels) != 1:
        raise WheelEnvError(
            f"expected one sdist and one wheel in {out_dir}, found {[p.name for p in out_dir.iterdir()]}"
        )
    return Dists(sdist=sdists[0], wheel=wheels[0])


def fresh_venv(
    wheel: Path,
    where: Path,
    *,
    extras: Sequence[str] = (),
    pins: Sequence[str] = (),
    constraints: Path | None = CONSTRAINTS,
) -> Path:
    """A new virtual environment at ``where`` with ``wheel`` installed (not editable), with its
    ``extras`` and any further requirement ``pins`` (e.g. ``"ray[data,serve]==2.59.0"``),
    under ``constraints`` (default: the CPU pins). Returns ``where``.

    The environment is made from this interpreter's base Python, without system site-packages,
    and pip runs from ``where``'s parent with :func:`clean_env`, so the checkout is never on the
    path. Dependencies come from the package index (the pip cache makes a repeat fast)."""
    where = Path(where)
    if where.exists():
        raise WheelEnvError(f"{where} exists: a fresh environment needs a new folder")
    base = getattr(sys, "_base_executable", sys.executable)
    _run([base, "-m", "venv", where], cwd=where.parent, timeout=300)
    requirement = f"{wheel}[{','.join(extras)}]" if extras else str(wheel)
    cmd: list[str | Path] = [where / "bin" / "python", "-m", "pip", "install", "-q", requirement, *pins]
    if constraints is not None:
        cmd[5:5] = ["-c", constraints]
    _run(cmd, cwd=where.parent, timeout=INSTALL_TIMEOUT_S)
    return where


def run_in(
    venv: Path,
    program: str,
    *args: str,
    cwd: Path,
    timeout: float = 600,
    env: Mapping[str, str] | None = None,
    check: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run ``venv``'s ``bin/program`` with ``args`` from ``cwd`` (never the checkout), with
    ``env`` (default: :func:`clean_env`). With ``check``, a non-zero exit raises."""
    return _run([venv / "bin" / program, *args], cwd=cwd, timeout=timeout, env=env, check=check)


# Run by the environment's own Python: imports every module below the given packages and prints,
# as JSON, where each was found and why any failed (the missing module's name for an ImportError).
_IMPORT_EVERY_MODULE = """
import importlib, importlib.util, json, pkgutil, sys
found, failed = {}, {}
def fail(name, exc):
    failed[name] = {"type": type(exc).__name__, "message": str(exc)[:500], "missing": getattr(exc, "name", None)}
for top in sys.argv[1:]:
    package = importlib.import_module(top)
    found[top] = package.__file__
    for info in pkgutil.walk_packages(package.__path__, top + ".", onerror=lambda name: fail(name, sys.exc_info()[1])):
        if info.name in found or info.name in failed:
            continue
        if info.name.rsplit(".", 1)[-1] == "__main__":  # importing it runs the command: checked for existence only
            found[info.name] = importlib.util.find_spec(info.name).origin
            continue
        try:
            found[info.name] = importlib.import_module(info.name).__file__
        except Exception as exc:
            fail(info.name, exc)
print(json.dumps({"found": found, "failed": failed}))
"""


def import_every_module(venv: Path, packages: Sequence[str], *, cwd: Path) -> dict[str, dict]:
    """Import every module below ``packages`` (``pkgutil.walk_packages``, so a subpackage added
    later is found too) with ``venv``'s Python, from ``cwd``. Returns ``{"found": {module:
    file}, "failed": {module: {"type", "message", "missing"}}}``."""
    done = run_in(venv, "python", "-c", _IMPORT_EVERY_MODULE, *packages, cwd=cwd, timeout=600, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def trajectory_record(id_: str, env: str, task: str, actions: list[str]) -> dict:
    """A successful trajectory as one JSONL record of `lifemem-ray ingest`, each action observed."""
    return {
        "id": id_,
        "env": env,
        "task": task,
        "steps": [{"thought": "", "action": a, "observation": f"done: {a}"} for a in actions],
        "outcome": {"success": True, "reward": 1.0},
    }
