"""Who is asking: the tenant and the scopes of the API key behind a request.

The HTTP layer (REST and MCP on Ray Serve) authenticates a bearer key into a
:class:`Principal` and sets it for the request with :func:`acting_as`; code that serves the
request (a route, an MCP tool) reads it with :func:`current`. Local interfaces without keys
(the stdio MCP server, the CLI) act as one fixed principal.

>>> from lifemem_ray.service.principal import Principal, acting_as, current
>>> with acting_as(Principal("acme", frozenset({"read"}), "key-1")):
...     current().tenant, current().allows("write")
('acme', False)
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field

from lifemem_ray.core.errors import AuthError, ForbiddenError, InvalidArgumentError

__all__ = ["SCOPES", "Principal", "acting_as", "current", "require"]

SCOPES = ("read", "write", "admin")  # admin implies read and write and adds stats of every tenant and tenant purge


@dataclass(frozen=True)
class Principal:
    tenant: str  # every read and write of this principal is confined to this tenant
    scopes: frozenset[str] = field(default_factory=frozenset)  # a subset of SCOPES
    key_id: str = ""  # a short, non-secret name of the key (for logs and metrics), never the key

    def allows(self, scope: str) -> bool:
        return scope in self.scopes or "admin" in self.scopes

    def require(self, scope: str, what: str = "") -> Principal:
        """This principal if its key has ``scope``, else :class:`ForbiddenError` naming the key,
        the scope and (``what``) the operation. The one scope check of REST, MCP and the rest."""
        if scope not in SCOPES:
            raise InvalidArgumentError(f"scope: {scope!r} is not one of {SCOPES}")
        if not self.allows(scope):
            raise ForbiddenError(
                f"key {self.key_id or '(unnamed)'} of tenant {self.tenant!r} lacks the {scope!r} scope"
                + (f" needed for {what}" if what else "")
                + "; use a key with that scope"
            )
        return self


_current: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("lifemem_principal", default=None)


@contextlib.contextmanager
def acting_as(principal: Principal) -> Iterator[Principal]:
    """Run the block as ``principal`` (restored afterwards, also on error)."""
    token = _current.set(principal)
    try:
        yield principal
    finally:
        _current.reset(token)


def current() -> Principal:
    """The principal of the running request; :class:`AuthError` where none was set."""
    got = _current.get()
    if got is None:
        raise AuthError("no authenticated principal for this request: send 'Authorization: Bearer <key>'")
    return got


def require(scope: str) -> Principal:
    """The running principal if its key has ``scope``, else :class:`ForbiddenError` naming the scope."""
    return current().require(scope)
