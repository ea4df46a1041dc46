"""The JVM side of the py4j-based simulators (TextWorldExpress, ScienceWorld).

Both packages start their JVM through py4j with ``die_on_exit``, so a killed worker does
not leave it behind. Here: capping the heap while the JVM starts (``JAVA_TOOL_OPTIONS``
is process-wide, so one lock serves every adapter) and stopping it for sure on close.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["gateway_process", "java_options", "stop_simulator"]

_LOCK = threading.Lock()


@contextlib.contextmanager
def java_options(ours: str) -> Iterator[None]:
    """``JAVA_TOOL_OPTIONS`` = ours, then the user's own (later options win), for the
    duration of a JVM start; restored afterwards."""
    with _LOCK:
        previous = os.environ.get("JAVA_TOOL_OPTIONS")
        os.environ["JAVA_TOOL_OPTIONS"] = f"{ours} {previous}" if previous else ours
        try:
            yield
        finally:
            if previous is None:
                os.environ.pop("JAVA_TOOL_OPTIONS", None)
            else:
                os.environ["JAVA_TOOL_OPTIONS"] = previous


def gateway_process(sim: Any) -> subprocess.Popen | None:
    """The JVM process behind a simulator object's py4j gateway, if any."""
    return getattr(getattr(sim, "_gateway", None), "java_process", None)


def stop_simulator(sim: Any, timeout_s: float = 5.0) -> None:
    """Close the simulator's gateway, then wait for its JVM to exit (kill it if it lingers)."""
    proc = gateway_process(sim)
    try:
        sim.close()
    except Exception:  # noqa: BLE001, S110 - a dead gateway: the process is handled below
        pass
    sim.close = lambda: None  # the packages' __del__ call close() again
    if proc is None:
        return
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout_s)
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()
