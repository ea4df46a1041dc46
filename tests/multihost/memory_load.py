"""Load, checks and measurements against a deployment, run by the installed wheel's Python on
the head host (``python memory_load.py JOB SPEC_JSON``), never imported by the tests: the
multi-host fault tests (``test_node_fault.py``, ``test_node_lost.py``) and ``benchmarks/durability.py`` start it in
host 0 and read what it writes. Its own process: it holds its own Ray connection and imports
the project from the wheel, not from the checkout.

Jobs (each reads its spec, a JSON object, and prints its answer as JSON on its last line):

``load``
    Sustained load over the REST front door until the spec's ``stop_file`` appears (or
    ``seconds`` passed, or ``max_batches`` were sent): one thread adds batches of
    ``batch`` trajectories (``POST /v1/trajectories``; an answer other than 200 leaves the batch
    unacknowledged and the thread goes on after ``Retry-After``, at most ``pause_s``), one
    retrieves, alternately through REST and a ``MemoryClient``. Every call is one line of the
    ``events`` file (when it started, how long it took, its status or error), written as it
    ends, so a test sees the progress. Then every unacknowledged batch is sent again (same
    ids, same content) until acknowledged or ``settle_s`` passed (as a caller told to retry
    does), and every acknowledged id is looked up on every shard (``known``): the answer lists
    those missing, stored twice, or stored with other content.
``fixed``
    ``MemoryClient`` adds ``count`` trajectories of ``tenant`` (``add``: false skips that), then
    answers the retrieval of every ``every``-th one's task: per query, the hit ids in order; and
    how many of the tenant's trajectories each shard holds.
``bench_add``
    ``threads`` clients add batches of ``batch`` trajectories with their vectors (no embedding
    model: ``text_vectors``) for ``seconds``: per add its latency, and the trajectories per second.
``preload``
    ``count`` trajectories added in batches of ``batch`` (``threads`` at a time), with vectors.
``until_serving``
    A retrieval through every shard (``MemoryClient.retrieve_many`` of ``queries`` tasks) tried
    until it answers or ``seconds`` passed: when it first answered (``time.time()``), and the
    errors before.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import ray

from lifemem_ray.actors.client.blocking import MemoryClient
from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.core.model import Trajectory
from lifemem_ray.core.tenancy import DEFAULT_TENANT
from lifemem_ray.engine.ingest import pack_trajectories
from lifemem_ray.lab.synthetic import generate, text_vectors

ENVS = ["shop", "sql", "retail", "airline"]
ACCEPTED = {"added", "pending", "duplicate"}  # an add's per-item answers that mean "stored"


def trajectories(prefix: str, n: int, size: int, tenant: str = DEFAULT_TENANT) -> list[Trajectory]:
    """Batch ``n`` of a load: the same ids and content each time it is asked for."""
    made = generate(size, seed=n, envs=ENVS, length_scale=0.1, failure_rate=0.0, id_prefix=f"{prefix}-{n}")
    return [Trajectory.from_dict(t.to_dict(), tenant=tenant) for t in made]


def client(spec: dict[str, Any]) -> MemoryClient:
    """A MemoryClient of the deployment, its call timeout from the spec's settings."""
    config = DeploymentConfig().replace(spec.get("settings", {}))
    return MemoryClient.connect(spec["namespace"], spec["address"], config)


class Events:
    """The calls of a job, one JSON line each, flushed as they end."""

    def __init__(self, path: str | None) -> None:
        self.out = open(path, "a", buffering=1) if path else None  # noqa: SIM115 - closed by close()
        self.lock = threading.Lock()
        self.rows: list[dict[str, Any]] = []

    def add(self, row: dict[str, Any]) -> None:
        with self.lock:
            self.rows.append(row)
            if self.out is not None:
                self.out.write(json.dumps(row) + "\n")

    def close(self) -> None:
        if self.out is not None:
            self.out.close()


