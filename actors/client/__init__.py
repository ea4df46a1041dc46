"""The deployment's clients: one core of operations (:mod:`.core`), carried out blocking
(:class:`~.blocking.MemoryClient`) or awaiting (:class:`~.awaiting.AsyncMemoryClient`), one
connection rule (:mod:`.connection`). The short imports are :mod:`lifemem_ray.actors`'."""
