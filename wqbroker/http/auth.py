"""Bearer tokens on the HTTP API: one check, before every handler (the application's one middleware
makes it, see ``app.py``).

It looks up the rule of the route the request matched (``wqbroker.auth``) and checks the
``Authorization`` header against it; a refusal is raised as ``Unauthenticated`` (401, with
``WWW-Authenticate: Bearer``) or ``PermissionDenied`` (403), which the error middleware renders as
every other error. A path that matches no route, or a method the route does not take, goes on to
its 404 or 405 unchecked: there is nothing behind it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from aiohttp import hdrs, web

from wqbroker.auth import Access, Tokens, http_rule
from wqbroker.errors import Unauthenticated

Check = Callable[[web.Request], None]


def check_route(
    tokens: Tokens,
    authorizations: Sequence[str],
    method: str,
    route: str,
    public: Collection[str] = (),
) -> None:
    """Check a request for ``route`` (its canonical path, ``/jobs/{id}/ack``) with these
    Authorization headers (all it has; two are refused) against ``tokens``: raises
    Unauthenticated or PermissionDenied. ``public``: as for :func:`token_check`."""
    if len(authorizations) > 1:
        raise Unauthenticated("more than one Authorization header")
    rule = http_rule(method, route)
    if public and f"{'GET' if method == 'HEAD' else method} {route}" in public:
        rule = Access.OPEN
    tokens.check(authorizations[0] if authorizations else None, rule, f"{method} {route}")


def token_check(tokens: Tokens, public: Collection[str] = ()) -> Check:
    """The check of every request against ``tokens`` (which SIGHUP may reload): it raises
    Unauthenticated or PermissionDenied. ``public``: routes (``"GET /metrics"``) opened to
    everyone, whatever their rule says."""

    def authenticate(request: web.Request) -> None:
        match = request.match_info
        if match.http_exception is None:
            path = match.route.resource.canonical if match.route.resource is not None else ""
            values = request.headers.getall(hdrs.AUTHORIZATION, [])
            check_route(tokens, values, request.method, path, public)

    return authenticate
