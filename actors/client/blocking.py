"""MemoryClient: the sharded memory from any process of the cluster (rollout workers too).

Each method carries out one of :class:`~lifemem_ray.actors.client.core.ClientCore`'s scripts
in the calling thread (:func:`~lifemem_ray.actors.client.calls.drive`); the awaitable
:class:`~lifemem_ray.actors.client.awaiting.AsyncMemoryClient` carries out the same scripts.
The client connects at its first call (or at :meth:`MemoryClient.connect`) and again after its
deployment went away (:mod:`~lifemem_ray.actors.client.connection`).

Example (in a process of the Ray cluster that runs ``lifemem-ray serve --namespace lifemem``)::

    from lifemem_ray.actors import MemoryClient
    from lifemem_ray import Step, Trajectory

    memory = MemoryClient.connect(namespace="lifemem")
    done = Trajectory(env="shop", task="buy a usb stick", steps=(Step(action="search usb"),), id="t1")
    print(memory.add_many([done]).result())  # resolves on acknowledgement
    print(memory.retrieve("buy a usb stick", "shop", 4).context)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

import numpy as np

from lifemem_ray.actors.client.calls import Script, drive
from lifemem_ray.actors.client.face import ClientFace
from lifemem_ray.actors.client.futures import AddFuture
from lifemem_ray.actors.client.retrieve_options import RetrieveOptions
from lifemem_ray.actors.cluster import deployment
from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.core.model import Trajectory
from lifemem_ray.core.tenancy import DEFAULT_TENANT
from lifemem_ray.engine.protocols import MemoryStats
from lifemem_ray.engine.retrieval import Retrieval

__all__ = ["AddFuture", "MemoryClient"]

T = TypeVar("T")


class MemoryClient(ClientFace):
    """:class:`lifemem_ray.engine.protocols.MemoryAPI` over a Ray deployment (adds return an
    :class:`~lifemem_ray.actors.client.futures.AddFuture`). Thread-safe: one client serves
    every thread of a process.

    Constructed as :class:`~lifemem_ray.actors.client.face.ClientFace` (namespace, config,
    address, reconnect_after_s).
    """

    @classmethod
    def connect(
        cls, namespace: str = "lifemem", address: str | None = None, config: DeploymentConfig | None = None
    ) -> MemoryClient:
        """A client of the deployment in ``namespace``, connected now (starting a Ray connection
        to ``address`` if this process has none).

        Args:
            namespace: the deployment's Ray namespace.
            address: the Ray cluster to join when this process has none (never a scan).
            config: the deployment's configuration (None: the defaults).

        Returns:
            The connected client.

        Raises:
            DeploymentNotFoundError: no deployment runs in ``namespace``.
        """
        client = cls(namespace, config, address=address)
        client.core.connection.open()
        return client

    def _run(self, script: Script[T]) -> T:
        return drive(script, self.core.connection.judge)

    # -- what the connection found -----------------------------------------------------------
    @property
    def dim(self) -> int:
        """The deployment's vector size (connecting first if needed)."""
        return self._run(self.core.handles()).dim

    @property
    def shard_names(self) -> list[str]:
        return self._run(self.core.handles()).shard_names

    @property
    def embedder_names(self) -> list[str]:
        return self._run(self.core.handles()).embedder_names

    @property
    def embedders(self) -> list[Any]:
        return self._run(self.core.handles()).embedders

    @property
    def shards(self) -> list[Any]:
        """The shard actors' handles (looked up on first use, and after a shard failed)."""
        return self._run(self.core.connection.shards())

    # -- adding ----------------------------------------------------------------------------
    def add(self, trajectory: Trajectory, vector: Any = None) -> AddFuture:
        """One trajectory, as :meth:`add_many`.

        Args:
            trajectory: what to store.
            vector: its query text's embedding (None: this client's cached one, else the deployment embeds it).

        Returns:
            The request's future; its ``result()`` is the one result.
        """
        vectors = None if vector is None else np.asarray(vector, dtype=np.float32).reshape(1, -1)
        future = self.add_many([trajectory], vectors)
        future.single = True
        return future

    def add_many(self, trajectories: Sequence[Trajectory], vectors: Any = None) -> AddFuture:
        """One request: acknowledged as a whole; rejected whole if an id conflicts.

        Args:
            trajectories: what to store.
            vectors: their query texts' vectors (None: the deployment embeds them).

        Returns:
            The request's future (sent now).

        Raises:
            InvalidTrajectoryError: a trajectory or a vector is refused (nothing is sent).
        """
        request, send = self._run(self.core.prepare_add(trajectories, vectors))
        return AddFuture(send(), request, resend=send, judge=self.core.connection.judge)

    def stored_conflicts(self, ids: list[str], fingerprints: list[str]) -> list[bool]:
        """Per id key (:func:`lifemem_ray.core.tenancy.id_key`: the id itself for the default tenant):
        whether a shard holds it with another fingerprint (one call per shard)."""
        return self._run(self.core.stored_conflicts(ids, fingerprints))

    # -- retrieving --------------------------------------------------------------------------
    def embed(self, texts: list[str]) -> np.ndarray:
        """Embeddings of ``texts`` from the deployment's embedder actors (each text on the
        replica its hash names, so it meets that replica's cache)."""
        return self._run(self.core.embed(texts))

    def vectors(self, texts: Sequence[str]) -> np.ndarray:
        """``texts``' vectors, from this client's cache or the embedders."""
        return self._run(self.core.vectors(texts))

    def retrieve(
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
        """The ``k`` stored trajectories nearest to ``task``, with their clusters' skills, as
        :meth:`lifemem_ray.engine.protocols.MemoryAPI.retrieve` (its Args).

        Returns:
            The :class:`~lifemem_ray.engine.retrieval.Retrieval`.

        Raises:
            InvalidArgumentError: an argument refused (``where`` names it).
            ShardUnavailableError: a shard did not answer within ``cluster.call_timeout_s``.
        """
        options = RetrieveOptions(k, token_budget, skills, tenant, as_of)
        return self.retrieve_with([task], [env], options, None if vector is None else [vector])[0]

    def retrieve_many(
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
        """Like :meth:`lifemem_ray.engine.memory.Memory.retrieve_many`: queries of one tenant, which
        see only that tenant's trajectories and skills (``None`` envs: all of its environments)."""
        return self.retrieve_with(tasks, envs, RetrieveOptions(k, token_budget, skills, tenant, as_of), vectors)

    def retrieve_with(
        self,
        tasks: Sequence[str],
        envs: Sequence[str | None] | str,
        options: RetrieveOptions,
        vectors: Any = None,
    ) -> list[Retrieval]:
        """:meth:`retrieve_many` with its options as one object (what adapters pass along).

        Raises:
            InvalidArgumentError: an option or a task refused, naming it.
            ShardUnavailableError: a shard did not answer within ``cluster.call_timeout_s``.
        """
        return self._run(self.core.retrieve_many(tasks, envs, options, vectors))

    # -- state -----------------------------------------------------------------------------
    def version(self) -> str:
        """The deployment's version now: one watermark per shard (:mod:`lifemem_ray.engine.versions`).
        A retrieve ``as_of`` it sees what the shards had committed when each answered this
        call; a version read after an add's acknowledgement covers that add."""
        return self._run(self.core.version())

    def stats(self, tenant: str | None = None) -> MemoryStats:
        """The deployment's counts (``tenant``: only that tenant's own figures, nothing of the
        deployment as a whole; None: everything, with ``per_tenant``, LLM usage and the
        coordinator's figures)."""
        return cast(MemoryStats, self._run(self.core.stats(tenant)))

    def clusters(
        self, env: str | None = None, *, tenant: str | None = DEFAULT_TENANT, limit: int | None = None
    ) -> list[Any]:
        """``tenant``'s live clusters on every shard, largest first (None: every tenant's); with
        ``limit``, the largest that many (each shard sends at most that many)."""
        return self._run(self.core.clusters(env, tenant, limit))

    def cluster_count(self, env: str | None = None, *, tenant: str | None = DEFAULT_TENANT) -> int:
        """How many clusters :meth:`clusters` would list without a limit."""
        return self._run(self.core.cluster_count(env, tenant))

    # -- deleting ----------------------------------------------------------------------------
    def remove(self, ids: Sequence[str], *, tenant: str = DEFAULT_TENANT) -> int:
        """Delete ``tenant``'s trajectories of these ids; returns how many were stored. Sent
        through the coordinator, which runs it between its micro-batches (never beside a batch
        that may name the same clusters) on every shard; durable when this returns, and
        idempotent: sending it again is safe (unknown ids are ignored)."""
        return self._run(self.core.remove(ids, tenant))

    def purge_tenant(self, tenant: str) -> int:
        """Delete everything of ``tenant`` on every shard (see :meth:`remove`); each shard
        records the intent first and finishes an interrupted purge when it restarts."""
        return self._run(self.core.purge_tenant(tenant))

    def verify(self, deep: bool = False) -> dict[str, Any]:
        """Every shard's invariants (``deep``: also every record's fingerprint, recomputed)."""
        return self._run(self.core.verify(deep))

    def maintain(self) -> int:
        """Run every shard's queued splits and skills now and wait for its index retrains
        (all of which also run in the background)."""
        return self._run(self.core.maintain())

    def snapshot(self, directory: str | Path) -> dict[str, Any]:
        """A consistent copy of every shard and the routing in ``directory``."""
        return deployment.snapshot(directory, self.namespace)
