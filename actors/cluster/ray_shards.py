"""The coordinator's I/O to the deployment's actors: :class:`RayShards` (the
:class:`~.batching.ShardSet` of named shard actors) and :class:`RayEmbedders` (with the routing
of texts to embedder replicas that :class:`~.client.MemoryClient` shares)."""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from lifemem_ray.actors.cluster.batching import ShardSet
from lifemem_ray.actors.cluster.remote_errors import ShardUnavailableError, actor_failures
from lifemem_ray.core.errors import InvalidArgumentError

__all__ = [
    "RayEmbedders",
    "RayShards",
    "embed_plan",
    "embedding_totals",
    "gather_rows",
    "pack_queries",
    "route_texts",
    "unpack_queries",
]


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


def route_texts(texts: Sequence[str], replicas: int) -> list[list[int]]:
    """Per embedder replica, the positions of the texts it embeds: chosen by a stable hash of
    each text (CRC-32 of its UTF-8), the same in every process, so a text always reaches the
    same replica's cache: a retrieval's query and the later add of the same task share it."""
    routed: list[list[int]] = [[] for _ in range(replicas)]
    for i, text in enumerate(texts):
        routed[zlib.crc32(text.encode("utf-8", "surrogatepass")) % replicas].append(i)
    return routed


def embed_plan(texts: Sequence[str], replicas: int, chunk: int) -> list[tuple[int, list[int]]]:
    """The embedder calls for ``texts``: (replica, positions), at most ``chunk`` texts each, each
    text on its :func:`route_texts` replica. No texts: one empty call (it answers the width)."""
    if not texts:
        return [(0, [])]
    return [
        (replica, positions[a : a + chunk])
        for replica, positions in enumerate(route_texts(texts, replicas))
        for a in range(0, len(positions), chunk)
    ]


def gather_rows(texts: Sequence[str], plan: list[tuple[int, list[int]]], answers: Sequence[Any]) -> np.ndarray:
    """The vectors of ``texts`` in their order, from the answers of :func:`embed_plan`'s calls."""
    out: np.ndarray | None = None
    for (_, positions), answer in zip(plan, answers, strict=True):
        vectors = np.asarray(answer, dtype=np.float32)
        if out is None:
            out = np.empty((len(texts), vectors.shape[1]), dtype=np.float32)
        out[positions] = vectors
    assert out is not None  # a plan has at least one call
    return out


def pack_queries(vectors: np.ndarray, count: int, dim: int) -> np.ndarray | bytes:
    """What a retrieval sends a shard as its ``count`` query vectors: a float32 ``(count, dim)``
    array as its raw bytes, which Ray sends as they are (an array goes through pickle's
    out-of-band path: about 0.15 ms more a call on a 2-core machine, measured with
    ``benchmarks/client_path.py``); anything else as it is, for the shard to refuse with its
    usual message. :func:`unpack_queries` is the shard's side."""
    if vectors.dtype == np.float32 and vectors.shape == (count, dim):
        return np.ascontiguousarray(vectors).tobytes()
    return vectors


def unpack_queries(vectors: Any, count: int, dim: int) -> Any:
    """The shard's side of :func:`pack_queries`: raw bytes become the ``(count, dim)`` float32
    array (read-only, over the bytes); anything else is returned as it is."""
    if not isinstance(vectors, bytes | bytearray):
        return vectors
    size = np.dtype(np.float32).itemsize
    if len(vectors) != count * dim * size:
        raise InvalidArgumentError(
            f"query vectors: {len(vectors):,} bytes for {count} queries of {dim} float32 values "
            f"({count * dim * size:,} expected); send a (queries, {dim}) float32 array"
        )
    return np.frombuffer(vectors, dtype=np.float32).reshape(count, dim)


# Added up over the replicas.
SUMMED = ("texts", "hits", "misses", "entries", "capacity", "evictions", "batches", "failed_batches")


def embedding_totals(per_replica: Sequence[dict[str, Any] | BaseException]) -> dict[str, Any]:
    """The embedder replicas' figures added up (texts, cache hits and misses, hit_rate, model
    calls, mean texts per call...), with each replica's own under ``replicas`` (an unreachable
    one as ``{"error": ...}``)."""
    answered = [r for r in per_replica if isinstance(r, dict)]
    total = {key: sum(int(r.get(key, 0)) for r in answered) for key in SUMMED}
    lookups = total["hits"] + total["misses"]
    texts_in_batches = sum(float(r.get("mean_batch_texts", 0.0)) * int(r.get("batches", 0)) for r in answered)
    return {
        "backend": ",".join(sorted({str(r.get("backend", "")) for r in answered})),
        **total,
        "hit_rate": total["hits"] / lookups if lookups else 0.0,
        "mean_batch_texts": texts_in_batches / total["batches"] if total["batches"] else 0.0,
        "replicas": [r if isinstance(r, dict) else {"error": f"{type(r).__name__}: {r}"[:300]} for r in per_replica],
    }


class RayEmbedders:
    """Task texts embedded by the deployment's embedder actors, in chunks, each text on the
    replica its hash names (:func:`route_texts`)."""

    def __init__(self, names: list[str], namespace: str, chunk: int = 256, call_timeout_s: float = 30.0) -> None:
        self.names = names
        self.namespace = namespace
        self.chunk = chunk  # task texts per embedder call (cluster.embed_chunk)
        self.call_timeout_s = call_timeout_s  # how long stats waits for a replica
        self._handles: list[Any] | None = None

    def handles(self) -> list[Any]:
        if self._handles is None:
            import ray

            self._handles = [ray.get_actor(name, namespace=self.namespace) for name in self.names]
        return self._handles

    async def __call__(self, texts: list[str]) -> np.ndarray:
        handles = self.handles()
        plan = embed_plan(texts, len(handles), self.chunk)
        answers = await asyncio.gather(*(handles[replica].embed.remote([texts[i] for i in at]) for replica, at in plan))
        return gather_rows(texts, plan, answers)

    async def stats(self) -> dict[str, Any]:
        """:func:`embedding_totals` of every replica's ``stats()``."""
        answers = await asyncio.gather(
            *(asyncio.wait_for(h.stats.remote(), self.call_timeout_s) for h in self.handles()), return_exceptions=True
        )
        return embedding_totals(answers)


def find_embedders_again(handles: list[Any], names: list[str], namespace: str) -> list[Any]:
    """The embedder actors by name again, after a call to them failed: those the GCS reports
    dead are first forgotten by this process (:func:`~.ray_internals.forget_dead_actor`: a
    process connected before a head loss would otherwise keep finding them under their
    names); ``handles`` as they were while a name has no actor yet."""
    import contextlib

    import ray

    from lifemem_ray.actors.cluster.ray_internals import forget_dead_actor

    for handle in handles:
        with contextlib.suppress(Exception):  # the GCS unreachable now: looked at again next time
            forget_dead_actor(handle)
    try:
        return [ray.get_actor(name, namespace=namespace) for name in names]
    except ValueError:  # one is being started anew
        return handles
