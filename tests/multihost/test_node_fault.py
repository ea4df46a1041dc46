"""A worker node crashes under load and comes back (issue 25, item 3), on the multi-host
harness: three hosts, a 2-shard deployment with its stores on the node-local disks and no
durable address (``cluster.durable_uri`` empty: a shard lives on its node's disk).

From the head, a load job adds batches over REST and retrieves (REST and a ``MemoryClient``)
while every process of the worker hosting shard 1 is SIGKILLed at once, raylet included. The
node stays down a while, then ``ray start`` runs again on that host over the same disk (a new
Ray node at the same address). Checked: every call answered within :data:`CALL_BOUND_S`, and
every failure was a clear "retry later" (HTTP 503 ``unavailable`` with ``Retry-After``, or
``ShardUnavailableError``); shard 0 stayed up on its node throughout; shard 1 came back on
its own host with its data; once the load re-sent what was not acknowledged (same ids), every
id is stored exactly once, the counts equal what was acknowledged, and ``check --deep`` is ok.

The deployment's bounds are set as an operator would for callers that must not wait long:
``cluster.call_timeout_s`` and ``http.read_timeout_s`` 10 s, ``http.add_timeout_s`` 20 s."""

from __future__ import annotations

import ipaddress
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from multihost.harness import Hosts, RayNodes
from multihost.served import (
    CALL_BOUND_S,
    Served,
    acknowledged_adds,
    read_events,
    unclear_answers,
    wait_for_more_adds,
    wait_until,
)

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(1200)]

NAMESPACE = "faults"
SUBNET = ipaddress.ip_network("10.213.79.0/24")  # beside the other modules' hosts
SETTINGS = {
    "cluster": {"call_timeout_s": 10, "health_check_s": 1},
    "http": {"read_timeout_s": 10, "add_timeout_s": 20},
}
DOWN_SEEN_S = 90  # Ray notices a node whose raylet died within this (its health checks), the keeper next
DOWN_HELD_S = 15  # the node stays down this long after its shard was seen down
BACK_WITHIN_S = 120  # from `ray start` on the host again to its shard answering
LOAD_S = 420  # the load job's own bound (it normally stops at the stop file)


@dataclass
class NodeFault:
    """What happened, for the tests to check."""

    before: dict[str, Any]  # status before the kill
    victim: int  # the host killed (shard 1's)
    killed: int  # processes SIGKILLed
    down_polls: list[dict[str, Any]]  # status while shard 1 was down
    new_node: str  # the Ray node id of the host after its restart
    after: dict[str, Any]  # status once shard 1 answered again
    events: list[dict[str, Any]]  # every call of the load
    killed_at: float
    back_at: float
    load: dict[str, Any]  # the load job's answer: acknowledged ids, resends, the stored check
    stats: dict[str, Any]
    checked: dict[str, Any]
    front_door: list[int | None]  # the hosts of the front door's Serve replicas, before the kill
    ray_errors: list[str]  # tracebacks in the hosts' Ray logs, when a call was answered unclearly


@pytest.fixture(scope="module")
def fault(venv: Path) -> Iterator[NodeFault]:
    started = time.monotonic()
    with Hosts(3, prefix="lmf", subnet=SUBNET) as hosts, RayNodes(hosts, venv) as ray_nodes:
        served = Served.start(hosts, ray_nodes, NAMESPACE, SETTINGS)
        print(f"\nRay on 3 hosts and the deployment in {time.monotonic() - started:.0f} s")
        before = served.status()
        victim = served.host_of(before["shards"][1]["address"])
        assert victim not in (None, 0), before
        job, events_file, stop_file = served.start_load("fault", LOAD_S, 2 * CALL_BOUND_S)
        try:
            before = wait_until("5 adds acknowledged, shard 1 holding some", 120, lambda: _loaded(served, events_file))
            front_door = served.front_door_hosts()
            print(f"front door replica(s) on hosts {front_door}; killing host {victim}")
            killed_at = time.time()
            killed = ray_nodes.kill_node(victim)
            down_polls = [wait_until("shard 1 seen down", DOWN_SEEN_S, lambda: _shard_down(served))]
            print(f"shard 1 seen down {time.time() - killed_at:.0f} s after the kill")
            held = time.monotonic() + DOWN_HELD_S
            while time.monotonic() < held:
                down_polls.append(served.status())
            new_node = ray_nodes.restart_node(victim)
            restarted_at = time.time()
            after = wait_until("shard 1 up again", BACK_WITHIN_S, lambda: _shard_up(served))
            back_at = time.time()
            print(f"shard 1 up again {back_at - restarted_at:.0f} s after `ray start` on its host")
            wait_for_more_adds(events_file)
        finally:
            stop_file.write_text("stop")
        load = job.wait(timeout=LOAD_S + 300)
        yield NodeFault(
            before=before,
            victim=victim,
            killed=killed,
            down_polls=down_polls,
            new_node=new_node,
            after=after,
            events=read_events(events_file),
            killed_at=killed_at,
            back_at=back_at,
            load=load,
            front_door=front_door,
            **served.aftermath(read_events(events_file)),
        )
        assert served.stop()["stopped"] is True


