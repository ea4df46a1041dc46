"""The multi-host harness (issue 25, item 1) and a real deployment on it (item 2): three hosts,
each a network namespace with its own address on a private bridge and a local disk of its own
(a mount namespace), Ray from the wheel installed in a fresh virtual environment, token
authentication on. ``lifemem-ray serve --shards 2 --http`` run on the head host puts its store
on the node-local path: each shard on its own worker host and disk, the routing table on the
head's. From the head, the CLI, the REST front door (over HTTP to the head's address) and a
``MemoryClient`` ingest and retrieve; ``stats``, ``check --deep`` and ``snapshot`` (into the
shared folder) work across the hosts.

One set of hosts, Ray nodes and deployment serves the whole module (module-scoped fixtures):
each test adds ids of its own and records what was acknowledged (:attr:`Deployment.acknowledged`),
so counts are checked against everything acknowledged so far, in whatever order tests run.

Root and minutes (the build, the install, three Ray nodes): behind the ``multihost`` marker,
``pytest -m multihost tests/multihost``. ``LIFEMEM_MULTIHOST_VENV=DIR`` reuses an environment
already made with ``tests/support/wheel_env.py`` (for a quicker rerun while developing)."""

from __future__ import annotations

import ipaddress
import json
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from support.wheel_env import trajectory_record

from multihost.harness import ACTOR_PLACES, Hosts, HostsError, RayNodes, mounts_under, namespaces_refused

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(2400)]

NAMESPACE = "multihost"
HEAD = 0  # the host that runs the Ray head, `serve` and every client of these tests
SHARDS = 2
COORDINATOR = "lifemem-coordinator"  # the deployment's actor names (actors/cluster/deployment.py)
CLI_TIMEOUT_S = 300  # one lifemem-ray command across the hosts
HTTP_PORT = 8000
HTTP_READY_S = 180  # Serve's proxy and the front door's replica, from `serve --http` returning
HTTP_TENANT = "acme"  # the tenant of the front door's API key
CLIENT_TENANT = "lab"  # the tenant of the MemoryClient's trajectories
TASKS = {
    "shop": ["buy a red wool scarf", "order two packs of aa batteries", "find a one liter water bottle"],
    "sql": ["count the orders of every customer", "list the employees hired after 2020", "find the priciest product"],
}


def skip_unless_namespaces_work() -> None:
    """Skip (with the reason) where this machine cannot make what the harness needs: not root,
    or a kernel or container that refuses network namespaces or bridges to root."""
    refused = namespaces_refused()
    if refused:
        pytest.skip(refused)


def _records(prefix: str) -> list[dict]:
    """One trajectory per task of :data:`TASKS`, with ids ``<prefix>-<env>-<i>``."""
    return [
        trajectory_record(f"{prefix}-{env}-{i}", env, task, [f"step one of {task}", "step two", "finish"])
        for env, tasks in TASKS.items()
        for i, task in enumerate(tasks)
    ]


