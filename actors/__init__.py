"""The Ray layer: actors that wrap the engine (installed as ``lifemem_ray.actors``)."""
