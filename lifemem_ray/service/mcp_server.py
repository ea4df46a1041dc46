"""The memory as a Model Context Protocol server (the official ``mcp`` SDK, 2.x API).

Three tools, each with a typed (pydantic) result, so ``tools/list`` advertises an
``outputSchema`` and every answer carries ``structuredContent`` beside its text:

* ``add_trajectory`` (scope ``write``): one native trajectory record (task, env, steps of
  thought / action / observation, outcome, optional id and metadata: what the REST route and
  ``ingest`` accept, an integer id and a bare true/false outcome included), checked by
  :meth:`Trajectory.from_dict`; it answers id, status and cluster after the memory acknowledged it.
* ``retrieve_experience`` (scope ``read``; annotated read-only and idempotent): the top-k
  trajectories for a task as fields, the skills of their clusters, and the prompt block an
  agent would get (``context``: the trajectories rendered as fenced data, within the token budget).
* ``memory_stats`` (scope ``read``): the tenant's counts.

The tenant of every call is the acting principal's (``principal_provider()``), never an
argument. A refused call is an MCP tool error (``isError: true``) whose text says what is wrong,
where (the argument or record field) and what to do.

Two transports:

* stdio: ``lifemem-ray mcp --store DIR`` (:func:`run_stdio`) serves one engine
  :class:`~lifemem_ray.engine.memory.Memory` as one fixed principal, without Ray.
* Streamable HTTP, stateless (every request stands alone, so any Ray Serve replica can answer it),
  with JSON responses: :func:`mcp_http` gives the pieces to mount, :func:`streamable_http_app`
  a ready Starlette app with them.

Mounting contract (for the Serve ingress, ``actors/frontdoor/app.py``)::

    mcp = mcp_http(build_mcp_server(lambda: client, principal.current))
    app.router.routes.append(starlette.routing.Route("/mcp", endpoint=mcp.asgi, methods=["GET", "POST", "DELETE"]))
    # in the app's lifespan (Starlette does not run a mounted sub-app's lifespan):
    async with mcp.run():
        yield

* Route the exact path ``/mcp`` to ``mcp.asgi`` (a plain ASGI app; a ``Mount`` would answer
  ``/mcp`` with a redirect to ``/mcp/``).
* Enter ``mcp.run()`` once per process for the app's lifetime (it starts the SDK's session
  manager; a request before that is a server error). It cannot be entered twice: build a new
  :func:`mcp_http` for another app.
* Authenticate before the request reaches ``mcp.asgi`` and run it inside
  ``principal.acting_as(p)`` (an ASGI middleware or wrapper around the route): the tools read
  the principal with ``principal.current()``. The SDK runs a stateless request's handler in
  tasks started from the request's own task (legacy and 2026 protocol revisions, JSON and SSE
  answers) and sync tools in worker threads, which copy the context, so the contextvar set
  around the request is the one the tool sees (tests/service/test_mcp.py checks it with two keys).
* Bound the request body before it reaches the SDK if the ingress wants a lower limit than
  ``max_body_bytes`` (the SDK answers 413 above it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import stat
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import anyio
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.stdio import stdio_server
from mcp.server.streamable_http_manager import StreamableHTTPASGIApp, StreamableHTTPSessionManager
from mcp.server.transport_security import DEFAULT_MAX_REQUEST_BODY_SIZE, TransportSecuritySettings
from mcp_types import ToolAnnotations
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Route

from lifemem_ray.core.errors import (
    AuthError,
    ForbiddenError,
    IdConflictError,
    LifeMemError,
    OverloadedError,
    ShardUnavailableError,
)
from lifemem_ray.core.model import Trajectory
from lifemem_ray.engine.retrieval import RetrievedTrajectory
from lifemem_ray.service.principal import Principal
from lifemem_ray.service.public_errors import storage_failure, without_paths

__all__ = ["McpHttp", "build_mcp_server", "mcp_http", "run_stdio", "streamable_http_app"]

log = logging.getLogger(__name__)

SERVER_NAME = "lifemem"
INSTRUCTIONS = (
    "LifeMem: a lifelong workflow memory for agents. Before a task, call retrieve_experience with the task "
    "and environment to get earlier runs (succeeded or failed) and distilled skills; after a task, call "
    "add_trajectory with what you did (steps of thought, action, observation) and whether it succeeded."
)


# -- the tools' arguments and answers ---------------------------------------------------------------


class StepRecord(BaseModel):
    """One agent turn: what it thought, what it did, what the environment answered."""

    model_config = ConfigDict(extra="forbid", strict=True)
    thought: str = ""
    action: str = ""
    observation: str = ""


class OutcomeRecord(BaseModel):
    """How the task ended; either part may be unknown (null). Strict: ``"true"`` is not a
    success and ``true`` is not a reward."""

    model_config = ConfigDict(extra="forbid", strict=True)
    success: bool | None = None
    reward: float | None = None


class AddAnswer(BaseModel):
    id: str = Field(description="the trajectory's id: the one given, or a content hash")
    status: Literal["added", "duplicate", "pending"] = Field(
        description="added; duplicate (this id is stored with the same content); pending (stored, "
        "clustered once the memory holds enough trajectories)"
    )
    cluster_id: int | None = Field(description="the workflow cluster it joined (null while pending)")
    tenant: str = Field(description="the tenant it is stored under (the caller's key's)")


class RetrievedRecord(BaseModel):
    id: str
    env: str
    task: str
    initial_observation: str
    steps: list[StepRecord]
    outcome: OutcomeRecord
    metadata: dict[str, Any]
    score: float = Field(description="cosine similarity of its task to the query task")
    cluster_id: int | None


class SkillRecord(BaseModel):
    cluster_id: int
    text: str


class RetrieveAnswer(BaseModel):
    task: str
    env: str | None = Field(description="the environment searched (null: every environment)")
    k: int
    trajectories: list[RetrievedRecord] = Field(description="most similar first")
    skills: list[SkillRecord] = Field(description="the skills of the retrieved trajectories' clusters")
    context: str = Field(description="skills and exemplars as one prompt block, within the token budget")
    tokens: int = Field(description="estimated tokens of context")


class EnvCounts(BaseModel):
    trajectories: int
    clusters: int


class StatsAnswer(BaseModel):
    tenant: str
    trajectories: int
    clusters: int
    pending: int = Field(description="stored, waiting for the initial clustering")
    per_env: dict[str, EnvCounts]
    version: str | None = Field(None, description="the memory's version now: give it as_of to pin a retrieval to it")


# -- the tools ---------------------------------------------------------------------------------


class ToolRefusal(LifeMemError, ToolError):
    """A tool call refused with a message for the model: the SDK's ToolError (answered as a
    tool result with ``is_error``, logged without a traceback), and a LifeMemError as every
    error raised on purpose."""


def _problem(exc: BaseException) -> ToolRefusal:
    """A tool error whose text says what is wrong, where, and what to do (the SDK puts
    "Error executing tool <name>: " in front)."""
    storage = storage_failure(exc)
    if storage is not None:  # which storage failed, never its path (the log keeps the full message)
        log.warning("a tool call failed, the memory's storage failed: %s: %s", type(exc).__name__, exc)
        return ToolRefusal(f"{storage}: what the memory acknowledged is kept, and sending the same id again is safe")
    if isinstance(exc, (AuthError, ForbiddenError)):
        return ToolRefusal(f"not allowed: {exc}")
    if isinstance(exc, IdConflictError):
        return ToolRefusal(f"id conflict: {exc}; send the record under another id, or without one (a content hash)")
    if isinstance(exc, (OverloadedError, ShardUnavailableError)):
        return ToolRefusal(
            f"the memory is busy or a part of it is restarting ({without_paths(str(exc))}); what it acknowledged "
            "is kept: retry in a few seconds"
        )
    if isinstance(exc, ValueError):  # InvalidTrajectoryError, TenantError, argument checks: the caller's to fix
        return ToolRefusal(f"invalid argument: {exc}; correct it and call again")
    if not isinstance(exc, LifeMemError):  # not one raised on purpose: the log has its traceback
        log.error("a tool call failed unexpectedly", exc_info=exc)
    return ToolRefusal(without_paths(f"{type(exc).__name__}: {exc}"))


def _settled(answer: Any) -> Any:
    """A deployment answers an add with a future; a store with the results."""
    return answer.result() if hasattr(answer, "result") and callable(answer.result) else answer


class _Tools:
    """The tool functions over one backend; each resolves the acting principal first."""

    def __init__(self, backend_factory: Callable[[], Any], principal_provider: Callable[[], Principal]) -> None:
        self._backend = backend_factory
        self._principal = principal_provider

    def _acting(self, scope: str) -> Principal:
        try:
            return self._principal().require(scope)
        except (AuthError, ForbiddenError) as exc:
            raise _problem(exc) from None

    def add_trajectory(
        self,
        task: Annotated[str, Field(description="the goal the agent was given")],
        env: Annotated[
            str, Field(description="the environment or application, e.g. 'webshop' (at most 128 characters)")
        ],
        steps: Annotated[list[StepRecord], Field(description="the turns in order; each needs an action or a thought")],
        outcome: Annotated[
            OutcomeRecord | StrictBool | None,
            Field(description="success true/false/null and an optional reward, or just true/false"),
        ] = None,
        id: Annotated[
            str | StrictInt | None,
            Field(
                description="your id for the run (a string or an integer): makes a retry idempotent (default: a content hash)"
            ),
        ] = None,
        initial_observation: Annotated[
            str, Field(description="what the environment showed before the first action")
        ] = "",
        metadata: Annotated[dict[str, Any] | None, Field(description="free JSON kept with the record")] = None,
    ) -> AddAnswer:
        """Store one finished run of a task (a trajectory) in the memory, for later retrieval.

        Answers after the memory acknowledged it (durable). The same id with the same content
        answers 'duplicate'; the same id with other content is refused."""
        principal = self._acting("write")
        record: dict[str, Any] = {
            "env": env,
            "task": task,
            "steps": [s.model_dump() for s in steps],
            "initial_observation": initial_observation,
            "outcome": outcome.model_dump() if isinstance(outcome, OutcomeRecord) else outcome,
            "metadata": metadata,
            "tenant": principal.tenant,
        }
        if id is not None:
            record["id"] = id
        try:
            trajectory = Trajectory.from_dict(record)
            result = _settled(self._backend().add_many([trajectory]))[0]
        except Exception as exc:  # noqa: BLE001 - every failure as a tool error without server paths
            raise _problem(exc) from None
        return AddAnswer(id=result.id, status=result.status, cluster_id=result.cluster_id, tenant=principal.tenant)

    def retrieve_experience(
        self,
        task: Annotated[str, Field(description="the task about to be attempted")],
        env: Annotated[
            str | None, Field(description="the environment to search; null searches every environment")
        ] = None,
        k: Annotated[
            StrictInt | None, Field(description="how many trajectories, an integer (default: the memory's retrieval.k)")
        ] = None,
        token_budget: Annotated[
            StrictInt | None,
            Field(description="token budget of the context block, an integer (default: retrieval.token_budget)"),
        ] = None,
        as_of: Annotated[
            str | None,
            Field(
                description="a memory version from memory_stats: see only the trajectories committed then",
                max_length=2048,
            ),
        ] = None,
    ) -> RetrieveAnswer:
        """Earlier runs of tasks like this one (succeeded and failed), and the skills distilled
        from their workflows: read them before acting. Reads only; changes nothing."""
        principal = self._acting("read")
        try:
            backend = self._backend()
            got = backend.retrieve_many(
                [task], [env], k, token_budget=token_budget, tenant=principal.tenant, as_of=as_of
            )[0]
        except Exception as exc:  # noqa: BLE001 - every failure as a tool error without server paths
            raise _problem(exc) from None
        return RetrieveAnswer(
            task=task,
            env=env,
            k=k if k is not None else backend.config.retrieval.k,
            trajectories=[_record(hit) for hit in got.trajectories],
            skills=[SkillRecord(cluster_id=s.cluster_id, text=s.text) for s in got.skills],
            context=got.context,
            tokens=got.tokens,
        )

    def memory_stats(self) -> StatsAnswer:
        """How many trajectories and workflow clusters this tenant's memory holds, per environment."""
        principal = self._acting("read")
        try:
            stats = self._backend().stats(tenant=principal.tenant)
        except Exception as exc:  # noqa: BLE001 - every failure as a tool error without server paths
            raise _problem(exc) from None
        per_env = {
            env: EnvCounts(trajectories=int(c.get("trajectories", 0)), clusters=int(c.get("clusters", 0)))
            for env, c in (stats.get("per_env") or {}).items()
        }
        return StatsAnswer(
            tenant=principal.tenant,
            trajectories=int(stats.get("trajectories", 0)),
            clusters=int(stats.get("clusters", 0)),
            pending=int(stats.get("pending", 0)),
            per_env=per_env,
            version=stats.get("version"),
        )


