"""The Mem0 OSS side of ``benchmarks/peer_mem0.py``: run in Mem0's own virtualenv, never the project's.

Imports only mem0, the standard library, numpy and ``load_timing.py`` beside it (standard library) (Mem0 is no dependency of the project). Reads a
JSON job (``--job PATH``: the texts, ``k``, the client count, the local model folder), builds a
Mem0 ``Memory`` over FAISS (cosine, 384 dimensions) and the shipped MiniLM through
sentence-transformers, with an OpenAI LLM config that points at a local socket nobody answers
(Mem0 builds an LLM client at construction; with ``infer=False`` it must never call it: the
socket counts connections and ``generate_response`` is wrapped to count calls). Then, each
phase one after the other: untimed warm-up adds and searches, one ``add(text, infer=False)`` per
text, one search per query text, the same searches from ``clients`` threads, one text searched
again and again. Prints raw timings (wall seconds and per-call seconds) as JSON on stdout; the
figures are computed by the caller, the same way for both sides.

Usage (by peer_mem0.py): MEM0_PYTHON benchmarks/peer_mem0_side.py --job JOB.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import threading
import time
from typing import Any

from load_timing import timed_work  # benchmarks/ (the script's folder): the standard library only

USER = "bench-user"


class SilentLlmEndpoint:
    """A listening socket on 127.0.0.1 that counts the connections made to it (none expected)."""

    def __init__(self) -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.bind(("127.0.0.1", 0))
        self._socket.listen(16)
        self._socket.settimeout(0.2)
        self.port = self._socket.getsockname()[1]
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._socket.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._socket.close()


def mem0_config(folder: str, model_dir: str, llm_port: int) -> dict[str, Any]:
    """FAISS (cosine: normalised vectors, inner product) in ``folder``, the local MiniLM through
    sentence-transformers, and an LLM config that only points at the silent local endpoint."""
    return {
        "vector_store": {
            "provider": "faiss",
            "config": {
                "collection_name": "bench",
                "path": os.path.join(folder, "faiss"),
                "distance_strategy": "cosine",
                "embedding_model_dims": 384,
            },
        },
        "embedder": {
            "provider": "huggingface",
            "config": {"model": model_dir, "embedding_dims": 384, "model_kwargs": {"device": "cpu"}},
        },
        "llm": {
            "provider": "openai",
            "config": {
                "model": "never-called",
                "api_key": "benchmark-dummy-key",
                "openai_base_url": f"http://127.0.0.1:{llm_port}/v1",
            },
        },
        "history_db_path": os.path.join(folder, "history.db"),
    }


def run(job: dict[str, Any], folder: str) -> dict[str, Any]:
    """Build Mem0 in ``folder`` (a fresh one) and run every phase of ``job``; the raw timings."""
    os.environ.setdefault("MEM0_DIR", os.path.join(folder, "mem0home"))
    endpoint = SilentLlmEndpoint()
    import mem0
    import torch
    from mem0 import Memory

    began = time.perf_counter()
    memory = Memory.from_config(mem0_config(folder, job["model_dir"], endpoint.port))
    open_s = time.perf_counter() - began
    llm_calls = [0]
    generate = memory.llm.generate_response

    def counted_generate(*args: Any, **kwargs: Any) -> Any:
        llm_calls[0] += 1
        return generate(*args, **kwargs)

    memory.llm.generate_response = counted_generate
    k, clients = job["k"], job["clients"]

    def add(text: str) -> tuple[int, int]:
        out = memory.add(text, user_id=USER, infer=False)
        return 1, len(out.get("results", [])) if isinstance(out, dict) else 0

    def search(text: str) -> tuple[int, int]:
        out = memory.search(text, top_k=k, filters={"user_id": USER}, threshold=0.0)
        return 1, len(out.get("results", [])) if isinstance(out, dict) else 0

    warm = {"adds": timed_work(add, job["warm_adds"], 1), "searches": timed_work(search, job["warm_queries"], 1)}
    phases = {
        "adds": timed_work(add, job["adds"], 1),
        "retrieve_1": timed_work(search, job["queries"], 1),
        "retrieve_n": timed_work(search, job["queries"], clients),
        "same_text": timed_work(search, [job["queries"][0]] * job["same_text_calls"], 1),
    }
    try:
        import spacy  # noqa: F401

        spacy_installed = True
    except ImportError:
        spacy_installed = False
    stored = len(memory.vector_store.index_to_id)
    endpoint.close()
    return {
        "phases": phases,
        "warm_up_errors": {name: w["errors"] for name, w in warm.items()},
        "open_s": open_s,
        "stored_after": stored,
        "llm_generate_calls": llm_calls[0],
        "llm_endpoint_connections": endpoint.connections,
        "mem0_version": getattr(mem0, "__version__", "unknown"),
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "spacy_installed": spacy_installed,
        "telemetry": os.environ.get("MEM0_TELEMETRY", "(unset: on)"),
        "embedder_class": type(memory.embedding_model).__name__,
        "vector_store_class": type(memory.vector_store).__name__,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--job", required=True, help="the JSON job peer_mem0.py wrote")
    args = ap.parse_args()
    with open(args.job, encoding="utf-8") as f:
        job = json.load(f)
    with tempfile.TemporaryDirectory(prefix="peer-mem0-") as folder:
        result = run(job, folder)
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
