"""What the REST routes (and the MCP tools) do, without the web layer: each operation of the
front door against the running deployment, confined to the caller's tenant.

One :class:`FrontService` per Serve replica holds a :class:`~lifemem_ray.actors.client.blocking.MemoryClient`
(connected by name on first use, dropped and reconnected after the deployment went away) and
the handle of the operations actor. Every method takes the request's
:class:`~lifemem_ray.service.principal.Principal` explicitly and checks its scope; tenants come from it,
never from a request body.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import ray

from lifemem_ray.actors.client.blocking import MemoryClient
from lifemem_ray.actors.cluster.cluster_config import DeploymentConfig
from lifemem_ray.actors.cluster.deployment import find_coordinator
from lifemem_ray.actors.cluster.remote_errors import (
    DeploymentNotFoundError,
    ShardUnavailableError,
    remote_cause,
)
from lifemem_ray.actors.frontdoor.error_answers import ApiError, error_detail, unavailable_errors
from lifemem_ray.actors.frontdoor.operations import operations_actor
from lifemem_ray.core.errors import (
    ForbiddenError,
    InvalidArgumentError,
    InvalidTrajectoryError,
    LifeMemError,
    OverloadedError,
    join_where,
)
from lifemem_ray.core.model import Trajectory
from lifemem_ray.service.principal import Principal

log = logging.getLogger(__name__)

__all__ = ["ApiError", "FrontService", "ServiceMemory", "request_field", "unavailable_errors"]


def request_field(where: str | None) -> str | None:
    """A retrieve argument's location as the request names it: ``tasks[2]`` -> ``queries[2].task``,
    ``envs[0]`` -> ``queries[0].env`` (other locations as they are).

    >>> request_field("tasks[2]"), request_field("envs[0]"), request_field("k")
    ('queries[2].task', 'queries[0].env', 'k')
    """
    for argument, field in (("tasks[", "task"), ("envs[", "env")):
        if where is not None and where.startswith(argument) and "]" in where:
            index, rest = where[len(argument) :].split("]", 1)
            return f"queries[{index}].{field}{rest}"
    return where


class StateLog:
    """Logs a watched state the way an operator wants to read it: a warning when it turns bad
    or changes, a reminder at most every ``repeat_s`` while it stays bad, one line when it
    is good again; repeats in between go to debug. ``/healthz`` needs no key and may be
    polled many times a second: one outage must not write a warning per poll.

    >>> import logging
    >>> now = [0.0]
    >>> states = StateLog(logging.getLogger("doc"), repeat_s=60, clock=lambda: now[0])
    >>> states.bad("shard 1 down", "health: %s", "shard 1 down"), states.bad("shard 1 down", "health")
    (True, False)
    >>> now[0] = 61.0; states.bad("shard 1 down", "health"), states.good("health: recovered")
    (True, True)
    """

    def __init__(self, logger: logging.Logger, repeat_s: float = 60.0, clock: Any = time.monotonic) -> None:
        self._log = logger
        self._repeat_s = repeat_s
        self._clock = clock
        self._lock = threading.Lock()  # health runs on the request threads
        self._state: str | None = None  # the bad state last warned of; None while good
        self._warned_at = 0.0

    def bad(self, state: str, message: str, *args: Any) -> bool:
        """Record a bad ``state``; returns whether this call warned."""
        with self._lock:
            now = self._clock()
            warn = state != self._state or now - self._warned_at >= self._repeat_s
            if warn:
                self._state, self._warned_at = state, now
        self._log.log(logging.WARNING if warn else logging.DEBUG, message, *args)
        return warn

    def good(self, message: str, *args: Any) -> bool:
        """Record that all is well; returns whether this ended a bad state (and logged so)."""
        with self._lock:
            ended, self._state = self._state is not None, None
        if ended:
            self._log.info(message, *args)
        return ended


HEALTH_REPEAT_S = 60.0  # while the deployment stays unhealthy, /healthz warns again at most this often


class FrontService:
    """The front door's operations on the deployment in ``namespace``."""

    def __init__(self, namespace: str, config: DeploymentConfig) -> None:
        self.namespace = namespace
        self.config = config
        self.http = config.http
        self.memory = MemoryClient(namespace, config)  # connected at the first request
        self._ops: Any = None
        # Adds answered 202 are waited for here, at most max_ongoing_requests at a time per replica.
        self._waiters = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.http.max_ongoing_requests, thread_name_prefix="lifemem-add"
        )
        self._waiting = threading.BoundedSemaphore(self.http.max_ongoing_requests)
        # Reads run here so a request can stop waiting for a shard that is restarting (503).
        self._readers = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.http.max_ongoing_requests, thread_name_prefix="lifemem-read"
        )
        # Deletions and purges run here so a request stops waiting after http.delete_timeout_s.
        self._removers = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.http.max_ongoing_requests, thread_name_prefix="lifemem-remove"
        )
        self._health_log = StateLog(log, HEALTH_REPEAT_S)  # what /healthz found, logged on change, not per poll

    # -- the deployment ---------------------------------------------------------------------
    def call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(memory, ...)`` with this replica's client, a remote error unwrapped. The client
        connects at the first request and again after the deployment went away (its own rule:
        :mod:`~lifemem_ray.actors.client.connection`)."""
        try:
            return fn(self.memory, *args, **kwargs)
        except ray.exceptions.RayTaskError as exc:
            raise remote_cause(exc) from None

    def read(self, fn: Any) -> Any:
        """``call(fn)``, or :class:`ShardUnavailableError` (503) as soon as a shard is seen
        restarting (checked every http.restart_probe_s while the read waits) or when it took
        longer than http.read_timeout_s. Shard calls wait through a restart by themselves; the
        caller is told to come back instead of hanging (the read finishes in the background)."""
        future = self._readers.submit(self.call, fn)
        deadline = time.monotonic() + self.http.read_timeout_s
        while True:
            try:
                return future.result(timeout=max(0.0, min(self.http.restart_probe_s, deadline - time.monotonic())))
            except concurrent.futures.TimeoutError:
                down = self._restarting()
                if down:
                    future.cancel()  # still queued: never run a read already answered 503
                    raise ShardUnavailableError(
                        f"{', '.join(down)} restarting; what it acknowledged is stored"
                    ) from None
                if time.monotonic() >= deadline:
                    future.cancel()
                    raise ShardUnavailableError(
                        f"the shards did not answer within {self.http.read_timeout_s:g} s (http.read_timeout_s)"
                    ) from None

    def _restarting(self) -> list[str]:
        """Names of the deployment's actors Ray does not report alive (restarting, or dead)."""
        client = self.memory
        if not client.core.connection.connected:
            return []
        try:
            from lifemem_ray.actors.cluster.ray_internals import actor_alive

            named = [("coordinator", client.coordinator), *((f"shard {i}", s) for i, s in enumerate(client.shards))]
            return [name for name, handle in named if not actor_alive(handle)]
        except Exception:  # noqa: BLE001 - the table moved in another Ray: rely on read_timeout_s alone
            return []

    def operations(self) -> Any:
        if self._ops is None:
            self._ops = operations_actor(self.namespace, self.http)
        return self._ops

    # -- adding ----------------------------------------------------------------------------
    def parse_records(self, records: Sequence[Any], principal: Principal) -> list[Trajectory]:
        """Each record checked by :meth:`Trajectory.from_dict` (errors name
        ``trajectories[i].<field>``), bound to the key's tenant."""
        if len(records) > self.http.max_batch_items:
            raise ApiError(
                422,
                "validation_error",
                f"{len(records):,} trajectories in one request, at most "
                f"{self.http.max_batch_items:,} (http.max_batch_items)",
                "trajectories",
                "split the batch into smaller requests",
            )
        out = []
        for i, record in enumerate(records):
            at = f"trajectories[{i}]"
            try:
                trajectory = Trajectory.from_dict(
                    record, tenant=principal.tenant
                )  # a record without a tenant is the key's
            except InvalidTrajectoryError as exc:
                where = at if exc.where in (None, "record") else join_where(at, exc.where)
                raise ApiError(
                    422, "validation_error", f"{where}: {exc.problem}", where, "fix this field and send the batch again"
                ) from None
            if trajectory.tenant != principal.tenant:
                raise ForbiddenError(
                    f"{trajectory.tenant!r} is not the tenant of this key "
                    f"({principal.tenant!r}); leave 'tenant' out, the key decides it",
                    where=f"{at}.tenant",
                )
            out.append(trajectory)
        return out

    def add(self, trajectories: list[Trajectory], principal: Principal) -> list[dict[str, Any]]:
        """Store and wait for the memory's acknowledgement: the per-item results."""
        self.require(principal, "write")
        return [r.to_dict() for r in self.acknowledged(trajectories)]

    def acknowledged(self, trajectories: Sequence[Trajectory]) -> list[Any]:
        """``add_many`` waited for until acknowledged, at most http.add_timeout_s (then 503)."""
        future = self.call(lambda c: c.add_many(list(trajectories)))
        try:
            return future.result(timeout=self.http.add_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise OverloadedError(
                f"the memory did not acknowledge the add within {self.http.add_timeout_s:g} s "
                "(http.add_timeout_s); send the same batch again: ids make retries idempotent"
            ) from None

    def add_later(self, trajectories: list[Trajectory], principal: Principal) -> dict[str, Any]:
        """Accept now; the answer lands in the operations actor (202 + operation id)."""
        self.require(principal, "write")
        if not self._waiting.acquire(blocking=False):
            raise OverloadedError(
                f"this replica already waits for {self.http.max_ongoing_requests} adds; retry later or send with wait=true"
            )
        try:
            ids = [t.id for t in trajectories]
            deadline = self.config.add_operation_deadline_s()  # AddFuture.result's attempts, each waited add_timeout_s
            op = ray.get(
                self.operations().create.remote(principal.tenant, ids, deadline, principal.key_id),
                timeout=self.http.health_timeout_s,
            )
            self._waiters.submit(self._finish, op, trajectories, principal)
        except BaseException:
            self._waiting.release()
            raise
        return {"operation": op, "status": "pending", "ids": ids}

    def _finish(self, op: str, trajectories: list[Trajectory], principal: Principal) -> None:
        try:
            items = self.add(trajectories, principal)
            self.operations().finish.remote(op, items)
        except Exception as exc:  # noqa: BLE001 - reported to the poller in the one error shape
            _, detail, _ = error_detail(exc, self.http.retry_after_s)
            self.operations().fail.remote(op, detail)
        finally:
            self._waiting.release()

    def operation(self, op: str, principal: Principal) -> dict[str, Any] | None:
        """A read key sees every operation of its tenant; a write-only key the ones it created
        (it must be able to learn what became of its own add)."""
        if not principal.allows("read"):
            self.require(principal, "write", "polling an operation (a write-only key polls its own adds)")
        own_only = None if principal.allows("read") else principal.key_id
        return ray.get(self.operations().get.remote(op, principal.tenant, own_only), timeout=self.http.health_timeout_s)

    # -- reading ---------------------------------------------------------------------------
    def retrieve(
        self,
        queries: Sequence[Any],
        k: int | None,
        skills: bool,
        context: bool,
        full: bool,
        principal: Principal,
        as_of: str | None = None,
    ) -> list[dict[str, Any]]:
        self.require(principal, "read")
        if len(queries) > self.http.max_queries:
            raise ApiError(
                422,
                "validation_error",
                f"{len(queries):,} queries in one request, at most {self.http.max_queries:,} (http.max_queries)",
                "queries",
                "send fewer queries per request",
            )
        tasks, envs = [q.task for q in queries], [q.env for q in queries]
        try:
            got = self.read(
                lambda c: c.retrieve_many(tasks, envs, k, skills=skills, tenant=principal.tenant, as_of=as_of)
            )
        except ValueError as exc:
            # the engine's argument checks name tasks[i] / envs[i]: the request's fields are queries[i].task / .env
            if isinstance(exc, LifeMemError) and not isinstance(exc, (InvalidArgumentError, InvalidTrajectoryError)):
                raise
            where, what = request_field(getattr(exc, "where", None)), getattr(exc, "problem", str(exc))
            raise ApiError(
                422, "validation_error", f"{where}: {what}" if where else what, where, "fix this field and ask again"
            ) from None
        out = []
        for r in got:
            hits = []
            for t in r.trajectories:
                hit = t.to_dict()
                if full:
                    hit["trajectory"] = t.trajectory.to_dict()
                hits.append(hit)
            answer = {"task": r.task, "env": r.env, "trajectories": hits, "skills": [s.to_dict() for s in r.skills]}
            if context:
                answer["context"] = r.context
            out.append(answer)
        return out

    def stats(self, principal: Principal, tenant: str | None) -> dict[str, Any]:
        """The key's tenant's figures; ``tenant="*"`` (every tenant) or another tenant needs admin."""
        self.require(principal, "read")
        if tenant in (None, "", principal.tenant):
            return self.read(lambda c: c.stats(tenant=principal.tenant))
        self.require(principal, "admin", f"the stats of {'every tenant' if tenant == '*' else repr(tenant)}")
        return self.read(lambda c: c.stats(tenant=None if tenant == "*" else tenant))

    def clusters(self, principal: Principal, env: str | None) -> dict[str, Any]:
        self.require(principal, "read")
        limit = self.http.max_clusters_listed
        got = self.read(
            lambda c: c.clusters(env, tenant=principal.tenant, limit=limit)
        )  # the shards send at most this many
        total = len(got) if len(got) < limit else self.read(lambda c: c.cluster_count(env, tenant=principal.tenant))
        return {"clusters": [c.to_dict() for c in got], "total": total, "truncated": total > len(got)}

    # -- deleting --------------------------------------------------------------------------
    def delete(self, trajectory_id: str, principal: Principal) -> bool:
        self.require(principal, "write")
        return bool(self.removal(lambda c: c.remove([trajectory_id], tenant=principal.tenant)))

    def purge(self, tenant: str, principal: Principal) -> int:
        self.require(principal, "admin", f"purging tenant {tenant!r}")
        from lifemem_ray.core.tenancy import check_tenant

        tenant = check_tenant(tenant, "tenant")
        return int(self.removal(lambda c: c.purge_tenant(tenant)))

    def removal(self, fn: Any) -> Any:
        """``call(fn)`` waited for at most http.delete_timeout_s, then 503: the removal goes on in
        the memory (it cannot be called back), and sending it again is safe (idempotent)."""
        future = self._removers.submit(self.call, fn)
        try:
            return future.result(timeout=self.http.delete_timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()  # still queued behind others: the caller sends it again
            raise OverloadedError(
                f"the removal did not finish within {self.http.delete_timeout_s:g} s (http.delete_timeout_s); "
                "it goes on in the memory: send it again later (removals are idempotent)"
            ) from None

    # -- health ----------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        """Whether the coordinator and every shard answer a ping within http.health_timeout_s
        (looked up by name each time, so a shard that is gone shows as such)."""
        timeout = self.http.health_timeout_s
        try:
            coordinator = find_coordinator(self.namespace)
            names = ray.get(coordinator.deployment.remote(), timeout=timeout)["shards"]
        except Exception as exc:  # noqa: BLE001 - no deployment, or its coordinator does not answer: the answer says so
            # The route needs no key: the answer names no namespace, actor or Ray internals (the log does).
            self._health_log.bad(
                type(exc).__name__,
                "health check: the deployment in namespace %r did not answer: %s: %s",
                self.namespace,
                type(exc).__name__,
                exc,
            )
            detail = (
                "no deployment is serving"
                if isinstance(exc, DeploymentNotFoundError)
                else "the coordinator did not answer"
            )
            return {"ok": False, "coordinator": False, "shards": [], "detail": detail}
        refs: list[Any] = [coordinator.ping.remote()]
        for name in names:
            try:
                refs.append(ray.get_actor(name, namespace=self.namespace).ping.remote())
            except ValueError:  # the named actor is gone for good
                refs.append(None)
        waiting = [r for r in refs if r is not None]
        ready, _ = ray.wait(waiting, num_returns=len(waiting), timeout=timeout)
        alive = []
        for ref in refs:
            ok = False
            if ref is not None and ref in ready:
                try:
                    ray.get(ref, timeout=0)
                    ok = True
                except Exception:  # noqa: BLE001 - a dead actor's ping (whatever it raises): not alive
                    ok = False
            alive.append(ok)
        ok = all(alive)
        if ok:
            self._health_log.good("health check: the deployment in namespace %r answers again", self.namespace)
        else:
            silent = ["coordinator" if i == 0 else names[i - 1] for i, up in enumerate(alive) if not up]
            self._health_log.bad(
                ",".join(silent),
                "health check in namespace %r: no answer to the ping from %s",
                self.namespace,
                ", ".join(silent),
            )
        return {
            "ok": ok,
            "coordinator": alive[0],
            "shards": alive[1:],
            "detail": None if ok else "an actor did not answer the ping",
        }

    def close(self) -> None:
        self._waiters.shutdown(wait=False, cancel_futures=False)
        self._readers.shutdown(wait=False, cancel_futures=True)
        self._removers.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    def require(principal: Principal, scope: str, what: str = "") -> None:
        """ForbiddenError unless ``principal`` has ``scope`` (admin has every scope)."""
        principal.require(scope, what)


class ServiceMemory:
    """The memory calls of the MCP tools (``add_many``, ``retrieve_many``, ``stats``,
    ``config``) made through a :class:`FrontService`, so MCP over HTTP gets the REST routes'
    add timeout, restart probe, read timeout and error unwrapping."""

    def __init__(self, service: FrontService) -> None:
        self.service = service

    @property
    def config(self) -> DeploymentConfig:
        return self.service.config

    def add_many(self, trajectories: Sequence[Trajectory]) -> list[Any]:
        return self.service.acknowledged(trajectories)

    def retrieve_many(
        self, tasks: Sequence[str], envs: Sequence[str | None], k: int | None = None, **options: Any
    ) -> Any:
        return self.service.read(lambda c: c.retrieve_many(tasks, envs, k, **options))

    def stats(self, tenant: str | None = None) -> Any:
        return self.service.read(lambda c: c.stats(tenant=tenant))
