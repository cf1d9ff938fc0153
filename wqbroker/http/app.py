"""aiohttp's side of the HTTP API: every row of the route table (``core.ROUTES``) registered with
aiohttp's router, the operator's routes (/metrics, /openapi.json, /ui) beside them, and the
application's one middleware.

A row's handler (``core.py``, shared with the fast lane) sees aiohttp's request through
:class:`_View`; its answer is rendered here. Every rule lives in the service. Every error answer
is JSON, ``{"error": "<message naming the problem>"}``, including the ones aiohttp produces
itself (unknown path, wrong method, body too large). What any request may cost the transport
(bodies, time-outs, malformed HTTP) is bounded in ``transport.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Final

from aiohttp import web
from aiohttp.typedefs import Middleware

from wqbroker.auth import Tokens
from wqbroker.clock import SystemClock
from wqbroker.errors import WqError
from wqbroker.http import dashboard, openapi
from wqbroker.http.auth import token_check
from wqbroker.http.core import HEADERS, ROUTES, STATUS, Route, error_parts, render_error
from wqbroker.http.lane import LANE, Lane
from wqbroker.http.metrics import ROUTE as METRICS_ROUTE
from wqbroker.http.metrics import count_http
from wqbroker.http.metrics import handler as metrics_handler
from wqbroker.http.server import DEFAULT_IDLE_TIMEOUT, DEFAULT_READ_HEADER_TIMEOUT, Runner
from wqbroker.http.transport import (
    BODY,
    DEFAULT_MAX_BODY,
    DEFAULT_READ_BODY_TIMEOUT,
    BodyRules,
    RequestTimeout,
    body_refusal,
    error_response,
    expect_continue,
    finish_body,
    json_response,
    no_content,
    read_body,
)
from wqbroker.metrics import Metrics
from wqbroker.service import Service

__all__ = ["STATUS", "create_app", "error_answer", "make_runner"]

log = logging.getLogger("wqbroker.http")

SERVICE: Final = web.AppKey("service", Service)

_HEADERS: Final = frozenset(HEADERS)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class _View:
    """aiohttp's request as a route's handler sees it (``core.Request``)."""

    __slots__ = ("_request", "answer")

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self.answer: web.StreamResponse | None = None  # written by the handler (a claim's)

    def match(self, name: str) -> str:
        return self._request.match_info[name]

    def query(self, name: str) -> Sequence[str]:
        return self._request.query.getall(name, [])

    def header(self, name: str) -> Sequence[str]:
        if name not in _HEADERS:
            raise LookupError(f"{name} is not one of the headers a handler reads (core.HEADERS)")
        return self._request.headers.getall(name, [])

    def body(self) -> Coroutine[None, None, bytes]:
        return read_body(self._request)

    async def write(self, body: bytes) -> None:
        request = self._request
        transport = request.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client went away")
        answer = json_response(body)
        await answer.prepare(request)
        await answer.write_eof()
        self.answer = answer


def _handler(route: Route) -> Handler:
    """aiohttp's handler for a row of the table: its handler, over the request, rendered."""
    handle = route.handler

    async def serve(request: web.Request) -> web.StreamResponse:
        view = _View(request)
        status, body = await handle(request.app[SERVICE], view)
        if body is not None:
            return json_response(body, status)
        return no_content() if view.answer is None else view.answer  # (204, or WRITTEN)

    serve.__name__ = handle.__name__
    return serve


# -- errors -------------------------------------------------------------------------------------


def error_answer(error: WqError) -> web.Response:
    """The JSON answer for an error of the tree, with the headers its status calls for."""
    status, headers = error_parts(error)
    response = json_response(render_error(error), status)
    for name, value in headers:
        response.headers[name] = value
    return response


def _answer_to_exception(request: web.Request, error: Exception) -> web.Response | None:
    """The JSON answer to an exception a handler (or the token check) raised, or None for one
    that must go on up (a cancellation, a lost connection, an HTTP exception below 400)."""
    if isinstance(error, WqError):
        return error_answer(error)
    if isinstance(error, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(error.allowed_methods))
        response = error_response(
            405, f"method {request.method} is not allowed on {request.path}; use {allowed}"
        )
        response.headers["Allow"] = ",".join(sorted(error.allowed_methods))
        return response
    if isinstance(error, web.HTTPNotFound):
        return error_response(404, f"no such endpoint: {request.method} {request.path}")
    if isinstance(error, web.HTTPException):
        return None if error.status_code < 400 else error_response(error.status_code, error.reason)
    if isinstance(error, RequestTimeout):
        return error_response(408, error.message)
    if isinstance(error, ConnectionError):
        return None
    log.error("unexpected error in %s %s", request.method, request.path, exc_info=error)
    return error_response(500, "internal error")


