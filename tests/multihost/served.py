"""A deployment served on the harness's hosts (``harness.py``), for the node-fault tests and
``benchmarks/durability.py``: ``lifemem-ray serve`` run on the head host with a TOML
configuration file of the caller's settings (as an operator passes ``--config``), an API key
for the REST front door, the CLI's JSON answers, and the jobs of ``memory_load.py`` (load,
checks, measurements) run by the wheel's Python on the head host, blocking or in the
background. Nothing here imports the project.

>>> with Hosts(3) as hosts, RayNodes(hosts, venv) as ray_nodes:          # doctest: +SKIP
...     served = Served.start(hosts, ray_nodes, "faults", {"cluster": {"call_timeout_s": 10}})
...     served.status()["shards"][1]["address"]
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from multihost.harness import ACTOR_PLACES, Hosts, HostsError, RayNodes

HEAD = 0  # the host of the Ray head, `serve`, and every client
HTTP_PORT = 8000
HTTP_TENANT = "acme"  # the tenant of the front door's API key
CLI_TIMEOUT_S = 300  # one lifemem-ray command across the hosts
HTTP_READY_S = 180  # Serve's proxy and the front door's replica, from `serve --http` returning
LOAD_SCRIPT = Path(__file__).with_name("memory_load.py")
CALL_BOUND_S = 30.0  # no caller waits longer than this for an answer, whatever happens to a node

T = TypeVar("T")
_RAY_OWN_LOGS = ("dashboard", "event", "gcs_server", "raylet", "monitor", "log_monitor", "runtime_env", "controller")


def wait_until(what: str, timeout_s: float, probe: Callable[[], T | None], every_s: float = 2.0) -> T:
    """``probe()``'s first answer that is not None, tried every ``every_s`` (HostsError naming
    ``what`` after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = probe()
        if found is not None:
            return found
        if time.monotonic() > deadline:
            raise HostsError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(every_s)


