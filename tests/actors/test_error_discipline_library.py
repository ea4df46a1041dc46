"""Every deliberate raise of both trees (lifemem_ray/ and actors/) is a LifeMemError: the checker
of tests/docs_and_packaging/test_error_discipline.py over the library. It imports every module
to resolve what is raised, the Ray layer's among them, so it runs with Ray."""

from __future__ import annotations

import ast

from test_error_discipline import ALLOWED, ROOT, bad_raises, library_files, module_namespace


def test_every_deliberate_raise_is_a_lifemem_error():
    offenders, used = [], set()
    for path in library_files():
        source = path.read_text(encoding="utf-8")
        rel = path.relative_to(ROOT).as_posix()
        for line, what, why in bad_raises(source, module_namespace(path, ast.parse(source))):
            if (rel, what) in ALLOWED:
                used.add((rel, what))
            else:
                offenders.append(f"{rel}:{line}: raise {what}: {why}")
    assert not offenders, "raise a lifemem_ray.core.errors class (or add one there):\n" + "\n".join(offenders)
    assert set(ALLOWED) == used, f"allow-list entries no longer needed: {sorted(set(ALLOWED) - used)}"
