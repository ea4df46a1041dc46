"""The head node lost and back (issue 33), on the multi-host harness: the head (coordinator,
Serve, the front door) on host 0, a shard on each of hosts 1 and 2, Redis on host 3.

With GCS fault tolerance (Ray's GCS on an external Redis, append-only, as KubeRay runs it),
under a load from host 1 (REST and ``MemoryClient`` adds, REST and ``MemoryClient``
retrievals), every process of host 0 is SIGKILLed and ``ray start --head`` is run again on
the same host 15 s later with the same Redis and token. Checked: the memory serves again by
itself, no ``serve`` run (measured from the head's restart and printed); the shards survived
(same nodes, never restarted); the clients opened before the loss work after it; once the
load re-sent what was not acknowledged, every id is stored exactly once and ``check --deep``
is ok; ``status`` says the coordinator is up.

Without fault tolerance, the workers' Ray processes exit with the head; the documented
recovery (the head started again, ``ray start`` on each worker, the same ``serve``) brings the
memory back from the shards' node-local stores with everything acknowledged."""

from __future__ import annotations

import ipaddress
import json
import shutil
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from multihost.harness import Hosts, HostsError, RayNodes
from multihost.served import CALL_BOUND_S, Served, read_events, wait_for_more_adds, wait_until

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(1500)]

SUBNET = ipaddress.ip_network("10.213.81.0/24")  # beside the other modules' hosts
NO_FT_SUBNET = ipaddress.ip_network("10.213.83.0/24")
REDIS_HOST = 3
REDIS_PORT = 6380
DOWN_S = 15  # how long the head stays dead before `ray start --head` again
RECONNECT_S = 600  # RAY_gcs_rpc_server_reconnect_timeout_s on every node and driver: more than a head restart takes
SERVE_AGAIN_S = 240  # from the head's restart to every kind of call answering again
LOAD_S = 600  # the load job's own bound (it normally stops at the stop file)
SETTINGS = {
    "cluster": {"call_timeout_s": 10, "health_check_s": 1},
    "http": {"read_timeout_s": 10, "add_timeout_s": 20},
}
KINDS = [("add", "rest"), ("add", "client"), ("retrieve", "rest"), ("retrieve", "client")]
FIXED = {"tenant": "kept", "prefix": "kept", "count": 48, "every": 4, "k": 3}  # stored before the loss, read after
WORKERS_EXIT_S = 240  # without fault tolerance, the workers' Ray exits once it gave up on the GCS


@dataclass
class HeadLost:
    """What happened, for the tests to check."""

    before: dict[str, Any]  # status before the loss
    places_before: dict[str, dict]  # the named actors' places before
    places_after: dict[str, dict]
    killed_at: float
    restarted_at: float  # when `ray start --head` was run again
    head_up_s: float  # how long it took to answer
    after: dict[str, Any]  # status once serving again
    events: list[dict[str, Any]]
    load: dict[str, Any]
    stats: dict[str, Any]
    checked: dict[str, Any]


@pytest.fixture(scope="module")
def redis_available() -> str:
    found = shutil.which("redis-server")
    if found is None:
        pytest.skip("redis-server not installed (Debian: apt-get install redis-server; .ci/run installs it)")
    return found


def start_redis(hosts: Hosts, redis: str) -> subprocess.Popen[bytes]:
    """Redis on host 3, append-only, its files in that host's folder (ended by its PID)."""
    host = hosts.hosts[REDIS_HOST]
    folder = host.folder / "redis"
    folder.mkdir()
    argv = [redis, "--port", str(REDIS_PORT), "--bind", host.address, "--protected-mode", "no"]
    argv += ["--appendonly", "yes", "--dir", str(folder), "--save", ""]
    server = subprocess.Popen(
        hosts.command(REDIS_HOST, *argv),
        env=hosts.env(REDIS_HOST),
        stdin=subprocess.DEVNULL,
        stdout=(folder / "redis.log").open("wb"),
        stderr=subprocess.STDOUT,
    )
    wait_until(f"Redis at {host.address}:{REDIS_PORT}", 60, lambda: _open(hosts, host.address, REDIS_PORT), 1)
    return server


def _open(hosts: Hosts, address: str, port: int) -> bool | None:
    probe = f"import socket; socket.create_connection(({address!r}, {port}), timeout=2).close()"
    return True if hosts.run(0, "python3", "-c", probe, timeout=30).returncode == 0 else None