def http(url: str, key: str, path: str, body: Any, timeout_s: float) -> tuple[int | None, Any, str | None]:
    """One POST with the key: (status, answer, Retry-After); status None when no answer came."""
    request = urllib.request.Request(
        url + path,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Authorization": "Bearer " + key, "content-type": "application/json"},
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=timeout_s) as answer:
            return answer.status, json.loads(answer.read()), None
    except urllib.error.HTTPError as exc:
        text = exc.read().decode(errors="replace")
        try:
            detail = json.loads(text)
        except ValueError:
            detail = text
        return exc.code, detail, exc.headers.get("Retry-After")
    except OSError as exc:
        return None, f"{type(exc).__name__}: {exc}", None


def timed(events: Events, row: dict[str, Any], call: Any) -> tuple[Any, dict[str, Any]]:
    """``call()`` (which returns its value and what to record of it) timed into one event: its
    status, or its error's type and message. Returns the value (None on an error) and the event."""
    started = time.time()
    try:
        value, seen = call()
    except Exception as exc:
        value, seen = None, {"error": type(exc).__name__, "why": str(exc)[:300]}
    event = {**row, "t": started, "s": time.time() - started, **seen}
    events.add(event)
    return value, event


def rest_add(spec: dict[str, Any], batch: list[Trajectory]) -> tuple[list[dict] | None, dict[str, Any]]:
    records = [t.to_dict() for t in batch]
    for record in records:
        record.pop("tenant", None)  # the key decides it
    status, answer, retry_after = http(
        spec["url"], spec["key"], "/v1/trajectories", {"trajectories": records}, spec["http_timeout_s"]
    )
    row: dict[str, Any] = {"status": status, "retry_after": retry_after}
    if status != 200:
        row["why"] = json.dumps(answer)[:300]
        return None, row
    items = answer["items"]
    ok = sorted(i["id"] for i in items) == sorted(t.id for t in batch) and all(i["status"] in ACCEPTED for i in items)
    row["statuses"] = dict(Counter(i["status"] for i in items))
    return (items if ok else None), row


def client_add(
    memory: MemoryClient, spec: dict[str, Any], batch: list[Trajectory]
) -> tuple[list | None, dict[str, Any]]:
    """``batch`` added through the ``MemoryClient`` (its resends and in-doubt rules), as REST adds are recorded."""
    results = memory.add_many(batch).result(timeout=spec["http_timeout_s"])
    statuses = Counter(r.status for r in results)
    ok = all(r.status in ACCEPTED for r in results)
    return (results if ok else None), {"status": 200 if ok else None, "statuses": dict(statuses)}


def adder(
    spec: dict[str, Any], events: Events, stop: threading.Event, unanswered: list[int], memory: MemoryClient
) -> None:
    deadline = time.monotonic() + spec["seconds"]
    n = 0
    while not stop.is_set() and time.monotonic() < deadline and n < spec["max_batches"]:
        batch = trajectories(spec["prefix"], n, spec["batch"], spec["tenant"])
        if spec.get("client_adds") and n % 2:
            row, call = {"op": "add", "via": "client", "batch": n}, lambda b=batch: client_add(memory, spec, b)
        else:
            row, call = {"op": "add", "via": "rest", "batch": n}, lambda b=batch: rest_add(spec, b)
        items, event = timed(events, row, call)
        if items is None:
            unanswered.append(n)
            stop.wait(min(float(event.get("retry_after") or 1), spec["pause_s"]))
        n += 1


def retriever(spec: dict[str, Any], events: Events, stop: threading.Event, memory: MemoryClient) -> None:
    deadline = time.monotonic() + spec["seconds"]
    queries = [t.task for n in range(4) for t in trajectories(spec["prefix"], n, spec["batch"], spec["tenant"])]
    i = 0
    while not stop.is_set() and time.monotonic() < deadline:
        task = queries[i % len(queries)]
        if i % 2 == 0:
            body = {"queries": [{"task": task}], "k": 3}

            def rest(body: dict = body) -> tuple[Any, dict[str, Any]]:
                status, answer, retry_after = http(
                    spec["url"], spec["key"], "/v1/retrieve", body, spec["http_timeout_s"]
                )
                row = {"status": status, "retry_after": retry_after}
                if status != 200:
                    row["why"] = json.dumps(answer)[:300]
                return answer, row

            timed(events, {"op": "retrieve", "via": "rest"}, rest)
        else:
            timed(
                events,
                {"op": "retrieve", "via": "client"},
                lambda t=task: (memory.retrieve(t, None, 3, tenant=spec["tenant"]), {"status": 200}),
            )
        i += 1
        stop.wait(spec["pause_s"] / 4)


