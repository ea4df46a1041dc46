"""A store made from its shared log alone (the newest whole checkpoint plus the entries after
it), in a new folder, the log only read: what ``lifemem-ray restore`` starts from when given a
durable address instead of a snapshot folder (a deployment lost whole, or resharded).

A damaged entry stops the copy (:class:`~lifemem_ray.engine.store.log_errors.LogDamagedError`)
unless the operator accepted the loss of that entry and everything after it
(``accept_loss_from``): the copy then holds what the entries before it hold, and says so."""

from __future__ import annotations

import logging
from pathlib import Path

from lifemem_ray.core.errors import InvalidArgumentError, PathExistsError, PathNotFoundError
from lifemem_ray.engine.store.shared_log import open_shared_log
from lifemem_ray.engine.store.storage import MemoryStore

__all__ = ["materialize"]

log = logging.getLogger(__name__)


def materialize(
    log_uri: str, folder: str | Path, endpoint_url: str = "", *, accept_loss_from: int | None = None
) -> Path:
    """The store whose log is at ``log_uri``, written into the new folder ``folder``.

    Args:
        log_uri: the shared log (a folder, or an fsspec URL such as ``s3://bucket/prefix``).
        folder: a new, empty folder for the copy.
        endpoint_url: an S3-compatible server's address for ``s3://`` addresses.
        accept_loss_from: replay only the entries before this one (the operator's explicit
            decision to accept the loss of a damaged entry and of every entry after it).

    Returns:
        ``folder``, holding the store.

    Raises:
        PathExistsError: ``folder`` is not empty.
        PathNotFoundError: no shared log at ``log_uri``.
        LogDamagedError: an entry needed cannot be read back (and its loss was not accepted).

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
    if accept_loss_from is not None and accept_loss_from < 1:
        raise InvalidArgumentError(f"an entry number (1 or more), got {accept_loss_from}", where="accept_loss_from")
    shared = open_shared_log(log_uri, endpoint_url, read_only=True)
    if shared is None or shared.is_empty():
        raise PathNotFoundError(f"{log_uri}: no shared log here (no entry and no checkpoint)")
    if accept_loss_from is not None:
        head = shared.head()
        log.warning(
            "%s: the operator accepted the loss of entries %d..%d; the copy in %s holds what the entries before them hold",
            log_uri,
            accept_loss_from,
            head,
            target,
        )
    # Fetched and replayed on opening; nothing is written to the log.
    MemoryStore(target, shared_log=shared, replay_before=accept_loss_from).close()
    return target
