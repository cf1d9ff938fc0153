"""How the application is served: aiohttp's server, with the transport's settings.

- ``handler_cancellation``: a long-poll whose client disconnects is cancelled at once, so it leaves
  the queue of waiting consumers and is never handed a task.
- ``auto_decompress=False``: a body is never inflated (a compressed one is refused, see
  ``transport.py``).
- ``lingering_time=0``: aiohttp never drains an unread body after an answer (it would, for up to
  ten seconds, whatever it costs); ``transport.guard_body`` skips a bounded amount of it first,
  and the connection is closed if more is left.
- Whatever escapes the application (an HTTP error raised before the middlewares run, such as
  aiohttp's own ``Expect`` handling on an unknown path) is answered in JSON.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from wqbroker.http.transport import error_response

RequestHandler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


def _outermost(handler: RequestHandler) -> RequestHandler:
    """The application's handler, with what escapes it as JSON."""

    @functools.wraps(handler)
    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status_code < 400:
                raise
            if isinstance(e, web.HTTPExpectationFailed):
                message = "the Expect header supports only 100-continue"
            else:
                message = e.reason
            response = error_response(e.status_code, message)
            response.force_close()
            return response

    return handle


class Runner(web.AppRunner):
    """An AppRunner serving its application with the transport's settings."""

    def __init__(
        self,
        app: web.Application,
        *,
        access_log: logging.Logger | None,
        shutdown_timeout: float,
    ) -> None:
        super().__init__(app, shutdown_timeout=shutdown_timeout)
        self._protocol_kwargs: dict[str, Any] = {
            "access_log": access_log,
            "lingering_time": 0.0,
            "auto_decompress": False,
        }

    async def _make_server(self) -> web.Server:
        made = await super()._make_server()  # starts and freezes the application
        return web.Server(
            _outermost(made.request_handler),
            request_factory=made.request_factory,
            handler_cancellation=True,
            loop=asyncio.get_running_loop(),
            **self._protocol_kwargs,
        )
