"""The domain model: a workflow cluster, how a member folds into it and out of it, and the
invariant :meth:`lifemem_ray.engine.memory.Memory.verify` checks.

A cluster keeps running sums of its members' unit vectors (``tsum`` over task texts,
``wsum`` over workflows), so its mean resultant length R = |wsum| / count is known without
reading the members. Every change of membership goes through :func:`fold_member` /
:func:`unfold_member` (or :func:`merged` for two whole clusters), so the invariant holds:
a live cluster's count, sums and R equal a recomputation from its stored members
(:func:`check_against_members`). How a record is stored is :mod:`lifemem_ray.engine.store.codec`'s business.

Also here: the rules that schedule maintenance for a cluster (:func:`needs_split`,
:func:`needs_skill`, :func:`needs_description`) and :class:`ClusterInfo`, the public view.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from lifemem_ray.core.errors import InvalidArgumentError
from lifemem_ray.core.tenancy import DEFAULT_TENANT, display_envs, record_tenant

if TYPE_CHECKING:
    from lifemem_ray.engine.memory_config import EvolutionConfig
    from lifemem_ray.llm.llm_config import LLMConfig

__all__ = [
    "MAX_FLOWS",
    "OTHER_FLOW",
    "ClusterInfo",
    "ClusterRecord",
    "add_member",
    "check_against_members",
    "check_listing_limit",
    "cosine_to_sum",
    "example_task",
    "fold_member",
    "merged",
    "needs_description",
    "needs_skill",
    "needs_skill_after_removal",
    "needs_split",
    "new_cluster_record",
    "scrub_text",
    "unfold_member",
]

MAX_FLOWS = 24  # distinct workflow summaries kept per cluster (the rest count as OTHER_FLOW)
OTHER_FLOW = "(other)"


@dataclass
class ClusterRecord:
    """A workflow cluster. ``tsum``/``wsum`` are running sums of member unit vectors,
    so the mean resultant length R = |wsum| / count is known without reading members.
    ``envs`` counts members per *scope* (:mod:`lifemem_ray.core.tenancy`: the environment, with
    the tenant for a tenant other than the default); a cluster holds one tenant only."""

    id: int
    count: int
    tsum: np.ndarray  # float64 (dim,): sum of text unit vectors
    wsum: np.ndarray  # float64 (wdim,): sum of workflow unit vectors
    envs: dict[str, int] = field(default_factory=dict)
    flows: dict[str, int] = field(default_factory=dict)  # workflow summary -> count (bounded)
    successes: int = 0
    failures: int = 0
    description: str = ""
    description_by: str = ""
    description_n: int = 0  # count when the description was last written by its author
    skill: str = ""
    skill_by: str = ""
    skill_n: int = 0  # count when the skill was last distilled
    version: int = 0
    born: str = "new"  # init | new | split
    parent: int | None = None
    created: float = 0.0
    updated: float = 0.0
    split_into: list[int] | None = None  # set on the tombstone of a split (or merged) cluster
    no_split_until: int = 0  # a split that found no structure is not retried before this count

    @property
    def live(self) -> bool:
        return self.split_into is None and self.count > 0

    @property
    def tenant(self) -> str | None:
        """The tenant of the members (None for a cluster without members)."""
        return record_tenant(self.envs)

    @property
    def mrl(self) -> float:
        """Mean resultant length R of the members' workflow vectors."""
        return float(np.linalg.norm(self.wsum) / self.count) if self.count else 0.0

    def copy(self) -> ClusterRecord:
        return ClusterRecord(
            **{
                **self.__dict__,
                "tsum": self.tsum.copy(),
                "wsum": self.wsum.copy(),
                "envs": dict(self.envs),
                "flows": dict(self.flows),
                "split_into": list(self.split_into) if self.split_into is not None else None,
            }
        )


def scrub_text(record: ClusterRecord) -> ClusterRecord:
    """Drop what a record says about its members in words (description, skill, workflow
    summaries), in place: a tombstone or a retired cluster keeps only numbers, so text about
    trajectories deleted later does not outlive them."""
    record.description = record.skill = record.description_by = record.skill_by = ""
    record.flows = {}
    return record


