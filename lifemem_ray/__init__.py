"""lifemem-ray: lifelong workflow memory for LLM agents (LifeMem), sharded on Ray."""

from lifemem_ray.core.model import InvalidTrajectoryError, Outcome, Step, Trajectory
from lifemem_ray.engine.memory_config import ConfigError, MemoryConfig

__all__ = [
    "ConfigError",
    "InvalidTrajectoryError",
    "MemoryConfig",
    "Outcome",
    "Step",
    "Trajectory",
]
__version__ = "0.1.0"
