"""The Ray deployment's settings: the ``[cluster]`` table, and :class:`DeploymentConfig`, the
engine's :class:`~lifemem_ray.engine.memory_config.MemoryConfig` with the ``[cluster]`` and
``[http]`` tables added (what ``lifemem-ray serve`` and every actor read)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from lifemem_ray.core.errors import ConfigError
from lifemem_ray.core.settings import Section, positive
from lifemem_ray.engine.memory_config import MemoryConfig
from lifemem_ray.service.http_config import HttpConfig

__all__ = ["ClusterConfig", "DeploymentConfig"]


@dataclass
class ClusterConfig(Section):
    """The sharded deployment on Ray (``lifemem_ray.actors``)."""

    NAME = "cluster"
    BOUNDS: ClassVar[dict[str, tuple[float, float]]] = {
        "shards": (1, 1_024),
        "batch_size": (1, 65_536),
        "batch_wait_ms": (0.0, 60_000.0),
        "max_pending": (1, 10_000_000),
        "overload_timeout_s": (0.1, 86_400.0),
        "embedders": (1, 1_024),
        "shard_cpus": (0.0, 1_024.0),
        "coordinator_cpus": (0.0, 1_024.0),
        "embedder_cpus": (0.0, 1_024.0),
        "call_timeout_s": (0.1, 86_400.0),
        "start_timeout_s": (1.0, 86_400.0),
        "one_round_max": (0, 4_096),
        "search_chunk": (1, 65_536),
        "retrieve_chunk": (1, 65_536),
        "embed_chunk": (1, 65_536),
        "client_vector_cache": (0, 10_000_000),
        "add_resends": (0, 100),
        "snapshot_every_s": (0.0, 604_800.0),
        "snapshots_kept": (1, 1_000),
        "node_lost_after_s": (1.0, 86_400.0),
        "health_check_s": (0.1, 3_600.0),
        "restart_wait_s": (0.0, 3_600.0),
    }

    namespace: str = "lifemem"  # Ray namespace of the named actors
    shards: int = 2
    batch_size: int = 512  # the coordinator's micro-batch
    batch_wait_ms: float = 20.0  # how long a micro-batch waits to fill
    # The shards look up the next micro-batch while the coordinator plans the current one;
    # that batch is then planned with what the current one stored (as one batch twice the size).
    pipeline: bool = True
    max_pending: int = 50_000  # trajectories queued at the coordinator; beyond, callers wait
    overload_timeout_s: float = 60.0  # a caller waiting longer than this gets OverloadedError
    embedders: int = 1  # embedding actors (one per GPU where there are GPUs)
    shard_cpus: float = 0.5  # CPU reserved per shard actor
    coordinator_cpus: float = 0.5
    embedder_cpus: float = 0.5
    call_timeout_s: float = 600.0  # a shard call taking longer is reported as a failure
    start_timeout_s: float = 180.0  # actors not running by then: a clear error (resources, nodes)
    # MemoryClient.retrieve_many: up to one_round_max queries, shards send records with their
    # hits (one round trip); beyond, search_chunk queries per shard search call, and the
    # records of retrieve_chunk queries per fetch (decoded while the next chunk is fetched).
    one_round_max: int = 16
    search_chunk: int = 512
    retrieve_chunk: int = 256
    embed_chunk: int = 256  # task texts per embedder-actor call (a text goes to the embedder its hash names)
    # MemoryClient: query vectors of recent retrieval texts kept in the client (about 1.6 KB
    # each); a text met again skips the embedder call, and one text asked by several threads at
    # once is embedded once. 0: off.
    client_vector_cache: int = 4096
    add_resends: int = 10  # MemoryClient: times an add whose coordinator died is sent again (it restarts itself)
    # Durability beyond a node: every shard's committed transactions also go, before they are
    # acknowledged, to <durable_uri>/<namespace>/shard-NN (a folder every node sees, or
    # s3://bucket/prefix), beside its checkpoints. Empty: off (a shard lives on its node's disk).
    durable_uri: str = ""
    durable_endpoint_url: str = ""  # an S3-compatible server's address (empty: AWS, or AWS_ENDPOINT_URL)
    snapshot_every_s: float = 900.0  # each shard's checkpoint to durable_uri (0: none scheduled)
    snapshots_kept: int = 3  # checkpoints kept per shard; the log entries the newest covers are removed
    # A shard whose node is gone this long is rebuilt on another node from durable_uri (only with
    # durable_uri; without it, the shard waits for a node that sees its files).
    node_lost_after_s: float = 30.0
    health_check_s: float = 2.0  # how often the coordinator looks at its shards and their nodes
    # A shard Ray restarts on its live node (a crashed process) is waited for this long before
    # calls to it are refused: a restart takes seconds, a node that died takes Ray ~30 s to see.
    restart_wait_s: float = 5.0
    # The coordinator and the embedders are replaced by new actors when they die (the shards'
    # watch starts a coordinator on the node that served the deployment, the coordinator's keeper
    # the embedders: actors/cluster/coordinator_watch.py), instead of restarted by Ray: a driver
    # connected before a head loss keeps calling a restarted actor at its old address. Off: Ray
    # restarts them.
    replace_dead_actors: bool = True

    def validate(self) -> None:
        for key, low, high in (("one_round_max", 0, 4_096), ("search_chunk", 1, 65_536), ("retrieve_chunk", 1, 65_536)):
            value = getattr(self, key)
            if not low <= value <= high:
                raise ConfigError(f"cluster.{key}: must be in [{low}, {high}], got {value}")
        if self.search_chunk % self.retrieve_chunk:
            raise ConfigError(
                f"cluster.search_chunk ({self.search_chunk}) must be a multiple of cluster.retrieve_chunk ({self.retrieve_chunk})"
            )
        positive(
            self,
            "shards",
            "batch_size",
            "max_pending",
            "overload_timeout_s",
            "embedders",
            "call_timeout_s",
            "start_timeout_s",
        )
        if self.batch_wait_ms < 0 or self.shard_cpus < 0 or self.coordinator_cpus < 0 or self.embedder_cpus < 0:
            raise ConfigError("batch_wait_ms and *_cpus must be >= 0", where="cluster")
        for key in ("durable_uri", "durable_endpoint_url"):
            value = getattr(self, key)
            if len(value) > 4096 or not value.isprintable():
                raise ConfigError(f"cluster.{key}: must be at most 4096 printable characters, got {value[:80]!r}")
        if self.durable_uri and "://" not in self.durable_uri and not self.durable_uri.startswith("/"):
            raise ConfigError(
                f"{self.durable_uri[:80]!r} must be an absolute path every node sees, or a URL (s3://bucket/prefix)",
                where="cluster.durable_uri",
            )
        if not self.namespace or len(self.namespace) > 256 or not self.namespace.isprintable():
            raise ConfigError(f"{self.namespace[:80]!r} must be 1-256 printable characters", where="cluster.namespace")


@dataclass
class DeploymentConfig(MemoryConfig):
    """A sharded memory's settings: the engine's sections (each shard's store), ``[cluster]``
    (the actors) and ``[http]`` (the front door).

    >>> DeploymentConfig().replace({"cluster.shards": 4, "evolution.top_k": 8}).cluster.shards
    4
    """

    FOREIGN: ClassVar[tuple[str, ...]] = ("experiment", "run", "rollout", "serve")

    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    http: HttpConfig = field(default_factory=HttpConfig)

    def check(self) -> None:
        if self.http.operations_max_items < self.http.max_batch_items:
            raise ConfigError(
                f"{self.http.operations_max_items:,} is below http.max_batch_items "
                f"({self.http.max_batch_items:,}): one add answered 202 could never be kept; raise it",
                where="http.operations_max_items",
            )
        deadline = self.add_operation_deadline_s()
        if self.http.operations_ttl_s < deadline:
            raise ConfigError(
                f"{self.http.operations_ttl_s:g} s would forget an add answered 202 before it can "
                f"finish ({deadline:g} s: http.add_timeout_s x (1 + cluster.add_resends) + 60); raise it or lower those",
                where="http.operations_ttl_s",
            )

    def add_operation_deadline_s(self) -> float:
        """How long an add answered 202 may take before its operation reads failed: every
        attempt's wait (``http.add_timeout_s``, the first and ``cluster.add_resends`` resends)
        plus a minute of slack."""
        return self.http.add_timeout_s * (1 + self.cluster.add_resends) + 60.0

    def shard_count(self, shards: int | None, source: str = "shards") -> int:
        """The shard count a deployment or a restore asked for ``shards`` gets: ``cluster.shards``
        when None, else ``shards`` checked against that setting's bounds (0 is refused, never
        read as 'the default').

        Raises:
            ConfigError: ``shards`` out of bounds, naming ``source``.
        """
        if shards is None:
            return self.cluster.shards
        return self.replace({"cluster.shards": shards}, source).cluster.shards