@pytest.fixture(scope="module")
def head_lost(venv: Path, redis_available: str) -> Iterator[HeadLost]:
    with Hosts(4, prefix="lmr", subnet=SUBNET) as hosts:
        redis = start_redis(hosts, redis_available)
        try:
            fault_tolerant = {
                "RAY_REDIS_ADDRESS": f"{hosts.hosts[REDIS_HOST].address}:{REDIS_PORT}",
                "RAY_external_storage_namespace": "lifemem-head-lost",
            }
            reconnect = {"RAY_gcs_rpc_server_reconnect_timeout_s": str(RECONNECT_S)}
            with RayNodes(hosts, venv, nodes=3, env=reconnect, head_env=fault_tolerant) as ray_nodes:
                yield _lose_the_head(hosts, ray_nodes)
        finally:
            redis.terminate()
            redis.wait(timeout=60)


def _lose_the_head(hosts: Hosts, ray_nodes: RayNodes) -> HeadLost:
    served = Served.start(hosts, ray_nodes, "headlost", SETTINGS)
    before, places_before = served.status(), served.actor_places()
    job, events_file, stop_file = served.start_load("head", LOAD_S, 2 * CALL_BOUND_S, host=1, client_adds=True)
    try:
        wait_for_more_adds(events_file, within_s=120)
        killed_at = time.time()
        ray_nodes.kill_head()
        time.sleep(DOWN_S)
        restarted_at = time.time()
        ray_nodes.restart_head()
        head_up_s = time.time() - restarted_at
        print(f"\nhead killed, restarted after {DOWN_S} s; it answered {head_up_s:.1f} s after `ray start --head`")
        try:
            wait_until(
                "every kind of call answered after the head's restart",
                SERVE_AGAIN_S,
                lambda: _all_kinds_answered(read_events(events_file), restarted_at) or None,
                every_s=2,
            )
            served.wait_http()
        except HostsError as exc:
            raise HostsError(f"{exc}\n{_diagnosis(served, read_events(events_file), restarted_at)}") from None
    finally:
        stop_file.write_text("stop")
    load = job.wait(timeout=LOAD_S + 300)
    aftermath = served.aftermath(read_events(events_file))
    out = HeadLost(
        before=before,
        places_before=places_before,
        places_after=served.actor_places(),
        killed_at=killed_at,
        restarted_at=restarted_at,
        head_up_s=head_up_s,
        after=served.status(),
        events=read_events(events_file),
        load=load,
        stats=aftermath["stats"],
        checked=aftermath["checked"],
    )
    served.stop()
    return out


def _diagnosis(served: Served, events: list[dict[str, Any]], since: float) -> str:
    """What the calls since ``since`` answered (per kind: statuses and errors, counted), what
    ``status`` says, and the head's log lines of the coordinator, for a failure's report."""
    seen: dict[str, Counter[str]] = {}
    for e in events:
        if e["t"] + e["s"] > since:
            answer = (
                str(e.get("status"))
                if e.get("status") == 200
                else f"{e.get('status')} {e.get('error')} {e.get('why', '')[:120]}"
            )
            seen.setdefault(f"{e['op']} via {e['via']}", Counter())[answer] += 1
    try:
        status: Any = served.status()
    except HostsError as exc:
        status = str(exc)[-2000:]
    table = served.ray_nodes.run(
        0, "python", "-c", _ACTOR_TABLE, served.ray_nodes.address, served.namespace, timeout=120
    ).stdout[-3000:]
    counted = json.dumps({k: dict(v) for k, v in seen.items()}, indent=1) + "\n" + table
    return "\n".join([counted, json.dumps(status)[:3000], *served.head_log("coordinator")[-20:], *served.ray_errors(3)])


def _first_answers(events: list[dict[str, Any]], since: float) -> dict[tuple[str, str], float | None]:
    """Per kind of call, seconds from ``since`` to the end of its first answer ending after it."""
    out: dict[tuple[str, str], float | None] = {}
    for kind in KINDS:
        ends = [e["t"] + e["s"] for e in events if (e["op"], e["via"]) == kind and e.get("status") == 200]
        later = [end for end in ends if end > since]
        out[kind] = min(later) - since if later else None
    return out


def _all_kinds_answered(events: list[dict[str, Any]], since: float) -> bool:
    return all(v is not None for v in _first_answers(events, since).values())


@dataclass
class HeadLostForGood:
    """The same loss without fault tolerance, and the documented recovery."""

    before: dict[str, Any]  # the fixed tenant's answers before the loss
    after: dict[str, Any]  # ... and after the recovery
    workers_exited_s: float  # from the kill to the workers' Ray processes gone
    served_again: dict[str, Any]  # the same `serve`'s answer