def new_cluster_record(cluster_id: int, dim: int, wdim: int, born: str, now: float) -> ClusterRecord:
    return ClusterRecord(
        id=cluster_id,
        count=0,
        tsum=np.zeros(dim, dtype=np.float64),
        wsum=np.zeros(wdim, dtype=np.float64),
        born=born,
        created=now,
        updated=now,
    )


def fold_member(
    record: ClusterRecord, vec: np.ndarray, wvec: np.ndarray, env: str, success: bool | None, flow: str, now: float
) -> None:
    """Add one member to a cluster's running state (sums, counts, profiles)."""
    record.count += 1
    record.tsum += vec
    record.wsum += wvec
    record.envs[env] = record.envs.get(env, 0) + 1
    flows = record.flows
    if flow in flows or len(flows) < MAX_FLOWS:
        flows[flow] = flows.get(flow, 0) + 1
    else:
        flows[OTHER_FLOW] = flows.get(OTHER_FLOW, 0) + 1
    if success is True:
        record.successes += 1
    elif success is False:
        record.failures += 1
    record.version += 1
    record.updated = now


def unfold_member(
    record: ClusterRecord, vec: np.ndarray, wvec: np.ndarray, env: str, success: bool | None, flow: str, now: float
) -> None:
    """The inverse of :func:`fold_member`: take one member out of the running state."""
    record.count -= 1
    record.tsum -= vec
    record.wsum -= wvec
    env_n = record.envs.get(env, 0) - 1
    if env_n > 0:
        record.envs[env] = env_n
    else:
        record.envs.pop(env, None)
    key = flow if flow in record.flows else OTHER_FLOW
    if key in record.flows:
        record.flows[key] -= 1
        if record.flows[key] <= 0:
            del record.flows[key]
    if success is True:
        record.successes -= 1
    elif success is False:
        record.failures -= 1
    record.version += 1
    record.updated = now
    if record.count == 0:
        record.tsum[:] = 0
        record.wsum[:] = 0


def add_member(record: ClusterRecord, item: Any, now: float) -> None:
    """:func:`fold_member` for a batch item (:class:`lifemem_ray.engine.clustering.evolution.BatchItem`)."""
    fold_member(record, item.vec, item.wvec, item.env, item.success, item.flow, now)


def merged(keep: ClusterRecord, gone: ClusterRecord, now: float) -> ClusterRecord:
    """``keep`` with every member of ``gone`` folded in (``gone``'s profile added to its own)."""
    out = keep.copy()
    out.count += gone.count
    out.tsum = out.tsum + gone.tsum
    out.wsum = out.wsum + gone.wsum
    for env, n in gone.envs.items():
        out.envs[env] = out.envs.get(env, 0) + n
    for flow, n in gone.flows.items():
        key = flow if flow in out.flows or len(out.flows) < MAX_FLOWS else OTHER_FLOW
        out.flows[key] = out.flows.get(key, 0) + n
    out.successes += gone.successes
    out.failures += gone.failures
    out.version += 1
    out.updated = now
    return out


def cosine_to_sum(vec: np.ndarray, total: np.ndarray) -> float:
    """Cosine of a unit vector with a cluster's running sum (0 for an empty sum)."""
    norm = float(np.sqrt(total @ total))
    return float(vec @ total) / norm if norm > 0 else 0.0


def check_against_members(
    record: ClusterRecord, members: int, count: int, tsum: np.ndarray, wsum: np.ndarray
) -> list[str]:
    """The invariant of a live cluster: its count equals its member list (``members``) and the
    recount of the stored vectors assigned to it (``count``, summing to ``tsum`` / ``wsum``);
    its running sums equal those sums, and its R the R they give. Problems found, as text."""
    if record.count != members or record.count != count:
        return [f"cluster {record.id}: count {record.count}, members {members}, recomputed {count}"]
    problems = []
    if not np.allclose(record.tsum, tsum, atol=1e-3) or not np.allclose(record.wsum, wsum, atol=1e-3):
        problems.append(f"cluster {record.id}: running sums differ from recomputation")
    r = float(np.linalg.norm(wsum) / count) if count else 0.0
    if abs(r - record.mrl) > 1e-4:
        problems.append(f"cluster {record.id}: R {record.mrl:.6f} != recomputed {r:.6f}")
    return problems


