"""The lifelong experiment's settings: the ``[experiment]`` table of a run file, loaded as every
layer's settings are (:mod:`lifemem_ray.core.settings`)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from lifemem_ray.core.errors import ConfigError
from lifemem_ray.core.settings import Section, load_section

__all__ = ["BOOTSTRAP_DEFAULT", "MEMORY_AGENTS", "MEMORY_MODES", "RETRIEVING_MODES", "STREAMS", "ExperimentConfig"]

STREAMS = ("similarity", "random", "buffer")
# none: no memory (ReAct). trajectory: top-k over the whole pool, no skills (Synapse-like).
# global-skills: one skill profile distilled, by the memory's own distiller, over the whole
# unclustered pool, no exemplars (AutoSkill-like). lifemem: same-environment top-k plus
# their clusters' skills. The ablations of Table 3: lifemem-no-skills (the same-environment
# exemplars alone) and skills-only (the retrieved clusters' skills, no exemplars).
MEMORY_MODES = ("none", "trajectory", "global-skills", "lifemem", "lifemem-no-skills", "skills-only")
RETRIEVING_MODES = ("trajectory", "lifemem", "lifemem-no-skills", "skills-only")  # modes that search a memory
# Agents whose actions depend on what the memory returns: as learners, each mode needs its own memory.
MEMORY_AGENTS = ("exemplar", "skill-guided", "react")
BOOTSTRAP_DEFAULT = 1000


@dataclass
class ExperimentConfig(Section):
    """One lifelong experiment, the ``[experiment]`` table of a run file.

    The default is built so that every LifeMem component can move a number: TextWorldExpress
    games whose goals are worded alike while their action spaces differ (``twx-coin`` and
    ``twx-coin-doors``, the same game with closed doors between its 8 rooms;
    ``twx-arithmetic``'s and ``twx-mapreader``'s "put it in the box"), ``twx-sorting`` as an evaluation-only
    environment (zero-shot transfer), a split size L of 10 (paper appendix E) so that clusters
    split within 20 tasks per environment, every mode, and the agent that reads skills."""

    NAME = "experiment"
    BOUNDS: ClassVar[dict[str, tuple[float, float]]] = {
        "train_tasks": (1, 10_000),
        "test_tasks": (1, 10_000),
        "buffer_size": (1, 10_000),
        "workers": (1, 256),
        "episodes_per_worker": (1, 1024),
        "shards": (1, 64),
        "max_attempts": (1, 10),
        "seeds": (1, 100),
        "bootstrap": (0, 100_000),
        "max_steps": (0, 10_000),
        "seed": (0, 2**31 - 1),
        "step_timeout_s": (0.001, 3_600.0),
        "episode_timeout_s": (0.001, 86_400.0),
        "worker_cpus": (0.0, 64.0),
    }

    name: str = "lifelong"
    envs: list[str] = field(default_factory=lambda: ["twx-coin", "twx-arithmetic", "twx-mapreader", "twx-coin-doors"])
    eval_envs: list[str] = field(default_factory=lambda: ["twx-sorting"])  # test tasks only: zero-shot transfer
    # An evaluation-only environment's stored stand-in for retrieval (tau2-airline = "tau2-retail");
    # without one, the stored environment whose trajectories best match each task (see actors.experiment).
    aliases: dict[str, str] = field(default_factory=dict)
    train_tasks: int = 20  # per environment
    test_tasks: int = 20
    stream: str = "similarity"
    buffer_size: int = 5
    modes: list[str] = field(default_factory=lambda: list(MEMORY_MODES))
    agent: str = "skill-guided"  # evaluation (and, with learn_agent "same", learning) agent
    learn_agent: str = "noisy-gold"  # who acts while learning: same | gold | noisy-gold | exemplar | random | react ...
    self_learn: bool = True
    seeds: int = 3  # runs with seeds seed, seed+1, ...: tasks, learner noise and agents all follow the seed
    bootstrap: int = BOOTSTRAP_DEFAULT  # resamples for the 95% intervals (0: no intervals)
    dedupe_test: bool = True  # drop test tasks that overlap a training task (see overlap())
    workers: int = 2
    # Episodes each worker runs at once (asyncio): 1 runs them one by one; above 1, for an LLM
    # agent that mostly waits on its server (set llm.concurrency to at least this).
    episodes_per_worker: int = 1
    worker_cpus: float = 0.5
    shards: int = 1
    seed: int = 0
    max_steps: int = 0  # 0: each environment's own limit
    step_timeout_s: float = 60.0
    episode_timeout_s: float = 600.0
    max_attempts: int = 3
    output: str = ""  # default: runs/<name>
    # The coin games get 8 rooms (the package default of 4 is solved by exploring alone); the
    # test folds list 60 seeds so that tasks dropped for overlap are replaced.
    env_options: dict[str, dict[str, Any]] = field(
        default_factory=lambda: {
            "twx-coin": {"numLocations": 8, "n_test": 60},
            "twx-arithmetic": {"n_test": 60},
            "twx-mapreader": {"n_test": 60},
            "twx-coin-doors": {"adapter": "twx-coin", "includeDoors": 1, "numLocations": 8, "n_test": 60},
        }
    )
    # Memory settings of this experiment ("section.key" -> value), applied over the memory config.
    memory: dict[str, Any] = field(default_factory=lambda: {"evolution.split_min_size": 10})

    def validate(self) -> None:
        from lifemem_ray.lab.agents import AGENTS

        if not self.envs:
            raise ConfigError("name at least one environment", where="experiment.envs")
        every = list(self.envs) + list(self.eval_envs)
        if len(set(every)) != len(every):
            raise ConfigError(f"experiment.envs / eval_envs: repeated names in {every}")
        for env, target in self.aliases.items():
            if env not in self.eval_envs or target not in self.envs:
                raise ConfigError(
                    f"experiment.aliases.{env} = {target!r}: an alias maps an evaluation-only environment "
                    f"(eval_envs: {self.eval_envs}) to a trained one (envs: {self.envs})"
                )
        if self.stream not in STREAMS:
            raise ConfigError(f"must be one of {', '.join(STREAMS)}; got {self.stream!r}", where="experiment.stream")
        if not self.modes or any(m not in MEMORY_MODES for m in self.modes) or len(set(self.modes)) != len(self.modes):
            raise ConfigError(
                f"each once, each one of {', '.join(MEMORY_MODES)}; got {self.modes}", where="experiment.modes"
            )
        if self.eval_envs and "none" not in self.modes:
            raise ConfigError(
                "zero-shot transfer (eval_envs) is reported against 'none': include it", where="experiment.modes"
            )
        for key in ("agent", "learn_agent"):
            value = getattr(self, key)
            if value not in AGENTS and not (key == "learn_agent" and value == "same"):
                raise ConfigError(f"experiment.{key}: unknown agent {value!r}; known: {', '.join(sorted(AGENTS))}")
        for key in ("envs", "eval_envs", "modes"):
            if not all(isinstance(v, str) for v in getattr(self, key)):
                raise ConfigError(f"experiment.{key}: expected a list of names, got {getattr(self, key)!r}")
        for name, options in self.env_options.items():
            if not isinstance(options, dict):
                raise ConfigError(f"experiment.env_options.{name}: must be a table of keyword options")

    @property
    def learner_uses_memory(self) -> bool:
        """Whether the learner's actions depend on the memory (then each mode collects its own)."""
        return self.learner in MEMORY_AGENTS

    @property
    def seed_list(self) -> list[int]:
        return [self.seed + i for i in range(self.seeds)]

    @property
    def learner(self) -> str:
        return self.agent if self.learn_agent == "same" else self.learn_agent

    @property
    def output_dir(self) -> Path:
        return Path(self.output or f"runs/{self.name}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str] | None = None,
        *,
        environ: Mapping[str, str] | None = None,
        overrides: Mapping[str, Any] | None = None,
    ) -> ExperimentConfig:
        """Defaults < the file's ``[experiment]`` table < ``LIFEMEM_EXPERIMENT_*`` < overrides
        (keys without ``experiment.``), as every section is loaded (:func:`load_section`)."""
        return load_section(cls(), path, environ=environ, overrides=overrides)
