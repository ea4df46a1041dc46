"""Separate hosts on one machine, for multi-node tests (issue 25, item 1): each host is a Linux
network namespace with its own address on a private bridge this module creates, and a folder
of its own (its home, its Ray temp folder, its local disk); one folder stands for shared storage.

Node-local disks: every process of host ``i`` (the ``ray start`` of that node and all it spawns,
and every command a test runs there) runs in a private mount namespace in which one agreed path,
:attr:`Hosts.local`, is bind-mounted from that host's own folder (``<top>/host-<i>/local``). A
store under ``hosts.local`` is therefore node-local, like a separate disk: the same path names a
different folder on each host, and the test process outside sees each host's disk at
:meth:`Hosts.local_path`. :attr:`Hosts.shared` is one folder every host sees (shared storage).
The mounts live only in those namespaces: they vanish with the last process of a host.

:class:`Hosts` makes the bridge, the namespaces and their veth pairs (root only), refuses to
start when any of its names or its address range is already in use, and takes down everything
it made on the way out, also when the setup itself fails: the processes of each namespace by
their PIDs (``ip netns pids``; SIGTERM, a grace period, then SIGKILL), the namespaces, the links
and the bridge, and checks that no process still holds a mount of its folders. Processes are
only ever ended by the PIDs their namespaces hold.

:class:`RayNodes` starts Ray on those hosts from a virtual environment holding the installed
wheel (``tests/support/wheel_env.py``): the head in host 0, a worker offering ``lifemem_shard`` in every
other host, token authentication on, the token file handed to each host as an operator would
(``RAY_AUTH_TOKEN_PATH``). Nothing here imports the project.

>>> with Hosts(3) as hosts, RayNodes(hosts, venv) as ray_nodes:          # doctest: +SKIP
...     ray_nodes.run(0, "lifemem-ray", "serve", "--store", str(hosts.local / "store"), ...)
...     hosts.local_path(1, hosts.local / "store" / "shard-00")  # host 1's shard, seen from outside
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from support.wheel_env import clean_env

SUBNET = ipaddress.ip_network("10.213.77.0/24")  # private, and unlikely to be used by anything else
FIRST_HOST = 10  # host i gets SUBNET's address FIRST_HOST + i
IP_TIMEOUT_S = 30  # one `ip` command
KILL_GRACE_S = 10.0  # between SIGTERM and SIGKILL of a namespace's processes
RAY_PORT = 6379  # the head's GCS port: free, since each host has a network namespace of its own
RAY_START_TIMEOUT_S = 180
NODES_JOIN_TIMEOUT_S = 120
OBJECT_STORE_BYTES = 200_000_000  # small: the machine has 2 cores and several nodes
REAPER = Path(__file__).with_name("reaper.py")  # a child subreaper for the head host's Ray (see RayNodes)
SHARD_RESOURCE = "lifemem_shard"  # what the deployment's placement looks for (actors/cluster/deployment.py)


class HostsError(RuntimeError):
    """The harness could not set up, use or take down its hosts; the message says what and why.

    A test helper's own error, deliberately not a ``LifeMemError``: like ``wheel_env``, the
    harness must not depend on the package it tests."""


@dataclass(frozen=True)
class Host:
    """One simulated host: its network namespace, address and folders."""

    index: int
    netns: str  # the network namespace's name
    address: str  # its IPv4 address on the bridge
    folder: Path  # everything of this host: home, Ray's temp folder, its local disk

    @property
    def home(self) -> Path:
        return self.folder / "home"

    @property
    def ray_tmpdir(self) -> Path:
        """Short (Ray's Unix socket paths must stay under 107 characters)."""
        return self.folder / "t"

    @property
    def local(self) -> Path:
        """This host's local disk as the test process (outside every host) sees it; inside the
        host the same folder is mounted at :attr:`Hosts.local`."""
        return self.folder / "local"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip args``; with ``check``, a failure raises :class:`HostsError` with its output."""
    done = subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False, stdin=subprocess.DEVNULL
    )
    if check and done.returncode != 0:
        raise HostsError(f"`ip {' '.join(args)}` exited with code {done.returncode}: {done.stderr.strip()}")
    return done


def _link_exists(name: str) -> bool:
    return _ip("link", "show", "dev", name, check=False).returncode == 0


def _netns_names() -> set[str]:
    """The network namespaces ``ip netns`` knows (the first word of each line)."""
    return {line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()}


def _networks_in_use() -> list[tuple[str, ipaddress.IPv4Network]]:
    """Every IPv4 network of this namespace's addresses and routes, with where it was seen."""
    used: list[tuple[str, ipaddress.IPv4Network]] = []
    for entry in json.loads(_ip("-j", "-4", "addr").stdout or "[]"):
        for info in entry.get("addr_info", []):
            used.append(
                (f"address on {entry['ifname']}", ipaddress.ip_network(f"{info['local']}/{info['prefixlen']}", False))
            )
    for route in json.loads(_ip("-j", "-4", "route", "show", "table", "all").stdout or "[]"):
        dst = route.get("dst", "")
        if dst and dst != "default":
            try:
                used.append((f"route {dst} dev {route.get('dev', '?')}", ipaddress.ip_network(dst, strict=False)))
            except ValueError:  # e.g. a broadcast route's name: not a network
                continue
    return used


def _end_processes(pids: Sequence[int], grace_s: float = KILL_GRACE_S) -> None:
    """SIGTERM each of ``pids``; those still running after ``grace_s``, SIGKILL."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [pid for pid in alive if _running(pid)]
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def mounts_under(folder: Path | str) -> list[str]:
    """Mounts at or below ``folder`` that any process still has (``/proc/<pid>/mountinfo``'s
    mount point, its fifth field), as ``pid: mount point``: a host's bind mount outlives its
    namespace's processes only if a process of that mount namespace is still running."""
    found: list[str] = []
    prefix = str(folder)
    for info in Path("/proc").glob("[0-9]*/mountinfo"):
        try:
            lines = info.read_text().splitlines()
        except OSError:  # the process ended meanwhile
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 4 and (fields[4] == prefix or fields[4].startswith(prefix + "/")):
                found.append(f"{info.parent.name}: {fields[4]}")
    return found


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, already dead but not reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def namespaces_refused() -> str | None:
    """Why this machine cannot make what the harness needs (not root, or a kernel or container
    that refuses network namespaces to root), or None where it can."""
    if os.geteuid() != 0:
        return "the multihost harness needs root (network namespaces, a bridge)"
    probe = f"lmh-probe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if made.returncode != 0:
        return f"this machine refuses network namespaces to root: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=IP_TIMEOUT_S, check=True)
    return None


class Hosts:
    """``n`` hosts on a private bridge, as a context manager; see the module's docstring.

    ``prefix`` names everything made (bridge ``<prefix>-br``, namespaces ``<prefix>-n<i>``,
    links ``<prefix>-v<i>`` / ``<prefix>-e<i>``: at most 15 characters each, so a short one);
    ``subnet`` is the private range of the addresses."""

    def __init__(self, n: int, *, prefix: str = "lmh", subnet: ipaddress.IPv4Network = SUBNET) -> None:
        if not 1 <= n <= 50 or len(prefix) > 8:
            raise HostsError(f"Hosts(n={n}, prefix={prefix!r}): n must be 1..50 and the prefix at most 8 characters")
        self.n, self.prefix, self.subnet = n, prefix, subnet
        self.bridge = f"{prefix}-br"
        base = subnet.network_address
        self.hosts: list[Host] = []
        self.top: Path | None = None  # the temporary folder of all hosts' folders, once made
        self._made_bridge = False
        self._made_netns: list[str] = []
        self._addresses = [str(base + FIRST_HOST + i) for i in range(n)]

    @property
    def shared(self) -> Path:
        """A folder every host sees, standing for shared storage (an NFS mount, say)."""
        assert self.top is not None, "only inside the `with` block"
        return self.top / "shared"

    @property
    def local(self) -> Path:
        """The agreed path of every host's local disk: inside host ``i`` it is that host's own
        folder (:meth:`local_path`); outside every host it is an empty folder."""
        assert self.top is not None, "only inside the `with` block"
        return self.top / "local"

    def local_path(self, i: int, path: Path | str | None = None) -> Path:
        """Where ``path`` (at or under :attr:`local`, as host ``i`` names it; default: the
        whole local disk) lies on host ``i``'s disk, seen from outside every host."""
        inside = Path(path) if path is not None else self.local
        if not inside.is_relative_to(self.local):
            raise HostsError(f"{inside} is not on the hosts' local disk {self.local}: no host-local folder holds it")
        return self.hosts[i].local / inside.relative_to(self.local)

    def __enter__(self) -> Hosts:
        if os.geteuid() != 0:
            raise HostsError("Hosts needs root (network namespaces and a bridge); run the multihost tests as root")
        self._refuse_what_is_in_use()
        try:
            self._set_up()
        except BaseException:
            self.tear_down()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.tear_down()

    def _refuse_what_is_in_use(self) -> None:
        """:class:`HostsError` if the bridge, a namespace, a link or the address range is taken."""
        netns = _netns_names()
        taken = [f"link {self.bridge}"] if _link_exists(self.bridge) else []
        for i in range(self.n):
            taken += [f"network namespace {self._netns(i)}"] if self._netns(i) in netns else []
            taken += [f"link {name}" for name in (f"{self.prefix}-v{i}", f"{self.prefix}-e{i}") if _link_exists(name)]
        taken += [f"{where} overlaps {self.subnet}" for where, net in _networks_in_use() if net.overlaps(self.subnet)]
        if taken:
            raise HostsError(
                f"Hosts({self.n}, prefix={self.prefix!r}) refuses to start: already in use: {'; '.join(taken)}. "
                "Another harness runs, or one was killed before its teardown: remove those (`ip netns del NAME`, "
                "`ip link del NAME`) or pick another prefix/subnet"
            )

    def _netns(self, i: int) -> str:
        return f"{self.prefix}-n{i}"

    def _set_up(self) -> None:
        self.top = Path(tempfile.mkdtemp(prefix=self.prefix, dir="/tmp"))  # short: Ray's socket paths
        self.shared.mkdir()
        self.local.mkdir()  # the mount point: each host mounts its own local disk here
        _ip("link", "add", "name", self.bridge, "type", "bridge")
        self._made_bridge = True
        _ip("link", "set", "dev", self.bridge, "up")
        for i, address in enumerate(self._addresses):
            netns, outside, inside = self._netns(i), f"{self.prefix}-v{i}", f"{self.prefix}-e{i}"
            _ip("netns", "add", netns)
            self._made_netns.append(netns)
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            _ip("link", "set", "dev", outside, "master", self.bridge)
            _ip("link", "set", "dev", outside, "up")
            _ip("link", "set", "dev", inside, "netns", netns)
            _ip("-n", netns, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", inside)
            _ip("-n", netns, "link", "set", "dev", inside, "up")
            _ip("-n", netns, "link", "set", "dev", "lo", "up")
            host = Host(i, netns, address, self.top / f"host-{i}")
            for folder in (host.home, host.ray_tmpdir, host.local):
                folder.mkdir(parents=True)
            self.hosts.append(host)
        self._wait_reachable()

    def _wait_reachable(self, timeout_s: float = 20.0) -> None:
        """Host 0 reaches every other host (the bridge forwards once its ports are up): a TCP
        connection to a port where nothing listens is refused by a host that is reached, and
        times out where none is (no ``ping`` is needed)."""
        deadline = time.monotonic() + timeout_s
        for host in self.hosts[1:]:
            while True:
                probe = self.run(0, sys.executable, "-c", _REACH, host.address, timeout=10, env=dict(os.environ))
                if probe.stdout.strip() == "reached":
                    break
                if time.monotonic() > deadline:
                    raise HostsError(
                        f"host 0 cannot reach {host.address} over {self.bridge}: {probe.stdout}{probe.stderr[-2000:]}"
                    )
                time.sleep(0.5)

    def pids(self, i: int) -> list[int]:
        """The processes running in host ``i``'s network namespace."""
        done = _ip("netns", "pids", self._netns(i), check=False)
        return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []

    def end_processes(self, i: int) -> None:
        """End every process of host ``i`` by its PID (SIGTERM, grace, SIGKILL), until none is left."""
        for _ in range(5):  # a dying process may have started another meanwhile
            pids = [pid for pid in self.pids(i) if _running(pid)]
            if not pids:
                return
            _end_processes(pids)
        raise HostsError(f"host {i} ({self._netns(i)}) still runs processes {self.pids(i)} after SIGKILL")

    def kill_processes(self, i: int) -> int:
        """SIGKILL every process of host ``i`` at once, without warning, as a machine that
        crashes or is preempted (Ray's raylet, its workers, anything a test started there), until
        none is left; returns how many were killed. Its disk (:meth:`local_path`) stays, as a
        crashed machine's disk does; its mount namespace ends with its last process."""
        killed = 0
        for _ in range(10):  # a process may have forked meanwhile
            pids = [pid for pid in self.pids(i) if _running(pid)]
            if not pids:
                return killed
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
        raise HostsError(f"host {i} ({self._netns(i)}) still runs processes {self.pids(i)} after SIGKILL")

    def disconnect(self, i: int) -> None:
        """Take host ``i`` off the bridge (its outside link down): from then on packets to its
        address are dropped, as to a machine that is gone, instead of refused by a live one."""
        _ip("link", "set", "dev", f"{self.prefix}-v{i}", "down")

    def tear_down(self) -> None:
        """Remove everything this harness made (idempotent); errors are collected and raised
        once everything was tried."""
        problems: list[str] = []
        for i, netns in enumerate(self._made_netns):
            try:
                self.end_processes(i)
            except (HostsError, OSError, subprocess.SubprocessError) as exc:
                problems.append(str(exc))
            done = _ip("netns", "del", netns, check=False)
            if done.returncode != 0 and netns in _netns_names():
                problems.append(f"ip netns del {netns}: {done.stderr.strip()}")
        self._made_netns = []
        for i in range(self.n):  # the outside end goes with its namespace; one left over (a failed move) goes here
            if _link_exists(f"{self.prefix}-v{i}"):
                _ip("link", "del", f"{self.prefix}-v{i}", check=False)
        if self._made_bridge:
            done = _ip("link", "del", self.bridge, check=False)
            if done.returncode != 0 and _link_exists(self.bridge):
                problems.append(f"ip link del {self.bridge}: {done.stderr.strip()}")
            self._made_bridge = False
        if self.top is not None:
            problems += [f"still mounted (pid: mount point): {m}" for m in mounts_under(self.top)]
            shutil.rmtree(self.top, ignore_errors=True)
            self.top = None
        if problems:
            raise HostsError("teardown left things behind: " + "; ".join(problems))

    def command(self, i: int, *argv: str | Path) -> list[str]:
        """``argv`` as run in host ``i``: in its network namespace, and in a private mount
        namespace of its own in which :attr:`local` is host ``i``'s local disk (the mount is
        made before ``argv`` starts, and everything ``argv`` spawns inherits it)."""
        return [
            *("ip", "netns", "exec", self._netns(i)),
            *("unshare", "--mount", "--propagation", "private"),
            *("sh", "-c", _MOUNT_LOCAL_THEN_EXEC, "sh", str(self.hosts[i].local), str(self.local)),
            *map(str, argv),
        ]

    def run(
        self, i: int, *argv: str | Path, timeout: float, env: Mapping[str, str] | None = None, cwd: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in host ``i`` (default environment: :meth:`env`, working folder: its home)."""
        return subprocess.run(
            self.command(i, *argv),
            env=dict(env if env is not None else self.env(i)),
            cwd=cwd or self.hosts[i].home,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            stdin=subprocess.DEVNULL,
        )

    def env(self, i: int, **extra: str) -> dict[str, str]:
        """What a shell of host ``i`` has: a clean environment (:func:`wheel_env.clean_env`), its
        own home and Ray temp folder, no inherited Ray token, and ``extra``."""
        host = self.hosts[i]
        env = {k: v for k, v in clean_env().items() if not k.startswith("RAY_")}
        env.update(HOME=str(host.home), RAY_TMPDIR=str(host.ray_tmpdir), OMP_NUM_THREADS="1")
        env.update(extra)
        return env


class RayNodes:
    """Ray on every host of ``hosts``, from ``venv`` (the installed wheel), as a context manager:
    the head in host 0 (``--port port``), a worker offering ``lifemem_shard`` in each other host,
    all with token authentication on and the same token file copied into each host's folder.

    On the way out every host's processes end by PID (Ray's and anything a test started there)."""

    def __init__(
        self,
        hosts: Hosts,
        venv: Path,
        *,
        port: int = RAY_PORT,
        num_cpus: int = 1,
        head_cpus: int = 2,
        env: Mapping[str, str] | None = None,
        head_env: Mapping[str, str] | None = None,
        nodes: int | None = None,
    ) -> None:
        self.hosts, self.venv, self.port, self.num_cpus = hosts, venv, port, num_cpus
        # The head holds the coordinator, the front door's replicas and what `serve` pins to its
        # node; logical CPUs, so 2 here do not take more of the machine than 1.
        self.head_cpus = head_cpus
        self.address = f"{hosts.hosts[0].address}:{port}"
        self.token = secrets.token_hex(32)  # as `ray get-auth-token --generate` makes one
        self.node_env = dict(env or {})  # what every host's shell also has (an operator's credentials, say)
        self.head_env = dict(head_env or {})  # what only the head's `ray start` has (GCS fault tolerance's Redis)
        self.ray_hosts = hosts.hosts[: nodes or len(hosts.hosts)]  # the hosts that run Ray (the others: Redis...)
        self._heads: list[subprocess.Popen[bytes]] = []  # the reaper of each head started (the last: the head now)

    def env(self, i: int, **extra: str) -> dict[str, str]:
        """Host ``i``'s environment for Ray and the project's commands: token authentication on,
        the token from the file handed to that host, and the ``env`` given to every host."""
        token_file = self.hosts.hosts[i].folder / "ray_auth_token"
        own = {**self.node_env, **extra}
        return self.hosts.env(i, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_file), **own)

    def run(self, i: int, program: str, *args: str, timeout: float, **extra: str) -> subprocess.CompletedProcess[str]:
        """Run the environment's ``bin/program`` in host ``i`` with :meth:`env`."""
        return self.hosts.run(i, self.venv / "bin" / program, *args, timeout=timeout, env=self.env(i, **extra))

    def __enter__(self) -> RayNodes:
        try:
            self._start()
        except BaseException:
            self._end()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._end()

    def _start(self) -> None:
        for host in self.hosts.hosts:  # handed to each host as an operator would: a file only root reads
            token_file = host.folder / "ray_auth_token"
            token_file.write_text(self.token)
            token_file.chmod(0o600)
        self._start_head()
        for host in self.ray_hosts[1:]:
            self._ray_start(host.index, *self._worker_args(host.index))
        self._wait_nodes(len(self.ray_hosts))

    def _start_head(self) -> None:
        """``ray start --head --block`` in host 0, under :mod:`reaper` run from outside every host:
        when the head host is killed, its processes are reaped there (not left as zombies
        that a new ``ray start --head`` would take for a GCS still running). Returns once the
        head answers."""
        head = self.hosts.hosts[0]
        argv = self.hosts.command(
            0,
            self.venv / "bin" / "ray",
            "start",
            "--head",
            "--block",
            f"--node-ip-address={head.address}",
            f"--port={self.port}",
            "--include-dashboard=false",
            f"--num-cpus={self.head_cpus}",
            f"--object-store-memory={OBJECT_STORE_BYTES}",
            "--disable-usage-stats",
        )
        log_path = head.folder / f"head-{len(self._heads)}.log"
        with log_path.open("wb") as log_file:
            reaper = subprocess.Popen(
                [sys.executable, str(REAPER), *argv],
                env=self.env(0, **self.head_env),
                cwd=head.home,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
            )
        self._heads.append(reaper)
        deadline = time.monotonic() + RAY_START_TIMEOUT_S
        while True:
            if reaper.poll() is not None:
                raise HostsError(
                    f"the head's `ray start --head --block` exited with code {reaper.returncode}:\n"
                    f"{log_path.read_text(errors='replace')[-4000:]}"
                )
            if self._head_answers():
                return
            if time.monotonic() > deadline:
                raise HostsError(f"the head at {self.address} did not answer within {RAY_START_TIMEOUT_S} s")
            time.sleep(1)

    def _head_answers(self) -> bool:
        """Whether the head lists itself alive (its GCS answers and its raylet registered)."""
        if self.hosts.run(0, sys.executable, "-c", _REACH_PORT, self.address, timeout=30).stdout.strip() != "open":
            return False
        try:
            return any(n["address"] == self.hosts.hosts[0].address for n in self.nodes(timeout=90))
        except (HostsError, subprocess.TimeoutExpired):
            return False

    def kill_head(self) -> int:
        """The head host crashes: every process of host 0 SIGKILLed at once (Ray's GCS, its raylet,
        the actors there, anything a test started there), reaped by its reaper; its disk stays.
        Returns how many processes were killed."""
        killed = self.hosts.kill_processes(0)
        for reaper in self._heads:
            reaper.wait(timeout=120)
        return killed

    def restart_head(self) -> None:
        """``ray start --head`` again on host 0, after :meth:`kill_head`, with the same port, token
        and head environment (the same Redis, for GCS fault tolerance). The dead head's address
        file is removed first: a head machine or pod started anew has none, and ``ray start
        --head`` refuses while it names a GCS address some raylet still names."""
        (self.hosts.hosts[0].ray_tmpdir / "ray" / "ray_current_cluster").unlink(missing_ok=True)
        self._start_head()

    def _worker_args(self, i: int) -> list[str]:
        return [
            f"--address={self.address}",
            f"--node-ip-address={self.hosts.hosts[i].address}",
            f"--resources={json.dumps({SHARD_RESOURCE: 1})}",
            f"--num-cpus={self.num_cpus}",
            f"--object-store-memory={OBJECT_STORE_BYTES}",
            "--disable-usage-stats",
        ]

    def kill_node(self, i: int) -> int:
        """Worker host ``i`` crashes: every process of it SIGKILLed at once, raylet included
        (:meth:`Hosts.kill_processes`); its disk stays. Returns how many processes were killed."""
        if i == 0:
            raise HostsError("kill_node(0) would kill the head: use kill_head()")
        return self.hosts.kill_processes(i)

    def restart_node(self, i: int) -> str:
        """Worker host ``i`` comes back (after :meth:`kill_node`): ``ray start`` again in its
        namespace, over the same local disk; the cluster sees a new node at the same address.
        Returns the new node's id, once the head lists it alive."""
        if i == 0:
            raise HostsError("restart_node(0): use restart_head()")
        before = {n["NodeID"] for n in self.nodes()}
        self._ray_start(i, *self._worker_args(i))
        deadline = time.monotonic() + NODES_JOIN_TIMEOUT_S
        address = self.hosts.hosts[i].address
        while True:
            new = [n for n in self.nodes() if n["address"] == address and n["NodeID"] not in before]
            if new:
                return new[0]["NodeID"]
            if time.monotonic() > deadline:
                raise HostsError(f"host {i} ({address}) did not join again within {NODES_JOIN_TIMEOUT_S} s")
            time.sleep(1)

    def _ray_start(self, i: int, *args: str) -> None:
        done = self.run(i, "ray", "start", *args, timeout=RAY_START_TIMEOUT_S)
        if done.returncode != 0:
            raise HostsError(
                f"`ray start {' '.join(args)}` in host {i} exited with code {done.returncode}:\n"
                f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
            )

    def nodes(self, timeout: float = 120) -> list[dict]:
        """The cluster's live nodes as the head sees them: ``NodeID``, ``address``, ``resources``."""
        done = self.run(0, "python", "-c", _LIVE_NODES, self.address, timeout=timeout)
        if done.returncode != 0:
            raise HostsError(f"could not list the Ray nodes at {self.address}:\n{done.stderr[-4000:]}")
        listed = [line for line in done.stdout.splitlines() if line.startswith("[")]  # Ray may print warnings after it
        if not listed:
            raise HostsError(f"no node list from the head at {self.address}:\n{done.stdout[-2000:]}")
        return json.loads(listed[-1])

    def _wait_nodes(self, count: int) -> None:
        deadline = time.monotonic() + NODES_JOIN_TIMEOUT_S
        while True:
            nodes = self.nodes()
            if len(nodes) >= count:
                return
            if time.monotonic() > deadline:
                raise HostsError(
                    f"only {len(nodes)} of {count} Ray nodes joined within {NODES_JOIN_TIMEOUT_S} s: {nodes}"
                )
            time.sleep(2)

    def _end(self) -> None:
        for host in reversed(self.ray_hosts):  # workers first, the head last
            self.hosts.end_processes(host.index)
        for reaper in self._heads:  # it exits once the head's processes have
            try:
                reaper.wait(timeout=60)
            except subprocess.TimeoutExpired:
                reaper.kill()
                reaper.wait(timeout=60)


# The start of every command in a host (``sh -c`` with $1 the host's local folder, $2 the agreed
# path, then the command): its local disk mounted at the agreed path, then the command itself.
_MOUNT_LOCAL_THEN_EXEC = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'

# Run in a host: "open" when something accepts TCP connections at HOST:PORT.
_REACH_PORT = """
import socket, sys
host, _, port = sys.argv[1].rpartition(":")
try:
    socket.create_connection((host, int(port)), timeout=3).close()
except OSError:
    print("closed")
else:
    print("open")
"""

# Run in host 0: "reached" when the given address answers on the TCP port 9 (refused counts).
_REACH = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], 9), timeout=2).close()
except ConnectionRefusedError:
    print("reached")
except OSError as exc:
    print("unreached", exc)
else:
    print("reached")
"""

# Run by the environment's Python in the head's host: the live nodes, as JSON.
_LIVE_NODES = """
import json, logging, sys, ray
ray.init(address=sys.argv[1], logging_level=logging.ERROR, log_to_driver=False)
print(json.dumps([
    {"NodeID": n["NodeID"], "address": n["NodeManagerAddress"], "resources": n.get("Resources", {})}
    for n in ray.nodes() if n.get("Alive")
]))
"""

# Run by the environment's Python in the head's host: each live named actor and the address and
# node it runs on (Ray's actor table, from the GCS; no dashboard needed). The table does not say
# an actor's namespace: the harness's cluster is private, so a name is the test's own.
ACTOR_PLACES = """
import json, logging, sys, ray
from ray._private import state
ray.init(address=sys.argv[1], namespace=sys.argv[2], logging_level=logging.ERROR, log_to_driver=False)
places = {}
for actor in state.actors().values():
    if actor.get("Name") and actor.get("State") == "ALIVE":
        places[actor["Name"]] = {"address": actor["Address"]["IPAddress"], "NodeID": actor["Address"]["NodeID"]}
print(json.dumps(places))
"""
