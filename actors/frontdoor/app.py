"""The REST (and MCP) front door on Ray Serve: ``lifemem-ray serve --http``.

A Serve application (:data:`APP_NAME`, route prefix ``/``) whose FastAPI ingress runs in
``http.replicas`` replicas in front of the running deployment; each replica finds the
coordinator and shards by name (:class:`~lifemem_ray.actors.frontdoor.front_service.FrontService`).
Routes (OpenAPI at ``/openapi.json``, docs at ``/docs``):

==========================================  ===========  ==============================================
route                                        scope        answer
==========================================  ===========  ==============================================
``POST /v1/trajectories``                    write        per item ``{id, status, cluster_id}`` once
                                                          acknowledged; ``?wait=false``: 202 + operation
``POST /v1/retrieve``                        read         per query: trajectories and skills
``GET /v1/stats[?tenant=*]``                 read/admin   the tenant's figures (admin: any or all)
``GET /v1/clusters[?env=E]``                 read         the tenant's clusters
``DELETE /v1/trajectories/{id}``             write        404 when the tenant has no such id
``DELETE /v1/tenants/{tenant}``              admin        every trajectory of the tenant removed
``GET /v1/operations/{id}``                  read, write  pending / done / failed (write alone: its own adds)
``GET /healthz``                             none         whether coordinator and shards answer
``/mcp``                                     read/write   the MCP server (Streamable HTTP), same keys
==========================================  ===========  ==============================================

Every request carries ``Authorization: Bearer <key>`` (see :mod:`lifemem_ray.service.auth`); every
error answer is ``{"error": {"type", "message", "where", "what_to_do"}}``
(:mod:`lifemem_ray.actors.frontdoor.error_answers`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, cast

from fastapi import Depends, FastAPI, Request
from fastapi import Query as Q
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray import serve
from ray.serve.exceptions import RayServeException
from starlette.exceptions import HTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.routing import Match, Route
from starlette.types import Message, Receive, Scope, Send

from lifemem_ray import __version__
from lifemem_ray.actors.cluster import ray_internals
from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.actors.cluster.placement import home_node_resource
from lifemem_ray.actors.cluster.ray_metrics import RECORDER
from lifemem_ray.actors.frontdoor.admission import BodyPace, TenantShare
from lifemem_ray.actors.frontdoor.error_answers import ApiError, error_detail, unavailable_errors, validation_detail
from lifemem_ray.actors.frontdoor.front_service import FrontService, ServiceMemory
from lifemem_ray.actors.frontdoor.http_metrics import check_routes, count_http
from lifemem_ray.actors.frontdoor.operations import OPERATIONS_ACTOR, operations_actor
from lifemem_ray.core.errors import ConfigError, LifeMemError
from lifemem_ray.service import api_models as m
from lifemem_ray.service.auth import KeyRing, check_bind
from lifemem_ray.service.http_config import HttpConfig
from lifemem_ray.service.principal import Principal, acting_as, current

__all__ = ["APP_NAME", "DEPLOYMENT_NAME", "FrontDoor", "build_app", "start_http", "stop_http"]

log = logging.getLogger(__name__)

APP_NAME = "lifemem"
DEPLOYMENT_NAME = "lifemem-http"
ROUTE_PREFIX = "/"
MCP_PATH = "/mcp"
PUBLIC_PATHS = frozenset({"/healthz", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})  # no key needed
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")  # Host names a keyless front door answers
_TIMED = {"/v1/trajectories": "add", "/v1/retrieve": "retrieve"}  # routes whose latency is observed


class BodyTooLarge(LifeMemError, HTTPException):
    """A request body over http.max_body_bytes (413). An HTTPException, so FastAPI's body
    reading passes it through as itself (and a LifeMemError, as every error raised on purpose)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than {limit:,} bytes (http.max_body_bytes)")


