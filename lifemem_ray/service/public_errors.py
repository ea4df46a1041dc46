"""What a caller of a front door (REST, MCP) may read of a failure on the server's side.

A key's holder is a tenant, not the operator: an answer never names the server's folders or
storage addresses (a shard's store folder, ``cluster.durable_uri``, an ``s3://`` prefix).

* A failure of the memory's storage (:class:`~lifemem_ray.core.errors.StoreError`: a full or
  failing disk under a store, a store that cannot be written; its subclass
  :class:`~lifemem_ray.engine.store.shared_log.SharedLogError`: the durable storage unreachable,
  read-only, full, or refusing the write) reads as one sentence saying which storage is
  unavailable (:func:`storage_failure`); the front door answers it 503 with ``Retry-After``
  and logs the full message, which names the path and the cause, for the operator.
* Any other server-side message a tenant is shown (a shard that is unavailable, an unexpected
  error) has its absolute paths and URLs replaced by ``<server path>`` (:func:`without_paths`).

>>> from lifemem_ray.core.errors import StoreError
>>> storage_failure(StoreError("no space left on the device in /srv/lifemem/shard-00"))
"the memory's storage is unavailable; retry later"
>>> without_paths("shared log s3://bucket/ns/shard-01: appending entry 6 failed ('/srv/x/.6.txn')")
"shared log <server path>: appending entry 6 failed ('<server path>')"
"""

from __future__ import annotations

import re

from lifemem_ray.core.errors import StoreError
from lifemem_ray.engine.store.shared_log import SharedLogError

__all__ = ["DURABLE_UNAVAILABLE", "SERVER_PATH", "STORAGE_UNAVAILABLE", "storage_failure", "without_paths"]

STORAGE_UNAVAILABLE = "the memory's storage is unavailable; retry later"
DURABLE_UNAVAILABLE = "the memory's durable storage is unavailable; retry later"
SERVER_PATH = "<server path>"

_STOP = r"\s'\"`<>()\[\]{},;"  # what ends a path in a message: space, quotes, brackets, separators
_PATHS = re.compile(
    rf"\b[A-Za-z][A-Za-z0-9+.-]*://[^{_STOP}]*[^{_STOP}:.]"  # a URL: s3://bucket/prefix, file:///srv/x
    rf"|(?<![\w./~-])/[^{_STOP}:]*[^{_STOP}:.]"  # an absolute POSIX path (not 1/2, a/b or a route's tail)
    rf"|\b[A-Za-z]:\\[^{_STOP}:]*[^{_STOP}:.]"  # a Windows path
)  # none ends with the sentence's ':' or '.'


def storage_failure(exc: BaseException) -> str | None:
    """The sentence a tenant reads for a failure of the memory's storage.

    Args:
        exc: the error a memory call raised (already unwrapped from Ray's wrapper).

    Returns:
        :data:`DURABLE_UNAVAILABLE` for the durable storage (the shared log and its
        checkpoints), :data:`STORAGE_UNAVAILABLE` for a shard's own store, None for any other
        error.
    """
    if isinstance(exc, SharedLogError):
        return DURABLE_UNAVAILABLE
    if isinstance(exc, StoreError):
        return STORAGE_UNAVAILABLE
    return None


def without_paths(text: str) -> str:
    """``text`` with every absolute path and URL in it replaced by :data:`SERVER_PATH`.

    Args:
        text: a server-side message about to be shown to a tenant.

    Returns:
        The same message without the server's folders and storage addresses.
    """
    return _PATHS.sub(SERVER_PATH, text)