def _record(hit: RetrievedTrajectory) -> RetrievedRecord:
    t = hit.trajectory
    return RetrievedRecord(
        id=hit.id,
        env=hit.env,
        task=t.task,
        initial_observation=t.initial_observation,
        steps=[StepRecord(thought=s.thought, action=s.action, observation=s.observation) for s in t.steps],
        outcome=OutcomeRecord(success=t.outcome.success, reward=t.outcome.reward),
        metadata=dict(t.metadata),
        score=float(hit.score),
        cluster_id=hit.cluster_id,
    )


def build_mcp_server(backend_factory: Callable[[], Any], principal_provider: Callable[[], Principal]) -> MCPServer:
    """An MCP server with the three tools over ``backend_factory()`` (anything with the
    :class:`~lifemem_ray.engine.protocols.MemoryAPI` calls and the tenant interface: the engine's
    ``Memory`` or the Ray ``MemoryClient``), acting as ``principal_provider()`` on every call."""
    server = MCPServer(SERVER_NAME, instructions=INSTRUCTIONS, log_level="WARNING")
    tools = _Tools(backend_factory, principal_provider)
    server.add_tool(
        tools.add_trajectory,
        name="add_trajectory",
        title="Add a trajectory",
        annotations=ToolAnnotations(
            read_only_hint=False, destructive_hint=False, idempotent_hint=True, open_world_hint=False
        ),
    )
    server.add_tool(
        tools.retrieve_experience,
        name="retrieve_experience",
        title="Retrieve experience",
        annotations=ToolAnnotations(read_only_hint=True, idempotent_hint=True, open_world_hint=False),
    )
    server.add_tool(
        tools.memory_stats,
        name="memory_stats",
        title="Memory statistics",
        annotations=ToolAnnotations(read_only_hint=True, idempotent_hint=True, open_world_hint=False),
    )
    return server


