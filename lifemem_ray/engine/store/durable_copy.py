"""A store made from its shared log alone (the newest checkpoint plus the entries after it),
in a new folder, the log only read: what ``lifemem-ray restore`` starts from when given a
durable address instead of a snapshot folder (a deployment lost whole, or resharded)."""

from __future__ import annotations

from pathlib import Path

from lifemem_ray.core.errors import PathExistsError, PathNotFoundError
from lifemem_ray.engine.store.shared_log import open_shared_log
from lifemem_ray.engine.store.storage import MemoryStore

__all__ = ["materialize"]


def materialize(log_uri: str, folder: str | Path, endpoint_url: str = "") -> Path:
    """The store whose log is at ``log_uri``, written into the new folder ``folder``.

    >>> import tempfile
    >>> from pathlib import Path
    >>> from lifemem_ray.engine.store.shared_log import SharedLog
    >>> root = Path(tempfile.mkdtemp())
    >>> MemoryStore(root / "live", dim=4, workflow_dim=4, shared_log=SharedLog(str(root / "log"))).close()
    >>> copy = materialize(str(root / "log"), root / "copy")
    >>> MemoryStore(copy, read_only=True).dim
    4
    """
    target = Path(folder)
    if target.exists() and any(target.iterdir()):
        raise PathExistsError(f"{target}: a copy from a shared log needs a new, empty folder")
    shared = open_shared_log(log_uri, endpoint_url, read_only=True)
    if shared is None or shared.is_empty():
        raise PathNotFoundError(f"{log_uri}: no shared log here (no entry and no checkpoint)")
    MemoryStore(target, shared_log=shared).close()  # fetched and replayed on opening; nothing written to the log
    return target
