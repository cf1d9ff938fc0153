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


def authorization(request: web.Request) -> str | None:
    """The request's one Authorization header, or None; two of them are refused."""
    return one_authorization(request.headers.getall(hdrs.AUTHORIZATION, []))


def one_authorization(values: Sequence[str]) -> str | None:
    """The one Authorization header of ``values`` (all a request has), or None."""
    if len(values) > 1:
        raise Unauthenticated("more than one Authorization header")
    return values[0] if values else None


def token_check(tokens: Tokens, public: Collection[str] = ()) -> Check:
    """The check of every request against ``tokens`` (which SIGHUP may reload): it raises
    Unauthenticated or PermissionDenied. ``public``: routes (``"GET /metrics"``) opened to
    everyone, whatever their rule says."""

    def authenticate(request: web.Request) -> None:
        match = request.match_info
        if match.http_exception is None:
            path = match.route.resource.canonical if match.route.resource is not None else ""
            rule = http_rule(request.method, path)
            if public and f"{'GET' if request.method == 'HEAD' else request.method} {path}" in (
                public
            ):
                rule = Access.OPEN
            tokens.check(authorization(request), rule, f"{request.method} {path}")

    return authenticate