@pytest.fixture(scope="module")
def head_lost_without_fault_tolerance(venv: Path) -> Iterator[HeadLostForGood]:
    exit_soon = {"RAY_gcs_rpc_server_reconnect_timeout_s": "20"}  # the workers give up on the GCS soon
    with Hosts(3, prefix="lmn", subnet=NO_FT_SUBNET) as hosts, RayNodes(hosts, venv, env=exit_soon) as ray_nodes:
        served = Served.start(hosts, ray_nodes, "headgone", SETTINGS, http=False)
        before = served.job("fixed", 300, **FIXED)
        killed_at = time.time()
        ray_nodes.kill_head()
        try:
            wait_until("the workers' Ray processes gone", WORKERS_EXIT_S, lambda: _workers_gone(hosts) or None, 2)
        except HostsError as exc:
            raise HostsError(f"{exc}: still running {_commands(hosts, 1) + _commands(hosts, 2)}") from None
        workers_exited_s = time.time() - killed_at
        ray_nodes.restart_head()  # the documented recovery: the head, each worker's Ray started anew, the same serve
        for i in (1, 2):
            hosts.end_processes(i)  # the host's leftovers, by PID: the log monitor outlives its raylet
            ray_nodes.restart_node(i)
        served_again = Served.start(hosts, ray_nodes, "headgone", SETTINGS, http=False).served
        after = served.job("fixed", 300, **FIXED, add=False)
        yield HeadLostForGood(before, after, workers_exited_s, served_again)
        served.stop()


def _workers_gone(hosts: Hosts) -> bool:
    """Whether the worker hosts' raylets and workers (the shards) have exited. Ray's log monitor
    is left: it outlives its raylet, and is ended with the host's other leftovers by PID."""
    return not [cmd for i in (1, 2) for cmd in _commands(hosts, i) if "ray" in cmd and "log_monitor" not in cmd]


def _commands(hosts: Hosts, i: int) -> list[str]:
    out = []
    for pid in hosts.pids(i):
        try:
            out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200])
        except OSError:
            continue
    return out


def test_without_fault_tolerance_the_documented_recovery_brings_everything_back(head_lost_without_fault_tolerance):
    lost = head_lost_without_fault_tolerance
    print(f"\nwithout fault tolerance, the workers' Ray exited {lost.workers_exited_s:.0f} s after the head's loss")
    assert len(lost.before["added"]) == FIXED["count"] and all(lost.before["per_shard"]), lost.before
    assert lost.after["stored"] == {"missing": [], "doubled": [], "conflict": []}, lost.after["stored"]
    assert lost.after["per_shard"] == lost.before["per_shard"]
    assert lost.after["answers"] == lost.before["answers"]
    assert len(lost.served_again["shards"]) == 2


def test_the_memory_serves_again_by_itself_after_the_head_restarts(head_lost):
    firsts = _first_answers(head_lost.events, head_lost.restarted_at)
    shown = {f"{op} via {via}": None if s is None else round(s, 1) for (op, via), s in firsts.items()}
    print(f"\nfrom `ray start --head` again to the first answer of each kind (s): {shown}")
    assert all(s is not None and s <= SERVE_AGAIN_S for s in firsts.values()), shown
    down = [e for e in head_lost.events if head_lost.killed_at <= e["t"] and e.get("status") != 200]
    assert down, "no call saw the head's loss: the kill did not hit the load"
    assert head_lost.after["coordinator"] == "up" and all(s["health"] == "up" for s in head_lost.after["shards"])


def test_the_shards_survived_and_the_coordinator_came_back_on_the_head(head_lost):
    shards = [n for n in head_lost.places_before if n.startswith("lifemem-shard-")]
    assert len(shards) == 2
    for name in shards:  # the same node (never restarted there or elsewhere)
        assert head_lost.places_after[name]["NodeID"] == head_lost.places_before[name]["NodeID"], name
    head = head_lost.places_before["lifemem-coordinator"]["address"]
    assert head_lost.places_after["lifemem-coordinator"]["address"] == head
    assert (
        head_lost.places_after["lifemem-coordinator"]["NodeID"]
        != head_lost.places_before["lifemem-coordinator"]["NodeID"]
    )


def test_nothing_acknowledged_is_missing_or_doubled(head_lost):
    load = head_lost.load
    assert load["settle"]["unsettled"] == [], load["settle"]
    assert load["stored"] == {"missing": [], "doubled": [], "conflict": []}, load["stored"]
    acknowledged = set(load["acknowledged"])
    print(f"\n{len(acknowledged)} ids acknowledged, {load['settle']['resent_batches']} batches sent again")
    assert head_lost.stats["per_tenant"]["acme"]["trajectories"] == len(acknowledged)
    assert head_lost.checked["ok"] is True, head_lost.checked


# Run in the head's host: every actor of the table with a name (any state), its id, restarts and place.
_ACTOR_TABLE = """
import json, logging, sys, ray
from ray._private import state
ray.init(address=sys.argv[1], namespace=sys.argv[2], logging_level=logging.ERROR, log_to_driver=False)
for actor_id, actor in state.actors().items():
    if actor.get("Name"):
        print(json.dumps({"id": actor_id, "name": actor["Name"], "state": actor.get("State"),
                          "restarts": actor.get("NumRestarts"), "address": actor.get("Address", {}).get("IPAddress")}))
"""
