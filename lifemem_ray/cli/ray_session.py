"""Joining Ray from the command line, or starting a local head ``lifemem-ray stop --ray`` can stop
alone; and how a command ends on SIGINT or SIGTERM.

Which cluster a command joins is :mod:`lifemem_ray.actors.cluster.ray_address`'s rule
(``--address``, ``RAY_ADDRESS``, the head ``serve`` started here; never Ray's search of the
machine), joined within seconds or not at all, token authentication on. With nothing named,
``serve`` (and ``restore``) start a head of their own; every other command fails at once. A head
a command started is stopped by its pid, never by name: by ``stop --ray``, or at once when the
command that started it fails or is interrupted before it finished."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from types import FrameType
from typing import Any

from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.actors.cluster.ray_address import (
    ClusterNotNamed,
    HeadRecord,
    NoRayCluster,
    RayAddress,
    forget_head,
    join,
    join_in_flight,
    named_address,
    not_named,
    python_signal_handlers,
    record_head,
    this_netns,
)
from lifemem_ray.actors.cluster.ray_address import refused as refused
from lifemem_ray.core.errors import CommandError

__all__ = [
    "HEAD_MARKER",
    "NoRayCluster",
    "command_lifetime",
    "connect",
    "deployment_client",
    "forget_current_cluster",
    "interrupting_signal",
    "refused",
    "start_local_head",
    "stop_local_head",
]

log = logging.getLogger("lifemem_ray.cli")

HEAD_MARKER = "lifemem-ray-head.json"  # in the Ray session folder of a head `serve` started: its record
HEAD_START_S = 180  # `ray start --head` up and joined, on a loaded machine
HEAD_STOP_S = 30  # a head's `ray start --block` stops its Ray processes on SIGTERM within this, else SIGKILL

_started: list[int] = []  # pids of the heads this command started and has not finished with
_signalled: list[int] = []  # the signal that interrupted this command, if one did


def free_port() -> int:
    """A TCP port of this machine nothing listens on now."""
    import socket

    with socket.socket() as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def connect(args: argparse.Namespace, config: DeploymentConfig, *, start_local: bool = False) -> str:
    """Connect this process to the Ray cluster the rule names; with ``start_local`` and nothing
    named, start a local head of our own and join it.

    Args:
        args: the command's arguments (``address``, ``namespace``).
        config: the deployment configuration (its namespace where ``--namespace`` is not given).
        start_local: start a head when nothing names a cluster (``serve --store``, ``restore``).

    Returns:
        The Ray namespace joined.

    Raises:
        ClusterNotNamed: nothing names a cluster (and ``start_local`` is false).
        ClusterUnreachable, ClusterRefused: the named cluster cannot be joined (within seconds,
            naming the address and who named it).
    """
    namespace: str = args.namespace or config.cluster.namespace
    target = named_address(args.address)
    if target.address is None:
        if not start_local:
            raise ClusterNotNamed(not_named())
        start_local_head(namespace)
        return namespace
    join(target, namespace)
    return namespace


def start_local_head(namespace: str) -> None:
    """Start a local Ray head that ``lifemem-ray stop --ray`` can stop alone, join it, and record it.

    ``ray start --block`` runs in a session of its own (its Ray processes are its children and
    end with it) on a free port of ours (not the default 6379 another cluster may hold), with
    token authentication on. Its record (pid, address, network namespace) goes beside Ray's
    address file, where later commands of this machine find it, and into its session folder.

    Args:
        namespace: the Ray namespace to join it in.

    Raises:
        CommandError: the head exited, or did not come up within ``HEAD_START_S``.
    """
    ray = Path(sys.executable).with_name("ray")
    # Token authentication stays on: `ray start` turns it on when a token exists, so make one
    # first where none does (Ray's own command; it keeps an existing token, and prints it: not shown).
    subprocess.run(
        [str(ray), "get-auth-token", "--generate"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=False,
        timeout=60,
    )
    port = free_port()
    cpus = str(max(4, 2 * (os.cpu_count() or 2)))  # logical: the actors reserve fractions, bulk loads need room
    cmd = [str(ray), "start", "--head", "--block", f"--port={port}", f"--num-cpus={cpus}"]
    cmd += ["--include-dashboard=false", "--disable-usage-stats"]
    head = subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    _started.append(head.pid)  # until the command finishes, a failure or an interruption stops it
    try:
        address = wait_for_head(head, port, namespace, cmd)
    except BaseException:
        end_started_heads()
        raise
    from lifemem_ray.actors.cluster import ray_internals

    session = ray_internals.session_dir()
    record = HeadRecord(head.pid, address, port, cmd, this_netns(), os.getuid(), str(session))
    record_head(record)
    (session / HEAD_MARKER).write_text(json.dumps(asdict(record)))


def wait_for_head(head: subprocess.Popen[bytes], port: int, namespace: str, cmd: list[str]) -> str:
    """Join the head ``head`` is starting on ``port`` once its GCS answers; its GCS address.

    Raises:
        CommandError: the head exited, or was not joined within ``HEAD_START_S``.
    """
    from lifemem_ray.actors.cluster.ray_address import ClusterRefused, answers, join_timeout_s

    target = RayAddress(f"127.0.0.1:{port}", "the Ray head this command started")
    deadline = time.monotonic() + HEAD_START_S
    last = "its GCS did not answer"
    while True:
        if head.poll() is not None:
            raise CommandError(
                f"could not start a local Ray head: `{' '.join(cmd)}` exited with code {head.returncode}"
            )
        left = deadline - time.monotonic()
        if left <= 0:
            raise CommandError(f"a local Ray head did not come up within {HEAD_START_S} s ({last})")
        if answers(target.address or ""):
            try:
                return join(target, namespace, timeout_s=min(left, join_timeout_s()), logging_level=logging.WARNING)
            except (NoRayCluster, ClusterRefused) as exc:  # not up yet: Ray's GCS answers before it serves
                last = str(exc)
        time.sleep(1.0)


def stop_local_head() -> str:
    """Stop the Ray head this machine's ``lifemem-ray serve`` started (by its pid), or say why not.

    Returns:
        What was done.

    Raises:
        CommandError: the cluster joined was not started by ``lifemem-ray serve``.
    """
    import ray

    from lifemem_ray.actors.cluster import ray_internals

    session, address = ray_internals.session_dir(), ray.get_runtime_context().gcs_address
    marker = session / HEAD_MARKER
    ray.shutdown()
    if not marker.exists():
        raise CommandError(
            "the Ray cluster was not started by `lifemem-ray serve`, so it is left running; "
            "stop it the way it was started (by its address or pid)"
        )
    pid = int(json.loads(marker.read_text())["pid"])
    try:
        os.kill(pid, signal.SIGTERM)  # ray start --block stops its Ray processes on the way out
    except ProcessLookupError:
        said = "the local Ray head had already stopped"
    else:
        said = wait_gone(pid)
    forget_current_cluster(address)
    forget_head(address)
    return said


def wait_gone(pid: int, timeout_s: float = 60.0) -> str:
    """Wait for the head's ``ray start --block`` to exit; past the timeout, kill its session.

    Args:
        pid: the head's pid (the leader of its own session).
        timeout_s: how long it may take to stop its Ray processes.

    Returns:
        What was done.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return f"stopped the local Ray head (pid {pid})"
        reap(pid)
        time.sleep(0.2)
    try:
        os.killpg(pid, signal.SIGKILL)  # its session: the head and the Ray processes it started, nothing else
    except ProcessLookupError:
        pass
    reap(pid)
    return f"killed the local Ray head (pid {pid}) after {timeout_s:.0f} s"


