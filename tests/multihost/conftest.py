"""The multi-host tests' one session-wide fixture: the wheel of the checkout installed in a
fresh virtual environment, with its ``s3`` extra (``s3fs``: shared logs on S3-compatible
storage), built once per session and used by every host of every module."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.wheel_env import build_dists, fresh_venv

from multihost.harness import namespaces_refused


@pytest.fixture(scope="session")
def venv() -> Iterator[Path]:
    """The environment every host runs Ray and the project from. ``LIFEMEM_MULTIHOST_VENV=DIR``
    reuses one already made with ``wheel_env`` (``fresh_venv(..., extras=["s3"])``)."""
    refused = namespaces_refused()
    if refused:
        pytest.skip(refused)
    given = os.environ.get("LIFEMEM_MULTIHOST_VENV")
    if given:
        yield Path(given)
        return
    work = Path(tempfile.mkdtemp(prefix="lifemem-multihost-"))
    try:
        yield fresh_venv(build_dists(work / "dist").wheel, work / "venv", extras=["s3"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