def read_events(path: Path) -> list[dict[str, Any]]:
    """The calls a ``load`` job made so far (``memory_load.py``), one dict each."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def unclear_answers(rows: list[dict[str, Any]], bound_s: float = CALL_BOUND_S) -> list[dict[str, Any]]:
    """The calls that took longer than ``bound_s``, or failed other than clearly: a REST answer
    other than 200 must be 503 ``unavailable`` with ``Retry-After``, a client's error a
    ``ShardUnavailableError``."""
    unclear = []
    for row in rows:
        rest_ok = row.get("status") == 200 or (
            row.get("status") == 503 and row.get("retry_after") and '"type": "unavailable"' in row.get("why", "")
        )
        client_ok = row.get("error") in (None, "ShardUnavailableError")
        if row["s"] > bound_s or not (rest_ok if row["via"] == "rest" else client_ok):
            unclear.append(row)
    return unclear


def acknowledged_adds(rows: list[dict[str, Any]]) -> int:
    return sum(1 for row in rows if row["op"] == "add" and row.get("status") == 200)


def wait_for_more_adds(events_file: Path, within_s: float = 60.0) -> None:
    """Until the load in ``events_file`` acknowledged another add (the memory serves it again)."""
    count = acknowledged_adds(read_events(events_file))
    wait_until("adds acknowledged again", within_s, lambda: acknowledged_adds(read_events(events_file)) > count or None)


def toml_text(settings: dict[str, dict[str, Any]]) -> str:
    """``{"cluster": {"shards": 2}}`` as TOML (strings, numbers and booleans only)."""
    lines = []
    for section, values in settings.items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            lines.append(f"{key} = {json.dumps(value)}")  # a JSON string, number or boolean is TOML too
    return "\n".join(lines) + "\n"


def answer_of(done: subprocess.CompletedProcess[str], what: str) -> Any:
    """The JSON ``done`` printed (all its output, or else its last line), once it exited 0
    (else a HostsError with its output)."""
    if done.returncode != 0:
        raise HostsError(f"{what} exited with code {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    lines = done.stdout.splitlines()
    # Whole, or from the first line that opens an object (Ray may print a warning before it),
    # or its last line (a job's answer after its own output).
    starts = [0] + [i for i, line in enumerate(lines) if line.startswith("{")] + [len(lines) - 1]
    for start in starts:
        try:
            return json.loads("\n".join(lines[start:]))
        except ValueError:
            continue
    raise HostsError(f"{what} printed no JSON:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")


@dataclass
class Job:
    """A ``memory_load.py`` job running in the background on the head host; its output goes to
    files (``<output>.out``, ``.err``), so a chatty job never blocks on a full pipe."""

    name: str
    process: subprocess.Popen[bytes]
    output: Path

    def wait(self, timeout: float) -> Any:
        """Its JSON answer, once it ended (HostsError if it failed or ran past ``timeout``)."""
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=30)
            raise HostsError(f"job {self.name} still ran after {timeout:.0f} s:\n{self._tail()}") from None
        stdout, stderr = (self.output.with_suffix(s).read_text(errors="replace") for s in (".out", ".err"))
        done = subprocess.CompletedProcess(self.process.args, self.process.returncode, stdout, stderr)
        return answer_of(done, f"job {self.name}")

    def _tail(self) -> str:
        return "\n".join(self.output.with_suffix(s).read_text(errors="replace")[-4000:] for s in (".out", ".err"))


@dataclass
class Served:
    """A deployment ``lifemem-ray serve`` started on the head host in Ray namespace ``namespace``."""

    hosts: Hosts
    ray_nodes: RayNodes
    namespace: str
    served: dict  # serve's JSON answer: shards, nodes, store, http
    api_key: str  # the front door's key, of HTTP_TENANT (read, write)
    settings: dict[str, dict[str, Any]]  # its configuration file's tables

    @classmethod
    def start(
        cls,
        hosts: Hosts,
        ray_nodes: RayNodes,
        namespace: str,
        settings: dict[str, dict[str, Any]],
        *,
        shards: int = 2,
        http: bool = True,
    ) -> Served:
        """``serve --shards N --store <local>/<namespace> --config FILE [--http]`` on the head,
        the front door (when ``http``) up and answering ``/healthz``."""
        head = hosts.hosts[HEAD]
        key = answer_of(
            ray_nodes.run(
                HEAD,
                "lifemem-ray",
                "keys",
                "new",
                "--tenant",
                HTTP_TENANT,
                "--scopes",
                "read,write",
                "--json",
                timeout=120,
            ),
            "keys new",
        )
        keys_file = head.folder / f"api_keys-{namespace}.json"
        keys_file.write_text(json.dumps([key["entry"]]))
        config = head.folder / f"{namespace}.toml"
        config.write_text(toml_text(settings))
        serve = ["serve", "--shards", str(shards), "--store", str(hosts.local / namespace), "--config", str(config)]
        if http:
            serve += ["--http", "--host", "0.0.0.0", "--port", str(HTTP_PORT)]
        ns = ["--address", ray_nodes.address, "--namespace", namespace, "--json"]
        served = answer_of(
            ray_nodes.run(HEAD, "lifemem-ray", *serve, *ns, timeout=CLI_TIMEOUT_S, LIFEMEM_API_KEYS=str(keys_file)),
            "serve",
        )
        out = cls(hosts, ray_nodes, namespace, served, key["key"], settings)
        if http:
            out.wait_http()
        return out

    @property
    def url(self) -> str:
        """The front door at the head's address on the bridge."""
        return f"http://{self.hosts.hosts[HEAD].address}:{HTTP_PORT}"

    @property
    def store(self) -> Path:
        """The store folder as every host names it (node-local)."""
        return Path(self.served["store"])

    def lifemem(self, *args: str, timeout: float = CLI_TIMEOUT_S) -> Any:
        """``lifemem-ray ARGS --json`` against the deployment, run on the head host; its JSON answer."""
        ns = ["--address", self.ray_nodes.address, "--namespace", self.namespace, "--json"]
        return answer_of(self.ray_nodes.run(HEAD, "lifemem-ray", *args, *ns, timeout=timeout), f"lifemem-ray {args[0]}")

    def status(self) -> dict[str, Any]:
        """``lifemem-ray status --json``: per shard its node, address, health, durability."""
        return self.lifemem("status", timeout=120)

    def wait_http(self) -> None:
        deadline = time.monotonic() + HTTP_READY_S
        while True:
            done = self.ray_nodes.run(HEAD, "python", "-c", _HEALTHZ, self.url, timeout=60)
            if done.returncode == 0 and done.stdout.strip().endswith("200"):
                return
            if time.monotonic() > deadline:
                raise HostsError(f"the front door at {self.url} did not answer within {HTTP_READY_S} s: {done.stdout}")
            time.sleep(2)

    def spec(self, **spec: Any) -> dict[str, Any]:
        """A job's spec: the deployment's address, namespace, key and call timeout, and ``spec``."""
        timeout = self.settings.get("cluster", {}).get("call_timeout_s", 600)
        base = {"address": self.ray_nodes.address, "namespace": self.namespace, "url": self.url}
        return {**base, "key": self.api_key, "settings": {"cluster.call_timeout_s": timeout}, **spec}

    def job(self, name: str, timeout: float, **spec: Any) -> Any:
        """Run job ``name`` of ``memory_load.py`` on the head host; its JSON answer."""
        done = self.ray_nodes.run(
            HEAD, "python", str(LOAD_SCRIPT), name, json.dumps(self.spec(**spec)), timeout=timeout
        )
        return answer_of(done, f"job {name}")

    def start_job(self, name: str, host: int = HEAD, **spec: Any) -> Job:
        """Job ``name`` started in the background on ``host`` (default: the head; see :meth:`Job.wait`)."""
        argv = [self.ray_nodes.venv / "bin" / "python", LOAD_SCRIPT, name, json.dumps(self.spec(**spec))]
        output = self.hosts.hosts[host].home / f"job-{name}-{time.time_ns()}"
        with output.with_suffix(".out").open("wb") as out, output.with_suffix(".err").open("wb") as err:
            process = subprocess.Popen(
                self.hosts.command(host, *argv),
                env=self.ray_nodes.env(host),
                cwd=self.hosts.hosts[host].home,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
            )
        return Job(name, process, output)

    def start_load(
        self, prefix: str, seconds: float, http_timeout_s: float, *, host: int = HEAD, client_adds: bool = False
    ) -> tuple[Job, Path, Path]:
        """The mixed REST and MemoryClient load of the fault tests (tenant ``acme``, batches of 8,
        a pause of 2 s after a refusal, 120 s to settle) started in the background on ``host``
        (``client_adds``: adds alternate between REST and a ``MemoryClient``); returns the job,
        its events file and the file that stops it when written."""
        home = self.hosts.hosts[host].home
        events_file, stop_file = home / f"{prefix}-events.jsonl", home / f"{prefix}-stop"
        job = self.start_job(
            "load",
            host,
            client_adds=client_adds,
            tenant="acme",
            prefix=prefix,
            batch=8,
            seconds=seconds,
            max_batches=5000,
            pause_s=2,
            settle_s=120,
            http_timeout_s=http_timeout_s,
            stop_file=str(stop_file),
            events=str(events_file),
        )
        return job, events_file, stop_file

    def aftermath(self, events: list[dict[str, Any]]) -> dict[str, Any]:
        """What a fault test checks once its load ended: ``stats``, ``check --deep`` and, where
        a call's answer was unclear, the Ray errors on record."""
        return {
            "stats": self.lifemem("stats"),
            "checked": self.lifemem("check", "--deep"),
            "ray_errors": self.ray_errors() if unclear_answers(events) else [],
        }

    def actor_places(self) -> dict[str, dict]:
        """Where each live named actor runs, from Ray's actor table: name -> address, NodeID."""
        done = self.ray_nodes.run(
            HEAD, "python", "-c", ACTOR_PLACES, self.ray_nodes.address, self.namespace, timeout=120
        )
        return answer_of(done, "the actor table")

    def front_door_hosts(self) -> list[int | None]:
        """The hosts the front door's Serve replicas run on."""
        places = self.actor_places()
        return [self.host_of(place["address"]) for name, place in places.items() if name.startswith("SERVE_REPLICA")]

    def host_of(self, address: str | None) -> int | None:
        return next((h.index for h in self.hosts.hosts if h.address == address), None)

    def stop(self) -> dict[str, Any]:
        return self.lifemem("stop")

    def ray_errors(self, limit: int = 6, lines_after: int = 40) -> list[str]:
        """Tracebacks in every host's Ray logs of this session (each with the file it is in and
        ``lines_after`` lines; not those of Ray's own processes), for a failure's report: the
        first ``limit`` found, those of the front door's replicas first (an HTTP 500 is theirs)."""
        paths = [
            (host.index, path)
            for host in self.hosts.hosts
            for path in (host.ray_tmpdir / "ray" / "session_latest" / "logs").rglob("*")
            if path.is_file() and not path.name.startswith(_RAY_OWN_LOGS)  # Ray's own: a lost node's noise
        ]
        paths.sort(key=lambda found: (not found[1].name.startswith("replica_"), found[0], found[1].name))
        found: list[str] = []
        for index, path in paths:
            try:
                lines = path.read_text(errors="replace").splitlines()
            except OSError:
                continue
            for i, line in enumerate(lines):
                if "Traceback" in line and len(found) < limit:
                    found.append(f"host {index} {path.name}:\n" + "\n".join(lines[max(0, i - 3) : i + lines_after]))
        return found

    def head_log(self, needle: str, limit: int = 40) -> list[str]:
        """The lines of the head's Ray logs (this session's) holding ``needle``: what the
        coordinator's shard keeper did, say."""
        logs = self.hosts.hosts[HEAD].ray_tmpdir / "ray" / "session_latest" / "logs"  # $RAY_TMPDIR/ray
        found = []
        for path in sorted(logs.glob("*.err")) + sorted(logs.glob("*.out")) + sorted(logs.glob("*.log")):
            try:
                found += [line for line in path.read_text(errors="replace").splitlines() if needle in line]
            except OSError:
                continue
        return found[-limit:]


# Run by the environment's Python on the head host: the front door's /healthz status.
_HEALTHZ = """
import sys, urllib.error, urllib.request
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
try:
    print(opener.open(sys.argv[1] + "/healthz", timeout=20).status)
except urllib.error.HTTPError as exc:
    print(exc.code)
except OSError as exc:
    print("unreached", exc)
"""
