"""One exception root: every error the library raises on purpose is a LifeMemError."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import lifemem_ray.core.errors as errors

ROOT = Path(__file__).resolve().parents[1]


def test_every_error_class_derives_from_the_root():
    classes = [getattr(errors, name) for name in errors.__all__]
    assert all(inspect.isclass(c) and issubclass(c, errors.LifeMemError) for c in classes)
    from lifemem_ray.actors.cluster.remote_errors import OverloadedError
    from lifemem_ray.core.importers import RecordError
    from lifemem_ray.engine.memory import IdConflictError
    from lifemem_ray.engine.memory_config import ConfigError
    from lifemem_ray.engine.store.storage import StoreLockedError

    for cls in (OverloadedError, ConfigError, RecordError, IdConflictError, StoreLockedError):
        assert issubclass(cls, errors.LifeMemError), cls


def test_no_bare_builtin_errors_of_the_runtime_kind_in_library_code():
    pattern = re.compile(r"raise (RuntimeError|Exception)\(")
    offenders = []
    for path in list((ROOT / "lifemem_ray").rglob("*.py")) + list((ROOT / "actors").rglob("*.py")):
        if path.name == "faulty.py":  # injects a broken environment on purpose
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
