"""Bringing a store's workflow data up to this version's featurizer.

A trajectory's action tokens and workflow vector are derived from its stored record
(:func:`lifemem_ray.engine.clustering.steps.featurize`), and every cluster's workflow sum and flow counts from
those. A store records which featurizer wrote them (meta ``workflow_features``, e.g.
``roles-v2``; stores from before this was recorded hold ``tokens-v1`` vectors). When this
version featurizes differently, comparing new trajectories with the old vectors would compare
unlike things, so a store opened for writing is migrated first:

1. every trajectory's tokens and workflow vector are recomputed from its record, in chunks,
   one transaction each;
2. every live cluster's workflow sum and flows are recomputed from its members, and a split
   is queued where the paper's rule now holds;
3. the new featurizer is recorded, in the same transaction as step 2.

A crash before step 3 leaves the old featurizer recorded; the next open starts again
(recomputing is idempotent). Text vectors, cluster membership and everything else stay.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from lifemem_ray.engine.clustering.clusters import ClusterRecord
from lifemem_ray.engine.clustering.steps import featurize
from lifemem_ray.engine.clustering.workflow import workflow_summary
from lifemem_ray.engine.store.storage import MemoryStore

__all__ = ["LEGACY_FEATURES", "migrate_features", "stored_features"]

log = logging.getLogger(__name__)

LEGACY_FEATURES = "tokens-v1"  # what a store without the meta key was written with
CHUNK = 2048


def stored_features(store: MemoryStore) -> str:
    """The featurizer the store's workflow vectors were computed with."""
    return str(store.get_meta("workflow_features", default=LEGACY_FEATURES) or LEGACY_FEATURES)


def _rewrite_workflows(store: MemoryStore, txn: Any, rows: list[tuple[int, np.ndarray, list[str]]]) -> None:
    """One chunk of :func:`migrate_features`: the new workflow vector and tokens of each vid."""
    for vid, wvec, tokens in rows:
        store.rewrite_workflow(txn, vid, wvec, tokens)


def migrate_features(
    store: MemoryStore,
    kind: str,
    target: str,
    fold: Callable[[ClusterRecord, np.ndarray, np.ndarray, str, bool | None, str, float], None],
    needs_split: Callable[[ClusterRecord], bool],
    now: float,
) -> int:
    """Recompute the store's workflow data with featurizer ``kind`` and record ``target``;
    returns the trajectories rewritten. ``fold`` adds one member to a cluster's state (the
    engine's own rule) and ``needs_split`` says when the paper's split rule holds."""
    with store.read() as txn:
        vids = [vid for vid, _, _ in store.iter_trajectories(txn)]
    log.warning(
        "%s: recomputing the workflow vectors of %d trajectories (%s -> %s)",
        store.path,
        len(vids),
        stored_features(store),
        target,
    )
    for start in range(0, len(vids), CHUNK):
        chunk = vids[start : start + CHUNK]
        with store.read() as txn:
            rows = []
            for vid in chunk:
                got = store.trajectory(txn, vid)
                if got is not None:
                    tokens, wvec = featurize(got[0], kind, store.workflow_dim)
                    rows.append((vid, wvec, tokens))
        store.write(partial(_rewrite_workflows, store, rows=rows))

    def finish(txn: Any) -> None:
        for record in list(store.iter_clusters(txn)):
            if not record.live:
                continue
            fresh = record.copy()
            fresh.count, fresh.wsum, fresh.tsum = 0, np.zeros_like(record.wsum), np.zeros_like(record.tsum)
            fresh.envs, fresh.flows, fresh.successes, fresh.failures = {}, {}, 0, 0
            for vid in store.members(txn, record.id):
                _, vec, wvec = store.vectors(txn, vid)  # type: ignore[misc]
                brief = store.brief(txn, vid)
                assert brief is not None
                fold(fresh, vec, wvec, brief.env, brief.success, workflow_summary(brief.tokens), now)
            fresh.version = record.version + 1
            store.put_cluster(txn, fresh)
            if needs_split(fresh):
                store.add_todo(txn, fresh.id, split=True)
        store.put_meta(txn, "workflow_features", target)

    store.write(finish)
    return len(vids)
