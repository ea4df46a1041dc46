"""The JVM side of the py4j-based simulators (TextWorldExpress, ScienceWorld).

Both packages start their JVM through py4j with ``die_on_exit``, so a killed worker does
not leave it behind. Here: capping the heap while the JVM starts (``JAVA_TOOL_OPTIONS``
is process-wide, so one lock serves every adapter), stopping it for sure on close, and
:class:`JvmSimulatorEnv`, the base both adapters share: the simulator started on first use,
its process id, closing (twice is safe) and the finaliser.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
from collections.abc import Iterator
from typing import Any, ClassVar

from lifemem_ray.core.errors import EnvUnavailable
from lifemem_ray.lab.envs.base import Environment

__all__ = ["JvmSimulatorEnv", "gateway_process", "java_options", "stop_simulator"]

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


class JvmSimulatorEnv(Environment):
    """An environment over a py4j simulator whose JVM starts at the first use and stops at
    :meth:`close`. A subclass names the simulator (``SIMULATOR``, ``INSTALL``) and says how to
    make it (:meth:`_new_simulator`) with which JVM options (:meth:`_java_options`)."""

    SIMULATOR: ClassVar[str] = ""  # the simulator's name in errors ("TextWorldExpress")
    INSTALL: ClassVar[str] = ""  # what to install when it cannot start

    _simulator: Any = None  # the running simulator (None: not started, or closed)
    _loaded: Any = None  # what the simulator holds loaded now (None: nothing known)
    _task: Any = None  # the episode's task (None: no episode)
    _done: bool = True  # whether the episode has ended

    def _java_options(self) -> str:
        """The JVM's options (its heap cap, its collector)."""
        raise NotImplementedError

    def _new_simulator(self) -> Any:
        """A new simulator object (its constructor starts the JVM)."""
        raise NotImplementedError

    @property
    def jvm_pid(self) -> int | None:
        """The simulator JVM's process id while it runs (for tests and monitoring)."""
        proc = gateway_process(self._simulator)
        return proc.pid if proc is not None and proc.poll() is None else None

    def _sim(self) -> Any:
        """The running simulator; starts the JVM (heap capped) on first use.

        Raises:
            EnvUnavailable: the JVM did not start (no Java 17, no package).
        """
        if self._simulator is None:
            with java_options(self._java_options()):
                try:
                    self._simulator = self._new_simulator()
                except Exception as exc:
                    raise EnvUnavailable(
                        f"{self.name}: cannot start the {self.SIMULATOR} JVM ({type(exc).__name__}: {exc}); "
                        f"needs Java 17: {self.INSTALL}"
                    ) from exc
            self._loaded = None
        return self._simulator

    def close(self) -> None:
        """Stop the JVM and wait for it to exit (kill it if it lingers); safe to call twice."""
        sim, self._simulator = self._simulator, None
        self._loaded = None
        self._task = None
        self._done = True
        if sim is not None:
            self._stop(sim)

    def _stop(self, sim: Any) -> None:
        """Stop a simulator taken out of use (a subclass frees what else it holds)."""
        stop_simulator(sim)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001, S110 - nothing may escape a finaliser
            pass
