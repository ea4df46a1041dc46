"""What an episode memory can be asked, as one checked object: every adapter (the gymnasium
wrapper, SkyRL's ``memory`` block, verl's agent-loop YAML, OpenRLHF's agent) takes these
options under these names and bounds, and refuses a bad one naming where it was given.

>>> EpisodeOptions(k=8).k
8
>>> validated(EpisodeOptions, {"k": 0}, where="memory")
Traceback (most recent call last):
...
lifemem_ray.core.errors.ConfigError: memory.k: must be within 1..64, got 0
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from lifemem_ray.core.errors import InvalidArgumentError, TenantError
from lifemem_ray.core.tenancy import DEFAULT_TENANT, check_tenant
from lifemem_ray.core.validation import validated
from lifemem_ray.engine.versions import check_version
from lifemem_ray.lab.agent_prompts import DEFAULT_MEMORY_TOKENS

__all__ = ["EpisodeOptions", "validated"]


class EpisodeOptions(BaseModel):
    """An episode memory's options (:class:`~lifemem_ray.episodes.episode_memory.EpisodeMemory`)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    k: int = Field(4, ge=1, le=64, description="trajectories recalled per episode")
    token_budget: int = Field(
        DEFAULT_MEMORY_TOKENS, ge=1, le=100_000, description="the recalled context's budget in tokens"
    )
    tenant: str = Field(DEFAULT_TENANT, description="whose memory is read and written")
    ack_timeout_s: float = Field(
        120.0, ge=0.1, le=3600.0, description="how long a recall, or a write's acknowledgement, may take"
    )
    max_pending: int = Field(
        256, ge=1, le=100_000, description="writes in flight at most (the next waits: bounded backpressure)"
    )
    same_env: bool = Field(
        True, description="recall from the episode's environment only (false: from every environment)"
    )
    as_of: str | None = Field(
        None, description="a memory version to read at (a pinned read), recorded in each stored trajectory"
    )

    @field_validator("tenant")
    @classmethod
    def _tenant(cls, value: str) -> str:
        try:
            check_tenant(value, "tenant")
        except TenantError as exc:  # pydantic's protocol: the field's refusal as a ValueError
            raise ValueError(exc.problem) from None
        return value

    @field_validator("as_of")
    @classmethod
    def _version(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                check_version(value, "as_of")
            except InvalidArgumentError as exc:
                raise ValueError(exc.problem) from None
        return value
