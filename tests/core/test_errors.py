"""One exception root: every error the library raises on purpose is a LifeMemError."""

from __future__ import annotations

import inspect

import lifemem_ray.core.errors as errors


def test_every_error_class_derives_from_the_root():
    classes = [getattr(errors, name) for name in errors.__all__]
    assert all(inspect.isclass(c) and issubclass(c, errors.LifeMemError) for c in classes)
    from lifemem_ray.core.errors import IdConflictError
    from lifemem_ray.core.importers import RecordError
    from lifemem_ray.engine.memory_config import ConfigError
    from lifemem_ray.engine.store.storage import StoreLockedError

    for cls in (ConfigError, RecordError, IdConflictError, StoreLockedError):
        assert issubclass(cls, errors.LifeMemError), cls


# Every raise of library code is checked by tests/actors/test_error_discipline_library.py (an AST walk;
# the checker: tests/docs_and_packaging/test_error_discipline.py).
