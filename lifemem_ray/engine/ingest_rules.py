"""The rules of ingest, written once: every entry point (``Memory.add`` / ``add_many``, the
prepared-items path, a shard's commit, the coordinator's micro-batches) calls these.

* **Ids.** A trajectory id the memory does not hold is *fresh*; one stored with the same
  content (fingerprint) is a *duplicate* (reported, not stored again); one stored with other
  content, or repeated inside one request with other content, is a *conflict*, and the whole
  request is refused: nothing of it is stored (:class:`IdConflictError`). A repeat inside
  one request with the same content is a duplicate of its first occurrence.
* **Vectors.** Task vectors are finite, non-zero, of the store's dimension, L2-normalised
  here (:func:`unit_rows`).
* **Planning.** One :class:`~lifemem_ray.engine.clustering.evolution.BatchPlanner` per batch, built by
  :func:`make_planner`; what its plan counted goes to the store as :func:`plan_counters`.

Example:

>>> from lifemem_ray.engine.ingest_rules import classify_ids
>>> got = classify_ids(["a", "b", "a"], ["f1", "f2", "f1"], [None, ("f2", 7), None])
>>> got.fresh, got.results[1].status, got.first
([0], 'duplicate', {'a': 0, 'b': 1})
>>> got.complete()[2].status  # the repeat of "a" reports its first occurrence
'duplicate'
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lifemem_ray.core.errors import IdConflictError, InvalidArgumentError

__all__ = [
    "AddResult",
    "IdClasses",
    "caller_results",
    "classify_ids",
    "conflict_error",
    "make_decider",
    "make_planner",
    "plan_counters",
    "refuse_conflicts",
    "unit_rows",
]


@dataclass(frozen=True, slots=True)
class AddResult:
    """What happened to one trajectory of an add."""

    id: str
    status: str  # added | duplicate | pending (stored, waiting for the initial partition) | conflict (never returned by an add)
    cluster_id: int | None

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "status": self.status, "cluster_id": self.cluster_id}


@dataclass
class IdClasses:
    """One request's ids, classified (see the module docstring).

    ``results[i]``: the result of a duplicate (or, for a conflict with stored content, a
    ``conflict`` result); None for a fresh id and for in-request repeats. ``fresh``: the
    positions to store (first occurrences of new ids). ``first``: id -> position of its
    first occurrence. ``conflicts``: (position, why) of every conflict."""

    ids: list[str]
    results: list[AddResult | None]
    fresh: list[int]
    first: dict[str, int]
    conflicts: list[tuple[int, str]] = field(default_factory=list)

    def complete(self, placed: Sequence[AddResult] | None = None) -> list[AddResult]:
        """Every position's result once the fresh ones are ``placed`` (in ``fresh`` order;
        without it they read ``pending``): an in-request repeat reports its first occurrence."""
        out = list(self.results)
        for i, result in zip(
            self.fresh,
            placed if placed is not None else [AddResult(self.ids[i], "pending", None) for i in self.fresh],
            strict=True,
        ):
            out[i] = result
        for i, tid in enumerate(self.ids):
            if out[i] is None:
                got = out[self.first[tid]]
                out[i] = AddResult(tid, "duplicate", got.cluster_id if got is not None else None)
        return out  # type: ignore[return-value]


def caller_results(results: Sequence[AddResult]) -> list[AddResult]:
    """Results as the caller reads them: ids without their tenant (the engine, the shards and
    the coordinator classify by id key, :func:`lifemem_ray.core.tenancy.id_key`)."""
    from lifemem_ray.core.tenancy import SEP, caller_id

    return [AddResult(caller_id(r.id), r.status, r.cluster_id) if SEP in r.id else r for r in results]


def classify_ids(
    ids: Sequence[str], fingerprints: Sequence[str], stored: Sequence[tuple[str, int | None] | None]
) -> IdClasses:
    """Classify a request's ids. ``stored[i]``: the (fingerprint, cluster id) a store holds for
    ``ids[i]``, or None when no store holds it."""
    if not len(ids) == len(fingerprints) == len(stored):
        raise InvalidArgumentError(
            f"{len(ids)} ids, {len(fingerprints)} fingerprints, {len(stored)} lookups; need one of each per id",
            where="classify_ids",
        )
    out = IdClasses(list(ids), [None] * len(ids), [], {})
    for i, (tid, fp, got) in enumerate(zip(ids, fingerprints, stored, strict=True)):
        if tid in out.first:
            if fingerprints[out.first[tid]] != fp:
                out.conflicts.append(
                    (i, f"trajectory id {_named(tid)} is repeated in this request with different content")
                )
            continue
        out.first[tid] = i
        if got is None:
            out.fresh.append(i)
        elif got[0] != fp:
            out.results[i] = AddResult(tid, "conflict", got[1])
            out.conflicts.append((i, f"trajectory id {_named(tid)} is already stored with different content"))
        else:
            out.results[i] = AddResult(tid, "duplicate", got[1])
    return out


def _named(key: str) -> str:
    """An id key as its caller knows it: the id, and the tenant when it is not the default."""
    from lifemem_ray.core.tenancy import split_scope

    tenant, tid = split_scope(key)
    return repr(tid) if tid == key else f"{tid!r} of tenant {tenant!r}"


def refuse_conflicts(classes: IdClasses, where: str = "") -> None:
    """Raise :func:`conflict_error` when there are conflicts: nothing of the request may be stored."""
    if classes.conflicts:
        raise conflict_error(classes.conflicts, where)


def conflict_error(conflicts: list[tuple[int, str]], where: str = "") -> IdConflictError:
    """The :class:`IdConflictError` naming ``conflicts`` (``(position, why)``, at least one),
    up to five of them."""
    shown = "; ".join(why for _, why in conflicts[:5])
    more = f" (and {len(conflicts) - 5} more)" if len(conflicts) > 5 else ""
    return IdConflictError(
        f"{shown}{more}; nothing of this request was stored "
        "(give the new content a new id, or remove the stored trajectory first)",
        where=where or None,
    )


def unit_rows(vectors: Any, n: int, dim: int, what: str = "vectors") -> np.ndarray:
    """Validated, L2-normalised float32 (n, dim) vectors, or a ValueError naming the row."""
    try:
        arr = np.asarray(vectors, dtype=np.float32)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"not numeric ({exc})", where=what) from None
    if arr.ndim == 1 and n == 1:
        arr = arr[None, :]
    if arr.shape != (n, dim):
        raise InvalidArgumentError(f"expected shape ({n}, {dim}), got {tuple(arr.shape)}", where=what)
    if not np.isfinite(arr).all():
        bad = int(np.argwhere(~np.isfinite(arr))[0][0])
        raise InvalidArgumentError("contains NaN or infinity", where=f"{what}[{bad}]")
    norms = np.linalg.norm(arr, axis=1)
    if (norms == 0).any():
        raise InvalidArgumentError(f"{what}[{int(np.argmin(norms))}]: zero vector")
    return np.ascontiguousarray(arr / norms[:, None], dtype=np.float32)


def make_planner(clusters: dict, policy: Any, config: Any, dim: int, wdim: int, decider: Any) -> Any:
    """The batch planner every ingest path uses (``config``: the whole MemoryConfig)."""
    from lifemem_ray.engine.clustering.evolution import BatchPlanner

    return BatchPlanner(clusters, policy, config.evolution, dim=dim, wdim=wdim, decider=decider, llm_config=config.llm)


def make_decider(config: Any, metrics: Any = None) -> Any:
    """The LLM decider the configuration asks for (``llm.backend = "openai"``), else None: the
    offline policy decides. Every ingest path (engine, coordinator) builds it here; ``metrics``:
    the :class:`~lifemem_ray.core.metrics.MetricsSink` its calls are recorded in."""
    if config.llm.backend != "openai":
        return None
    from lifemem_ray.llm.decider import LLMDecider

    return LLMDecider(config.llm, metrics=metrics)


def plan_counters(plan: Any) -> dict[str, int]:
    """What a plan counted, in the store's ``counters`` meta."""
    return {"llm_requests": plan.llm_requests, "llm_fallbacks": plan.llm_fallbacks, "llm_skipped": plan.llm_skipped}
