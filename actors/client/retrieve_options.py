"""What a retrieval asks for besides its texts: one typed object every client path carries.

>>> RetrieveOptions(k=4, tenant="acme").skills
True
"""

from __future__ import annotations

from dataclasses import dataclass

from lifemem_ray.core.tenancy import DEFAULT_TENANT

__all__ = ["RetrieveOptions"]


@dataclass(frozen=True)
class RetrieveOptions:
    """A retrieval's options, as :meth:`lifemem_ray.engine.memory.Memory.retrieve` takes them.

    Checked where the retrieval runs (:func:`~lifemem_ray.engine.retrieval.check_retrieve_args`,
    :func:`~lifemem_ray.core.tenancy.search_targets`, the version's parser), each error naming
    the option."""

    k: int | None = None  # trajectories per query (None: retrieval.k)
    token_budget: int | None = None  # the context's budget in tokens (None: retrieval.token_budget)
    skills: bool = True  # the clusters' skills beside the trajectories
    tenant: str = DEFAULT_TENANT  # whose trajectories and skills are searched
    as_of: str | None = None  # a version (``MemoryClient.version()``) to read at: a pinned read