def settle(spec: dict[str, Any], events: Events, unanswered: list[int]) -> dict[str, Any]:
    """Send each unacknowledged batch again until acknowledged (its ids make it idempotent)."""
    deadline = time.monotonic() + spec["settle_s"]
    left = list(unanswered)
    tries = 0
    while left and time.monotonic() < deadline:
        n = left[0]
        batch = trajectories(spec["prefix"], n, spec["batch"], spec["tenant"])
        tries += 1
        if timed(events, {"op": "resend", "via": "rest", "batch": n}, lambda b=batch: rest_add(spec, b))[0] is None:
            time.sleep(1)
        else:
            left.pop(0)
    return {"resent_batches": len(unanswered), "tries": tries, "unsettled": left}


def stored_once(memory: MemoryClient, batch: list[Trajectory]) -> dict[str, list[str]]:
    """Per kind, the ids of ``batch`` that no shard holds, two shards hold, or one holds with
    other content (``known`` on every shard: the store's own id index)."""
    packed = pack_trajectories(batch, None, memory.dim, memory.config.evolution.workflow_features)
    answers = ray.get([s.known.remote(packed.ids, packed.fingerprints) for s in memory.shards], timeout=120)
    out: dict[str, list[str]] = {"missing": [], "doubled": [], "conflict": []}
    for i, trajectory in enumerate(batch):
        found = [a[i] for a in answers if a[i] is not None]
        if not found:
            out["missing"].append(trajectory.id)
        elif len(found) > 1:
            out["doubled"].append(trajectory.id)
        elif found[0].status != "duplicate":
            out["conflict"].append(trajectory.id)
    return out


def job_load(spec: dict[str, Any]) -> dict[str, Any]:
    memory = client(spec)
    events = Events(spec.get("events"))
    stop = threading.Event()
    unanswered: list[int] = []
    threads = [
        threading.Thread(target=adder, args=(spec, events, stop, unanswered, memory), name="adder"),
        threading.Thread(target=retriever, args=(spec, events, stop, memory), name="retriever"),
    ]
    for thread in threads:
        thread.start()
    stop_file = Path(spec["stop_file"])
    deadline = time.monotonic() + spec["seconds"]
    while not stop_file.exists() and time.monotonic() < deadline and any(t.is_alive() for t in threads):
        time.sleep(0.2)
    stop.set()
    for thread in threads:
        thread.join(timeout=spec["http_timeout_s"] + 30)
    sent = sorted({row["batch"] for row in events.rows if row["op"] == "add"})
    settled = settle(spec, events, unanswered)
    acknowledged = [n for n in sent if n not in settled["unsettled"]]
    # Items a resend found stored already: their first attempt committed before it failed.
    settled["found_stored"] = sum(
        row.get("statuses", {}).get("duplicate", 0) for row in events.rows if row["op"] == "resend"
    )
    checked: dict[str, list[str]] = {"missing": [], "doubled": [], "conflict": []}
    ids: list[str] = []
    for start in range(0, len(acknowledged), 20):
        batch = [
            t
            for n in acknowledged[start : start + 20]
            for t in trajectories(spec["prefix"], n, spec["batch"], spec["tenant"])
        ]
        ids += [t.id for t in batch]
        for kind, found in stored_once(memory, batch).items():
            checked[kind] += found
    events.close()
    return {"batches": len(sent), "ids": len(ids), "acknowledged": ids, "settle": settled, "stored": checked}


