"""The coordinator's I/O to the deployment's actors: :class:`RayShards` (the
:class:`~.batching.ShardSet` of named shard actors) and :class:`RayEmbedders`."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from lifemem_ray.actors.cluster.batching import ShardSet
from lifemem_ray.actors.cluster.remote_errors import ShardUnavailableError, actor_failures

__all__ = ["RayEmbedders", "RayShards"]


class RayShards(ShardSet):
    """The :class:`~.batching.ShardSet` of a deployment: its calls travel to named shard actors,
    each call under ``cluster.call_timeout_s``; a dead shard, node or a timeout becomes a
    :class:`ShardUnavailableError` naming the shard.

    A shard the shard keeper reports down (:attr:`down`: its node is gone, it is being restarted
    or rebuilt) fails at once, and a call already waiting on it stops waiting within
    ``check_s``: callers get a clear answer to retry instead of waiting for the node. After the
    keeper started the shard anew, :meth:`forget` drops the old handle."""

    def __init__(self, names: list[str], namespace: str, call_timeout_s: float, check_s: float = 1.0) -> None:
        self.names = names
        self.namespace = namespace
        self.call_timeout_s = call_timeout_s
        self.check_s = check_s  # how often a waiting call looks whether its shard was reported down
        self.down: dict[int, str] = {}  # shard -> why it is down now (set by the shard keeper)
        self._handles: dict[int, Any] = {}  # shard -> actor handle, looked up on first use

    def handle(self, shard: int) -> Any:
        if shard not in self._handles:
            import ray

            try:
                self._handles[shard] = ray.get_actor(self.names[shard], namespace=self.namespace)
            except ValueError:  # the actor is gone and not yet started again
                raise ShardUnavailableError(
                    f"shard {shard} ({self.names[shard]}) is not running now; the deployment starts it again"
                ) from None
        return self._handles[shard]

    @property
    def handles(self) -> list[Any]:
        return [self.handle(i) for i in range(len(self.names))]

    def mark(self, shard: int, why: str | None) -> None:
        """Shard ``shard`` down for ``why`` (calls to it refused), or up again (None); either way
        its handle is dropped, so the next call finds the actor running now."""
        if why is None:
            self.down.pop(shard, None)
        else:
            self.down[shard] = why
        self.forget(shard)

    def forget(self, shard: int) -> None:
        """Drop shard ``shard``'s handle: the next call looks the actor up again."""
        self._handles.pop(shard, None)

    def __len__(self) -> int:
        return len(self.names)

    def _refuse_if_down(self, shard: int, method: str) -> None:
        why = self.down.get(shard)
        if why is not None:
            raise ShardUnavailableError(f"shard {shard} ({self.names[shard]}) is unavailable during {method}: {why}")

    async def call(self, shard: int, method: str, *args: Any) -> Any:
        self._refuse_if_down(shard, method)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.call_timeout_s
        try:
            waiting = asyncio.ensure_future(getattr(self.handle(shard), method).remote(*args))
            while True:
                done, _ = await asyncio.wait({waiting}, timeout=max(0.0, min(self.check_s, deadline - loop.time())))
                if done:
                    return waiting.result()
                if shard in self.down or loop.time() >= deadline:
                    waiting.cancel()
                    self.forget(shard)
                    self._refuse_if_down(shard, method)
                    raise ShardUnavailableError(
                        f"shard {shard} ({self.names[shard]}) is unavailable during {method}: no answer within "
                        f"cluster.call_timeout_s = {self.call_timeout_s:g} s"
                    )
        except actor_failures() as exc:
            self.forget(shard)
            raise ShardUnavailableError(
                f"shard {shard} ({self.names[shard]}) is unavailable during {method}: {type(exc).__name__}: {exc}"
            ) from exc


class RayEmbedders:
    """Task texts embedded by the deployment's embedder actors, in chunks, round robin."""

    def __init__(self, names: list[str], namespace: str, chunk: int = 256) -> None:
        self.names = names
        self.namespace = namespace
        self.chunk = chunk  # task texts per embedder call (cluster.embed_chunk)
        self._handles: list[Any] | None = None
        self._next = 0

    async def __call__(self, texts: list[str]) -> np.ndarray:
        if self._handles is None:
            import ray

            self._handles = [ray.get_actor(name, namespace=self.namespace) for name in self.names]
        refs = []
        for a in range(0, len(texts), self.chunk):
            actor = self._handles[self._next % len(self._handles)]
            self._next += 1
            refs.append(actor.embed.remote(texts[a : a + self.chunk]))
        return np.vstack(await asyncio.gather(*refs))
