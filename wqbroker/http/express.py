"""The express lane: the requests a producer or a worker makes all day, routed without aiohttp's
router.

aiohttp resolves every request by walking its resources (a coroutine per candidate: ``/jobs``,
``/jobs/{id}``, then ``/jobs/{id}/ack``), builds a match, looks up its cached middleware chain and
wraps it in a layer that sets the current application. For the six routes below, :class:`Express`
does the same from one dict and one regular expression, with the very routes, handlers and
middleware the application registered: a request it takes is answered exactly as aiohttp's
router would answer it (``tests/test_http_express.py`` compares them).

It takes only requests whose target is plain: ``POST /jobs``, ``POST /jobs/batch``,
``GET /jobs/next`` and ``POST /jobs/{id}/ack|nack|extend`` with an id of letters, digits, ``_``,
``-`` and ``~`` (no percent-encoding, no dot segment, nothing a URL parser could read otherwise),
and no ``Expect`` header. Everything else (other routes, methods, encoded or odd paths, absolute
targets) goes to the application's own handling, unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Final, cast

from aiohttp import web
from aiohttp.web_urldispatcher import AbstractRoute, UrlMappingMatchInfo

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
RequestHandler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]

PLAIN: Final = frozenset({("POST", "/jobs"), ("POST", "/jobs/batch"), ("GET", "/jobs/next")})
TASK_ACTIONS: Final = frozenset({"ack", "nack", "extend"})
_TASK_ROUTE: Final = re.compile(r"/jobs/([A-Za-z0-9_~-]+)/(ack|nack|extend)")


class Express:
    """The application's request handler, with the express lane in front of it. ``fallback``
    is the application's own handler (``Application._handle``), for every other request."""

    def __init__(self, app: web.Application, fallback: RequestHandler) -> None:
        self._app = app
        self._fallback = fallback
        self._plain: dict[tuple[str, str], tuple[AbstractRoute, Handler]] = {}
        self._task: dict[str, tuple[AbstractRoute, Handler]] = {}
        for route in app.router.routes():
            resource = route.resource
            if resource is None:
                continue
            chain = route.handler
            for middleware in reversed(app.middlewares):
                chain = partial(middleware, handler=chain)
            where = (route.method, resource.canonical)
            if where in PLAIN:
                self._plain[where] = (route, chain)
            elif route.method == "POST" and resource.canonical.startswith("/jobs/{id}/"):
                action = resource.canonical.rsplit("/", 1)[1]
                if action in TASK_ACTIONS:
                    self._task[action] = (route, chain)
        missing = len(PLAIN) + len(TASK_ACTIONS) - len(self._plain) - len(self._task)
        if missing:
            raise RuntimeError(f"the express lane found {missing} of its routes missing")

    async def __call__(self, request: web.BaseRequest) -> web.StreamResponse:
        method = request.method
        path = request.raw_path.partition("?")[0]
        found = self._plain.get((method, path))
        match: dict[str, str] = {}
        if found is None and method == "POST":
            task = _TASK_ROUTE.fullmatch(path)
            if task is not None:
                found = self._task[task[2]]
                match = {"id": task[1]}
        if found is None or "Expect" in request.headers:
            return await self._fallback(request)
        route, chain = found
        info = UrlMappingMatchInfo(match, route)
        info.add_app(self._app)
        info.freeze()
        web_request = cast(web.Request, request)  # (the application's requests are)
        web_request._match_info = info
        return await chain(web_request)
