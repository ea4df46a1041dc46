"""Joining Ray, or starting a local head ``lifemem-ray stop --ray`` can stop alone: the address
Ray would join is probed first (a dead one is named within seconds), token authentication
stays on, and a head this command line started is stopped by its pid, never by name."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.core.errors import CommandError

log = logging.getLogger("lifemem_ray.cli")

HEAD_MARKER = "lifemem-ray-head.json"  # in the Ray session folder of a head `serve` started: its pid


HEAD_START_S = 180


def free_port() -> int:
    """A TCP port of this machine nothing listens on now."""
    import socket

    with socket.socket() as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


class NoRayCluster(CommandError):
    """No Ray cluster answers where the command would join (nothing to stop, for ``stop``)."""


def connect(args: argparse.Namespace, config: DeploymentConfig, *, start_local: bool = False) -> Any:
    """Connect this process to Ray (the running cluster, or with ``start_local`` a new local head).

    The address Ray would join is probed first (:mod:`lifemem_ray.actors.cluster.ray_address`), so a
    dead one is reported in seconds, naming who named it, instead of Ray retrying it for
    minutes; with ``start_local``, a dead address left in Ray's address file (a crashed head's)
    is passed over and a head of our own started."""
    import ray

    from lifemem_ray.actors.cluster.ray_address import answers, named_address

    namespace = args.namespace or config.cluster.namespace
    target = named_address(args.address)
    if target.address is not None and not answers(target.address):
        if not (start_local and target.from_file):
            raise NoRayCluster(dead(target.address, target.source))
        log.warning(
            "%s names %s, where no Ray cluster answers (a head that is gone); starting a local head",
            target.source,
            target.address,
        )
        start_local_head(namespace)
        return namespace
    try:
        # "auto" unless given: Ray turns its token authentication on by itself only for an address it found.
        ray.init(
            address=args.address or "auto",
            namespace=namespace,
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.ERROR,
        )
    except ConnectionError:
        if target.address is not None and answers(target.address):
            raise CommandError(refused(target.address)) from None
        if not (start_local and target.address is None):
            raise NoRayCluster(
                f"no Ray cluster found at {target.address or 'auto'!r}; start one (`ray start --head`) or "
                "run `lifemem-ray serve`"
            ) from None
        start_local_head(namespace)
    return namespace


def dead(address: str, source: str) -> str:
    """Why a command cannot join ``address`` (named by ``source``), and what to do."""
    if source in ("--address", "RAY_ADDRESS"):
        return (
            f"no Ray cluster answers at {address!r} (given by {source}): check the address, or start the cluster "
            "(`ray start --head`)"
        )
    return (
        f"no Ray cluster answers at {address!r}, which Ray's address file {source} names (left by a head that "
        "is gone): start one (`lifemem-ray serve --store DIR` starts its own), or give --address"
    )


def refused(address: str) -> str:
    """Why a listening Ray cluster refused this client: almost always its token authentication."""
    token_env, token_path = os.environ.get("RAY_AUTH_TOKEN"), os.environ.get("RAY_AUTH_TOKEN_PATH")
    default = Path.home() / ".ray" / "auth_token"
    if token_env:
        where = "the token in RAY_AUTH_TOKEN was not accepted"
    elif token_path:
        where = f"the token in {token_path} (RAY_AUTH_TOKEN_PATH) was not accepted"
    elif default.is_file():
        where = f"the token in {default} was not accepted"
    else:
        where = f"no token was found (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or {default})"
    return (
        f"the Ray cluster at {address!r} refused this client (it listens, but the handshake failed: almost always "
        f"Ray's token authentication, and {where}); "
        "run `ray get-auth-token` on the cluster's head node and set RAY_AUTH_TOKEN to its output (or copy it to "
        f"{default}), then try again"
    )


def start_local_head(namespace: str) -> None:
    """A local Ray head that ``lifemem-ray stop --ray`` can stop alone: ``ray start --block`` in
    a session of its own (its Ray processes are its children and end with it), its pid recorded
    in the head's session folder."""
    import json
    import signal
    import subprocess
    import time

    import ray

    from lifemem_ray.actors.cluster import ray_internals
    from lifemem_ray.actors.cluster.ray_address import answers, named_address

    # Logical CPUs: the deployment's actors reserve fractions, and bulk loads need room beside them.
    cpus = str(max(4, 2 * (os.cpu_count() or 2)))
    # Token authentication stays on: `ray start` turns it on when a token exists, so make one
    # first where none does (Ray's own command; it keeps an existing token, and prints it: not shown).
    subprocess.run(
        [str(Path(sys.executable).with_name("ray")), "get-auth-token", "--generate"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=False,
        timeout=60,
    )
    port = free_port()  # our own port, not the default 6379 another cluster of this machine may hold
    cmd = [
        str(Path(sys.executable).with_name("ray")),
        "start",
        "--head",
        "--block",
        f"--port={port}",
        f"--num-cpus={cpus}",
        "--include-dashboard=false",
        "--disable-usage-stats",
    ]
    head = subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.monotonic() + HEAD_START_S
    while True:
        if head.poll() is not None:
            raise CommandError(
                f"could not start a local Ray head: `{' '.join(cmd)}` exited with code {head.returncode}"
            )
        named = named_address(None).address  # `ray start` writes it once its GCS runs
        try:
            if named and named.endswith(f":{port}") and answers(named):
                ray.init(
                    address="auto",
                    namespace=namespace,
                    include_dashboard=False,
                    log_to_driver=False,
                    logging_level=logging.WARNING,
                )
                break
        except ConnectionError:
            pass  # the new head's GCS does not answer yet: wait for it below
        if time.monotonic() > deadline:
            os.killpg(head.pid, signal.SIGKILL)
            raise CommandError(f"a local Ray head did not come up within {HEAD_START_S} s")
        time.sleep(1.0)
    session = ray_internals.session_dir()
    (session / HEAD_MARKER).write_text(json.dumps({"pid": head.pid, "cmd": cmd}))


def stop_local_head() -> str:
    """Stop the Ray head this machine's ``lifemem-ray serve`` started (by its pid), or say why not."""
    import json
    import signal

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
    return said


def wait_gone(pid: int, timeout_s: float = 60.0) -> str:
    """Wait for the head's ``ray start --block`` to exit; past the timeout, kill its session."""
    import signal
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return f"stopped the local Ray head (pid {pid})"
        time.sleep(0.5)
    os.killpg(pid, signal.SIGKILL)  # its session: the head and the Ray processes it started, nothing else
    return f"killed the local Ray head (pid {pid}) after {timeout_s:.0f} s"


def forget_current_cluster(address: str, path: Path | None = None) -> None:
    """Remove Ray's "current cluster" file (``path``: Ray's default) when it names the head just
    stopped, as Ray's own stop command does: a stale one makes the next plain ``ray.init()``
    try to join the dead cluster. A file naming another cluster is left alone."""
    if path is None:
        from lifemem_ray.actors.cluster.ray_address import address_file

        path = address_file()
    try:
        if path.read_text().strip() == address:
            path.unlink()
    except OSError:  # no file, or not ours to remove
        pass


def deployment_client(args: argparse.Namespace, config: DeploymentConfig) -> Any:
    from lifemem_ray.actors.cluster.client import MemoryClient

    namespace = connect(args, config)
    return MemoryClient(namespace, config.replace({"cluster.namespace": namespace}))
