"""Which Ray cluster lifemem-ray joins, and joining it within a bound.

One rule for every place of the project that joins Ray (the command line, ``MemoryClient`` and
``AsyncMemoryClient.connect``, the experiment runner):

1. the address given (``--address``, a ``connect(address=...)`` argument);
2. else ``RAY_ADDRESS``;
3. else the head ``lifemem-ray serve`` started on this machine: our own record of it
   (:data:`HEAD_RECORD`, beside Ray's address file), which counts only while that
   ``ray start`` still runs, in this network namespace and as this user;
4. else nothing: ``serve`` starts a head of its own, ``run`` a Ray of its own, every other
   command fails at once saying how to name a cluster (:class:`ClusterNotNamed`).

Never Ray's ``address="auto"`` (nor ``ray.init()`` without an address when a cluster may
exist): Ray then reads its ``ray_current_cluster`` file, written by anyone's last ``ray start``,
and scans the process table for any raylet's ``--gcs-address``, so it finds the clusters of other
containers and network namespaces that share the process table, and retries an unreachable
one for minutes. ``ray.init`` here is only ever given a concrete ``host:port``.

Joining is bounded: the address is probed with one TCP connection and one HTTP/2 greeting (a Ray
GCS is a gRPC server and answers it at once), then ``ray.init`` runs in a helper thread that
the caller waits for at most :func:`join_timeout_s` seconds. A dead address, a listener that is
not Ray, or one that never completes Ray's handshake fails within seconds naming the address
and who named it; SIGINT and SIGTERM reach the waiting main thread at once. Token
authentication stays on (:func:`~lifemem_ray.actors.cluster.ray_internals.keep_token_auth`).

>>> named_address("10.0.0.5:6379")
RayAddress(address='10.0.0.5:6379', source='--address')
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lifemem_ray.core.errors import InvalidArgumentError, LifeMemError

__all__ = [
    "HEAD_RECORD",
    "JOIN_TIMEOUT_ENV",
    "JOIN_TIMEOUT_S",
    "PROBE_TIMEOUT_S",
    "ClusterNotNamed",
    "ClusterRefused",
    "ClusterUnreachable",
    "HeadRecord",
    "NoRayCluster",
    "RayAddress",
    "address_file",
    "answers",
    "connect",
    "forget_head",
    "head_record_path",
    "join",
    "join_in_flight",
    "join_timeout_s",
    "named_address",
    "own_head",
    "private_ray",
    "python_signal_handlers",
    "record_head",
    "speaks_grpc",
]

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 3.0  # one TCP connection, one HTTP/2 greeting: a live GCS answers both at once
JOIN_TIMEOUT_S = 60.0  # ray.init against a live cluster takes a few seconds; Ray alone retries for minutes
JOIN_TIMEOUT_ENV = "LIFEMEM_RAY_JOIN_TIMEOUT_S"  # overrides JOIN_TIMEOUT_S (a slow network, a loaded head)
HEAD_RECORD = "lifemem-ray-head.json"  # beside Ray's address file: the head `lifemem-ray serve` started here
ADDRESS_ARG, ADDRESS_ENV = "--address", "RAY_ADDRESS"

# The HTTP/2 client preface and an empty SETTINGS frame: a gRPC server answers with its SETTINGS.
_H2_GREETING = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
_H2_SETTINGS = 0x04


class NoRayCluster(LifeMemError, ConnectionError):
    """There is no Ray cluster to join: none is named, or none answers where one is named."""


class ClusterNotNamed(NoRayCluster):
    """Nothing names a Ray cluster (no address given, no ``RAY_ADDRESS``, no head of ours here)."""


class ClusterUnreachable(NoRayCluster):
    """The named address does not answer, is not a Ray cluster, or did not complete Ray's
    handshake within :func:`join_timeout_s`."""


class ClusterRefused(LifeMemError, ConnectionError):
    """A Ray cluster listens at the address but refused this client (almost always its token
    authentication)."""


@dataclass(frozen=True)
class RayAddress:
    """The address a command joins (``host:port``; None: nothing names one) and what named it:
    ``--address``, ``RAY_ADDRESS`` or our record of the head ``serve`` started here."""

    address: str | None
    source: str

    @property
    def ours(self) -> bool:
        """Named by our record of a head ``lifemem-ray serve`` started (not by the user)."""
        return self.address is not None and self.source not in (ADDRESS_ARG, ADDRESS_ENV)


@dataclass(frozen=True)
class HeadRecord:
    """A Ray head ``lifemem-ray serve`` started on this machine: the pid of its
    ``ray start --block``, the address its GCS has, and where it was started from."""

    pid: int
    address: str  # host:port, as Ray reports the GCS address once joined
    port: int  # the GCS port given to `ray start --port`
    cmd: list[str]  # the `ray start` command line
    netns: str  # the network namespace it was started in (/proc/self/ns/net), "" where unknown
    uid: int
    session: str = ""  # its Ray session folder

    def running(self) -> bool:
        """Whether it still is that head, seen from here: its pid runs ``ray start`` with the
        same ``--port``, as this user, and this process is in the same network namespace."""
        if self.netns != this_netns() or self.uid != os.getuid():
            return False
        try:
            argv = Path(f"/proc/{self.pid}/cmdline").read_bytes().split(b"\0")
            owner = os.stat(f"/proc/{self.pid}").st_uid
        except OSError:  # gone (or no /proc: nothing can be checked, so nothing is trusted)
            return False
        words = {a.decode(errors="replace") for a in argv}
        return owner == self.uid and "start" in words and f"--port={self.port}" in words


def this_netns() -> str:
    """This process's network namespace (``net:[4026531992]``), "" where /proc does not say."""
    try:
        return os.readlink("/proc/self/ns/net")
    except OSError:
        return ""


