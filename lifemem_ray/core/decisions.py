"""What a decision maker (an LLM, :class:`lifemem_ray.llm.decider.LLMDecider`) is asked and may answer.

The engine computes candidates and offline scores (:class:`lifemem_ray.engine.clustering.policy.OfflinePolicy`);
a :class:`Decider` only chooses among ids it was given. Any answer outside them is invalid
and the engine falls back to the offline policy for that item.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from lifemem_ray.core.model import Trajectory

__all__ = ["AssignRequest", "Assignment", "Candidate", "ClusterView", "Decider", "Groups"]

# A grouping: one label per item (0..g-1, in the answer's order) and one description per group.
Groups = tuple[list[int], list[str]]


@dataclass(frozen=True, slots=True)
class ClusterView:
    """A cluster as shown to a decider: enough to judge, never the whole membership."""

    id: int  # negative ids are clusters opened earlier in the same batch, not yet committed
    count: int
    description: str
    skill: str = ""
    envs: dict[str, int] = field(default_factory=dict)
    examples: tuple[Trajectory, ...] = ()


@dataclass(frozen=True, slots=True)
class Candidate:
    cluster: ClusterView
    score: float  # the offline policy's combined similarity in [0, 1]
    text_similarity: float
    workflow_similarity: float
    neighbour_hits: int  # how many of the trajectory's top-k neighbours are in this cluster


@dataclass(frozen=True, slots=True)
class AssignRequest:
    key: int  # the item's position in its batch; answers refer to it
    trajectory: Trajectory
    candidates: tuple[Candidate, ...]  # best offline score first; may be empty


@dataclass(frozen=True, slots=True)
class Assignment:
    """Join ``cluster_id``, or open a new cluster when it is None.

    Items of one answer that open a new cluster with the same ``new_group``
    open it together (one cluster, not several).
    """

    cluster_id: int | None
    new_group: str | None = None
    description: str | None = None  # optional description for a new cluster


class Decider(Protocol):
    """A source of decisions. Returning None (or None for an item) means: no valid answer."""

    name: str

    def assign(self, requests: Sequence[AssignRequest]) -> list[Assignment | None]: ...

    def partition(self, trajectories: Sequence[Trajectory]) -> Groups | None: ...

    def describe(self, cluster: ClusterView) -> str | None: ...

    def split(self, cluster: ClusterView, members: Sequence[Trajectory], max_parts: int) -> Groups | None: ...

    def distil(self, cluster: ClusterView, members: Sequence[Trajectory]) -> str | None: ...

    def usage(self) -> dict[str, dict[str, float]]: ...
