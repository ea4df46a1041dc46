"""Decisions from an LLM: :class:`LLMDecider` implements
:class:`~lifemem_ray.core.decisions.Decider` over :class:`~lifemem_ray.llm.transport.LLMClient`
and validates every answer against what was asked (:mod:`lifemem_ray.llm.answers`): an answer
may only name the item keys and cluster ids that the prompt offered, and a text it writes for
the memory to store must pass the provenance rule (counted as ``refused_generated`` when it
does not). Anything else becomes ``None`` (the engine then falls back to the offline policy),
never an exception and never a stored error string.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from lifemem_ray.core.decisions import Assignment, AssignRequest, ClusterView, Groups
from lifemem_ray.core.errors import InvalidArgumentError
from lifemem_ray.core.model import Trajectory
from lifemem_ray.llm import lexicon
from lifemem_ray.llm.answers import check_assign, check_description, check_groups, check_skill, count_phrase
from lifemem_ray.llm.llm_config import LLMConfig
from lifemem_ray.llm.prompts import (
    MEMORY_OPERATIONS,
    assign_prompt,
    describe_prompt,
    distil_prompt,
    partition_prompt,
    split_prompt,
)
from lifemem_ray.llm.provenance import from_trajectories
from lifemem_ray.llm.transport import LLMClient

__all__ = ["LLMDecider"]

log = logging.getLogger(__name__)


PLACEHOLDER_API_KEY = "sk-local"  # local servers want some key; they do not check it
DEFAULT_BASE_URL = "https://api.openai.com/v1"
RETRYABLE_STATUS = frozenset({408, 429})  # plus every 5xx
# Operations whose failed call leaves one decision to the offline policy (assign counts per item).
CALL_FALLBACKS = frozenset(MEMORY_OPERATIONS) - {"assign"}


# --------------------------------------------------------------------------- the decider


class LLMDecider:
    """:class:`~lifemem_ray.core.decisions.Decider` backed by :class:`LLMClient`.

    assign and describe use ``llm.model``; partition, split and distil use
    ``llm.strong_model`` (or ``llm.model``), as in the paper. Methods never raise
    because an LLM failed: they return None (per item for assign) and count it.
    They do raise on programming errors (duplicate keys, too few members).
    """

    name = "llm"

    def __init__(
        self,
        config: LLMConfig,
        client: LLMClient | None = None,
        *,
        prompt_char_budget: int | None = None,
        **client_options: Any,
    ) -> None:
        """``client_options`` go to :class:`LLMClient` when no client is given.
        ``prompt_char_budget`` caps the trajectory text of one multi-trajectory prompt
        (default: ``llm.prompt_char_budget``)."""
        prompt_char_budget = config.prompt_char_budget if prompt_char_budget is None else prompt_char_budget
        if prompt_char_budget <= 0:
            raise InvalidArgumentError("prompt_char_budget must be > 0", where="LLMDecider")
        self.config = config
        self.client = client or LLMClient(config, **client_options)
        self.prompt_char_budget = prompt_char_budget
        lexicon.size()  # load the provenance rule's lexicon now: a missing package fails here, not mid-ingest

    @property
    def model(self) -> str:
        return self.config.model

    @property
    def strong_model(self) -> str:
        return self.config.strong_model or self.config.model

    # -- assign ------------------------------------------------------------------------

    def assign(self, requests: Sequence[AssignRequest]) -> list[Assignment | None]:
        """Batches of ``llm.items_per_call`` items of one tenant each, all batches in flight at once."""
        return self.client.run(self._assign(requests))

    async def assign_async(self, requests: Sequence[AssignRequest]) -> list[Assignment | None]:
        """:meth:`assign` for callers inside an event loop: awaits without blocking it."""
        return await self.client.arun(self._assign(requests))

    async def _assign(self, requests: Sequence[AssignRequest]) -> list[Assignment | None]:
        keys = [r.key for r in requests]
        if len(set(keys)) != len(keys):
            raise InvalidArgumentError(
                f"duplicate request keys {sorted(k for k in set(keys) if keys.count(k) > 1)}",
                where="LLMDecider.assign",
            )
        if not requests:
            return []
        size = self.config.items_per_call
        by_tenant: dict[str, list[AssignRequest]] = {}
        for r in requests:  # one prompt never holds two tenants' trajectories or clusters
            by_tenant.setdefault(r.trajectory.tenant, []).append(r)
        chunks = [group[i : i + size] for group in by_tenant.values() for i in range(0, len(group), size)]
        answers = await asyncio.gather(*(self._assign_chunk(i, chunk) for i, chunk in enumerate(chunks)))
        merged: dict[int, Assignment | None] = {}
        for answer in answers:
            merged.update(answer)
        return [merged.get(r.key) for r in requests]

    async def _assign_chunk(self, index: int, chunk: list[AssignRequest]) -> dict[int, Assignment | None]:
        prompt = assign_prompt(chunk, self.config.max_item_chars)
        answer = await self.client.arequest(prompt, self.model, lambda data: check_assign(data, chunk, prompt.schema))
        answer = answer or {}
        result: dict[int, Assignment | None] = {}
        for request in chunk:
            assignment = answer.get(request.key)
            if assignment is not None and assignment.cluster_id is None:
                # new_group labels join items of one answer only: make them unique across calls.
                label = assignment.new_group or f"item-{request.key}"
                assignment = dataclasses.replace(assignment, new_group=f"llm{index}:{label}")
            result[request.key] = assignment
        invalid = sum(v is None for v in result.values())
        self.client.record("assign", items=len(chunk), items_invalid=invalid)
        self.client.metrics.count_fallbacks("assign", invalid)  # the offline policy places these items
        return result

    # -- partition / split -------------------------------------------------------------

    def partition(self, trajectories: Sequence[Trajectory]) -> Groups | None:
        """Group labels per trajectory (0.. in answer order) and one description per group."""
        if not trajectories:
            return [], []
        prompt = partition_prompt(trajectories, self.config.max_item_chars, self.prompt_char_budget)
        return self.client.request(
            prompt, self.strong_model, lambda data: check_groups(data, trajectories, prompt.schema)
        )

    def split(self, cluster: ClusterView, members: Sequence[Trajectory], max_parts: int) -> Groups | None:
        """Child labels per member (0.. in answer order, at least 2 groups) and their descriptions."""
        prompt = split_prompt(cluster, members, max_parts, self.config.max_item_chars, self.prompt_char_budget)
        return self.client.request(prompt, self.strong_model, lambda data: check_groups(data, members, prompt.schema))

    # -- describe / distil -------------------------------------------------------------

    def describe(self, cluster: ClusterView) -> str | None:
        """One sentence for the cluster, drawing on its example trajectories only (the
        description shown beside them is generated text, not evidence)."""
        prompt = describe_prompt(cluster, self.config.max_item_chars, self.prompt_char_budget)
        source = from_trajectories(
            cluster.examples,
            f"the cluster's {count_phrase(len(cluster.examples), 'example trajectory', 'example trajectories')}",
        )
        return self.client.request(prompt, self.model, lambda data: check_description(data, prompt.schema, source))

    def distil(self, cluster: ClusterView, members: Sequence[Trajectory]) -> str | None:
        """A skill for the cluster, drawing on ``members`` (the sample it is distilled from)."""
        prompt = distil_prompt(cluster, members, self.config.max_item_chars, self.prompt_char_budget)
        forbidden = sorted(
            {e for e in [t.env for t in members] + list(cluster.envs) if len(e) >= 4}
            | {t.id for t in members if len(t.id) >= 6}
        )
        source = from_trajectories(
            members, f"the cluster's {count_phrase(len(members), 'member trajectory', 'member trajectories')}"
        )
        return self.client.request(
            prompt, self.strong_model, lambda data: check_skill(data, prompt.schema, forbidden, source)
        )

    # -- bookkeeping -------------------------------------------------------------------

    def usage(self) -> dict[str, dict[str, float]]:
        """The memory's operations only (an agent sharing the client counts under ``act``)."""
        return {op: v for op, v in self.client.usage().items() if op in MEMORY_OPERATIONS}

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> LLMDecider:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
