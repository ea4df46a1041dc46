"""Shared fixtures, the ``ray`` marker and the run without Ray.

The folders mirror the layers (tests/core, llm, engine, service, lab, actors, cli, ...). Every test
under a folder of ``RAY_FOLDERS`` is marked ``ray`` here, by its folder: the Ray layer
(tests/actors) and the command line (tests/cli: ``lifemem_ray.cli`` imports the Ray layer). No
other test may need Ray: a run whose marker expression leaves ``ray`` out (``pytest -m "not ray"``),
or any run with ``LIFEMEM_TESTS_WITHOUT_RAY=1``, does not collect those folders and makes ``ray``
and ``lifemem_ray.actors`` unimportable, so a test elsewhere that needs them fails loudly.

Heavy things (the embedding model) start once per session. This module imports neither Ray nor
the Ray layer; the Ray fixtures are in ``support/ray_fixtures.py``, offered by tests/actors and
tests/cli.
"""

from __future__ import annotations

import importlib.abc
import itertools
import os
import re
import sys
from pathlib import Path

import pytest
from _pytest.mark.expression import Expression
from support.common import shared_dir

from lifemem_ray.lab.synthetic import generate, label_vectors

TESTS = Path(__file__).resolve().parent
# The folders whose tests need Ray or import the Ray layer: every test in them is marked `ray`.
RAY_FOLDERS = (TESTS / "actors", TESTS / "cli")
# Opt-in markers: the plain run leaves them out (pyproject's addopts). A -m expression that names
# none of them leaves them out too, so `pytest -m "not ray"` is the plain run without Ray.
OPT_IN = ("slow", "llm_real", "miniwob", "wheel", "multihost", "verl")
WITHOUT_RAY_ENV = "LIFEMEM_TESTS_WITHOUT_RAY"
REFUSED = re.compile(r"(ray|lifemem_ray\.actors)(\..*)?")


def _names(expr: str) -> set[str]:
    return set(re.findall(r"[A-Za-z_][\w.]*", expr)) - {"and", "or", "not"}


def _excludes_ray(expr: str) -> bool:
    """Whether no test marked `ray` can match the marker expression (whatever its other marks)."""
    if not expr.strip():
        return False
    compiled = Expression.compile(expr)
    others = sorted(_names(expr) - {"ray"})
    for marks in itertools.product((False, True), repeat=len(others)):
        held = {"ray", *(name for name, on in zip(others, marks, strict=True) if on)}
        if compiled.evaluate(lambda name, /, held=held, **kwargs: name in held):
            return False
    return True


def without_ray(config: pytest.Config) -> bool:
    return os.environ.get(WITHOUT_RAY_ENV) == "1" or _excludes_ray(config.getoption("markexpr") or "")


class RayRefused(importlib.abc.MetaPathFinder):
    """Refuses ``ray`` and ``lifemem_ray.actors`` (and their submodules), remembering each try."""

    def __init__(self) -> None:
        self.refused: list[str] = []

    def find_spec(self, fullname, path=None, target=None):
        if REFUSED.fullmatch(fullname):
            self.refused.append(fullname)
            raise ImportError(
                f"{fullname}: refused, this test run is without Ray (-m excluding `ray`, or {WITHOUT_RAY_ENV}=1). "
                "A test that needs Ray or the Ray layer belongs under tests/actors (or tests/cli)."
            )
        return None


_GUARD = RayRefused()


def pytest_configure(config: pytest.Config) -> None:
    if not without_ray(config):
        return
    loaded = sorted(m for m in sys.modules if REFUSED.fullmatch(m))
    if loaded:
        raise pytest.UsageError(f"a run without Ray, but these are imported already: {loaded}")
    sys.meta_path.insert(0, _GUARD)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _GUARD in sys.meta_path:
        sys.meta_path.remove(_GUARD)


def _in_ray_folder(path: Path) -> bool:
    return any(path == folder or folder in path.parents for folder in RAY_FOLDERS)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if without_ray(config) and _in_ray_folder(Path(collection_path)):
        return True
    return None


@pytest.hookimpl(tryfirst=True)  # before -m selects: the marks must be there
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _in_ray_folder(Path(item.path)):
            item.add_marker(pytest.mark.ray)
    expr = config.getoption("markexpr") or ""
    if expr.strip() and not _names(expr) & set(OPT_IN):
        kept, dropped = [], []
        for item in items:
            (dropped if any(item.get_closest_marker(m) for m in OPT_IN) else kept).append(item)
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = kept


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _GUARD.refused and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if _GUARD.refused:
        terminalreporter.write_sep("=", "imports refused in a run without Ray", red=True)
        terminalreporter.write_line(
            f"tests outside {', '.join(str(f.relative_to(TESTS.parent)) for f in RAY_FOLDERS)} tried to import: "
            f"{sorted(set(_GUARD.refused))} (move them to the Ray layer's folder)"
        )


@pytest.fixture(scope="session")
def trainset_dir() -> Path:
    path = shared_dir() / "data" / "lifemem-trainset"
    if not path.is_dir():
        pytest.skip(f"shared trajectory data not found at {path}")
    return path


@pytest.fixture(scope="session")
def embedder():
    from lifemem_ray.engine.embedding import MiniLMEmbedder

    return MiniLMEmbedder()


@pytest.fixture(scope="session")
def synthetic():
    """600 labelled synthetic trajectories with direct vectors (no embedding model needed)."""
    trajs = list(generate(600, seed=1, length_scale=0.2))
    vecs = label_vectors([t.metadata["workflow"] for t in trajs], list(range(len(trajs))))
    return trajs, vecs
