"""The wheel, proven (issue 24, item 6): the project as a cluster node installs it.

Every other test runs from the editable checkout, which hides a wheel that forgets a subpackage
(the wheel once shipped without ``lifemem_ray/engine``). Here the sdist and the wheel are built
with PyPA's ``build`` (the wheel from the sdist), the wheel is installed into a fresh virtual
environment, and from there, never from the checkout (a temporary working folder, no
PYTHONPATH): every module of ``lifemem_ray`` and ``lifemem_ray.actors`` imports,
``lifemem-ray demo`` runs, and ``serve`` / ``ingest`` / ``retrieve`` / ``stop --ray`` run a
2-shard memory on a Ray head of its own (``RAY_TMPDIR`` of the test's own, so the machine's Ray
address file is never touched), with Ray's token authentication on.

Minutes (the build, the install from the pip cache, a Ray head): behind the ``wheel`` marker,
run by ``.ci/run``: ``pytest -m wheel tests/docs_and_packaging/test_wheel.py``."""

from __future__ import annotations

import json
import shutil
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.serve_head import (
    end_head,
    plant_dead_address,
    ray_address,
    serve_head_pids,
    short_ray_tmpdir,
    tokenless_client_answer,
)
from support.wheel_env import (
    ROOT,
    Dists,
    build_dists,
    clean_env,
    fresh_venv,
    import_every_module,
    run_in,
    trajectory_record,
)

pytestmark = [pytest.mark.wheel, pytest.mark.timeout(2400)]

PACKAGES = ("lifemem_ray", "lifemem_ray.actors")
# What the environment adapters import from their optional extras (fast-envs, envs, llm-local and
# the --no-deps installs of .ci/run): a module may fail to import only because one is absent.
OPTIONAL_IMPORTS = frozenset(
    {
        "textworld_express",
        "alfworld",
        "textworld",
        "fast_downward",
        "scienceworld",
        "py4j",
        "miniwob",
        "selenium",
        "tau2",
        "bfcl_eval",
        "loguru",
        "orjson",
        "llama_cpp",
        "skyrl_gym",  # the rl extra (lifemem_ray.actors.integrations.skyrl_env)
        "verl",  # installed by the user beside ours (lifemem_ray.actors.integrations.verl_loop)
    }
)
NAMESPACE = "wheeltest"


