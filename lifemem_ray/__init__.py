"""lifemem-ray: lifelong workflow memory for LLM agents (LifeMem), sharded on Ray.

The public face of the engine (everything that runs without Ray)::

    from lifemem_ray import Memory, MemoryConfig, Trajectory, Step, Outcome

``Memory``, ``Retrieval`` and ``MemoryAPI`` are imported on first use, so ``import lifemem_ray``
stays light (no FAISS, no LMDB). The Ray layer's face is :mod:`lifemem_ray.actors`.

>>> import lifemem_ray
>>> lifemem_ray.Memory.__name__
'Memory'
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lifemem_ray.core.errors import LifeMemError
from lifemem_ray.core.model import InvalidTrajectoryError, Outcome, Step, Trajectory
from lifemem_ray.engine.memory_config import ConfigError, MemoryConfig

if TYPE_CHECKING:
    from lifemem_ray.engine.memory import Memory
    from lifemem_ray.engine.protocols import MemoryAPI
    from lifemem_ray.engine.retrieval import Retrieval

__all__ = [
    "ConfigError",
    "InvalidTrajectoryError",
    "LifeMemError",
    "Memory",
    "MemoryAPI",
    "MemoryConfig",
    "Outcome",
    "Retrieval",
    "Step",
    "Trajectory",
    "__version__",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """The engine's heavier public names, imported when first asked for (PEP 562)."""
    found: Any
    if name == "Memory":
        from lifemem_ray.engine.memory import Memory as found
    elif name == "MemoryAPI":
        from lifemem_ray.engine.protocols import MemoryAPI as found
    elif name == "Retrieval":
        from lifemem_ray.engine.retrieval import Retrieval as found
    else:
        raise AttributeError(f"module 'lifemem_ray' has no attribute {name!r}")
    globals()[name] = found
    return found
