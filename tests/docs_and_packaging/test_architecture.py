"""The folder tree is the architecture, and a machine refuses code that breaks its order: the
import contracts of pyproject.toml ([tool.importlinter]: the layers, no Ray below the Ray
layer, no HTTP or MCP in the engine, no import cycles), checked by import-linter over the
installed layout (actors/ is installed as lifemem_ray.actors), and no module name repeated
across layers."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def installed_layout(tmp: Path) -> Path:
    """A folder holding ``lifemem_ray`` as a wheel installs it: a copy of lifemem_ray/ with
    actors/ inside it as ``actors`` (what setup.py's package_dir does)."""
    target = tmp / "lifemem_ray"
    shutil.copytree(ROOT / "lifemem_ray", target, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "actors", target / "actors", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp


def lint_imports(site: Path, config: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("lint-imports")
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run(
        [str(exe), "--config", str(config), "--no-cache"],
        cwd=site,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_import_contracts_hold(tmp_path):
    done = lint_imports(installed_layout(tmp_path), ROOT / "pyproject.toml")
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "Contracts: 6 kept, 0 broken" in done.stdout, done.stdout[-3000:]


def test_a_forbidden_import_is_refused(tmp_path):
    """The contracts can fail: an engine module that imports Ray breaks two of them."""
    site = installed_layout(tmp_path)
    probe = site / "lifemem_ray" / "engine" / "ray_probe.py"
    probe.write_text(
        "def f():\n    import ray  # lazily: still an import\n    from lifemem_ray.actors.cluster import client\n"
    )
    done = lint_imports(site, ROOT / "pyproject.toml")
    assert done.returncode != 0
    assert "BROKEN" in done.stdout and "lifemem_ray.engine.ray_probe" in done.stdout, done.stdout[-3000:]


def test_no_module_name_repeats_across_layers():
    names = Counter(
        p.stem
        for tree in ("lifemem_ray", "actors")
        for p in (ROOT / tree).rglob("*.py")
        if p.stem not in ("__init__", "__main__") and "envs" not in p.parts
    )
    assert [name for name, n in names.items() if n > 1] == []


FACADES = {"lifemem_ray.engine.memory": {"Memory"}}  # a façade's module -> what may be imported from it


def test_nothing_is_imported_through_a_facade_but_the_facade():
    """The engine's façade module gives ``Memory`` alone: its parts are imported from where
    they are defined, so the Ray layer, the CLI and the tests never depend on what the façade
    happens to import (read from every module's source, lazy imports included)."""
    import ast

    found = []
    for tree_root in ("lifemem_ray", "actors", "tests", "benchmarks"):
        for path in (ROOT / tree_root).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and node.module in FACADES:
                    extra = {alias.name for alias in node.names} - FACADES[node.module]
                    if extra:
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {sorted(extra)} from {node.module}")
    assert not found, "import these from the modules that define them:\n" + "\n".join(found)
    from lifemem_ray.engine import memory

    assert memory.__all__ == ["Memory"]
