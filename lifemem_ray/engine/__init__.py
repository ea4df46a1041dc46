"""The parts of :class:`lifemem_ray.engine.memory.Memory`, one job each (see that module's table)."""