def _loaded(served: Served, events_file: Path) -> dict[str, Any] | None:
    if acknowledged_adds(read_events(events_file)) < 5:
        return None
    status = served.status()
    return status if status["shards"][1].get("trajectories") else None


def _shard_down(served: Served) -> dict[str, Any] | None:
    status = served.status()
    return status if status["shards"][1]["health"] == "down" else None


def _shard_up(served: Served) -> dict[str, Any] | None:
    status = served.status()
    return status if status["shards"][1]["health"] == "up" else None


def test_every_call_answers_within_the_bound_and_clearly(fault):
    during = [e for e in fault.events if fault.killed_at <= e["t"] <= fault.back_at]
    unavailable = [e for e in during if e.get("status") == 503 or e.get("error") == "ShardUnavailableError"]
    took = max(e["s"] for e in fault.events)
    print(f"\n{len(fault.events)} calls, {len(during)} while shard 1 was down or coming back, the longest {took:.1f} s")
    assert fault.killed >= 3, f"only {fault.killed} processes killed on host {fault.victim}: was Ray running there?"
    assert unavailable, "no caller saw the node's loss: the kill did not hit the load"
    assert not unclear_answers(fault.events), (
        f"front door on hosts {fault.front_door}, host {fault.victim} killed: "
        + json.dumps([{**e, "after_kill_s": e["t"] - fault.killed_at} for e in unclear_answers(fault.events)[:5]])
        + "\n"
        + "\n\n".join(fault.ray_errors)
    )


def test_the_other_shard_keeps_serving(fault):
    shard_0 = fault.before["shards"][0]
    for status in fault.down_polls:
        assert status["shards"][1]["health"] == "down" and status["shards"][1]["why"], status["shards"][1]
        now = status["shards"][0]
        assert (now["health"], now["node_id"]) == ("up", shard_0["node_id"]), now
        assert now["trajectories"] >= shard_0["trajectories"], now
    assert not fault.after["shards"][0]["keeper"]["history"], fault.after["shards"][0]  # never restarted


def test_the_shard_comes_back_on_its_host_with_its_data(fault):
    before, after = fault.before["shards"][1], fault.after["shards"][1]
    assert after["address"] == before["address"] and after["node_id"] == fault.new_node, (before, after)
    assert after["trajectories"] >= before["trajectories"], (before, after)
    assert [h["action"] for h in after["keeper"]["history"]] == ["restart"], after["keeper"]


def test_nothing_acknowledged_is_missing_or_doubled(fault):
    load = fault.load
    assert load["settle"]["unsettled"] == [], load["settle"]
    assert load["stored"] == {"missing": [], "doubled": [], "conflict": []}, load["stored"]
    acknowledged = set(load["acknowledged"])
    print(
        f"\n{len(acknowledged)} ids acknowledged, {load['settle']['resent_batches']} batches sent again "
        f"({load['settle']['found_stored']} of their items found stored by the first attempt)"
    )
    assert fault.stats["trajectories"] == len(acknowledged), fault.stats["per_tenant"]
    assert fault.stats["per_tenant"]["acme"]["trajectories"] == len(acknowledged), fault.stats["per_tenant"]
    checked = fault.checked
    assert checked["ok"] is True, [p for shard in checked["shards"] for p in shard["problems"]]
    assert sum(s["trajectories"] for s in checked["shards"]) == len(acknowledged), checked