class BodyTooSlow(LifeMemError, HTTPException):
    """A request body that missed its deadline (408; :class:`~lifemem_ray.actors.frontdoor.admission.BodyPace`).
    The connection is closed after the answer: the rest of the body is never read."""

    def __init__(self, why: str) -> None:
        super().__init__(408, why, headers={"Connection": "close"})


class TenantBusy(LifeMemError, HTTPException):
    """A tenant already at its share of this replica's request slots (429, before the body is read)."""

    def __init__(self, tenant: str, cap: int, retry_after_s: int) -> None:
        super().__init__(
            429,
            f"tenant {tenant!r} already has {cap} requests in flight on this replica (http.max_ongoing_per_tenant)",
            headers={"Retry-After": str(retry_after_s), "Connection": "close"},
        )


class FrontDoor:
    """ASGI middleware around every request: the body limit (Content-Length and the bytes
    actually streamed) and its pace (:class:`BodyTooSlow`), authentication of every route but
    :data:`PUBLIC_PATHS` (before the route reads the body), the tenant's share of the request
    slots (:class:`TenantBusy`), and the metrics (answers by route template, method and status;
    latency of adds and retrievals)."""

    def __init__(self, app: Any, keyring: KeyRing, http: HttpConfig, routes: list[Any]) -> None:
        self.app, self.keyring, self.http = app, keyring, http
        self.max_body, self.retry_after_s = http.max_body_bytes, http.retry_after_s
        self.routes = routes  # the application's routes (the live list: the /mcp route joins it)
        # Keyed front doors only: without keys every request is one principal, with no other to protect.
        self.share = TenantShare(http.max_ongoing_per_tenant) if keyring.mode == "keys" else None

    def _needs_key(self, scope: Scope) -> bool:
        if scope.get("path", "") in PUBLIC_PATHS:
            return False
        return any(route.matches(scope)[0] != Match.NONE for route in self.routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, status, cut = time.perf_counter(), [0], [False]

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                if cut[0]:  # whatever answered a cut body, the connection closes after it (the rest is never read)
                    message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        try:
            await self._serve(scope, self._paced(receive, cut), sending)
        except Exception as exc:  # an error before any route ran (401 of /mcp, 413, 408, 429) in the one shape
            if status[0]:
                raise
            await self._answer(exc, sending)
        finally:
            self._observe(scope, status[0] or 500, time.perf_counter() - started)

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            raise BodyTooLarge(self.max_body)
        seen = [0]

        async def receiving() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                seen[0] += len(message.get("body", b""))
                if seen[0] > self.max_body:
                    raise BodyTooLarge(self.max_body)
            return message

        if not self._needs_key(scope):  # /healthz, the OpenAPI document and docs; an unknown path answers 404
            await self.app(scope, receiving, send)
            return
        # Before any route reads the body: a request without a valid key costs no parsing.
        header = dict(scope.get("headers") or []).get(b"authorization")
        principal = self.keyring.authenticate(header.decode("latin-1") if header else None)
        scope.setdefault("state", {})["principal"] = principal  # the routes' `principal` dependency
        if self.share is not None and not self.share.try_enter(principal.tenant):
            raise TenantBusy(principal.tenant, self.share.cap, self.retry_after_s)
        try:
            with acting_as(principal):  # the MCP tools read it from here
                await self.app(scope, receiving, send)
        finally:
            if self.share is not None:
                self.share.leave(principal.tenant)

    def _paced(self, receive: Receive, cut: list[bool]) -> Receive:
        """``receive`` with the body's deadlines (:class:`BodyPace`): :class:`BodyTooSlow`, and
        ``cut[0]`` set, when the next bytes are late. Once the body is whole, calls pass through
        (a route may wait for the client's disconnect)."""
        http = self.http
        pace = BodyPace(http.body_timeout_s, http.body_grace_s, http.body_min_rate_bytes_s, time.monotonic())
        whole = [False]

        async def receiving() -> Message:
            if whole[0]:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), timeout=max(0.0, pace.deadline() - time.monotonic()))
            except TimeoutError:
                cut[0] = True
                raise BodyTooSlow(pace.why_late(time.monotonic())) from None
            if message["type"] == "http.request":
                pace.received(len(message.get("body", b"")))
                whole[0] = not message.get("more_body", False)
            else:
                whole[0] = True  # http.disconnect: nothing more will come
            return message

        return receiving

    async def _answer(self, exc: BaseException, send: Send) -> None:
        code, detail, headers = error_detail(exc, self.retry_after_s)
        response = JSONResponse({"error": detail}, status_code=code, headers=headers)
        await response({"type": "http"}, _no_body, send)

    def _observe(self, scope: Scope, status: int, seconds: float) -> None:
        route = getattr(scope.get("route"), "path", None)
        if route is None:  # answered here (401, 413) before routing: the template of the route it was for
            route = next((r.path for r in self.routes if r.matches(scope)[0] == Match.FULL), "other")
        try:
            count_http(route, scope.get("method", ""), status)
            if (
                route in _TIMED and scope.get("method") == "POST" and status == 200
            ):  # answered (a 202 is not acknowledged yet)
                RECORDER.observe_latency(_TIMED[route], "http", seconds)
        except Exception:  # metrics never fail a request
            log.warning("metrics failed", exc_info=True)


