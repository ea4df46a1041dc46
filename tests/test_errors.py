"""One exception root: every error the library raises on purpose is a LifeMemError."""

from __future__ import annotations

import inspect

import lifemem_ray.core.errors as errors


def test_every_error_class_derives_from_the_root():
    classes = [getattr(errors, name) for name in errors.__all__]
    assert all(inspect.isclass(c) and issubclass(c, errors.LifeMemError) for c in classes)
    from lifemem_ray.actors.cluster.remote_errors import OverloadedError
    from lifemem_ray.core.errors import IdConflictError
    from lifemem_ray.core.importers import RecordError
    from lifemem_ray.engine.memory_config import ConfigError
    from lifemem_ray.engine.store.storage import StoreLockedError

    for cls in (OverloadedError, ConfigError, RecordError, IdConflictError, StoreLockedError):
        assert issubclass(cls, errors.LifeMemError), cls


# Every raise of library code is checked by tests/test_error_discipline.py (an AST walk).
