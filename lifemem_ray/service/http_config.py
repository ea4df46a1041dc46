"""The front door's settings: the ``[http]`` table (keys, limits, timeouts of the REST and MCP
front door; served on Ray Serve by :mod:`lifemem_ray.actors.frontdoor`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from lifemem_ray.core.errors import ConfigError
from lifemem_ray.core.settings import Section
from lifemem_ray.service.auth import parse_key_entries

__all__ = ["HttpConfig"]


@dataclass
class HttpConfig(Section):
    """The REST and MCP front door on Ray Serve (``lifemem-ray serve --http``, actors/frontdoor/app.py)."""

    NAME = "http"
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {
        "auth": ("keys", "none"),
    }
    BOUNDS: ClassVar[dict[str, tuple[float, float]]] = {
        "port": (1, 65_535),
        "replicas": (1, 64),
        "replica_cpus": (0.0, 64.0),
        "max_ongoing_requests": (1, 10_000),
        "max_ongoing_per_tenant": (1, 10_000),
        "body_timeout_s": (0.1, 86_400.0),
        "body_grace_s": (0.0, 3_600.0),
        "body_min_rate_bytes_s": (0, 1_073_741_824),
        "max_body_bytes": (1_024, 1_073_741_824),
        "max_batch_items": (1, 100_000),
        "max_queries": (1, 100_000),
        "max_clusters_listed": (1, 1_000_000),
        "add_timeout_s": (0.1, 86_400.0),
        "read_timeout_s": (0.1, 86_400.0),
        "delete_timeout_s": (0.1, 86_400.0),
        "restart_probe_s": (0.01, 600.0),
        "retry_after_s": (1, 3_600),
        "health_timeout_s": (0.1, 600.0),
        "operations_max": (1, 10_000_000),
        "operations_ttl_s": (1.0, 30 * 86_400.0),
        "operations_max_items": (1_000, 100_000_000),
    }

    host: str = "127.0.0.1"  # where Serve's HTTP proxy listens
    port: int = 8000
    # keys: every request needs ``Authorization: Bearer <key>`` of api_keys (or LIFEMEM_API_KEYS);
    # none: every request acts as the default tenant with every scope (loopback hosts only).
    auth: str = "keys"
    api_keys: list = field(
        default_factory=list
    )  # [{name, sha256, tenant, scopes}]: hashes only (`lifemem-ray keys new`)
    replicas: int = 1  # Serve replicas of the ingress (any replica answers any request)
    replica_cpus: float = 0.1  # CPU reserved per replica
    max_ongoing_requests: int = 32  # per replica; Serve queues the rest
    # Fair share: at most this many requests of one tenant in flight per replica (keyed front
    # doors); the next answers 429 with Retry-After at once, before its body is read, so one
    # client, however many connections it opens, leaves the other slots to other tenants.
    max_ongoing_per_tenant: int = 16
    # A request body must arrive whole within body_timeout_s, and after body_grace_s at an
    # average of at least body_min_rate_bytes_s (0: no rate floor); else 408 and the connection
    # is closed. A client trickling bytes cannot hold a request slot.
    body_timeout_s: float = 60.0
    body_grace_s: float = 5.0
    body_min_rate_bytes_s: int = 1_024
    max_body_bytes: int = 16 * 1024 * 1024  # a larger request body is refused (413)
    max_batch_items: int = 1_000  # trajectories per POST /v1/trajectories
    max_queries: int = 256  # tasks per POST /v1/retrieve
    max_clusters_listed: int = 10_000  # clusters per GET /v1/clusters answer
    add_timeout_s: float = 300.0  # a waiting add not acknowledged by then answers 503 (its ids stay idempotent)
    read_timeout_s: float = 30.0  # retrieve, stats, clusters: shards not answering by then answer 503
    delete_timeout_s: float = (
        300.0  # a deletion or purge not finished by then answers 503 (it goes on; sending it again is safe)
    )
    restart_probe_s: float = 0.25  # a read not answered by then checks whether a shard is restarting (then 503 at once)
    retry_after_s: int = 2  # Retry-After of 503 answers
    health_timeout_s: float = 5.0  # /healthz waits this long for the coordinator and shards
    operations_max: int = 10_000  # operations (adds answered 202) kept for polling; the oldest finished go first
    operations_max_items: int = 1_000_000  # trajectory answers kept over all those operations (their memory), likewise
    operations_ttl_s: float = 3_600.0  # an operation is forgotten this long after it was created

    def validate(self) -> None:
        if not self.host.strip():
            raise ConfigError("must not be empty", where="http.host")
        if self.max_ongoing_per_tenant > self.max_ongoing_requests:
            raise ConfigError(
                f"{self.max_ongoing_per_tenant} is above http.max_ongoing_requests "
                f"({self.max_ongoing_requests}): one tenant could take every request slot of a replica; lower it",
                where="http.max_ongoing_per_tenant",
            )
        parse_key_entries(self.api_keys, "http.api_keys")
