"""The public faces (issue 34 item 2): the engine's names from ``lifemem_ray``, the Ray layer's
from ``lifemem_ray.actors``, each imported on first use (``import lifemem_ray`` loads neither
FAISS nor Ray), and every memory (a store, a deployment's clients) with the whole
``MemoryAPI``, ``version()`` included."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys

import pytest

import lifemem_ray
from lifemem_ray.engine.protocols import MemoryAPI


def test_importing_the_package_loads_neither_faiss_nor_ray():
    probe = "import sys, lifemem_ray, lifemem_ray.actors; print(sorted(m for m in ('faiss', 'ray', 'lmdb') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]"


def test_the_engine_and_the_ray_layer_have_short_public_imports():
    from lifemem_ray import LifeMemError, Memory, MemoryConfig, Outcome, Retrieval, Step, Trajectory
    from lifemem_ray.actors import AsyncMemoryClient, DeploymentConfig, MemoryClient, deploy, restore, snapshot, stop
    from lifemem_ray.actors.client.blocking import MemoryClient as DeepClient
    from lifemem_ray.engine.memory import Memory as DeepMemory

    assert Memory is DeepMemory and MemoryClient is DeepClient
    assert issubclass(DeploymentConfig, MemoryConfig) and callable(deploy) and callable(stop)
    assert all(callable(f) for f in (restore, snapshot)) and AsyncMemoryClient.__name__ == "AsyncMemoryClient"
    assert (
        Retrieval.__module__ == "lifemem_ray.engine.retrieval" and LifeMemError.__module__ == "lifemem_ray.core.errors"
    )
    assert {c.__module__ for c in (Outcome, Step, Trajectory)} == {"lifemem_ray.core.model"}
    assert set(lifemem_ray.__all__) <= set(dir(lifemem_ray)) | {"Memory", "MemoryAPI", "Retrieval"}


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Memroy'"):
        lifemem_ray.Memroy  # noqa: B018
    actors = importlib.import_module("lifemem_ray.actors")
    with pytest.raises(AttributeError, match="no attribute 'Client'"):
        actors.Client  # noqa: B018


def _api_methods() -> set[str]:
    return {name for name, _ in inspect.getmembers(MemoryAPI, inspect.isfunction) if not name.startswith("_")}


@pytest.mark.parametrize(
    "path", ["lifemem_ray.Memory", "lifemem_ray.actors.MemoryClient", "lifemem_ray.actors.AsyncMemoryClient"]
)
def test_every_memory_has_the_whole_api(path):
    module, name = path.rsplit(".", 1)
    cls = getattr(importlib.import_module(module), name)
    assert "version" in _api_methods()
    missing = sorted(m for m in _api_methods() if not callable(getattr(cls, m, None)))
    assert not missing, f"{path} lacks {missing}"
