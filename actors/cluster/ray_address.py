"""Which Ray cluster a command would join, who named it, and whether it answers, in seconds.

``ray.init(address="auto")`` joins the address in ``RAY_ADDRESS``, else the one Ray's
``ray_current_cluster`` file names (written by the last ``ray start``). A head that crashed or
was killed leaves that file behind, and Ray then retries the dead address for minutes,
printing only "Failed to connect to GCS". :func:`named_address` reads the same sources in
the same order and :func:`answers` probes the address with one TCP connection, so the CLI can
say at once which address is dead and which file or variable named it, or start a head of
its own instead.

The file's place is Ray's, read through Ray's own helper (no public API says where it is:
:mod:`lifemem_ray.actors.cluster.ray_internals`).

>>> named_address("10.0.0.5:6379")
RayAddress(address='10.0.0.5:6379', source='--address')
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PROBE_TIMEOUT_S", "RayAddress", "address_file", "answers", "named_address"]

PROBE_TIMEOUT_S = 3.0  # one TCP connection attempt: a live GCS accepts at once, a dead local one refuses at once


@dataclass(frozen=True)
class RayAddress:
    """The address a command would join (``host:port``; None: nothing names one) and what named it:
    ``--address``, ``RAY_ADDRESS`` or the address file's path."""

    address: str | None
    source: str

    @property
    def from_file(self) -> bool:
        """Named by Ray's address file, which a dead head leaves behind (not a choice of the user's)."""
        return self.address is not None and self.source not in ("--address", "RAY_ADDRESS")


def address_file() -> Path:
    """Where Ray keeps the address of the cluster the last ``ray start`` started."""
    from lifemem_ray.actors.cluster.ray_internals import address_file as rays

    return rays()


def named_address(explicit: str | None, environ: dict[str, str] | None = None, file: Path | None = None) -> RayAddress:
    """The cluster ``ray.init(address=explicit or "auto")`` would join, in Ray's order:
    ``explicit`` (unless "auto"), ``RAY_ADDRESS``, the address file."""
    env = os.environ if environ is None else environ
    if explicit and explicit != "auto":
        return RayAddress(explicit, "--address")
    if env.get("RAY_ADDRESS"):
        return RayAddress(env["RAY_ADDRESS"], "RAY_ADDRESS")
    path = address_file() if file is None else file
    try:
        text = path.read_text().strip()
    except OSError:
        return RayAddress(None, "")
    return RayAddress(text or None, str(path))


def answers(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether something accepts TCP connections at ``address`` (``host:port``, or
    ``ray://host:port``) within ``timeout_s``."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not port.isdigit():
        return False
    try:
        with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False