async def _no_body() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}


def build_app(service: FrontService, keyring: KeyRing) -> FastAPI:
    """The FastAPI application of one replica (routes, error answers, middleware, MCP)."""
    http = service.http
    mcp = _mcp_app(service)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        async with mcp.run():  # the MCP SDK's session manager, for the app's lifetime
            yield

    app = FastAPI(
        title="lifemem-ray",
        version=__version__,
        lifespan=lifespan,
        description="Lifelong workflow memory for LLM agents: REST front door. Every route but /healthz needs "
        "'Authorization: Bearer <key>'.",
        responses={code: {"model": m.ErrorBody} for code in (401, 403, 413, 422, 503)},
    )

    async def principal(request: Request) -> Principal:
        return request.state.principal  # FrontDoor authenticated the request before the body was read

    _error_handlers(app, http.retry_after_s)
    _write_routes(app, service, principal)
    _read_routes(app, service, principal)
    app.add_middleware(FrontDoor, keyring=keyring, http=http, routes=app.router.routes)
    # The exact path (a Mount would redirect /mcp to /mcp/); FrontDoor authenticates it.
    app.router.routes.append(Route(MCP_PATH, endpoint=mcp.asgi, methods=["GET", "POST", "DELETE"]))
    check_routes([path for route in app.router.routes if isinstance(path := getattr(route, "path", None), str)])
    if keyring.mode == "none":  # no keys, so no browser page may reach it under another host name (DNS rebinding)
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(LOOPBACK_HOSTS))
    return app


def _mcp_app(service: FrontService) -> Any:
    """The MCP server's stateless Streamable HTTP handler over this replica's service (the REST
    routes' timeouts and 503s), acting as the principal FrontDoor set for the request."""
    from lifemem_ray.service import mcp_server

    memory = ServiceMemory(service)
    return mcp_server.mcp_http(
        mcp_server.build_mcp_server(lambda: memory, current), max_body_bytes=service.http.max_body_bytes
    )


def _error_handlers(app: FastAPI, retry_after_s: int) -> None:
    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        code, detail, headers = error_detail(exc, retry_after_s)
        return JSONResponse({"error": detail}, status_code=code, headers=headers)

    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"error": validation_detail(list(exc.errors()))}, status_code=422)

    # Starlette types a handler as taking any Exception; this one is registered for (and gets) one kind.
    app.add_exception_handler(RequestValidationError, on_validation)  # type: ignore[arg-type]
    for kind in (HTTPException, LifeMemError, ValueError, *unavailable_errors(), Exception):
        app.add_exception_handler(kind, on_error)


