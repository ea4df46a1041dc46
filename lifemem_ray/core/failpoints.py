"""Named places where a test makes the process die, to prove that an interruption there
leaves nothing half done (the idea of FreeBSD's and TiKV's fail points, kept to one action:
``SIGKILL``, what a crash or an OOM kill does).

A process dies at a fail point only when ``LIFEMEM_FAILPOINTS`` names it (comma-separated);
unset, :func:`failpoint` is one dictionary lookup. Names are ``<operation>.<moment>``.

>>> failpoint("restore.absorbed")  # not named in LIFEMEM_FAILPOINTS: nothing happens
"""

from __future__ import annotations

import os
import signal

__all__ = ["FAILPOINTS_ENV", "failpoint"]

FAILPOINTS_ENV = "LIFEMEM_FAILPOINTS"


def failpoint(name: str) -> None:
    """Die here (``SIGKILL`` to this process) if ``LIFEMEM_FAILPOINTS`` names ``name``."""
    named = os.environ.get(FAILPOINTS_ENV)
    if named and name in {part.strip() for part in named.split(",")}:
        os.kill(os.getpid(), signal.SIGKILL)
