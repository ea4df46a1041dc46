"""Issue 23's attacks on the front door, rebuilt from its text and run against a real Serve on
loopback: slow request bodies sent with one valid key (read-write, then read-only) must not
stall another tenant, and their sockets must be closed; names with a final newline and loosely
typed numbers are refused naming the field; a write-only key polls the operations it created.

Unit tests of the admission policy (:mod:`lifemem_ray.actors.frontdoor.admission`) need no Ray."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from support.front_harness import Front, serve_front

from lifemem_ray.actors.frontdoor.admission import BodyPace, TenantShare
from lifemem_ray.lab.synthetic import generate

SLOW_CONNECTIONS = 40  # as in the issue: 40 connections, one valid key
SLOW_BODY_BYTES = 100_000  # each announcing a 100 kB body ...
SLOW_BYTE_EVERY_S = 2.0  # ... sent one byte every 2 s
GRACE_S = 3.0  # http.body_grace_s of this module's front door: how long a trickle may hold a slot


# -- the policy, without Ray -------------------------------------------------------------------
def test_tenant_share_caps_each_tenant_and_frees_on_leave():
    share = TenantShare(3)
    assert [share.try_enter("a") for _ in range(5)] == [True, True, True, False, False]
    assert share.try_enter("b") and share.in_flight("a") == 3
    share.leave("a")
    assert share.try_enter("a") and not share.try_enter("a")
    for _ in range(3):
        share.leave("a")
    assert share.in_flight("a") == 0


def test_body_pace_deadlines():
    pace = BodyPace(timeout_s=10, grace_s=2, min_rate=100, started=0.0)
    assert pace.deadline() == 2.0  # the grace period
    pace.received(500)
    assert pace.deadline() == 5.0  # 500 bytes at 100 B/s
    pace.received(5_000)
    assert pace.deadline() == 10.0  # never past the whole body's deadline
    assert "http.body_timeout_s" in pace.why_late(10.0)
    slow = BodyPace(timeout_s=10, grace_s=2, min_rate=100, started=0.0)
    slow.received(1)
    assert "too slowly" in slow.why_late(2.0) and "1 bytes" in slow.why_late(2.0)
    assert BodyPace(timeout_s=10, grace_s=2, min_rate=0, started=0.0).deadline() == 10.0  # no rate floor


# -- against a real front door ---------------------------------------------------------------------
ROLES = [
    ("acme", "acme", "read,write"),
    ("acme_ro", "acme", "read"),
    ("acme_wo", "acme", "write"),
    ("globex", "globex", "read,write"),
    ("admin", "ops", "read,write,admin"),
]


@pytest.fixture(scope="module")
def front(ray_local, tmp_path_factory) -> Iterator[Front]:
    namespace = f"hard-{tmp_path_factory.getbasetemp().name[-12:]}"
    overrides = {
        "http.body_grace_s": GRACE_S,
        "http.body_min_rate_bytes_s": 1_024,
        "http.body_timeout_s": 30.0,
        "http.retry_after_s": 1,
    }
    with serve_front(tmp_path_factory.mktemp("hard") / "store", namespace, ROLES, **overrides) as running:
        with running.http("globex") as g:  # something for globex to read
            records = [t.to_dict() for t in generate(12, seed=3, envs=["shop"], length_scale=0.1, id_prefix="g")]
            assert g.post("/v1/trajectories", json={"trajectories": records}).status_code == 200
        yield running


class SlowBodies:
    """``n`` raw connections, each announcing a body of ``SLOW_BODY_BYTES`` and sending one byte
    of it every ``SLOW_BYTE_EVERY_S`` seconds, read back in one thread until the server closes
    each (or ``give_up_s`` passed)."""

    def __init__(self, front: Front, key: str, n: int) -> None:
        head = (
            f"POST /v1/trajectories HTTP/1.1\r\nHost: 127.0.0.1:{front.port}\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {SLOW_BODY_BYTES}\r\n\r\n"
        ).encode()
        self.socks = []
        for _ in range(n):
            sock = socket.create_connection(("127.0.0.1", front.port), timeout=10)
            sock.sendall(head + b"{")
            sock.setblocking(False)
            self.socks.append(sock)
        self.answers: list[bytes] = [b""] * n  # what the server sent back on each
        self.closed_at: list[float | None] = [None] * n  # monotonic time the server closed each
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._trickle, daemon=True)
        self._thread.start()

    def _trickle(self) -> None:
        next_byte = time.monotonic() + SLOW_BYTE_EVERY_S
        while not self._stop.is_set() and any(c is None for c in self.closed_at):
            for i, sock in enumerate(self.socks):
                if self.closed_at[i] is not None:
                    continue
                try:
                    data = sock.recv(65536)
                    if data:
                        self.answers[i] += data
                    else:
                        self.closed_at[i] = time.monotonic()
                except BlockingIOError:
                    pass
                except OSError:  # reset by the server: closed too
                    self.closed_at[i] = time.monotonic()
            if time.monotonic() >= next_byte:
                next_byte += SLOW_BYTE_EVERY_S
                for i, sock in enumerate(self.socks):
                    if self.closed_at[i] is None:
                        try:
                            sock.send(b" ")
                        except OSError:
                            pass
            time.sleep(0.05)

    def wait_closed(self, give_up_s: float) -> None:
        self._thread.join(timeout=give_up_s)
        self._stop.set()
        self._thread.join(timeout=5)

    def statuses(self) -> list[int | None]:
        out = []
        for answer in self.answers:
            line = answer.split(b"\r\n", 1)[0].split()
            out.append(int(line[1]) if len(line) >= 2 and line[1].isdigit() else None)
        return out

    def close(self) -> None:
        self._stop.set()
        for sock in self.socks:
            sock.close()


@pytest.mark.parametrize("attacker", ["acme", "acme_ro"])
def test_slow_bodies_of_one_key_leave_other_tenants_served_and_are_closed(front, attacker):
    """40 connections of one valid key trickling 100 kB bodies: before this fix they took all
    32 request slots, another tenant's GET /v1/stats timed out at 30 s and no socket was closed
    in 40 s. Now the tenant gets at most http.max_ongoing_per_tenant slots (the rest answer 429
    at once), the others answer within the grace period, and every socket is closed after a
    408 or 429."""
    slow = SlowBodies(front, front.keys[attacker], SLOW_CONNECTIONS)
    try:
        time.sleep(1.0)  # the slow requests have reached the replica
        waits = []
        with front.http("globex", timeout=10) as other:
            for _ in range(5):  # while the slow bodies hold their slots
                started = time.monotonic()
                r = other.get("/v1/stats")
                waits.append(time.monotonic() - started)
                assert r.status_code == 200, r.text
                assert r.json()["trajectories"] == 12
        assert time.monotonic() - slow.started < GRACE_S + SLOW_BYTE_EVERY_S, (
            "the attack had ended before the reads were done"
        )
        print(f"other tenant's GET /v1/stats during the attack: {[round(w, 3) for w in waits]} s")
        slow.wait_closed(give_up_s=GRACE_S + 30)
        statuses = slow.statuses()
        assert all(c is not None for c in slow.closed_at), (
            f"sockets left open: {sum(c is None for c in slow.closed_at)}"
        )
        assert set(statuses) <= {408, 429}, statuses
        cap = front.config.http.max_ongoing_per_tenant
        assert statuses.count(408) <= cap and statuses.count(429) >= SLOW_CONNECTIONS - cap, statuses
        late = next(a for a, s in zip(slow.answers, statuses, strict=True) if s == 408)
        body = json.loads(late.split(b"\r\n\r\n", 1)[1])
        assert body["error"]["type"] == "timeout" and "too slowly" in body["error"]["message"]
        assert b"connection: close" in late.lower()
        busy = next(a for a, s in zip(slow.answers, statuses, strict=True) if s == 429)
        assert b"retry-after" in busy.lower() and b"max_ongoing_per_tenant" in busy
    finally:
        slow.close()
    with front.http(attacker, timeout=10) as again:  # the key itself is served again afterwards
        assert again.get("/v1/stats").status_code == 200


def test_a_whole_body_sent_at_once_is_served(front):
    with front.http("acme") as rw:
        records = [t.to_dict() for t in generate(3, seed=8, envs=["shop"], length_scale=0.1, id_prefix="w")]
        r = rw.post("/v1/trajectories", json={"trajectories": records})
        assert r.status_code == 200 and len(r.json()["items"]) == 3


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, (response.status_code, response.text[:1000])
    return response.json()["error"]


@pytest.mark.parametrize("field,value", [("k", True), ("k", "4"), ("k", 2.5), ("context", "yes"), ("skills", 1)])
def test_retrieve_refuses_loose_types_naming_the_field(front, field, value):
    with front.http("acme") as rw:
        body = {"queries": [{"task": "buy a lamp", "env": "shop"}], field: value}
        err = _error(rw.post("/v1/retrieve", json=body), 422)
        assert err["where"] == field, err


def test_names_with_a_final_newline_are_refused(front):
    with front.http("admin") as admin, front.http("acme") as rw:
        err = _error(admin.delete("/v1/tenants/beta%0A"), 422)
        assert "not a tenant name" in err["message"]
        record = next(generate(1, seed=4, envs=["shop"], length_scale=0.1, id_prefix="nl")).to_dict()
        for field, value in (("tenant", "acme\n"), ("env", "shop\n")):
            err = _error(rw.post("/v1/trajectories", json={"trajectories": [{**record, field: value}]}), 422)
            assert err["where"] == f"trajectories[0].{field}", err
        err = _error(rw.post("/v1/retrieve", json={"queries": [{"task": "x", "env": "shop\n"}]}), 422)
        assert err["where"] == "queries[0].env", err


def test_a_write_only_key_polls_the_operations_it_created(front):
    record = next(generate(1, seed=5, envs=["shop"], length_scale=0.1, id_prefix="wo")).to_dict()
    other = next(generate(1, seed=6, envs=["shop"], length_scale=0.1, id_prefix="rw")).to_dict()
    with front.http("acme_wo") as wo, front.http("acme") as rw, front.http("acme_ro") as ro, front.http("globex") as g:
        mine = wo.post("/v1/trajectories?wait=false", json={"trajectories": [record]})
        assert mine.status_code == 202, mine.text
        theirs = rw.post("/v1/trajectories?wait=false", json={"trajectories": [other]}).json()["operation"]
        op = mine.json()["operation"]
        deadline = time.monotonic() + 120
        while True:
            got = wo.get(f"/v1/operations/{op}")
            assert got.status_code == 200, got.text
            if got.json()["status"] != "pending":
                break
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert got.json()["status"] == "done" and got.json()["items"][0]["id"] == record["id"]
        _error(wo.get(f"/v1/operations/{theirs}"), 404)  # another key's: write alone does not read it
        assert ro.get(f"/v1/operations/{op}").status_code == 200  # a read key of the tenant sees every one
        _error(g.get(f"/v1/operations/{op}"), 404)  # another tenant never


def test_mcp_refuses_loose_types(front):
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    async def scenario() -> list[str]:
        http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {front.keys['acme']}"}, timeout=120)
        client = Client(streamable_http_client(f"{front.url}/mcp", http_client=http), mode="auto", cache=None)
        texts = []
        async with http, client as c:
            for args in ({"k": True}, {"k": "4"}, {"token_budget": "100"}, {"token_budget": False}):
                got = await c.call_tool("retrieve_experience", {"task": "buy a lamp", "env": "shop", **args})
                assert got.is_error, args
                texts.append(got.content[0].text)
            ok = await c.call_tool("retrieve_experience", {"task": "buy a lamp", "env": "shop", "k": 2})
            assert not ok.is_error and ok.structured_content["k"] == 2
        return texts

    texts = asyncio.run(scenario())
    assert all(("k" in t or "token_budget" in t) and "integer" in t for t in texts), texts