# -- when a cluster needs maintenance ----------------------------------------------------------
def needs_split(record: ClusterRecord, evo: EvolutionConfig) -> bool:
    """The paper's split rule: n > L and R < tau (and not refused at this size before)."""
    return (
        record.count > evo.split_min_size
        and record.mrl < evo.split_mrl_threshold
        and record.count >= record.no_split_until
    )


def needs_skill(record: ClusterRecord, evo: EvolutionConfig, llm: LLMConfig, llm_mode: bool) -> bool:
    """Every cluster has a skill from its creation on. With an LLM, a cluster gets an LLM
    skill once it has ``llm.min_cluster_size`` members, then again each time it has grown
    by ``evolution.skill_refresh_growth`` (the paper's budget: few, well-fed calls)."""
    if record.skill_n == 0:
        return True
    if llm_mode and record.skill_by == "offline" and record.count >= llm.min_cluster_size:
        return True
    return record.count >= record.skill_n * (1.0 + evo.skill_refresh_growth)


def needs_skill_after_removal(record: ClusterRecord, evo: EvolutionConfig) -> bool:
    """After members were removed: distil again once the cluster has shrunk as much as growth
    would call for (its skill was distilled at ``skill_n`` members; it now has at most
    ``skill_n / (1 + evolution.skill_refresh_growth)``), so a skill does not keep describing
    members that are gone."""
    return record.count > 0 and record.skill_n > 0 and record.count * (1.0 + evo.skill_refresh_growth) <= record.skill_n


def needs_description(record: ClusterRecord, evo: EvolutionConfig, llm: LLMConfig) -> bool:
    """With an LLM: describe a cluster once it has ``llm.min_cluster_size`` members, then
    each time it has grown by ``description_refresh_growth`` since the last attempt."""
    return record.count >= max(
        float(llm.min_cluster_size), record.description_n * (1.0 + evo.description_refresh_growth)
    )


def example_task(record: ClusterRecord) -> str:
    """The example goal an offline description ends with."""
    return record.description.partition("Example goal: ")[2]


def check_listing_limit(limit: Any) -> None:
    """How many clusters a listing may return: a positive integer, or None for all (the one
    check of the engine's and the client's ``clusters``)."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise InvalidArgumentError(f"expected a positive integer or None, got {limit!r}", where="limit")


@dataclass(frozen=True)
class ClusterInfo:
    """The public view of a live cluster."""

    id: int
    count: int
    envs: dict[str, int]
    description: str
    skill: str
    mrl: float
    born: str
    parent: int | None
    successes: int
    failures: int
    flows: dict[str, int] = field(default_factory=dict)
    tenant: str = DEFAULT_TENANT  # whose members these are; ``envs`` names the environments without it

    @classmethod
    def of(cls, record: ClusterRecord) -> ClusterInfo:
        top = dict(sorted(record.flows.items(), key=lambda kv: -kv[1])[:5])
        return cls(
            id=record.id,
            count=record.count,
            envs=display_envs(record.envs),
            description=record.description,
            skill=record.skill,
            mrl=round(record.mrl, 6),
            born=record.born,
            parent=record.parent,
            successes=record.successes,
            failures=record.failures,
            flows=top,
            tenant=record.tenant or DEFAULT_TENANT,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "count": self.count,
            "envs": self.envs,
            "description": self.description,
            "skill": self.skill,
            "mrl": self.mrl,
            "born": self.born,
            "parent": self.parent,
            "successes": self.successes,
            "failures": self.failures,
            "flows": self.flows,
            "tenant": self.tenant,
        }
