"""Timing a load from threads, shared by the benchmarks that drive a memory from several clients
(``text_path.py``, ``client_path.py``, ``peer_mem0.py``, ``http_load.py``): the standard library only, so that a
benchmark's side running in another environment (``peer_mem0_side.py``) can use it too."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["percentile_ms", "timed", "timed_work", "together"]


def percentile_ms(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100, nearest rank) of ``values`` in seconds, as milliseconds."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))], 2)


def timed(clients: int, seconds: float, op: Callable[[], int]) -> dict[str, Any]:
    """``op`` called by ``clients`` threads for ``seconds``; ``op`` returns how many memory
    operations it made. Operations/s, and p50 / p99 of one call; a call that raised is counted
    by its exception's name and the phase goes on."""
    stop = time.monotonic() + seconds
    latencies: list[float] = []
    counted = [0]
    errors: dict[str, int] = {}
    lock = threading.Lock()

    def loop() -> None:
        while time.monotonic() < stop:
            began = time.perf_counter()
            try:
                made = op()
            except Exception as exc:  # counted; the phase goes on
                with lock:
                    errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                continue
            with lock:
                latencies.append(time.perf_counter() - began)
                counted[0] += made

    began = time.monotonic()
    threads = [threading.Thread(target=loop) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.monotonic() - began
    return {
        "ops_per_s": round(counted[0] / took, 1),
        "calls": len(latencies),
        "p50_ms": percentile_ms(latencies, 50),
        "p99_ms": percentile_ms(latencies, 99),
        "errors": errors,
    }


def together(calls: list[Callable[[], Any]]) -> list[Any]:
    """Run ``calls`` at once, one thread each; their answers (the first error is raised here)."""
    out: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            out[i] = calls[i]()
        except Exception as exc:  # re-raised below, in the caller's thread
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for answer in out:
        if isinstance(answer, Exception):
            raise answer
    return out


def timed_work(op: Callable[[Any], tuple[int, int]], work: Sequence[Any], clients: int) -> dict[str, Any]:
    """``op`` once per item of ``work``, from ``clients`` threads taking items from one queue;
    ``op`` returns (items it did, results it returned). Raw figures, for the caller to reduce the
    same way whichever environment measured them: wall seconds, per-call seconds, items done,
    errors by exception name, and the mean number of results a call returned."""
    todo = list(reversed(work))
    latencies: list[float] = []
    returned: list[int] = []
    items = [0]
    errors: dict[str, int] = {}
    lock = threading.Lock()

    def loop() -> None:
        while True:
            with lock:
                if not todo:
                    return
                item = todo.pop()
            began = time.perf_counter()
            try:
                done, results = op(item)
            except Exception as exc:  # counted; the phase goes on
                with lock:
                    errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                continue
            took = time.perf_counter() - began
            with lock:
                latencies.append(took)
                returned.append(results)
                items[0] += done

    began = time.perf_counter()
    threads = [threading.Thread(target=loop) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {
        "wall_s": time.perf_counter() - began,
        "items": items[0],
        "latencies_s": latencies,
        "errors": errors,
        "mean_results": sum(returned) / len(returned) if returned else 0.0,
    }
