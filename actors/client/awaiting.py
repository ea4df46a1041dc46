"""AsyncMemoryClient: the sharded memory from asyncio code (an async Ray actor, a web server).

Every operation of :class:`~lifemem_ray.actors.client.blocking.MemoryClient`, awaitable: the
same scripts (:class:`~lifemem_ray.actors.client.core.ClientCore`) carried out by
:func:`~lifemem_ray.actors.client.calls.adrive`, which awaits Ray object refs and runs a
blocking lookup in a thread, never ``ray.get`` on the event loop; so one loop serves many
concurrent retrievals and adds, with the blocking client's rules, timeouts and merging.

Example (in a process of the Ray cluster that runs ``lifemem-ray serve --namespace lifemem``)::

    import asyncio

    from lifemem_ray.actors import AsyncMemoryClient
    from lifemem_ray import Step, Trajectory


    async def main() -> None:
        memory = await AsyncMemoryClient.connect(namespace="lifemem")
        done = Trajectory(env="shop", task="buy a usb stick", steps=(Step(action="search usb"),), id="t1")
        print(await memory.add_many([done]))  # resolves on acknowledgement
        hits = await asyncio.gather(*(memory.retrieve("buy a usb stick", "shop", 4) for _ in range(8)))
        print(hits[0].context)
        print((await memory.stats())["trajectories"])


    asyncio.run(main())
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

import numpy as np

from lifemem_ray.actors.client.calls import Script, adrive, drive
from lifemem_ray.actors.client.face import ClientFace
from lifemem_ray.actors.client.futures import AsyncAddFuture
from lifemem_ray.actors.client.retrieve_options import RetrieveOptions
from lifemem_ray.actors.client.rules import AddRequest
from lifemem_ray.actors.cluster import deployment
from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.core.errors import DeploymentNotFoundError
from lifemem_ray.core.model import Trajectory
from lifemem_ray.core.tenancy import DEFAULT_TENANT
from lifemem_ray.engine.protocols import MemoryStats
from lifemem_ray.engine.retrieval import Retrieval

__all__ = ["AsyncAddFuture", "AsyncMemoryClient"]

T = TypeVar("T")


class AsyncMemoryClient(ClientFace):
    """:class:`~lifemem_ray.actors.client.blocking.MemoryClient`'s operations as coroutines
    (adds return an :class:`~lifemem_ray.actors.client.futures.AsyncAddFuture`). Use it from one
    event loop; it connects at its first call (or at :meth:`connect`).

    Constructed as :class:`~lifemem_ray.actors.client.face.ClientFace` (namespace, config,
    address, reconnect_after_s).
    """

    @classmethod
    async def connect(
        cls, namespace: str = "lifemem", address: str | None = None, config: DeploymentConfig | None = None
    ) -> AsyncMemoryClient:
        """A client of the deployment in ``namespace``, connected now (as
        :meth:`MemoryClient.connect <lifemem_ray.actors.client.blocking.MemoryClient.connect>`).

        Raises:
            DeploymentNotFoundError: no deployment runs in ``namespace``.
        """
        client = cls(namespace, config, address=address)
        await asyncio.to_thread(client.core.connection.open)
        return client

    async def _run(self, script: Script[T]) -> T:
        return await adrive(script, self.core.connection.judge)

    # -- what the connection found -----------------------------------------------------------
    @property
    def dim(self) -> int:
        """The deployment's vector size, once connected (by :meth:`connect` or a first call).

        Raises:
            DeploymentNotFoundError: not connected now (never waits on the event loop).
        """
        if not self.core.connection.connected:
            raise DeploymentNotFoundError(
                f"AsyncMemoryClient of namespace {self.namespace!r}: not connected now; await a call first"
            )
        return self.core.connection.open().dim  # connected: answers at once

    async def shards(self) -> list[Any]:
        """The shard actors' handles (looked up on first use, and after a shard failed)."""
        return await self._run(self.core.connection.shards())

    # -- adding ----------------------------------------------------------------------------
    def add(self, trajectory: Trajectory, vector: Any = None) -> AsyncAddFuture:
        """One trajectory: ``await memory.add(t)`` gives its one result."""
        vectors = None if vector is None else np.asarray(vector, dtype=np.float32).reshape(1, -1)
        return self.add_many([trajectory], vectors, single=True)

    def add_many(
        self, trajectories: Sequence[Trajectory], vectors: Any = None, *, single: bool = False
    ) -> AsyncAddFuture:
        """One request, sent now (by a task on the loop when the client is not connected yet):
        acknowledged as a whole; rejected whole if an id conflicts. ``await`` the future for
        the results. Packed in the caller's process, as
        :meth:`MemoryClient.add_many <lifemem_ray.actors.client.blocking.MemoryClient.add_many>`."""
        judge = self.core.connection.judge
        script = self._sent(trajectories, vectors, single)
        if self.core.connection.connected:
            ref, request, resend = drive(script, judge)
            return AsyncAddFuture(ref, request, resend, judge=judge)
        return AsyncAddFuture(None, None, sending=asyncio.ensure_future(adrive(script, judge)), judge=judge)

    def _sent(
        self, trajectories: Sequence[Trajectory], vectors: Any, single: bool
    ) -> Script[tuple[Any, AddRequest, Any]]:
        request, send = yield from self.core.prepare_add(trajectories, vectors)
        request.single = single
        return send(), request, send

    async def stored_conflicts(self, ids: list[str], fingerprints: list[str]) -> list[bool]:
        """Per id key: whether a shard holds it with another fingerprint (one call per shard)."""
        return await self._run(self.core.stored_conflicts(ids, fingerprints))

    # -- retrieving --------------------------------------------------------------------------
    async def embed(self, texts: list[str]) -> np.ndarray:
        """Embeddings of ``texts`` from the deployment's embedder actors, routed as
        :meth:`MemoryClient.embed <lifemem_ray.actors.client.blocking.MemoryClient.embed>` routes them."""
        return await self._run(self.core.embed(texts))

    async def vectors(self, texts: Sequence[str]) -> np.ndarray:
        """``texts``' vectors, from this client's cache or the embedders."""
        return await self._run(self.core.vectors(texts))

    async def retrieve(
        self,
        task: str,
        env: str | None,
        k: int | None = None,
        *,
        vector: Any = None,
        token_budget: int | None = None,
        skills: bool = True,
        tenant: str = DEFAULT_TENANT,
        as_of: str | None = None,
    ) -> Retrieval:
        """Like :meth:`lifemem_ray.engine.memory.Memory.retrieve` (``env=None``: every environment of the tenant)."""
        options = RetrieveOptions(k, token_budget, skills, tenant, as_of)
        return (await self.retrieve_with([task], [env], options, None if vector is None else [vector]))[0]

    async def retrieve_many(
        self,
        tasks: Sequence[str],
        envs: Sequence[str | None] | str,
        k: int | None = None,
        *,
        vectors: Any = None,
        token_budget: int | None = None,
        skills: bool = True,
        tenant: str = DEFAULT_TENANT,
        as_of: str | None = None,
    ) -> list[Retrieval]:
        """Like :meth:`lifemem_ray.engine.memory.Memory.retrieve_many`: queries of one tenant
        (``None`` envs: all of its environments)."""
        return await self.retrieve_with(tasks, envs, RetrieveOptions(k, token_budget, skills, tenant, as_of), vectors)

    async def retrieve_with(
        self,
        tasks: Sequence[str],
        envs: Sequence[str | None] | str,
        options: RetrieveOptions,
        vectors: Any = None,
    ) -> list[Retrieval]:
        """:meth:`retrieve_many` with its options as one object (what adapters pass along)."""
        return await self._run(self.core.retrieve_many(tasks, envs, options, vectors))

    # -- state -----------------------------------------------------------------------------
    async def version(self) -> str:
        """As :meth:`MemoryClient.version <lifemem_ray.actors.client.blocking.MemoryClient.version>`."""
        return await self._run(self.core.version())

    async def stats(self, tenant: str | None = None) -> MemoryStats:
        """The deployment's counts, as :meth:`MemoryClient.stats
        <lifemem_ray.actors.client.blocking.MemoryClient.stats>` (``tenant``: that tenant's own)."""
        return cast(MemoryStats, await self._run(self.core.stats(tenant)))

    async def clusters(
        self, env: str | None = None, *, tenant: str | None = DEFAULT_TENANT, limit: int | None = None
    ) -> list[Any]:
        """``tenant``'s live clusters on every shard, largest first (None: every tenant's)."""
        return await self._run(self.core.clusters(env, tenant, limit))

    async def cluster_count(self, env: str | None = None, *, tenant: str | None = DEFAULT_TENANT) -> int:
        """How many clusters :meth:`clusters` would list without a limit."""
        return await self._run(self.core.cluster_count(env, tenant))

    # -- deleting ----------------------------------------------------------------------------
    async def remove(self, ids: Sequence[str], *, tenant: str = DEFAULT_TENANT) -> int:
        """Delete ``tenant``'s trajectories of these ids (through the coordinator; idempotent)."""
        return await self._run(self.core.remove(ids, tenant))

    async def purge_tenant(self, tenant: str) -> int:
        """Delete everything of ``tenant`` on every shard (see :meth:`remove`)."""
        return await self._run(self.core.purge_tenant(tenant))

    async def verify(self, deep: bool = False) -> dict[str, Any]:
        """Every shard's invariants (``deep``: also every record's fingerprint, recomputed)."""
        return await self._run(self.core.verify(deep))

    async def maintain(self) -> int:
        """Run every shard's queued splits and skills now and wait for its index retrains."""
        return await self._run(self.core.maintain())

    async def snapshot(self, directory: str | Path) -> dict[str, Any]:
        """A consistent copy of every shard and the routing (run in a thread: it waits on Ray)."""
        return await asyncio.to_thread(deployment.snapshot, directory, self.namespace)