# -- Streamable HTTP -----------------------------------------------------------------------------


@dataclass(frozen=True)
class McpHttp:
    """What a web app mounts (see the module docstring): ``asgi`` at the exact path ``/mcp``,
    and ``run()`` entered for the app's lifetime."""

    server: MCPServer
    session_manager: StreamableHTTPSessionManager
    asgi: StreamableHTTPASGIApp

    def run(self) -> contextlib.AbstractAsyncContextManager[None]:
        return self.session_manager.run()


def mcp_http(
    server: MCPServer,
    *,
    json_response: bool = True,
    max_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_SIZE,
    transport_security: TransportSecuritySettings | None = None,
) -> McpHttp:
    """The stateless Streamable HTTP handler of ``server``: a fresh transport per request, no
    session ids, so a request may land on any replica. ``transport_security`` turns on the SDK's
    Host / Origin checks (worth it where the endpoint runs without keys on loopback)."""
    manager = StreamableHTTPSessionManager(
        app=server._lowlevel_server,  # the SDK's own streamable_http_app passes the same object
        json_response=json_response,
        stateless=True,
        security_settings=transport_security,
        max_request_body_size=max_body_bytes,
    )
    return McpHttp(server, manager, StreamableHTTPASGIApp(manager))


def streamable_http_app(
    server: MCPServer,
    *,
    path: str = "/mcp",
    middleware: Sequence[Middleware] = (),
    json_response: bool = True,
    transport_security: TransportSecuritySettings | None = None,
) -> Starlette:
    """A Starlette app serving ``server`` at ``path`` (stateless, JSON answers), its session
    manager run by the app's lifespan; ``middleware`` (outermost first) authenticates."""
    handle = mcp_http(server, json_response=json_response, transport_security=transport_security)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> Any:
        async with handle.run():
            yield

    routes = [Route(path, endpoint=handle.asgi, methods=["GET", "POST", "DELETE"])]
    return Starlette(routes=routes, middleware=list(middleware), lifespan=lifespan)