def _ok(done: subprocess.CompletedProcess[str], what: str, *, last_line: bool = False) -> Any:
    """The JSON ``done`` printed (``last_line``: on its last line), once it exited 0 (else the
    assertion shows its output)."""
    assert done.returncode == 0, (
        f"{what} exited with code {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    )
    return json.loads(done.stdout.strip().splitlines()[-1] if last_line else done.stdout)


@dataclass
class Deployment:
    """The module's deployment, started by ``lifemem-ray serve`` on the head host, and what the
    tests had acknowledged so far (tenant -> ids)."""

    hosts: Hosts
    ray_nodes: RayNodes
    served: dict  # serve's JSON answer: shards, nodes, store, http
    api_key: str  # the front door's key, of HTTP_TENANT (read, write)
    acknowledged: dict[str, set[str]] = field(default_factory=dict)

    @property
    def store(self) -> Path:
        """The store folder as every host names it (under ``hosts.local``: node-local)."""
        return Path(self.served["store"])

    @property
    def url(self) -> str:
        """The front door at the head's address on the bridge."""
        return f"http://{self.hosts.hosts[HEAD].address}:{HTTP_PORT}"

    def lifemem(self, *args: str) -> Any:
        """``lifemem-ray ARGS`` against the deployment, run on the head host; its JSON answer."""
        ns = ["--address", self.ray_nodes.address, "--namespace", NAMESPACE, "--json"]
        return _ok(self.ray_nodes.run(HEAD, "lifemem-ray", *args, *ns, timeout=CLI_TIMEOUT_S), f"lifemem-ray {args[0]}")

    def python(self, script: str, *args: str) -> Any:
        """``script`` run by the environment's Python on the head host; the JSON it printed last."""
        return _ok(
            self.ray_nodes.run(HEAD, "python", "-c", script, *args, timeout=CLI_TIMEOUT_S),
            "python on the head",
            last_line=True,
        )

    def http(self, method: str, path: str, body: Any = None, *, wait_s: float = 0.0) -> tuple[int | None, Any]:
        """One request to the front door from the head host, with the key; (status, answer).
        ``wait_s``: retried until it answers 200 or that long passed (a front door starting)."""
        sent = json.dumps(body) if body is not None else ""
        answer = self.python(_HTTP_CALL, self.url, self.api_key, method, path, sent, str(wait_s))
        return answer["status"], answer["body"]

    def acknowledge(self, tenant: str, items: list[dict], ids: list[str]) -> None:
        """Record ``items`` (an add's answers) as acknowledged, once each of ``ids`` was added."""
        assert sorted(i["id"] for i in items) == sorted(ids), items
        assert all(i["status"] in {"added", "pending"} for i in items), items
        self.acknowledged.setdefault(tenant, set()).update(ids)

    def total(self) -> int:
        return sum(len(ids) for ids in self.acknowledged.values())

    def actor_places(self) -> dict[str, dict]:
        """Where each named actor runs, from Ray's actor table: name -> address, NodeID."""
        return self.python(ACTOR_PLACES, self.ray_nodes.address, NAMESPACE)

    def host_of(self, address: str) -> int:
        return next(h.index for h in self.hosts.hosts if h.address == address)


@pytest.fixture(scope="module")
def cluster(venv: Path) -> Iterator[tuple[Hosts, RayNodes]]:
    """Three hosts with Ray on each; afterwards, nothing of them is left (Hosts' own teardown
    also fails where a process still holds one of its mounts)."""
    started = time.monotonic()
    with Hosts(3) as hosts, RayNodes(hosts, venv) as ray_nodes:
        print(f"\nRay on 3 hosts in {time.monotonic() - started:.0f} s")
        yield hosts, ray_nodes
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    assert "lmh-n" not in names, f"teardown left a namespace: {names}"
    assert "lmh" not in Path("/proc/mounts").read_text(), "teardown left a mount"


@pytest.fixture(scope="module")
def deployment(cluster: tuple[Hosts, RayNodes]) -> Iterator[Deployment]:
    """``lifemem-ray serve --shards 2 --http`` on the head host, its store on the node-local
    path, the front door on every address of the head with one API key; the CLI's records
    ingested from the head. Stopped (and checked stopped) after the module."""
    hosts, ray_nodes = cluster
    started = time.monotonic()
    key = _ok(
        ray_nodes.run(
            HEAD, "lifemem-ray", "keys", "new", "--tenant", HTTP_TENANT, "--scopes", "read,write", "--json", timeout=120
        ),
        "keys new",
    )
    keys_file = hosts.hosts[HEAD].folder / "api_keys.json"  # on the head only, as an operator keeps it
    keys_file.write_text(json.dumps([key["entry"]]))
    serve = ["serve", "--shards", str(SHARDS), "--store", str(hosts.local / "store")]
    serve += ["--http", "--host", "0.0.0.0", "--port", str(HTTP_PORT)]
    ns = ["--address", ray_nodes.address, "--namespace", NAMESPACE, "--json"]
    served = _ok(
        ray_nodes.run(HEAD, "lifemem-ray", *serve, *ns, timeout=CLI_TIMEOUT_S, LIFEMEM_API_KEYS=str(keys_file)),
        "serve",
    )
    deployment = Deployment(hosts, ray_nodes, served, key["key"])
    status, health = deployment.http("GET", "/healthz", wait_s=HTTP_READY_S)
    assert status == 200, f"the front door did not come up within {HTTP_READY_S} s: {status} {health}"
    records = _records("cli")
    data = hosts.hosts[HEAD].home / "records.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    ingested = deployment.lifemem("ingest", str(data), "--quiet")
    assert ingested["added"] == len(records), ingested
    deployment.acknowledged["default"] = {r["id"] for r in records}
    print(f"\nserve, front door up and first ingest in {time.monotonic() - started:.0f} s")
    yield deployment
    stopped = deployment.lifemem("stop")
    assert stopped["stopped"] is True and stopped["http"] is True, stopped


def test_each_host_has_a_local_disk_of_its_own_and_all_share_one_folder(cluster):
    hosts, _ = cluster
    write = 'echo "$3" > "$1/whoami" && touch "$2/from-host-$3"'
    for host in hosts.hosts:  # the same path on every host ...
        done = hosts.run(host.index, "sh", "-c", write, "sh", hosts.local, hosts.shared, str(host.index), timeout=30)
        assert done.returncode == 0, done.stderr
    for host in hosts.hosts:  # ... names a folder of that host alone
        done = hosts.run(host.index, "cat", hosts.local / "whoami", timeout=30)
        assert done.stdout.strip() == str(host.index), done.stdout + done.stderr
        assert (hosts.local_path(host.index, hosts.local / "whoami")).read_text().strip() == str(host.index)
        (hosts.local_path(host.index) / "whoami").unlink()
    assert not any(hosts.local.iterdir()), "outside every host the agreed path is an empty mount point"
    assert sorted(p.name for p in hosts.shared.iterdir()) == [f"from-host-{h.index}" for h in hosts.hosts]
    for written in hosts.shared.iterdir():
        written.unlink()


def test_the_ray_nodes_join_from_their_own_addresses(cluster):
    hosts, ray_nodes = cluster
    nodes = ray_nodes.nodes()
    assert sorted(n["address"] for n in nodes) == sorted(h.address for h in hosts.hosts)
    offering = {n["address"] for n in nodes if n["resources"].get("lifemem_shard")}
    assert offering == {h.address for h in hosts.hosts[1:]}, nodes


def test_serve_places_each_shard_on_its_own_worker_and_the_coordinator_on_the_head(deployment):
    served, hosts = deployment.served, deployment.hosts
    nodes = {n["NodeID"]: n["address"] for n in deployment.ray_nodes.nodes()}
    assert len(served["shards"]) == SHARDS and len(served["nodes"]) == SHARDS, served
    placed = [nodes[node_id] for node_id in served["nodes"]]
    workers = {h.address for h in hosts.hosts[1:]}
    assert set(placed) == workers, f"shards placed on {placed}, the workers are {sorted(workers)}"
    # Where the actors really run (Ray's actor table), not only where they were asked to.
    places = deployment.actor_places()
    print(f"\nwhere the deployment's actors run: { {n: p['address'] for n, p in places.items()} }")
    assert [places[name]["NodeID"] for name in served["shards"]] == served["nodes"], places
    assert [places[name]["address"] for name in served["shards"]] == placed, places
    assert places[COORDINATOR]["address"] == hosts.hosts[HEAD].address, places  # pinned to serve's node


def test_each_shard_folder_is_on_its_workers_local_disk_only(deployment):
    hosts, store = deployment.hosts, deployment.store
    assert store.is_relative_to(hosts.local), f"serve's store {store} is not on the node-local path"
    places = deployment.actor_places()
    for i, name in enumerate(deployment.served["shards"]):
        holder = deployment.host_of(places[name]["address"])
        shard = store / f"shard-{i:02d}"
        on = [h.index for h in hosts.hosts if hosts.local_path(h.index, shard).exists()]
        assert on == [holder], f"{shard.name} of {name} (running on host {holder}) is on the disks of hosts {on}"
        assert (hosts.local_path(holder, shard) / "data.mdb").is_file()
    on = [h.index for h in hosts.hosts if hosts.local_path(h.index, store / "coordinator").exists()]
    assert on == [HEAD], f"the routing table is on the disks of hosts {on}, not the head's only"


def test_the_cli_on_the_head_retrieves(deployment):
    task = TASKS["sql"][1]
    hits = deployment.lifemem("retrieve", task, "--env", "sql", "-k", "2")["trajectories"]
    assert hits[0]["id"] == "cli-sql-1" and hits[0]["task"] == task, hits


def test_the_rest_front_door_ingests_and_retrieves_over_the_bridge(deployment):
    records = _records("rest")
    status, added = deployment.http("POST", "/v1/trajectories", {"trajectories": records})
    assert status == 200, added
    deployment.acknowledge(HTTP_TENANT, added["items"], [r["id"] for r in records])
    task = TASKS["shop"][2]
    status, found = deployment.http("POST", "/v1/retrieve", {"queries": [{"task": task, "env": "shop"}], "k": 2})
    assert status == 200, found
    hits = found["results"][0]["trajectories"]
    assert hits[0]["id"] == "rest-shop-2" and hits[0]["task"] == task, hits
    status, stats = deployment.http("GET", "/v1/stats")
    assert status == 200 and stats["trajectories"] == len(records), stats  # the key's tenant only


def test_a_memory_client_on_the_head_ingests_and_retrieves(deployment):
    records = _records("client")
    task = TASKS["sql"][2]
    out = deployment.python(
        _MEMORY_CLIENT, deployment.ray_nodes.address, NAMESPACE, CLIENT_TENANT, json.dumps(records), task, "sql"
    )
    deployment.acknowledge(CLIENT_TENANT, out["items"], [r["id"] for r in records])
    assert out["hits"][0] == {"id": "client-sql-2", "task": task}, out["hits"]


def test_stats_and_a_deep_check_count_every_acknowledged_trajectory(deployment):
    total = deployment.total()
    stats = deployment.lifemem("stats")
    assert stats["trajectories"] == total and len(stats["shards"]) == SHARDS, stats
    assert sum(s["trajectories"] for s in stats["shards"]) == total, stats["shards"]
    per_tenant = {tenant: counts["trajectories"] for tenant, counts in stats["per_tenant"].items()}
    assert per_tenant == {tenant: len(ids) for tenant, ids in deployment.acknowledged.items()}, per_tenant
    checked = deployment.lifemem("check", "--deep")
    assert checked["ok"] is True, [p for shard in checked["shards"] for p in shard["problems"]]
    assert len(checked["shards"]) == SHARDS and sum(s["trajectories"] for s in checked["shards"]) == total, checked


def test_a_snapshot_into_shared_storage_holds_every_shard(deployment):
    hosts = deployment.hosts
    target = hosts.shared / "snapshot"  # each worker writes its shard's copy here, the head the rest
    manifest = deployment.lifemem("snapshot", str(target))
    assert manifest["shards"] == SHARDS and manifest["shard_dirs"] == [f"shard-{i:02d}" for i in range(SHARDS)]
    assert (target / "snapshot.json").is_file() and (target / "coordinator").is_dir()
    copied = 0
    for folder in manifest["shard_dirs"]:
        assert (target / folder / "data.mdb").is_file(), f"{folder}: no copy in the shared folder"
        checked = _ok(
            deployment.ray_nodes.run(
                HEAD, "lifemem-ray", "check", "--store", str(target / folder), "--json", timeout=120
            ),
            f"check of the snapshot's {folder}",
        )
        assert checked["ok"] is True, checked
        copied += checked["trajectories"]
    assert copied == deployment.total(), f"the snapshot holds {copied} trajectories, {deployment.total()} acknowledged"


def test_the_snapshot_restores_onto_another_number_of_shards_across_hosts(deployment):
    """Resharding from the shared snapshot (the test before): a new deployment of one shard,
    restored on a worker from the shared folder, holds every acknowledged trajectory."""
    hosts, ray_nodes = deployment.hosts, deployment.ray_nodes
    snapshot = hosts.shared / "snapshot"
    if not (snapshot / "snapshot.json").is_file():
        deployment.lifemem("snapshot", str(snapshot))
    namespace = f"{NAMESPACE}-resharded"
    ns = ["--address", ray_nodes.address, "--namespace", namespace, "--json"]
    restore = ["restore", str(snapshot), "--store", str(hosts.local / "resharded"), "--shards", "1"]
    restored = _ok(ray_nodes.run(HEAD, "lifemem-ray", *restore, *ns, timeout=CLI_TIMEOUT_S), "restore --shards 1")
    try:
        assert restored["trajectories"] == deployment.total() and len(restored["shards"]) == 1, restored
        stats = _ok(ray_nodes.run(HEAD, "lifemem-ray", "stats", *ns, timeout=CLI_TIMEOUT_S), "stats of the restored")
        assert stats["trajectories"] == deployment.total(), stats
        checked = _ok(ray_nodes.run(HEAD, "lifemem-ray", "check", "--deep", *ns, timeout=CLI_TIMEOUT_S), "check")
        assert checked["ok"] is True and len(checked["shards"]) == 1, checked
        places = deployment.python(ACTOR_PLACES, ray_nodes.address, namespace)
        shard_hosts = {deployment.host_of(places[name]["address"]) for name in restored["shards"]}
        assert len(shard_hosts) == 1 and HEAD not in shard_hosts, places  # the one shard runs on a worker
    finally:
        _ok(ray_nodes.run(HEAD, "lifemem-ray", "stop", *ns, timeout=CLI_TIMEOUT_S), "stop the restored")


def test_a_client_without_the_token_is_refused(cluster, venv):
    hosts, ray_nodes = cluster
    tokenless = hosts.run(
        HEAD,
        venv / "bin" / "python",
        "-c",
        _TOKENLESS_CLIENT,
        ray_nodes.address,
        timeout=180,
        env=hosts.env(HEAD, RAY_AUTH_MODE="disabled"),
    )
    assert tokenless.stdout.strip().endswith("refused ConnectionError"), tokenless.stdout + tokenless.stderr[-2000:]


def test_a_hosts_local_disk_is_mounted_only_while_its_processes_run():
    skip_unless_namespaces_work()
    subnet = ipaddress.ip_network("10.213.78.0/24")  # beside the module's hosts, which may be up
    with Hosts(1, prefix="lmhm", subnet=subnet) as hosts:
        top, local = hosts.top, str(hosts.local)
        sleeper = subprocess.Popen(hosts.command(0, "sleep", "600"), stdin=subprocess.DEVNULL, env=hosts.env(0))
        deadline = time.monotonic() + 30
        while not mounts_under(local) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert mounts_under(local) == [f"{sleeper.pid}: {local}"]  # the host's own, invisible outside it
        assert local not in Path("/proc/self/mountinfo").read_text()
    assert sleeper.wait(timeout=30) != 0, "the teardown ended the host's process by its PID"
    assert top is not None and not mounts_under(top) and not top.exists()


def test_the_harness_refuses_a_bridge_name_in_use():
    skip_unless_namespaces_work()
    bridge = "lmhx-br"
    subprocess.run(["ip", "link", "add", "name", bridge, "type", "bridge"], check=True, timeout=30)
    try:
        with pytest.raises(HostsError, match=f"already in use: link {bridge}"), Hosts(2, prefix="lmhx"):
            pass
        # It made nothing of its own, and left the bridge it did not make.
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
        assert "lmhx-n" not in names
        assert subprocess.run(["ip", "link", "show", "dev", bridge], capture_output=True, timeout=30).returncode == 0
    finally:
        subprocess.run(["ip", "link", "del", bridge], check=False, timeout=30)


# A Ray client that sends no token: a cluster with token authentication on refuses it.
_TOKENLESS_CLIENT = """
import logging, sys, ray
try:
    ray.init(address=sys.argv[1], logging_level=logging.ERROR)
except Exception as exc:
    print("refused", type(exc).__name__)
else:
    print("accepted")
"""

# One HTTP request with a real client (urllib, no proxy): url key method path body wait_s. Prints
# {"status", "body"}; with wait_s > 0, retried until it answers 200 or wait_s passed.
_HTTP_CALL = """
import json, sys, time, urllib.error, urllib.request
url, key, method, path, body, wait_s = sys.argv[1:7]
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
deadline = time.monotonic() + float(wait_s)
while True:
    request = urllib.request.Request(url + path, data=body.encode() or None, method=method, headers={
        "Authorization": "Bearer " + key, "content-type": "application/json"})
    try:
        with opener.open(request, timeout=120) as answer:
            status, text = answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode(errors="replace")
    except OSError as exc:
        status, text = None, json.dumps(str(exc))
    if status == 200 or time.monotonic() > deadline:
        break
    time.sleep(2)
try:
    answer = json.loads(text)
except ValueError:
    answer = text
print(json.dumps({"status": status, "body": answer}))
"""

# A MemoryClient in a process of the head host: address namespace tenant records task env. Adds
# the records (acknowledged), then retrieves the task; prints the add's items and the hits.
_MEMORY_CLIENT = """
import json, sys
from lifemem_ray.actors.client.blocking import MemoryClient
from lifemem_ray.core.model import Trajectory
address, namespace, tenant, records, task, env = sys.argv[1:7]
client = MemoryClient.connect(namespace, address)
trajectories = [Trajectory.from_dict(r, tenant=tenant) for r in json.loads(records)]
items = [item.to_dict() for item in client.add_many(trajectories).result(timeout=120)]
found = client.retrieve(task, env, 2, tenant=tenant)
print(json.dumps({"items": items, "hits": [{"id": h.id, "task": h.task} for h in found.trajectories]}))
"""
