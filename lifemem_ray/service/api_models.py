"""The request and answer shapes of the REST front door: pydantic models, so FastAPI checks
them and the OpenAPI document describes them (the MCP tools declare theirs in
:mod:`lifemem_ray.service.mcp_server`).

Trajectory records inside a request are checked by the engine's own
:meth:`~lifemem_ray.core.model.Trajectory.from_dict` (one set of rules for every entry point);
the schema here documents them. Every error answer has one shape, :class:`ErrorBody`:
``{"error": {"type", "message", "where", "what_to_do"}}``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

__all__ = [
    "TRAJECTORY_SCHEMA",
    "AddAccepted",
    "AddAnswer",
    "AddItem",
    "AddRequest",
    "ClustersAnswer",
    "DeleteAnswer",
    "ErrorBody",
    "ErrorDetail",
    "HealthAnswer",
    "OperationAnswer",
    "PurgeAnswer",
    "Query",
    "QueryAnswer",
    "RetrieveAnswer",
    "RetrieveRequest",
    "field_path",
]

# The native trajectory record (what `lifemem-ray export` writes and `ingest` reads).
TRAJECTORY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "title": "Trajectory",
    "description": "A finished task in the native record form. 'tenant' may be left out (the key's tenant); naming "
    "another tenant is refused. An id makes retries idempotent (without one, a content hash is the id).",
    "required": ["env", "task", "steps"],
    "additionalProperties": False,
    "properties": {
        "id": {"type": ["string", "integer", "null"], "maxLength": 512},
        "env": {"type": "string", "maxLength": 128},
        "task": {"type": "string"},
        "initial_observation": {"type": "string"},
        "steps": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "thought": {"type": "string"},
                    "action": {"type": "string"},
                    "observation": {"type": "string"},
                },
            },
        },
        "outcome": {
            "anyOf": [
                {"type": "null"},
                {"type": "boolean"},
                {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"success": {"type": ["boolean", "null"]}, "reward": {"type": ["number", "null"]}},
                },
            ]
        },
        "metadata": {"type": ["object", "null"]},
        "tenant": {"type": "string"},
    },
}

TrajectoryRecord = Annotated[dict[str, Any], WithJsonSchema(TRAJECTORY_SCHEMA)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Request(BaseModel):
    """A request body: no unknown fields, and no coercion (``k: true`` or ``k: "4"`` is a 422
    naming the field, not 1 or 4; ``context: "yes"`` is not true)."""

    model_config = ConfigDict(extra="forbid", strict=True)


# -- errors ---------------------------------------------------------------------------------
class ErrorDetail(_Strict):
    type: str = Field(
        description="validation_error, unauthorized, forbidden, not_found, conflict, too_large, unavailable, ..."
    )
    message: str
    where: str | None = Field(
        None, description="the field path or place the error is about, e.g. trajectories[3].steps[0].action"
    )
    what_to_do: str


class ErrorBody(_Strict):
    error: ErrorDetail


# -- adding ---------------------------------------------------------------------------------
class AddRequest(_Request):
    trajectories: list[TrajectoryRecord] = Field(
        description="a batch of trajectory records (at most http.max_batch_items)"
    )
    wait: bool = Field(
        True, description="false: answer 202 with an operation id at once (poll GET /v1/operations/{id})"
    )


class AddItem(_Strict):
    id: str
    status: str = Field(
        description="added | duplicate (stored before with the same content) | pending (stored, clustered later)"
    )
    cluster_id: int | None = None


class AddAnswer(_Strict):
    items: list[AddItem]


class AddAccepted(_Strict):
    operation: str = Field(description="poll GET /v1/operations/{operation}")
    status: Literal["pending"] = "pending"
    ids: list[str]


class OperationAnswer(_Strict):
    operation: str
    status: Literal["pending", "done", "failed"]
    created: float
    finished: float | None = None
    items: list[AddItem] | None = None
    error: ErrorDetail | None = None


# -- retrieving -----------------------------------------------------------------------------
class Query(_Request):
    task: str = Field(min_length=1, description="the new task")
    env: str | None = Field(None, description="its environment; null: every environment")


class RetrieveRequest(_Request):
    queries: list[Query] = Field(min_length=1, description="at most http.max_queries")
    k: int | None = Field(None, description="trajectories per query, 1-1024 (default retrieval.k)")
    skills: bool = Field(True, description="also return the skills of the retrieved trajectories' clusters")
    context: bool = Field(False, description="also return the prompt block an agent would get")
    full: bool = Field(False, description="also return each retrieved trajectory's steps and outcome")
    as_of: str | None = Field(
        None,
        max_length=2048,
        description="a memory version (GET /v1/stats: version): see only the trajectories committed then",
    )


class RetrievedItem(BaseModel):
    id: str
    env: str
    task: str
    score: float
    cluster_id: int | None = None
    trajectory: dict[str, Any] | None = None


class SkillItem(BaseModel):
    cluster_id: int
    text: str


class QueryAnswer(BaseModel):
    task: str
    env: str | None
    trajectories: list[RetrievedItem]
    skills: list[SkillItem]
    context: str | None = None


class RetrieveAnswer(BaseModel):
    results: list[QueryAnswer]


# -- state ----------------------------------------------------------------------------------
class ClustersAnswer(BaseModel):
    clusters: list[dict[str, Any]]
    total: int
    truncated: bool


class DeleteAnswer(BaseModel):
    id: str
    deleted: bool


class PurgeAnswer(BaseModel):
    tenant: str
    removed: int


class HealthAnswer(BaseModel):
    ok: bool
    coordinator: bool
    shards: list[bool]
    detail: str | None = None


def field_path(loc: Sequence[Any]) -> str:
    """A pydantic error location as a field path: ``("body", "trajectories", 3, "steps")`` ->
    ``trajectories[3].steps`` (the leading ``body`` / ``query`` / ``path`` is dropped)."""
    parts = list(loc)
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            out += ("." if out else "") + str(p)
    return out or "body"