@pytest.fixture(scope="module")
def work() -> Iterator[Path]:
    """A temporary folder for the build, the environment and the commands' working folder."""
    path = Path(tempfile.mkdtemp(prefix="lifemem-wheel-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def dists(work: Path) -> Dists:
    return build_dists(work / "dist")


@pytest.fixture(scope="module")
def venv(dists: Dists, work: Path) -> Path:
    return fresh_venv(dists.wheel, work / "venv")


@pytest.fixture(scope="module")
def cwd(work: Path) -> Path:
    """Where the installed commands run: not the checkout, so only the wheel can answer."""
    path = work / "cwd"
    path.mkdir()
    return path


def _checkout_files(folder: str) -> set[str]:
    """Every file the package trees hold in the checkout (no caches), relative to ``folder``."""
    base = ROOT / folder
    return {
        p.relative_to(base).as_posix()
        for p in base.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo")
    }


def test_the_sdist_holds_the_tests_the_readme_and_what_the_tests_read(dists: Dists):
    with tarfile.open(dists.sdist) as sdist:
        top = sdist.getnames()[0].split("/")[0]
        names = {n.removeprefix(f"{top}/") for n in sdist.getnames()}
    assert {"README.md", "pyproject.toml", "setup.py", "MANIFEST.in", "constraints/cpu.txt", ".ci/run"} <= names
    tests = {
        f"tests/{p.relative_to(ROOT / 'tests').as_posix()}"
        for p in (ROOT / "tests").rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert {"tests/conftest.py", "tests/support/wheel_env.py", "tests/lab/envs/test_env_sql.py"} <= tests
    assert not tests - names, f"the sdist lacks test files: {sorted(tests - names)}"
    # What the tests read beside the package: the cluster definitions and the benchmarks they import.
    for folder in ("cluster_configs", "benchmarks"):
        wanted = {
            f"{folder}/{p.relative_to(ROOT / folder).as_posix()}"
            for p in (ROOT / folder).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts
        }
        assert wanted and not wanted - names, f"the sdist lacks {sorted(wanted - names)}"
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)


def test_the_wheel_holds_both_trees_whole_and_nothing_else(dists: Dists):
    with zipfile.ZipFile(dists.wheel) as wheel:
        names = set(wheel.namelist())
    wanted = {f"lifemem_ray/{f}" for f in _checkout_files("lifemem_ray")}
    wanted |= {f"lifemem_ray/actors/{f}" for f in _checkout_files("actors")}
    assert "lifemem_ray/engine/__init__.py" in wanted and "lifemem_ray/py.typed" in wanted
    assert not wanted - names, f"the wheel lacks {sorted(wanted - names)}"
    others = {n.split("/")[0] for n in names} - {"lifemem_ray"}
    assert len(others) == 1 and others.pop().endswith(".dist-info"), "the wheel holds only the package and its metadata"
    with zipfile.ZipFile(dists.wheel) as wheel:
        meta = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        assert "lifemem-ray = lifemem_ray.cli:main" in wheel.read(meta).decode()


def test_every_module_imports_from_the_fresh_environment(venv: Path, cwd: Path):
    got = import_every_module(venv, PACKAGES, cwd=cwd)
    found, failed = got["found"], got["failed"]
    site = venv / "lib"
    strays = {m: f for m, f in found.items() if not Path(f).resolve().is_relative_to(site.resolve())}
    assert not strays, f"modules imported from outside the environment (the checkout?): {strays}"
    for module, why in failed.items():
        missing = (why["missing"] or "").split(".")[0]
        assert why["type"] == "ModuleNotFoundError" and missing in OPTIONAL_IMPORTS, (
            f"{module} does not import from the wheel: {why['type']}: {why['message']}"
        )
    # Every module of the checkout's two trees was found (a subpackage the wheel forgot fails here).
    expected = {f"lifemem_ray.{m}" for m in _modules("lifemem_ray")} | {
        f"lifemem_ray.actors.{m}" for m in _modules("actors")
    }
    # A package that needs an optional package (skyrl_env: skyrl_gym) cannot be walked into: its
    # modules are excused, the package itself was checked above.
    unwalked = {m for m in expected if any(m.startswith(f"{package}.") for package in failed)}
    assert not expected - set(found) - set(failed) - unwalked, (
        f"not found in the wheel: {sorted(expected - set(found) - set(failed) - unwalked)}"
    )
    assert "lifemem_ray.engine.memory" in found and "lifemem_ray.actors.frontdoor.app" in found


def _modules(folder: str) -> set[str]:
    """The dotted module names below ``folder`` of the checkout (packages by their ``__init__``)."""
    names = set()
    for f in _checkout_files(folder):
        if f.endswith(".py"):
            parts = f[:-3].split("/")
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if parts:
                names.add(".".join(parts))
    return names


def test_demo_runs_from_the_fresh_environment(venv: Path, cwd: Path, work: Path):
    done = run_in(
        venv, "lifemem-ray", "demo", "--store", str(work / "demo-store"), "--json", "--quiet", cwd=cwd, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["trajectories"] > 0 and report["clusters"] > 0
    hits = report["retrieval"]["trajectories"]
    assert hits and all(h["env"] == report["query"]["env"] for h in hits)


SHOP = [
    "buy a red wool scarf under 30 dollars",
    "find a waterproof 64 gb usb flash drive",
    "order two packs of aa batteries",
    "get a stainless steel water bottle of one liter",
    "buy noise cancelling headphones under 100 dollars",
    "find a queen size cotton bed sheet set",
]
SQL = [
    "count the orders of every customer",
    "list the employees hired after 2020",
    "find the most expensive product",
    "sum the revenue of each month",
    "delete the duplicate rows of the users table",
    "average the salary by department",
]


def _records() -> list[dict]:
    shop = [
        trajectory_record(f"shop-{i}", "shop", t, [f"search[{t}]", "click[first result]", "click[buy now]"])
        for i, t in enumerate(SHOP)
    ]
    sql = [
        trajectory_record(f"sql-{i}", "sql", t, ["show tables", f"run query: {t}", "answer"]) for i, t in enumerate(SQL)
    ]
    return shop + sql


def test_a_two_shard_memory_serves_from_the_fresh_environment(venv: Path, cwd: Path, work: Path):
    ray_tmp = short_ray_tmpdir()
    dead = plant_dead_address(ray_tmp)  # so serve starts its own head even where other Ray clusters run
    env = clean_env(RAY_TMPDIR=str(ray_tmp))
    data = work / "records.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _records()))
    ns = ["--namespace", NAMESPACE]
    try:
        served = run_in(
            venv,
            "lifemem-ray",
            "serve",
            "--store",
            str(work / "served"),
            "--shards",
            "2",
            *ns,
            "--json",
            cwd=cwd,
            env=env,
            timeout=600,
        )
        assert served.returncode == 0, served.stdout[-2000:] + served.stderr[-4000:]
        info = json.loads(served.stdout)
        assert len(info["shards"]) == 2, info
        assert serve_head_pids(ray_tmp), "serve started its own head and recorded its pid (the marker's name changed?)"
        assert ray_address(ray_tmp) not in (None, dead)
        ingested = run_in(
            venv, "lifemem-ray", "ingest", str(data), *ns, "--json", "--quiet", cwd=cwd, env=env, timeout=600
        )
        assert ingested.returncode == 0, ingested.stderr[-4000:]
        assert json.loads(ingested.stdout)["added"] == len(SHOP) + len(SQL)
        for env_name, tasks in (("shop", SHOP), ("sql", SQL)):
            got = run_in(
                venv,
                "lifemem-ray",
                "retrieve",
                tasks[1],
                "--env",
                env_name,
                "-k",
                "3",
                *ns,
                "--json",
                cwd=cwd,
                env=env,
                timeout=300,
            )
            assert got.returncode == 0, got.stderr[-4000:]
            hits = json.loads(got.stdout)["trajectories"]
            assert hits[0]["id"] == f"{env_name}-1" and hits[0]["task"] == tasks[1], hits
            assert len(hits) == 3 and all(h["env"] == env_name for h in hits)
        address = ray_address(ray_tmp)  # token authentication is on: a client without the token is refused
        assert address and tokenless_client_answer(venv / "bin" / "python", address) == "refused ConnectionError"
        stopped = run_in(venv, "lifemem-ray", "stop", *ns, "--ray", "--json", cwd=cwd, env=env, timeout=300)
        assert stopped.returncode == 0, stopped.stderr[-4000:]
        said = json.loads(stopped.stdout)
        assert said["stopped"] is True and said["ray"].startswith("stopped the local Ray head"), said
    finally:
        leftovers = [pid for pid in serve_head_pids(ray_tmp) if end_head(pid)]
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert not leftovers, f"`lifemem-ray stop --ray` left the head(s) {leftovers} running"
