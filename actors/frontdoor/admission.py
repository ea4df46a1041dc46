"""Who may take a request slot of a front-door replica, and for how long: pure policy, no Ray.

A Serve replica serves at most ``http.max_ongoing_requests`` requests at once. Two rules keep
one client from holding them all (:class:`~lifemem_ray.actors.frontdoor.app.FrontDoor` applies them):

* :class:`TenantShare`: a tenant has at most ``http.max_ongoing_per_tenant`` requests in
  flight per replica; the next one is refused at once (429), before its body is read, so
  however many connections one key opens, the other slots stay free for other tenants.
* :class:`BodyPace`: a request body arrives whole within ``http.body_timeout_s`` and, after
  ``http.body_grace_s``, at an average of at least ``http.body_min_rate_bytes_s``; a body
  that falls behind is cut (408) and its connection closed, so a slot held by a client
  trickling bytes (one byte every two seconds) is freed within the grace period.

>>> share = TenantShare(2)
>>> share.try_enter("acme"), share.try_enter("acme"), share.try_enter("acme"), share.try_enter("beta")
(True, True, False, True)
>>> share.leave("acme"); share.try_enter("acme")
True
>>> pace = BodyPace(timeout_s=60, grace_s=5, min_rate=1024, started=100.0)
>>> pace.deadline()          # nothing received yet: the grace period
105.0
>>> pace.received(20 * 1024); pace.deadline()   # 20 kB buy 20 s at 1 kB/s
120.0
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from lifemem_ray.core.errors import InvalidArgumentError

__all__ = ["BodyPace", "TenantShare"]


class TenantShare:
    """Requests in flight per tenant in one replica, capped at ``cap`` each."""

    def __init__(self, cap: int) -> None:
        if cap < 1:
            raise InvalidArgumentError(f"cap must be at least 1, got {cap}", where="TenantShare")
        self.cap = cap  # requests of one tenant this replica serves at once
        self._in_flight: dict[str, int] = {}  # tenant -> requests entered and not left; absent when 0
        self._lock = threading.Lock()  # Serve may call the ASGI app from more than one thread

    def try_enter(self, tenant: str) -> bool:
        """Count one more request of ``tenant``; False (nothing counted) when it is at its cap."""
        with self._lock:
            held = self._in_flight.get(tenant, 0)
            if held >= self.cap:
                return False
            self._in_flight[tenant] = held + 1
            return True

    def leave(self, tenant: str) -> None:
        """One request of ``tenant`` that entered is over."""
        with self._lock:
            held = self._in_flight.get(tenant, 0) - 1
            if held > 0:
                self._in_flight[tenant] = held
            else:
                self._in_flight.pop(tenant, None)

    def in_flight(self, tenant: str) -> int:
        with self._lock:
            return self._in_flight.get(tenant, 0)


@dataclass
class BodyPace:
    """The deadline of a request body's next bytes, from when it started and what has arrived.

    The body must be complete by ``started + timeout_s``; past ``started + grace_s`` it must
    also have averaged at least ``min_rate`` bytes a second since it started (0: no floor), so
    with ``n`` bytes received the next ones are due by ``started + max(grace_s, n / min_rate)``.
    """

    timeout_s: float
    grace_s: float
    min_rate: int  # bytes per second; 0 turns the rate floor off
    started: float  # monotonic seconds when the request reached the replica
    bytes_received: int = field(default=0)

    def received(self, n: int) -> None:
        self.bytes_received += n

    def deadline(self) -> float:
        """Monotonic time by which more of the body must have arrived (or the whole of it)."""
        overall = self.started + self.timeout_s
        if self.min_rate <= 0:
            return overall
        return min(overall, self.started + max(self.grace_s, self.bytes_received / self.min_rate))

    def why_late(self, now: float) -> str:
        """What the body failed to do, for the 408 answer."""
        elapsed = now - self.started
        if now >= self.started + self.timeout_s - 1e-9:
            return (
                f"the request body was not complete within {self.timeout_s:g} s (http.body_timeout_s); "
                f"{self.bytes_received:,} bytes arrived"
            )
        return (
            f"the request body arrived too slowly: {self.bytes_received:,} bytes in {elapsed:.1f} s, below "
            f"{self.min_rate:,} bytes/s after the first {self.grace_s:g} s (http.body_min_rate_bytes_s)"
        )
