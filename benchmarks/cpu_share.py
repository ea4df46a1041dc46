"""Where a phase's CPU time went, by process kind, read from ``/proc`` (Linux): Ray's actor
processes by their title (``ray::MemoryShard``, ``ray::ServeReplica:...``), Ray's own daemons
(``raylet``, ``gcs_server``) and this benchmark's process. On a 2-core machine every part of a
deployment shares the same cores; this says which part a phase's operations cost the most."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cpu_seconds", "spent"]

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _kind(pid: str) -> str | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    args = [a for a in raw.split(b"\0") if a]
    if not args:
        return None
    first = args[0].decode(errors="replace")
    if pid == str(os.getpid()):
        return "this benchmark"
    if first.startswith("ray::"):  # an actor or task worker: its title
        name = first.split()[0][5:]
        return "ray::" + (name.split(":")[0] if name.startswith("ServeReplica") else name)
    base = os.path.basename(first)
    if base in ("raylet", "gcs_server"):
        return base
    joined = " ".join(a.decode(errors="replace") for a in args[:3])
    return "ray (other)" if "ray" in joined else None


def cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) used so far by each kind of process, summed over its processes."""
    out: dict[str, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        kind = _kind(entry)
        if kind is None:
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[kind] = out.get(kind, 0.0) + (int(fields[11]) + int(fields[12])) / _TICKS
    return out


def spent(before: dict[str, float], after: dict[str, float], per: float = 1.0) -> dict[str, float]:
    """CPU seconds each kind used between two :func:`cpu_seconds` readings, divided by ``per``
    (operations, for seconds an operation), largest first; a process that ended in between is
    left out (its time is not readable)."""
    used = {k: (after[k] - before.get(k, 0.0)) / per for k in after}
    return {k: round(v, 4) for k, v in sorted(used.items(), key=lambda kv: -kv[1]) if v > 0}
