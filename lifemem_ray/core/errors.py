"""Every error lifemem-ray raises on purpose: one root, :class:`LifeMemError`, and a class per
kind of problem. Each also derives from the built-in exception a caller would naturally
catch (a bad value is a ``ValueError``, a missing cluster a ``KeyError``, a broken store a
``RuntimeError``), so code written against those keeps working.

Messages say where (a file, a setting, a record), what is wrong, and what to do. Where a
location is known it also travels as data: ``error.where`` (``steps[0].action``,
``evolution.top_k``) and ``error.problem`` (what is wrong there), so a front door or a form
can point at the field without reading the message; :func:`join_where` puts an outer
location before it (``trajectories[3]`` + ``steps[0]``).

>>> from lifemem_ray.core.errors import ConfigError, LifeMemError
>>> issubclass(ConfigError, LifeMemError) and issubclass(ConfigError, ValueError)
True
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ActionParseError",
    "AnswerError",
    "ArgumentTypeError",
    "AuthError",
    "CommandError",
    "ConfigError",
    "CoordinatorUnavailableError",
    "DeploymentExistsError",
    "DeploymentNotFoundError",
    "EmbeddingError",
    "EnvHung",
    "EnvStateError",
    "EnvUnavailable",
    "EpisodeTimeout",
    "ForbiddenError",
    "GeneratedTextRefused",
    "IdConflictError",
    "IndexBuildError",
    "IndexCacheError",
    "IndexSaveError",
    "InvalidArgumentError",
    "InvalidTrajectoryError",
    "LifeMemError",
    "MaintenanceError",
    "MetricTagError",
    "OverloadedError",
    "PathExistsError",
    "PathNotFoundError",
    "ResourcesUnavailableError",
    "ShardUnavailableError",
    "StoreError",
    "StoreLockedError",
    "TaskError",
    "TenantError",
    "UnknownClusterError",
    "UnknownNameError",
    "UsageError",
    "VectorIndexError",
]


class LifeMemError(Exception):
    """The root of every error lifemem-ray raises on purpose.

    Args:
        message: what is wrong (and what to do); with ``where``, what is wrong there.
        where: the location it names, as data (a field path such as ``steps[0].action``, a
            setting such as ``evolution.top_k``); the message then reads ``where: message``.

    >>> error = InvalidTrajectoryError("expected a string", where="steps[0].action")
    >>> str(error), error.where, error.problem
    ('steps[0].action: expected a string', 'steps[0].action', 'expected a string')
    """

    where: str | None  # the location the error names, as data
    problem: Any  # what is wrong there (the message without the location)

    def __init__(self, message: Any = "", *args: Any, where: str | None = None, **kwargs: Any) -> None:
        # A subclass that set its own ``where`` or ``problem`` before calling this keeps them.
        self.__dict__.setdefault("where", where)  # the location named, as data (None: the message names none)
        self.__dict__.setdefault("problem", message)  # what is wrong there
        # ``args``/``kwargs``: what a second base takes (an HTTPException's detail and headers).
        super().__init__(f"{where}: {message}" if where else message, *args, **kwargs)


def join_where(outer: str, inner: str | None) -> str:
    """``outer`` followed by ``inner``: ``("a[1]", "b")`` -> ``a[1].b``, ``("a", "[2].b")`` -> ``a[2].b``.

    >>> join_where("trajectories[3]", None), join_where("queries", "[2].task")
    ('trajectories[3]', 'queries[2].task')
    """
    if not inner:
        return outer
    return f"{outer}{inner}" if inner.startswith("[") else f"{outer}.{inner}"


# -- input and configuration ----------------------------------------------------------------


class ConfigError(LifeMemError, ValueError):
    """A configuration value is missing, of the wrong type or out of range."""


class InvalidArgumentError(LifeMemError, ValueError):
    """A value given to a public function or constructor is out of its range or not one of
    the choices it takes (a ``k`` of 0, an unknown mode or split); the message names the
    argument, what it got and what it takes."""


class ArgumentTypeError(LifeMemError, TypeError):
    """An argument of the wrong type (one string where a list of ids goes, a dict where a
    :class:`~lifemem_ray.core.model.Trajectory` goes); the message names the argument and the
    type it takes."""


class UnknownNameError(LifeMemError, KeyError):
    """A name a fixed registry (the environments, a benchmark's task kinds) does not hold;
    the message lists the names it knows."""


class PathExistsError(LifeMemError, FileExistsError):
    """A file or folder that must be new or empty (the target of a snapshot or a restore)
    already holds something: nothing was written; name a new or empty folder."""


class PathNotFoundError(LifeMemError, FileNotFoundError):
    """A file or folder a call reads is missing, or holds none of what it should (neither a
    snapshot nor a store)."""


class InvalidTrajectoryError(LifeMemError, ValueError):
    """A trajectory (or a record that should become one) is malformed."""


class IdConflictError(LifeMemError, ValueError):
    """A trajectory id is already stored, or repeated in one request, with different content:
    nothing of the request was stored."""


class UnknownClusterError(LifeMemError, KeyError):
    """A placement names a cluster this store does not hold (it lives on another shard)."""


class CommandError(LifeMemError):
    """A command-line command cannot go on; the message says why and what to do."""


# -- storage, index and embedding ------------------------------------------------------------


class StoreError(LifeMemError, RuntimeError):
    """The store on disk is missing, unreadable or of another shape."""


class StoreLockedError(StoreError):
    """Another process has the store open for writing."""


class VectorIndexError(LifeMemError, ValueError):
    """A vector index was asked something it cannot do (wrong dimension, unknown ids)."""


class IndexSaveError(LifeMemError, OSError):
    """The index cache could not be written (a full disk); the store itself is intact."""


class IndexCacheError(LifeMemError, ValueError):
    """A saved index cache that cannot be used (a missing or damaged file, another dimension,
    format, store or contents): the engine logs why and rebuilds the index from the store."""


class IndexBuildError(LifeMemError, RuntimeError):
    """FAISS did not accept an index it should have (a bug or a FAISS change)."""


class EmbeddingError(LifeMemError, RuntimeError):
    """The embedding model cannot be loaded or run."""


class MaintenanceError(LifeMemError, RuntimeError):
    """Background maintenance (splits, skills) failed; the store holds what was committed."""


# -- the LLM -----------------------------------------------------------------------------------


class AnswerError(LifeMemError, ValueError):
    """An LLM answer that is not valid for its request (schema, ids, text checks)."""


class GeneratedTextRefused(AnswerError):
    """A generated skill or description refused by the provenance rule
    (:mod:`lifemem_ray.llm.provenance`): a token that is not plain prose and occurs in none of the
    trajectories it was generated from, or an instruction aimed at the operator. The offline
    text stands in; counted as ``refused_generated``."""


class UsageError(LifeMemError, RuntimeError):
    """An API called out of order: a client used after close, from another event loop, or
    before what it needs was started."""


class MetricTagError(LifeMemError, ValueError):
    """A metric recorded with a tag value (or value) its declaration in ``lifemem_ray.core.metrics`` does not allow."""


# -- environments and rollouts ----------------------------------------------------------------


class EnvUnavailable(LifeMemError, RuntimeError):
    """The environment's package or data is not installed here; the message says what to install."""


class TaskError(LifeMemError, ValueError):
    """A task does not belong to the environment or is malformed."""


class EnvStateError(LifeMemError, RuntimeError):
    """An environment was driven out of order (``step`` before ``reset``, after the end) or broke."""


class ActionParseError(LifeMemError, ValueError):
    """An agent's action that is not a call the environment can read (empty, not a call, not
    literal arguments); the environment answers it with an error observation, so the agent
    can try again."""


class EpisodeTimeout(LifeMemError, RuntimeError):
    """An episode ran past its time limit."""


class EnvHung(LifeMemError, RuntimeError):
    """An environment call did not return within the per-step limit."""


# -- the sharded memory --------------------------------------------------------------------------


class OverloadedError(LifeMemError, RuntimeError):
    """The coordinator's queue stayed full for longer than ``cluster.overload_timeout_s``."""


class ShardUnavailableError(LifeMemError, RuntimeError):
    """A shard (or the node it is pinned to) is gone; what it acknowledged is in its store
    and in the last snapshot, and what it did not acknowledge may be retried."""


class CoordinatorUnavailableError(LifeMemError, RuntimeError):
    """The deployment's coordinator did not answer in time (its node is being restarted, or it
    is overloaded); what it acknowledged is stored, and the call may be retried."""


class DeploymentNotFoundError(LifeMemError, RuntimeError):
    """No lifemem-ray deployment runs in this Ray namespace."""


class DeploymentExistsError(LifeMemError, RuntimeError):
    """A lifemem-ray deployment already runs in this Ray namespace (or serves this store)."""


class ResourcesUnavailableError(LifeMemError, RuntimeError):
    """The Ray cluster lacks the resources (CPUs, nodes) to start what was asked for."""


class TenantError(LifeMemError, ValueError):
    """A tenant name that is not allowed (names: a letter or digit, then letters, digits, ``_ . -``; at most 64)."""


class AuthError(LifeMemError, PermissionError):
    """A request without a valid API key (none, malformed, unknown or revoked): the caller is
    not known, and must send a key the operator issued. How a front end answers it (a status
    code, a tool error) is the front end's to decide."""


class ForbiddenError(LifeMemError, PermissionError):
    """A valid API key whose scopes (or tenant) do not allow the operation: the caller is
    known but not allowed; use a key with the scope named."""