def address_file() -> Path:
    """Where Ray keeps the address of the cluster the last ``ray start`` started (anyone's: it
    names a cluster only as a hint in messages, never one to join)."""
    from lifemem_ray.actors.cluster.ray_internals import address_file as rays

    return rays()


def head_record_path() -> Path:
    """Our record of the head ``lifemem-ray serve`` started here: beside Ray's address file, so it
    follows ``RAY_TMPDIR`` as Ray's own files do."""
    return address_file().parent / HEAD_RECORD


def read_head(path: Path | None = None) -> HeadRecord | None:
    """The head record at ``path`` (default :func:`head_record_path`), running or not; None
    where there is none or it cannot be read."""
    path = head_record_path() if path is None else path
    try:
        data = json.loads(path.read_text())
        return HeadRecord(**{k: data[k] for k in HeadRecord.__dataclass_fields__ if k in data})
    except (OSError, ValueError, TypeError):
        return None


def own_head(path: Path | None = None) -> HeadRecord | None:
    """The head ``lifemem-ray serve`` started here, where it still runs (:meth:`HeadRecord.running`)."""
    record = read_head(path)
    return record if record is not None and record.running() else None


def record_head(record: HeadRecord, path: Path | None = None) -> None:
    """Write ``record`` as the head ``lifemem-ray serve`` started here (replacing an older one).
    A folder that cannot be written is logged: later commands then need ``--address``."""
    path = head_record_path() if path is None else path
    temp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        temp.write_text(json.dumps(asdict(record)))
        temp.replace(path)
    except OSError as exc:
        log.warning(
            "could not record the Ray head in %s (%s); later commands need --address %s", path, exc, record.address
        )


def forget_head(address: str, path: Path | None = None) -> None:
    """Remove our head record where it names ``address`` (a head just stopped)."""
    path = head_record_path() if path is None else path
    record = read_head(path)
    if record is not None and record.address == address:
        try:
            path.unlink()
        except OSError:  # already gone, or not ours to remove
            pass


