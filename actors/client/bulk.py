"""Bulk loads through Ray Data: read -> parse and embed in parallel -> coordinator.

``read_text`` (JSONL, native or chat format) or ``read_parquet`` (native columns)
feeds ``map_batches`` with an actor pool that parses each record with the same
strict importer as the CLI and embeds the task texts (one actor per GPU where
there are GPUs); the driver streams the embedded batches to the coordinator with
a bounded number of requests in flight, so memory stays flat however big the input.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from lifemem_ray.actors.client.blocking import AddFuture, MemoryClient
from lifemem_ray.core.importers import parse_record
from lifemem_ray.core.model import InvalidTrajectoryError, Trajectory
from lifemem_ray.engine.memory_config import EmbeddingConfig

__all__ = ["ParseAndEmbed", "bulk_load"]


class ParseAndEmbed:
    """A Ray Data batch function (an actor per worker): records in, trajectories and vectors out."""

    def __init__(self, fmt: str, env: str | None, embedding: EmbeddingConfig | None) -> None:
        self.fmt = fmt
        self.env = env
        self.embedder = None
        if embedding is not None:
            from lifemem_ray.engine.embedding import open_embedder

            self.embedder = open_embedder(embedding)

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        records: list[str] = []
        errors: list[str] = []
        trajs: list[Trajectory] = []
        paths = batch.get("path")
        if "text" in batch:
            rows: Iterable[Any] = batch["text"]
        else:  # parquet: one column per native field
            columns = list(batch)
            rows = [{c: _plain(batch[c][i]) for c in columns if c != "path"} for i in range(len(batch[columns[0]]))]
        for n, row in enumerate(rows):
            where = f"{paths[n]}" if paths is not None else "input"
            try:
                if isinstance(row, str):
                    if not row.strip():
                        continue
                    data = json.loads(row)
                else:
                    data = row
                trajs.append(parse_record(data, fmt=self.fmt, env=self.env))
                records.append(json.dumps(trajs[-1].to_dict(), ensure_ascii=False))
            except (ValueError, InvalidTrajectoryError) as exc:
                snippet = (row if isinstance(row, str) else json.dumps(row, default=str))[:80]
                errors.append(f"{where}: {exc} (record starting {snippet!r})")
        vectors = (
            self.embedder.embed([t.query_text for t in trajs])
            if self.embedder is not None and trajs
            else np.zeros((len(trajs), 0), np.float32)
        )
        return {
            "record": np.asarray(records + [""] * len(errors), dtype=object),
            "vector": np.asarray(list(vectors) + [np.zeros(vectors.shape[1], np.float32)] * len(errors), dtype=object),
            "error": np.asarray([""] * len(records) + errors, dtype=object),
        }


def _plain(value: Any) -> Any:
    """Arrow/numpy values from parquet back to plain Python for the importer."""
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, np.generic):
        return value.item()
    return value


def bulk_load(
    client: MemoryClient,
    paths: list[str],
    *,
    fmt: str = "auto",
    env: str | None = None,
    batch_size: int = 256,
    embedders: int = 1,
    in_flight: int = 4,
    skip_invalid: bool = False,
    progress: Any = None,
) -> dict[str, Any]:
    """Load JSONL or Parquet files into the deployment; returns counts and the first errors."""
    import ray.data

    parquet = all(str(p).endswith(".parquet") for p in paths)
    ds = ray.data.read_parquet(paths, include_paths=True) if parquet else ray.data.read_text(paths, include_paths=True)
    gpus = ray.cluster_resources().get("GPU", 0)
    ds = ds.map_batches(
        ParseAndEmbed,
        fn_constructor_args=(fmt, env, client.config.embedding),
        batch_size=batch_size,
        batch_format="numpy",
        concurrency=max(1, embedders),
        num_cpus=client.config.cluster.embedder_cpus,  # parsing and embedding actors reserve what embedders do
        num_gpus=1 if gpus >= embedders else 0,
    )
    started = time.perf_counter()
    pending: list[AddFuture] = []
    counts = {"records": 0, "added": 0, "duplicates": 0, "invalid": 0}
    errors: list[str] = []

    def settle(block: bool) -> None:
        while pending and (block or len(pending) >= in_flight):
            for result in pending.pop(0).result():
                counts["added" if result.status == "added" else "duplicates"] += 1

    for batch in ds.iter_batches(batch_size=batch_size, batch_format="numpy"):
        bad = [e for e in batch["error"] if e]
        if bad:
            counts["invalid"] += len(bad)
            errors.extend(bad[: max(0, 100 - len(errors))])
            if not skip_invalid:
                settle(block=True)
                raise InvalidTrajectoryError(
                    f"{bad[0]} ({len(bad)} invalid record(s) in this batch; nothing after them was sent)"
                )
        keep = [i for i, e in enumerate(batch["error"]) if not e]
        if not keep:
            continue
        trajs = [Trajectory.from_dict(json.loads(batch["record"][i])) for i in keep]
        vectors = np.stack([batch["vector"][i] for i in keep]).astype(np.float32)
        counts["records"] += len(trajs)
        pending.append(client.add_many(trajs, vectors if vectors.shape[1] else None))
        settle(block=False)
        if progress is not None:
            progress(len(trajs))
    settle(block=True)
    return {**counts, "seconds": round(time.perf_counter() - started, 2), "errors": errors}