def middleware(
    metrics: Metrics, rules: BodyRules, check_token: Callable[[web.Request], None] | None
) -> Middleware:
    """The application's one middleware, around every handler (one layer rather than four: it
    runs on every request). In order:

    - a body the headers already rule out is refused (415, 413), before anything else;
    - the token is checked (``auth.py``), when the broker has tokens;
    - every error the check or the handler raises is answered in JSON (``_answer_to_exception``);
    - every answer is counted by method, route and status (refusals included), as is an HTTP
      exception that goes on up;
    - whatever of the body the handler left unread is dealt with (``transport.finish_body``).
    """

    @web.middleware
    async def handle(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            response: web.StreamResponse | None = body_refusal(request, rules)
            if response is None:
                try:
                    if check_token is not None:
                        check_token(request)
                    response = await handler(request)
                except Exception as e:
                    response = _answer_to_exception(request, e)
                    if response is None:
                        raise
        except web.HTTPException as e:
            count_http(metrics, request, e.status)
            raise
        # (Counted before the unread body is dealt with: that may take the lingering bounds.)
        count_http(metrics, request, response.status)
        if not request.content.is_eof():
            response = await finish_body(request, response)
        return response

    return handle


def create_app(
    service: Service,
    *,
    max_body: int = DEFAULT_MAX_BODY,
    read_body_timeout: float = DEFAULT_READ_BODY_TIMEOUT,
    tokens: Tokens | None = None,
    metrics: Metrics | None = None,
    metrics_public: bool = False,
) -> web.Application:
    """The app; with ``tokens``, every request but health checks needs a bearer token.
    ``metrics``: the broker's (else one of the app's own, which sees only the service's state
    and the requests), for GET /metrics (open to all with ``metrics_public``)."""
    if metrics is None:
        metrics = Metrics(SystemClock())
        metrics.watch(service)
    public = (f"GET {METRICS_ROUTE}",) if metrics_public else ()
    check_token = None if tokens is None else token_check(tokens, public)
    rules = BodyRules(max_body, read_body_timeout)
    handle = middleware(metrics, rules, check_token)
    app = web.Application(middlewares=[handle], client_max_size=max_body)
    app[SERVICE] = service
    app[BODY] = rules
    app[LANE] = Lane(service, metrics, tokens, max_body, read_body_timeout, handle)
    # The documented methods, and HEAD on the read-only GETs (it changes nothing); aiohttp adds
    # HEAD to every GET unless told not to, and a HEAD on /jobs/next would claim a task.
    routes = app.router
    expect = expect_continue
    for route in ROUTES:
        if route.method == "GET":
            routes.add_get(
                route.template, _handler(route), allow_head=route.head, expect_handler=expect
            )
        else:
            routes.add_route(route.method, route.template, _handler(route), expect_handler=expect)
    routes.add_get(METRICS_ROUTE, metrics_handler(metrics), expect_handler=expect)
    routes.add_get(
        openapi.PATH, openapi.handler(metrics_public=metrics_public), expect_handler=expect
    )
    dashboard.add_routes(routes, expect_handler=expect)  # GET /ui: static files, no token
    return app


def make_runner(
    app: web.Application,
    *,
    access_log: bool = False,
    read_header_timeout: float = DEFAULT_READ_HEADER_TIMEOUT,
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
    fast_lane: bool = True,
    local_only: bool = False,
) -> web.AppRunner:
    """The runner serving ``app``; ``fast_lane=False`` serves every request aiohttp's way (as
    does ``access_log``: aiohttp's access log sees only the requests it serves). ``local_only``:
    protected mode, only loopback peers are served (``wqbroker.protected``)."""
    return Runner(
        app,
        access_log=log if access_log else None,
        read_header_timeout=read_header_timeout,
        idle_timeout=idle_timeout,
        shutdown_timeout=5.0,
        fast_lane=fast_lane,
        local_only=local_only,
    )