def reap(pid: int) -> None:
    """Collect ``pid``'s exit status if it is a child of this process that exited (a zombie still
    answers ``kill(pid, 0)``); nothing otherwise."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # not our child (stop --ray of another command's head): nothing to collect
        pass


def forget_current_cluster(address: str, path: Path | None = None) -> None:
    """Remove Ray's "current cluster" file (``path``: Ray's default) when it names the head just
    stopped, as Ray's own stop command does. A file naming another cluster is left alone."""
    if path is None:
        from lifemem_ray.actors.cluster.ray_address import address_file

        path = address_file()
    try:
        if path.read_text().strip() == address:
            path.unlink()
    except OSError:  # no file, or not ours to remove
        pass


def end_started_heads() -> None:
    """Stop the heads this command started and has not finished with (it failed or was
    interrupted): disconnect, then each head by its pid, and forget their records."""
    import ray

    address = ""
    if ray.is_initialized() and not join_in_flight():  # a join still under way ends with the head
        address = ray.get_runtime_context().gcs_address
        try:
            ray.shutdown()
        except Exception as exc:  # noqa: BLE001 - the head goes next either way
            log.debug("ray.shutdown before stopping the head: %s", exc)
    while _started:
        pid = _started.pop()
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
        log.warning("%s, which this command started", wait_gone(pid, HEAD_STOP_S))
    if address:
        forget_current_cluster(address)
        forget_head(address)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    """SIGINT and SIGTERM: both handled as Python handles SIGINT (KeyboardInterrupt in the main
    thread), so every command's cleanup runs; the signal is remembered for the exit status."""
    _signalled.append(signum)
    signal.default_int_handler(signum, frame)


def interrupting_signal() -> int | None:
    """The signal that interrupted this command (``signal.SIGTERM``, ``signal.SIGINT``), if one did."""
    return _signalled[-1] if _signalled else None


@contextmanager
def command_lifetime() -> Iterator[None]:
    """What a command runs in: SIGINT and SIGTERM end it at once through KeyboardInterrupt, and a
    Ray head it started is stopped again, by its pid, unless the command finished.

    Yields:
        Nothing; the command runs inside.
    """
    main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, _interrupt) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
    python_signals = python_signal_handlers(True)  # no Ray C++ handler taking SIGTERM from ours
    try:
        yield
    except BaseException:
        if _started:
            end_started_heads()
        raise
    finally:
        _started.clear()  # finished: the head serve started is the deployment's now
        python_signal_handlers(python_signals)
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def deployment_client(args: argparse.Namespace, config: DeploymentConfig) -> Any:
    """A client of the deployment ``args`` name (joined by :func:`connect`)."""
    from lifemem_ray.actors.client.blocking import MemoryClient

    namespace = connect(args, config)
    return MemoryClient(namespace, config.replace({"cluster.namespace": namespace}))