def _write_routes(app: FastAPI, service: FrontService, principal: Callable[..., Awaitable[Principal]]) -> None:
    @app.post(
        "/v1/trajectories",
        response_model=m.AddAnswer,
        status_code=200,
        tags=["trajectories"],
        responses={202: {"model": m.AddAccepted}, 409: {"model": m.ErrorBody}},
    )
    async def add_trajectories(
        body: m.AddRequest,
        wait: bool | None = Q(None, description="false: answer 202 at once"),
        who: Principal = Depends(principal),
    ) -> Any:
        """Store a batch; answers per item once the memory acknowledged it (or 202 with ``wait=false``)."""
        service.require(who, "write")
        trajectories = await run_in_threadpool(service.parse_records, body.trajectories, who)
        if (body.wait if wait is None else wait) is False:
            accepted = await run_in_threadpool(service.add_later, trajectories, who)
            return JSONResponse(accepted, status_code=202)
        return {"items": await run_in_threadpool(service.add, trajectories, who)}

    @app.delete(
        "/v1/trajectories/{trajectory_id:path}",
        response_model=m.DeleteAnswer,
        tags=["trajectories"],
        responses={404: {"model": m.ErrorBody}},
    )
    async def delete_trajectory(trajectory_id: str, who: Principal = Depends(principal)) -> Any:
        """Delete one of the key's tenant's trajectories (404 when it holds no such id)."""
        if not await run_in_threadpool(service.delete, trajectory_id, who):
            raise ApiError(
                404,
                "not_found",
                f"tenant {who.tenant!r} holds no trajectory {trajectory_id!r}",
                "trajectory_id",
                "check the id (POST /v1/retrieve answers ids)",
            )
        return {"id": trajectory_id, "deleted": True}

    @app.delete("/v1/tenants/{tenant}", response_model=m.PurgeAnswer, tags=["admin"])
    async def purge_tenant(tenant: str, who: Principal = Depends(principal)) -> Any:
        """Delete every trajectory of a tenant (admin keys only)."""
        return {"tenant": tenant, "removed": await run_in_threadpool(service.purge, tenant, who)}


def _read_routes(app: FastAPI, service: FrontService, principal: Callable[..., Awaitable[Principal]]) -> None:
    @app.post("/v1/retrieve", response_model=None, responses={200: {"model": m.RetrieveAnswer}}, tags=["retrieval"])
    async def retrieve(body: m.RetrieveRequest, who: Principal = Depends(principal)) -> Any:
        """The most similar trajectories of the key's tenant, and their clusters' skills, per query
        (``context`` and each hit's ``trajectory`` only when asked for)."""
        results = await run_in_threadpool(
            service.retrieve, body.queries, body.k, body.skills, body.context, body.full, who, body.as_of
        )
        return JSONResponse({"results": results})

    @app.get("/v1/stats", tags=["state"])
    async def stats(
        tenant: str | None = Q(None, description="admin keys: another tenant, or * for every tenant"),
        who: Principal = Depends(principal),
    ) -> Any:
        """Counts of the key's tenant (trajectories, clusters, per environment)."""
        return await run_in_threadpool(service.stats, who, tenant)

    @app.get("/v1/clusters", response_model=m.ClustersAnswer, tags=["state"])
    async def clusters(
        env: str | None = Q(None, description="only clusters holding this environment"),
        who: Principal = Depends(principal),
    ) -> Any:
        """The key's tenant's workflow clusters (description, skill, R, environments), largest first."""
        return await run_in_threadpool(service.clusters, who, env)

    @app.get(
        "/v1/operations/{operation}",
        response_model=m.OperationAnswer,
        tags=["trajectories"],
        responses={404: {"model": m.ErrorBody}},
    )
    async def operation(operation: str, who: Principal = Depends(principal)) -> Any:
        """The state of an add answered 202: pending, done (with the items) or failed (with the error)."""
        got = await run_in_threadpool(service.operation, operation, who)
        if got is None:
            raise ApiError(
                404,
                "not_found",
                f"no operation {operation!r} for tenant {who.tenant!r} (unknown, or older than http.operations_ttl_s)",
                "operation",
                "check the id; send the add again if it expired (idempotent)",
            )
        return got

    @app.get("/healthz", response_model=m.HealthAnswer, tags=["health"])
    async def healthz() -> Any:
        """Whether the coordinator and every shard answer (no key needed); 503 when not."""
        got = await run_in_threadpool(service.health)
        headers = {} if got["ok"] else {"Retry-After": str(service.http.retry_after_s)}
        return JSONResponse(got, status_code=200 if got["ok"] else 503, headers=headers)


