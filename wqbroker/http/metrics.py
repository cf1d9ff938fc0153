"""``GET /metrics`` and the HTTP side of the broker's metrics (:mod:`wqbroker.metrics`).

The registry speaks no protocol; this module is what aiohttp needs of it: the handler of the
route, and :func:`count_http`, which the application's one middleware (``app.py``) calls for every
answer it gives, naming the route as registered (the fast lane counts its own answers with
:meth:`Metrics.count_answer` directly).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Final

from aiohttp import web
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from wqbroker.metrics import Metrics

#: The route, as the token rules and the app name it.
ROUTE: Final = "/metrics"


def count_http(metrics: Metrics, request: web.Request, status: int) -> None:
    """Counts an answer by method, route (as registered; ``unmatched`` for a path with no route)
    and status."""
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "unmatched"
    metrics.count_answer(request.method, route, status)


def handler(metrics: Metrics) -> Callable[[web.Request], Awaitable[web.Response]]:
    """The handler of ``GET /metrics``, for ``metrics``."""

    async def handle(request: web.Request) -> web.Response:
        body = await metrics.exposition()
        # The classic text format (every name here is a legacy one: the output is the same in
        # version 1.0.0), which every Prometheus reads.
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})

    return handle
