"""``lifemem-ray compact --store DIR``: rewrite a store that no process is using, in place.

LMDB keeps the bytes of deleted records in free pages and in the unused middle of live pages
until it happens to reuse them. Compaction opens the store for writing (its writer lock: a
store another process has open is refused), which also finishes a purge a crash interrupted,
rewrites every live record into fresh pages beside the data file, swaps the copy in
atomically (:meth:`lifemem_ray.engine.store.storage.MemoryStore.compact`) and saves the index cache anew
(:meth:`lifemem_ray.engine.local_shard.EngineShard.compact`). A running deployment compacts its
shards through :func:`lifemem_ray.actors.cluster.deployment.compact` instead.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lifemem_ray.core.errors import StoreError, StoreLockedError
from lifemem_ray.engine.memory_config import MemoryConfig

__all__ = ["compact_store"]


def compact_store(path: str | os.PathLike[str], config: MemoryConfig | None = None) -> dict[str, Any]:
    """Compact the store in ``path`` (see the module docstring); returns its path and the data
    file's bytes before and after. StoreLockedError when another process has it open."""
    from lifemem_ray.engine.memory import Memory

    path = Path(path)
    if not (path / "data.mdb").is_file():
        shards = sorted(p.parent.name for p in path.glob("shard-*/data.mdb"))
        if shards:
            raise StoreError(
                f"{path}: a deployment's folder (shards {', '.join(shards)}); compact the running deployment "
                f"(`lifemem-ray compact --namespace NS`), or, stopped, each shard's folder (`--store {path / shards[0]}`)"
            )
        raise StoreError(f"{path}: no memory store here (data.mdb missing); name the folder `lifemem-ray ingest` wrote")
    try:
        with Memory.open(path, config or MemoryConfig()) as memory:
            return memory.shard.compact()
    except StoreLockedError as exc:
        who = str(exc).split(";")[0]  # where and who, without the advice for other commands
        raise StoreLockedError(
            f"{who}; compaction needs the store to itself: stop that process first, or compact a "
            "running deployment with `lifemem-ray compact --namespace NS`"
        ) from None
