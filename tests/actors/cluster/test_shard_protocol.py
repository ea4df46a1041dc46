"""The engine's shard and the shard actor satisfy one protocol (tests/engine/test_engine_model.py
holds the engine's side)."""

from __future__ import annotations

from lifemem_ray.engine.memory import Memory
from lifemem_ray.engine.protocols import MemoryAPI, ShardProtocol


# -- the typed interfaces ----------------------------------------------------------------------
def test_the_engine_and_the_actor_satisfy_the_shard_protocol(tmp_path):
    import inspect

    from lifemem_ray.actors.cluster.shard_actor import MemoryShard
    from lifemem_ray.engine.local_shard import EngineShard

    with Memory.open(tmp_path / "m", dim=8) as m:
        assert isinstance(m, MemoryAPI) and isinstance(m.shard, ShardProtocol)

    def params(fn):  # a class Ray has made remote gains a tracing parameter
        return [p for p in inspect.signature(fn).parameters if not p.startswith("_ray")]

    for name in (n for n in dir(ShardProtocol) if not n.startswith("_")):
        wanted = params(getattr(ShardProtocol, name))
        assert params(getattr(EngineShard, name)) == wanted, name
        assert params(getattr(MemoryShard, name)) == wanted, name
    assert not any(
        hasattr(Memory, name)
        for name in ("check_ids", "prepare", "commit", "candidates", "cluster_states", "search_hits", "hit_records")
    )
