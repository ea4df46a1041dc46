"""Every error of the front door as one JSON shape, with its HTTP status:
``{"error": {"type", "message", "where", "what_to_do"}}``.

=================================================  ======  ====================
exception                                          status  type
=================================================  ======  ====================
ApiError                                           its own its own
request validation (pydantic), bad values           422    validation_error
AuthError                                           401    unauthorized (+ WWW-Authenticate: Bearer)
ForbiddenError                                      403    forbidden
IdConflictError                                     409    conflict
body over http.max_body_bytes                       413    too_large
body late (http.body_timeout_s, body_min_rate)      408    timeout (+ Connection: close)
tenant at http.max_ongoing_per_tenant               429    too_many_requests (+ Retry-After, Connection: close)
StoreError (SharedLogError too): storage failed     503    unavailable (+ Retry-After)
overload, a shard / the coordinator unavailable     503    unavailable (+ Retry-After)
anything else                                       500    internal
=================================================  ======  ====================

A tenant never reads the server's paths (:mod:`lifemem_ray.service.public_errors`): a storage
failure answers one sentence naming which storage is unavailable, its full message (the path,
the cause) goes to the replica's log; the other 503 and 500 messages have their paths replaced.
Every 503 carries ``Retry-After: http.retry_after_s`` (1-3,600 s).
"""

from __future__ import annotations

import logging
from typing import Any

import ray

from lifemem_ray.actors.cluster.remote_errors import DeploymentNotFoundError, ShardUnavailableError, actor_failures
from lifemem_ray.core.errors import AuthError, ForbiddenError, IdConflictError, LifeMemError, OverloadedError
from lifemem_ray.service.public_errors import storage_failure, without_paths

__all__ = ["ApiError", "error_detail", "unavailable_errors", "validation_detail", "where_of"]

log = logging.getLogger(__name__)


class ApiError(LifeMemError, ValueError):
    """A refusal with its HTTP answer: status, error type, where, what to do."""

    def __init__(self, status: int, type_: str, message: str, where: str | None = None, what_to_do: str = "") -> None:
        super().__init__(message)
        self.status, self.type, self.where, self.what_to_do = status, type_, where, what_to_do


def where_of(exc: BaseException) -> str | None:
    """The location an error names, as data (``LifeMemError.where``; None when it names none)."""
    where = getattr(exc, "where", None)
    return where if isinstance(where, str) else None


def unavailable_errors() -> tuple[type[BaseException], ...]:
    """What means "the memory cannot answer now, try again": 503 with Retry-After."""
    return (
        ShardUnavailableError,
        OverloadedError,
        DeploymentNotFoundError,
        ray.exceptions.GetTimeoutError,
        *actor_failures(),
    )


_HTTP_TYPES = {
    400: "bad_request",
    404: "not_found",
    405: "method_not_allowed",
    408: "timeout",
    413: "too_large",
    415: "unsupported_media_type",
    429: "too_many_requests",
}


def _detail(type_: str, message: str, where: str | None, what_to_do: str) -> dict[str, Any]:
    return {"type": type_, "message": message, "where": where, "what_to_do": what_to_do}


def error_detail(exc: BaseException, retry_after_s: int) -> tuple[int, dict[str, Any], dict[str, str]]:
    """The answer to an exception, in the one error shape.

    Args:
        exc: what a route (or the middleware, or an add answered 202) raised.
        retry_after_s: the ``Retry-After`` of a 503 (``http.retry_after_s``).

    Returns:
        ``(status, error detail, extra headers)``; no detail names a server path.
    """
    from starlette.exceptions import HTTPException

    storage = storage_failure(exc)
    if storage is not None:
        return _storage_answer(exc, storage, retry_after_s)
    if isinstance(exc, ApiError):
        return exc.status, _detail(exc.type, str(exc), exc.where, exc.what_to_do), {}
    if isinstance(exc, AuthError):
        return (
            401,
            _detail(
                "unauthorized", str(exc), "Authorization", "send 'Authorization: Bearer <key>' with a valid API key"
            ),
            {"WWW-Authenticate": 'Bearer realm="lifemem"'},
        )
    if isinstance(exc, ForbiddenError):
        where = where_of(exc)
        return 403, _detail("forbidden", str(exc), where, "use a key of the right tenant with the scope named"), {}
    if isinstance(exc, IdConflictError):
        where = where_of(exc)
        return (
            409,
            _detail(
                "conflict",
                str(exc),
                where,
                "nothing of the request was stored; give the other content a new id, or send the stored content again",
            ),
            {},
        )
    if isinstance(exc, unavailable_errors()):
        return (
            503,
            _detail(
                "unavailable",
                without_paths(f"{type(exc).__name__}: {exc}"),
                None,
                f"retry after {retry_after_s} s; resending the same ids is safe (adds are idempotent)",
            ),
            {"Retry-After": str(retry_after_s)},
        )
    if isinstance(exc, HTTPException):
        status = exc.status_code
        return (
            status,
            _detail(_HTTP_TYPES.get(status, "http_error"), str(exc.detail), None, _what_for(status)),
            dict(exc.headers or {}),
        )
    if isinstance(exc, ValueError):  # the engine's checks (bad trajectory, tenant, k, ...): they name the field
        where = where_of(exc)
        return 422, _detail("validation_error", str(exc), where, "fix the field named and send the request again"), {}
    log.exception("unexpected error in the front door")
    return (
        500,
        _detail(
            "internal",
            without_paths(f"{type(exc).__name__}: {exc}"),
            None,
            "this is a bug: report it; the replica's log has the traceback",
        ),
        {},
    )


def _storage_answer(
    exc: BaseException, sentence: str, retry_after_s: int
) -> tuple[int, dict[str, Any], dict[str, str]]:
    """503 for a failure of the memory's storage: the tenant reads ``sentence`` (which storage,
    no path); the replica's log keeps the full message for the operator."""
    log.warning("answered 503, the memory's storage failed: %s: %s", type(exc).__name__, exc)
    return (
        503,
        _detail(
            "unavailable",
            sentence,
            None,
            f"retry after {retry_after_s} s: what the memory acknowledged is kept, and resending the same ids is "
            "safe (adds are idempotent); if it lasts, tell the memory's operator (the server's log says what failed)",
        ),
        {"Retry-After": str(retry_after_s)},
    )


def _what_for(status: int) -> str:
    if status == 404:
        return "check the path; GET /openapi.json lists the routes"
    if status == 405:
        return "check the method; GET /openapi.json lists the routes"
    if status == 413:
        return "send a smaller body (http.max_body_bytes): split the batch"
    if status == 408:
        return (
            "send the whole body at once, faster (http.body_timeout_s, http.body_min_rate_bytes_s), on a new connection"
        )
    if status == 429:
        return "wait for the tenant's other requests to finish (Retry-After), or send fewer at once"
    return "check the request against GET /openapi.json"


def validation_detail(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """FastAPI's validation errors as one detail: the first one's field path, up to five listed."""
    from lifemem_ray.service.api_models import field_path

    parts = [f"{field_path(e.get('loc', ()))}: {e.get('msg', 'invalid')}" for e in errors[:5]]
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    where = field_path(errors[0].get("loc", ())) if errors else None
    return _detail(
        "validation_error", "; ".join(parts) + more, where, "fix the field(s) named and send the request again"
    )
