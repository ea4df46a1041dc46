"""The engine's parts over one open store, built and closed together: what the user façade
(:class:`~lifemem_ray.engine.memory.Memory`) and the shard protocol
(:class:`~lifemem_ray.engine.local_shard.EngineShard`) both call, so that neither calls the
other and each rule (a tenant check, when maintenance runs) is in the part that owns it."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from lifemem_ray.core.decisions import Decider
from lifemem_ray.core.errors import IndexSaveError
from lifemem_ray.core.metrics import MetricsSink
from lifemem_ray.engine.audit import Audit
from lifemem_ray.engine.deletion import Deletion
from lifemem_ray.engine.embedding import Embedder
from lifemem_ray.engine.ingest import Ingest
from lifemem_ray.engine.maintenance import Maintenance
from lifemem_ray.engine.memory_config import MemoryConfig
from lifemem_ray.engine.reads import Reads
from lifemem_ray.engine.search import Search
from lifemem_ray.engine.state import EngineState
from lifemem_ray.engine.transfer import Transfer

__all__ = ["EngineParts"]

log = logging.getLogger(__name__)


@dataclass
class EngineParts:
    """One store's state and its parts (one job each, see :mod:`lifemem_ray.engine.memory`)."""

    state: EngineState
    ingest: Ingest
    search: Search
    reads: Reads
    transfer: Transfer
    deletion: Deletion
    audit: Audit
    maintenance: Maintenance

    @classmethod
    def open(
        cls,
        path: str | Path,
        config: MemoryConfig | None = None,
        *,
        embedder: Embedder | None = None,
        decider: Decider | None = None,
        dim: int | None = None,
        read_only: bool = False,
        namespace: int = 0,
        metrics: MetricsSink | None = None,
    ) -> EngineParts:
        """Open the store and build the parts; a purge a crash interrupted is finished first,
        then background maintenance starts (when configured)."""
        state = EngineState(
            path,
            config,
            embedder=embedder,
            decider=decider,
            dim=dim,
            read_only=read_only,
            namespace=namespace,
            metrics=metrics,
        )
        parts = cls(
            state,
            Ingest(state),
            Search(state),
            Reads(state),
            Transfer(state),
            Deletion(state),
            Audit(state),
            Maintenance(state),
        )
        try:
            parts.deletion.resume()
        except BaseException:
            state.store.close()
            raise
        parts.maintenance.start()
        return parts

    def close(self) -> None:
        """Stop background work, save the index as a fresh cache, close the decider, the embedding
        service it opened and the store; idempotent."""
        s = self.state
        if s.closed:
            return
        self.maintenance.stop()
        with s.lock:
            try:
                if not s.read_only:
                    s.save_index()
            except IndexSaveError as exc:  # a cache: losing it costs a rebuild at the next open, never data
                log.warning("%s", exc)
            except Exception:
                log.warning("could not save the index cache", exc_info=True)
            if s.decider is not None and hasattr(s.decider, "close"):
                s.decider.close()
            s.close_embedder()
            s.store.close()
            s.closed = True