def split_address(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of ``host:port``, ``[v6]:port`` or ``ray://host:port``; None if it is not one."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host.strip("[]") or "127.0.0.1", int(port)


def concrete(address: str, source: str) -> str:
    """``address`` if it names one cluster (``host:port``); else why not.

    Raises:
        ClusterNotNamed: "auto" or "local", Ray's words for "search this machine" and "start one".
        InvalidArgumentError: anything else that is not ``host:port``.
    """
    if address.strip().lower() in ("auto", "local"):
        raise ClusterNotNamed(
            f"{source} is {address!r}: lifemem-ray joins only a cluster named by its address; give the "
            "head's HOST:PORT (its GCS port, 6379 unless `ray start --port` said otherwise)"
        )
    if split_address(address) is None:
        raise InvalidArgumentError(f"{source} is {address!r}, which is not HOST:PORT; give the Ray head's HOST:PORT")
    return address


def named_address(
    explicit: str | None,
    environ: dict[str, str] | None = None,
    record: Path | None = None,
    *,
    own_head_counts: bool = True,
) -> RayAddress:
    """The cluster to join, by the rule of this module: ``explicit`` (``--address``), else
    ``RAY_ADDRESS`` in ``environ`` (default: this process's), else (where ``own_head_counts``) the
    head recorded at ``record`` (default :func:`head_record_path`) while it runs, else none.
    Ray's own address file and the processes of the machine are never read.

    Args:
        explicit: the address the caller was given, or None.
        environ: the environment to read ``RAY_ADDRESS`` from.
        record: where our head record is.
        own_head_counts: False for a caller that starts a Ray of its own rather than join ours.

    Returns:
        The address (None where nothing names one) and what named it.

    Raises:
        ClusterNotNamed: the given address (or ``RAY_ADDRESS``) is "auto" or "local".
        InvalidArgumentError: it is not ``host:port``.
    """
    env = os.environ if environ is None else environ
    if explicit:
        return RayAddress(concrete(explicit, ADDRESS_ARG), ADDRESS_ARG)
    if env.get(ADDRESS_ENV):
        return RayAddress(concrete(env[ADDRESS_ENV], ADDRESS_ENV), ADDRESS_ENV)
    head = own_head(record) if own_head_counts else None
    if head is not None:
        where = head_record_path() if record is None else record
        return RayAddress(head.address, f"{where} (the Ray head `lifemem-ray serve` started here, pid {head.pid})")
    return RayAddress(None, "")


def answers(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether something accepts TCP connections at ``address`` (``host:port``, or
    ``ray://host:port``) within ``timeout_s``."""
    parts = split_address(address)
    if parts is None:
        return False
    try:
        with socket.create_connection(parts, timeout=timeout_s):
            return True
    except OSError:
        return False


def speaks_grpc(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the server at ``address`` answers an HTTP/2 greeting with its SETTINGS within
    ``timeout_s``, as every gRPC server (a Ray GCS, a Ray Client server) does at once; a plain
    TCP listener, or a server of another protocol, does not. With Ray's TLS on
    (``RAY_USE_TLS``) the greeting would be refused, so only the TCP connection is checked."""
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return answers(address, timeout_s)
    parts = split_address(address)
    if parts is None:
        return False
    deadline = time.monotonic() + timeout_s
    frame = b""
    try:
        with socket.create_connection(parts, timeout=timeout_s) as conn:
            conn.sendall(_H2_GREETING)
            while len(frame) < 9:
                conn.settimeout(max(0.01, deadline - time.monotonic()))
                chunk = conn.recv(9 - len(frame))
                if not chunk:
                    return False
                frame += chunk
    except OSError:
        return False
    return frame[3] == _H2_SETTINGS and frame[5:9] == b"\x00\x00\x00\x00"


def join_timeout_s() -> float:
    """How long a join may take: ``LIFEMEM_RAY_JOIN_TIMEOUT_S`` where set, else :data:`JOIN_TIMEOUT_S`.

    Raises:
        InvalidArgumentError: the variable is not a positive number.
    """
    raw = os.environ.get(JOIN_TIMEOUT_ENV)
    if raw is None or not raw.strip():
        return JOIN_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise InvalidArgumentError(f"{JOIN_TIMEOUT_ENV} is {raw!r}; give a positive number of seconds")
    return value


def join(target: RayAddress, namespace: str | None = None, *, timeout_s: float | None = None, **options: Any) -> str:
    """Join the Ray cluster ``target`` names, or fail within seconds naming it and who named it.

    Probes first (TCP, then the HTTP/2 greeting), keeps token authentication on, then runs
    ``ray.init`` with the concrete address in a helper thread and waits for it at most
    ``timeout_s`` (default :func:`join_timeout_s`); the wait is interruptible (SIGINT, SIGTERM).

    Args:
        target: the address and its source (:func:`named_address`).
        namespace: the Ray namespace to join in.
        timeout_s: the bound on ``ray.init``.
        **options: more ``ray.init`` arguments (defaults: no dashboard, no worker logs, Ray's
            logging at ERROR).

    Returns:
        The GCS address joined (``target.address`` for a ``ray://`` one).

    Raises:
        ClusterNotNamed: ``target`` names nothing.
        ClusterUnreachable: nothing answers there, it is not a Ray cluster, or the join did not
            finish within the bound.
        ClusterRefused: a Ray cluster there refused this client (token authentication).
    """
    import ray

    from lifemem_ray.actors.cluster import ray_internals

    if target.address is None:
        raise ClusterNotNamed(not_named())
    address = target.address
    if not address.startswith("ray://"):
        address = ray_internals.dialled_address(address)  # what ray.init dials: probe that
    if not answers(address):
        raise ClusterUnreachable(dead(target.address, target.source))
    if not speaks_grpc(address):
        raise ClusterUnreachable(not_ray(target.address, target.source))
    ray_internals.keep_token_auth()
    limit = join_timeout_s() if timeout_s is None else timeout_s
    settings = {"include_dashboard": False, "log_to_driver": False, "logging_level": logging.ERROR, **options}
    done, failure = _bounded_init(address, namespace, limit, settings)
    if not done:
        raise ClusterUnreachable(unfinished(target.address, target.source, limit))
    if isinstance(failure, ConnectionError):  # Ray's answer where it could not join
        if answers(address):
            raise ClusterRefused(refused(target.address, target.source)) from None
        raise ClusterUnreachable(dead(target.address, target.source)) from None
    if failure is not None:
        raise ClusterUnreachable(
            f"could not join the Ray cluster at {_named(target.address, target.source)}: "
            f"{type(failure).__name__}: {failure}"
        ) from failure
    if address.startswith("ray://"):
        return address
    return str(ray.get_runtime_context().gcs_address)


def connect(address: str | None = None, namespace: str | None = None, **options: Any) -> RayAddress:
    """Join the cluster this module's rule names (``address``, ``RAY_ADDRESS``, the head
    ``serve`` started here), bounded as :func:`join`: what the clients' ``connect`` calls when
    this process is not connected to Ray yet.

    Args:
        address: the address given, or None.
        namespace: the Ray namespace.
        **options: more ``ray.init`` arguments.

    Returns:
        The address joined and what named it.

    Raises:
        ClusterNotNamed: nothing names a cluster.
        ClusterUnreachable, ClusterRefused: as :func:`join`.
    """
    target = named_address(address)
    if target.address is None:
        raise ClusterNotNamed(not_named())
    join(target, namespace, **options)
    return target


def private_ray(**options: Any) -> Any:
    """Start a new Ray of this process alone (``ray.init(address="local")``): never one found,
    neither ``RAY_ADDRESS`` nor Ray's address file. For benchmarks, tests and ``lifemem-ray run``
    without an address. A SIGTERM handler the caller installed stays (``ray.init`` replaces it
    with one of its own).

    Args:
        **options: ``ray.init`` arguments (``num_cpus``, ``namespace``, ...).

    Returns:
        What ``ray.init`` returns.
    """
    import signal

    import ray

    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    _before_ray_starts_a_worker()
    context = ray.init(address="local", **options)
    if callable(previous):
        signal.signal(signal.SIGTERM, previous)
    return context


_WAIT_SLICE_S = 0.1
_python_signals: list[bool] = [False]  # whether SIGTERM stays Python's here (python_signal_handlers)


def python_signal_handlers(on: bool = True) -> bool:
    """Whether the Ray this process joins or starts from now on leaves SIGTERM to Python's
    handler (no Ray C++ failure-signal handler, which prints a stack and can abort the process
    before the handler's cleanup ran): what the command line wants, so that SIGTERM ends a
    command cleanly; a library caller keeps Ray's default.

    Args:
        on: the new setting.

    Returns:
        The setting before.
    """
    before = _python_signals[0]
    _python_signals[0] = on
    return before


def _before_ray_starts_a_worker() -> None:
    if _python_signals[0]:
        from lifemem_ray.actors.cluster import ray_internals

        ray_internals.keep_python_signal_handlers()


_joining: threading.Thread | None = None  # the last join's thread (one given up on may still run)
_join_lock = threading.Lock()


def join_in_flight() -> bool:
    """Whether a join given up on (timed out, interrupted) is still inside ``ray.init``: this
    process must not call ``ray.shutdown`` or ``ray.init`` beside it."""
    with _join_lock:
        return _joining is not None and _joining.is_alive()


def _no_sigterm_notice(record: logging.LogRecord) -> bool:
    """Drop Ray's notice that a ``ray.init`` outside the main thread sets no SIGTERM handler:
    that is the point here (the caller's handler, or the default, stays)."""
    return not str(record.msg).startswith("SIGTERM handler is not set")


def _bounded_init(
    address: str, namespace: str | None, timeout_s: float, settings: dict[str, Any]
) -> tuple[bool, BaseException | None]:
    """``ray.init(address)`` in a helper thread, waited for at most ``timeout_s``: Ray's own
    connection loop retries for minutes and holds the thread that runs it (signals wait for it).
    A join given up on that still succeeds later disconnects at once.

    Returns:
        Whether ``ray.init`` finished in time, and what it raised (None: joined).

    Raises:
        ClusterUnreachable: an earlier join given up on is still inside ``ray.init``.
    """
    global _joining
    import ray

    with _join_lock:
        if _joining is not None and _joining.is_alive():
            raise ClusterUnreachable(
                f"cannot join Ray at {address!r} yet: {_joining.name} was given up on and has not returned; "
                "try again in a minute"
            )
    worker_log = logging.getLogger("ray._private.worker")
    if _no_sigterm_notice not in worker_log.filters:
        worker_log.addFilter(_no_sigterm_notice)
    _before_ray_starts_a_worker()
    outcome: list[BaseException] = []
    finished, abandoned = threading.Event(), threading.Event()

    def attempt() -> None:
        try:
            ray.init(address=address, namespace=namespace, **settings)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            outcome.append(exc)
            finished.set()
            return
        with _join_lock:
            finished.set()
            late = abandoned.is_set()
        if late:
            ray.shutdown()  # the caller gave up: do not stay connected behind its back

    thread = threading.Thread(target=attempt, name=f"the join of Ray at {address}", daemon=True)
    with _join_lock:
        _joining = thread
    thread.start()
    deadline = time.monotonic() + timeout_s
    try:
        # In slices: a signal delivered to another thread (Ray's, this join's) runs its Python
        # handler only when the main thread next runs Python, which a single long wait delays.
        while not finished.wait(min(_WAIT_SLICE_S, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                break
    finally:
        with _join_lock:
            if not finished.is_set():
                abandoned.set()
    return not abandoned.is_set(), (outcome[0] if outcome else None)


# -- what the messages say ------------------------------------------------------------------------
def not_named() -> str:
    """Why a command has no cluster to join, and how to name one (with the address Ray's file
    holds, as a hint: it may be anyone's)."""
    hint = ""
    try:
        found = address_file().read_text().strip()
    except OSError:
        found = ""
    if found:
        hint = (
            f"; Ray's address file {address_file()} names {found} (the last `ray start` on this machine, "
            f"perhaps another user's or container's): give --address {found} if it is the one"
        )
    return (
        f"no Ray cluster is named: give {ADDRESS_ARG} HOST:PORT or set {ADDRESS_ENV}, or start one with "
        "`lifemem-ray serve --store DIR` (lifemem-ray joins only a cluster named to it, never one it finds by "
        f"searching this machine's processes){hint}"
    )


def _named(address: str, source: str) -> str:
    return f"{address!r} (given by {source})"


def dead(address: str, source: str) -> str:
    """Why a command cannot join ``address`` (named by ``source``): nothing answers there; and what to do."""
    if RayAddress(address, source).ours:
        return (
            f"no Ray cluster answers at {_named(address, source)}: its `ray start` runs but its GCS is gone; "
            "end that pid (SIGTERM) and serve again, or give --address"
        )
    return (
        f"no Ray cluster answers at {_named(address, source)}: check the address, or start the cluster "
        "(`ray start --head`, or `lifemem-ray serve --store DIR` without an address)"
    )


def not_ray(address: str, source: str) -> str:
    """Why a command cannot join ``address``: something listens there, but not a Ray cluster."""
    return (
        f"something listens at {_named(address, source)} but it is not a Ray cluster: it did not answer as a gRPC "
        f"server within {PROBE_TIMEOUT_S:g} s; check the address and port (the head's GCS port, 6379 unless "
        "`ray start --port` said otherwise)"
    )


def unfinished(address: str, source: str, timeout_s: float) -> str:
    """Why a command cannot join ``address``: it answers but did not complete Ray's handshake in time."""
    import ray

    return (
        f"could not join the Ray cluster at {_named(address, source)} within {timeout_s:g} s: it answers but did not "
        f"complete Ray's handshake; check it is a Ray {ray.__version__} head that is up, or allow longer with "
        f"{JOIN_TIMEOUT_ENV}"
    )


def refused(address: str, source: str = ADDRESS_ARG) -> str:
    """Why a listening Ray cluster refused this client: almost always its token authentication."""
    token_env, token_path = os.environ.get("RAY_AUTH_TOKEN"), os.environ.get("RAY_AUTH_TOKEN_PATH")
    default = Path.home() / ".ray" / "auth_token"
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        where = "RAY_AUTH_MODE=disabled here, so no token was sent"
    elif token_env:
        where = "the token in RAY_AUTH_TOKEN was not accepted"
    elif token_path:
        where = f"the token in {token_path} (RAY_AUTH_TOKEN_PATH) was not accepted"
    elif default.is_file():
        where = f"the token in {default} was not accepted"
    else:
        where = f"no token was found (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or {default})"
    return (
        f"the Ray cluster at {_named(address, source)} refused this client (it listens, but the handshake failed: almost "
        f"always Ray's token authentication, and {where}); run `ray get-auth-token` on the cluster's head node "
        f"and set RAY_AUTH_TOKEN to its output (or copy it to {default}), then try again"
    )