def job_fixed(spec: dict[str, Any]) -> dict[str, Any]:
    memory = client(spec)
    made = trajectories(spec["prefix"], 0, spec["count"], spec["tenant"])
    added: list[str] = []
    if spec.get("add", True):
        results = memory.add_many(made).result(timeout=300)
        added = [r.id for r in results if r.status in ACCEPTED]
    queries = made[:: spec["every"]]
    found = memory.retrieve_many([t.task for t in queries], [t.env for t in queries], spec["k"], tenant=spec["tenant"])
    per_shard = [s["trajectories"] for s in memory.stats(spec["tenant"])["shards"]]
    return {
        "added": added,
        "answers": [[h.id for h in r.trajectories] for r in found],
        "per_shard": per_shard,
        "stored": stored_once(memory, made),
    }


def vectors_of(batch: list[Trajectory]) -> Any:
    return text_vectors([t.task for t in batch])


def job_bench_add(spec: dict[str, Any]) -> dict[str, Any]:
    memory = client(spec)
    latencies: list[float] = []
    lock = threading.Lock()
    counter = iter(range(10**9))
    stored = 0
    deadline = time.monotonic() + spec["seconds"]

    def run(worker: int) -> None:
        nonlocal stored
        while time.monotonic() < deadline:
            batch = trajectories(f"{spec['prefix']}-{worker}", next(counter), spec["batch"])
            vectors = vectors_of(batch)
            started = time.perf_counter()
            results = memory.add_many(batch, vectors).result(timeout=300)
            took = time.perf_counter() - started
            with lock:
                latencies.append(took)
                stored += sum(r.status in ACCEPTED for r in results)

    started = time.perf_counter()
    with ThreadPoolExecutor(spec["threads"]) as pool:
        list(pool.map(run, range(spec["threads"])))
    elapsed = time.perf_counter() - started
    latencies.sort()
    return {
        "adds": len(latencies),
        "trajectories": stored,
        "seconds": round(elapsed, 2),
        "per_s": round(stored / elapsed, 1),
        "p50_ms": round(1000 * latencies[len(latencies) // 2], 1),
        "p99_ms": round(1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 1),
    }


def job_preload(spec: dict[str, Any]) -> dict[str, Any]:
    memory = client(spec)
    batches = range((spec["count"] + spec["batch"] - 1) // spec["batch"])
    started = time.perf_counter()

    def add(n: int) -> int:
        batch = trajectories(spec["prefix"], n, min(spec["batch"], spec["count"] - n * spec["batch"]))
        return sum(r.status in ACCEPTED for r in memory.add_many(batch, vectors_of(batch)).result(timeout=600))

    with ThreadPoolExecutor(spec["threads"]) as pool:
        stored = sum(pool.map(add, batches))
    return {"stored": stored, "seconds": round(time.perf_counter() - started, 1)}


def job_until_serving(spec: dict[str, Any]) -> dict[str, Any]:
    memory = client(spec)
    batch = trajectories(spec["prefix"], 0, spec["queries"], spec.get("tenant", DEFAULT_TENANT))
    vectors = vectors_of(batch)
    errors: Counter[str] = Counter()
    deadline = time.monotonic() + spec["seconds"]
    while time.monotonic() < deadline:
        try:
            memory.retrieve_many(
                [t.task for t in batch],
                [None] * len(batch),
                3,
                vectors=vectors,
                tenant=spec.get("tenant", DEFAULT_TENANT),
            )
            return {"serving_at": time.time(), "errors": dict(errors)}
        except Exception as exc:
            errors[type(exc).__name__] += 1
            time.sleep(0.5)
    return {"serving_at": None, "errors": dict(errors)}


JOBS = {
    "load": job_load,
    "fixed": job_fixed,
    "bench_add": job_bench_add,
    "preload": job_preload,
    "until_serving": job_until_serving,
}

if __name__ == "__main__":
    job, spec = sys.argv[1], json.loads(sys.argv[2])
    answer = JOBS[job](spec)
    if spec.get("out"):
        Path(spec["out"]).write_text(json.dumps(answer))
    print(json.dumps(answer))
