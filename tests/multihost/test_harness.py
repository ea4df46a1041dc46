"""The multi-host harness (issue 25, item 1) and a first real deployment on it (item 2's first
assertion): three hosts, each a network namespace with its own address on a private bridge, Ray
from the wheel installed in a fresh virtual environment, token authentication on; ``lifemem-ray
serve --shards 2`` run on the head host places each shard on a different worker host.

Root and minutes (the build, the install, three Ray nodes): behind the ``multihost`` marker,
``pytest -m multihost tests/multihost``. ``LIFEMEM_MULTIHOST_VENV=DIR`` reuses an environment
already made with ``tests/wheel_env.py`` (for a quicker rerun while developing)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import ACTOR_PLACES, Hosts, HostsError, RayNodes
from wheel_env import build_dists, fresh_venv, trajectory_record

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(2400)]

NAMESPACE = "multihost"
CLI_TIMEOUT_S = 300  # one lifemem-ray command across the hosts


def skip_unless_namespaces_work() -> None:
    """Skip (with the reason) where this machine cannot make what the harness needs: not root,
    or a kernel or container that refuses network namespaces or bridges to root."""
    if os.geteuid() != 0:
        pytest.skip("the multihost harness needs root (network namespaces, a bridge)")
    probe = f"lmh-probe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    if made.returncode != 0:
        pytest.skip(f"this machine refuses network namespaces to root: {made.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30, check=True)


@pytest.fixture(scope="session")
def venv() -> Iterator[Path]:
    """The wheel of the checkout installed in a fresh virtual environment (built once a session)."""
    skip_unless_namespaces_work()
    given = os.environ.get("LIFEMEM_MULTIHOST_VENV")
    if given:
        yield Path(given)
        return
    work = Path(tempfile.mkdtemp(prefix="lifemem-multihost-"))
    try:
        yield fresh_venv(build_dists(work / "dist").wheel, work / "venv")
    finally:
        shutil.rmtree(work, ignore_errors=True)


TASKS = {
    "shop": ["buy a red wool scarf", "order two packs of aa batteries", "find a one liter water bottle"],
    "sql": ["count the orders of every customer", "list the employees hired after 2020", "find the priciest product"],
}


def _records() -> list[dict]:
    return [
        trajectory_record(f"{env}-{i}", env, task, [f"step one of {task}", "step two", "finish"])
        for env, tasks in TASKS.items()
        for i, task in enumerate(tasks)
    ]


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


def _ok(done: subprocess.CompletedProcess[str], what: str) -> dict:
    assert done.returncode == 0, (
        f"{what} exited with code {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    )
    return json.loads(done.stdout)


def test_serve_places_each_shard_on_its_own_worker_host(venv: Path):
    started = time.monotonic()
    with Hosts(3) as hosts, RayNodes(hosts, venv) as ray_nodes:
        joined = time.monotonic() - started
        nodes = {n["NodeID"]: n for n in ray_nodes.nodes()}
        workers = {h.address for h in hosts.hosts[1:]}
        assert {n["address"] for n in nodes.values()} == {h.address for h in hosts.hosts}
        assert {n["address"] for n in nodes.values() if n["resources"].get("lifemem_shard")} == workers
        # One path for the whole deployment: each host sees it (no mount namespace hides it), so it
        # stands for shared storage; each shard writes only its own shard-NN folder below it.
        store = hosts.shared / "store"
        ns = ["--address", ray_nodes.address, "--namespace", NAMESPACE]
        served = _ok(
            ray_nodes.run(
                0, "lifemem-ray", "serve", "--shards", "2", "--store", str(store), *ns, "--json", timeout=CLI_TIMEOUT_S
            ),
            "serve",
        )
        assert len(served["shards"]) == 2 and len(served["nodes"]) == 2, served
        placed = [nodes[node_id]["address"] for node_id in served["nodes"]]
        assert set(placed) == workers, f"shards placed on {placed}, the workers are {sorted(workers)}"
        # Where the shard actors really run (Ray's actor table), not only where they were asked to.
        places = json.loads(
            ray_nodes.run(0, "python", "-c", ACTOR_PLACES, ray_nodes.address, NAMESPACE, timeout=120).stdout
        )
        assert [places[name]["address"] for name in served["shards"]] == placed, places
        print(f"\nwhere the deployment's actors run: { {n: p['address'] for n, p in places.items()} }")
        data = hosts.hosts[0].home / "records.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in _records()))
        ingested = _ok(
            ray_nodes.run(0, "lifemem-ray", "ingest", str(data), *ns, "--json", "--quiet", timeout=CLI_TIMEOUT_S),
            "ingest",
        )
        assert ingested["added"] == len(_records())
        task = TASKS["sql"][1]
        hits = _ok(
            ray_nodes.run(
                0, "lifemem-ray", "retrieve", task, "--env", "sql", "-k", "2", *ns, "--json", timeout=CLI_TIMEOUT_S
            ),
            "retrieve",
        )["trajectories"]
        assert hits[0]["id"] == "sql-1" and hits[0]["task"] == task, hits
        # Token authentication is on across the hosts: a client of host 0 without the token is refused.
        tokenless = hosts.run(
            0,
            venv / "bin" / "python",
            "-c",
            _TOKENLESS_CLIENT,
            ray_nodes.address,
            timeout=180,
            env=hosts.env(0, RAY_AUTH_MODE="disabled"),
        )
        assert tokenless.stdout.strip().endswith("refused ConnectionError"), tokenless.stdout + tokenless.stderr[-2000:]
        stopped = _ok(ray_nodes.run(0, "lifemem-ray", "stop", *ns, "--json", timeout=CLI_TIMEOUT_S), "stop")
        assert stopped["stopped"] is True, stopped
        print(f"\nRay on 3 hosts in {joined:.0f} s; serve to stop in {time.monotonic() - started - joined:.0f} s")
    assert not any(Path(f"/run/netns/lmh-n{i}").exists() for i in range(3)), "teardown left a namespace"


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
