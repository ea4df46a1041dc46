"""The parts of :class:`lifemem_ray.memory.Memory`, one job each (see that module's table)."""