# -- stdio ---------------------------------------------------------------------------------------


STDIO_MAX_LINE_BYTES = 256 * 1024 * 1024  # one JSON-RPC message over stdio; longer is answered as a parse error


async def _stdin_lines(fd: int) -> AsyncIterator[str]:
    """The lines of a pipe, read without a worker thread, so a cancelled server stops at once
    (the SDK's own stdin reader blocks a thread in read() until the host writes or closes)."""
    buffer = bytearray()
    overlong = False
    while True:
        await anyio.wait_readable(fd)
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            continue
        if not chunk:
            if buffer and not overlong:
                yield buffer.decode("utf-8", errors="replace")
            return
        buffer += chunk
        while (end := buffer.find(b"\n")) >= 0:
            line = bytes(buffer[: end + 1])
            del buffer[: end + 1]
            yield '{"message too long"}\n' if overlong else line.decode("utf-8", errors="replace")
            overlong = False
        if len(buffer) > STDIO_MAX_LINE_BYTES:
            buffer.clear()
            overlong = True


@contextlib.contextmanager
def _claimed_stdin() -> Iterator[int | None]:
    """A private non-blocking duplicate of fd 0 (fd 0 itself then reads the null device, so
    nothing else consumes the protocol), or None where stdin is not a pipe or socket (a regular
    file ends by itself; the SDK's reader serves it)."""
    try:
        mode = os.fstat(0).st_mode
    except OSError:
        yield None
        return
    if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
        yield None
        return
    private = os.dup(0)
    saved = os.dup(0)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.set_blocking(private, False)
    try:
        yield private
    finally:
        os.dup2(saved, 0)
        os.close(saved)
        os.close(private)


def run_stdio(memory: Any, principal: Principal) -> None:
    """Serve ``memory`` over stdin / stdout as ``principal`` until stdin closes or SIGTERM /
    SIGINT arrives; the caller closes the memory afterwards. stdout carries only the protocol
    (the SDK points fd 1 at stderr while serving)."""
    server = build_mcp_server(lambda: memory, lambda: principal)

    async def serve(stdin_fd: int | None) -> None:
        async with anyio.create_task_group() as tg:

            async def stop_on_signal() -> None:
                with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for signum in signals:
                        log.warning("mcp: %s received, closing the memory", signal.Signals(signum).name)
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(stop_on_signal)
            stdin = None if stdin_fd is None else _stdin_lines(stdin_fd)
            async with stdio_server(stdin=stdin) as (read_stream, write_stream):  # type: ignore[arg-type]
                lowlevel = server._lowlevel_server
                await lowlevel.run(read_stream, write_stream, lowlevel.create_initialization_options())
            tg.cancel_scope.cancel()  # stdin closed: the client is gone

    with _claimed_stdin() as fd:
        anyio.run(serve, fd)