@serve.deployment(name=DEPLOYMENT_NAME)
@serve.ingress()
class FrontDoorDeployment:
    """One Serve replica of the front door: a FrontService and its FastAPI app."""

    def __init__(self, namespace: str, config: DeploymentConfig, keyring: KeyRing, host: str) -> None:
        check_bind(host, keyring.mode)  # again here: a replica never serves without keys beyond loopback
        self.keyring = keyring
        self.service = FrontService(namespace, config)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_app(self.service, self.keyring)

    def __del__(self) -> None:  # Serve calls it when the replica stops: its waiting threads go too
        self.service.close()


def start_http(
    namespace: str, config: DeploymentConfig, keyring: KeyRing, *, host: str | None = None, port: int | None = None
) -> dict[str, Any]:
    """Start Serve's HTTP proxy on ``host:port`` (from ``[http]`` when not given) and the front
    door application in front of the deployment in ``namespace``. Call after ``ray.init``.
    Refuses ``auth = "none"`` on a non-loopback host before anything starts."""
    http = config.http
    host = host or http.host
    port = port or http.port
    check_bind(host, keyring.mode)
    operations_actor(namespace, http)  # marks the namespace as served (stop_http)
    serve.start(http_options={"host": host, "port": port})
    running = _serve_address()
    if running is not None and running != (host, port):
        raise ConfigError(
            f"Ray Serve already runs on this cluster with its HTTP proxy at {running[0]}:{running[1]}, not "
            f"{host}:{port} (Serve's HTTP address is fixed while it runs): serve on {running[0]}:{running[1]} "
            "(--host/--port), or shut Serve down first (`serve shutdown`)"
        )
    # The class decorators made FrontDoorDeployment a Serve Deployment; mypy does not apply class decorators.
    app = (
        cast(serve.Deployment, FrontDoorDeployment)
        .options(
            num_replicas=http.replicas,
            max_ongoing_requests=http.max_ongoing_requests,
            # On serve's node, beside the coordinator and Serve's proxy there: a replica on a worker
            # node would answer 500 for as long as Ray takes to declare that node dead.
            ray_actor_options={"num_cpus": http.replica_cpus, "resources": {home_node_resource(): 0.001}},
        )
        .bind(namespace, config, keyring, host)
    )
    serve.run(app, name=APP_NAME, route_prefix=ROUTE_PREFIX, blocking=False)
    return {
        "url": f"http://{host}:{port}",
        "app": APP_NAME,
        "replicas": http.replicas,
        "auth": keyring.mode,
        "keys": len(keyring.entries),
        "namespace": namespace,
    }


def _serve_address() -> tuple[str, int] | None:
    """Where the running Serve's HTTP proxy listens (None where this Ray does not say)."""
    try:
        return ray_internals.serve_http_address()
    except Exception:  # an internal of Serve that moved (tests/actors/cluster/test_ray_internals.py says): skip the check rather than fail the start
        log.warning("could not read Serve's HTTP address", exc_info=True)
        return None


def stop_http(namespace: str) -> bool:
    """Delete the front door started for the deployment in ``namespace`` (Serve itself keeps
    running) and its operations actor; whether there was one."""
    import ray

    try:
        ops = ray.get_actor(OPERATIONS_ACTOR, namespace=namespace)
    except ValueError:  # no front door was started for this namespace
        return False
    try:
        if APP_NAME in serve.status().applications:
            serve.delete(APP_NAME)
    except RayServeException:  # Serve is not running: nothing to delete
        pass
    ray.kill(ops, no_restart=True)
    return True
