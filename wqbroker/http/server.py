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
- What aiohttp's parser rejects (an oversized line or header, too many headers, Content-Length
  with Transfer-Encoding, bytes that are not allowed, an unknown method) gets a JSON 400 naming
  the problem without repeating the bytes sent, and the connection is closed; it is logged in one
  line, at INFO at most once every ten seconds (the rest at DEBUG), never with a traceback.

aiohttp has no public hook for that last one (aio-libs/aiohttp#3287): :class:`Runner` serves the
application with :class:`Protocol`, a ``web.RequestHandler`` whose ``handle_error`` (the method
aiohttp calls to answer those requests) is replaced.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Final

from aiohttp import http_exceptions, web

from wqbroker.http.transport import error_response

log = logging.getLogger("wqbroker.http")

# Rejected requests are logged at INFO at most once in this many seconds; the others at DEBUG.
REPORT_EVERY: Final = 10.0

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


# -- requests the parser rejected ---------------------------------------------------------------

_QUOTING: Final = ("b'", 'b"', "\\x", "bytearray(")


def _reason(message: str) -> str | None:
    """The parser's own reason (llhttp's or aiohttp's fixed words) from an error message, or None
    when it would quote what the client sent."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if lines and lines[0].lower().startswith("bad status line"):
        lines = lines[1:]
    if not lines:
        return None
    reason = lines[0].rstrip(":. ")
    if not (reason.isascii() and reason.isprintable()) or len(reason) > 100:
        return None
    if any(mark in reason for mark in _QUOTING):
        return None
    first = reason.split(" ", 1)[0]
    if first[1:].islower() and "-" not in first:  # "Invalid ..." but not "Content-Length ..."
        reason = reason[:1].lower() + reason[1:]
    return reason


def describe_protocol_error(exc: BaseException | None) -> str:
    """What was wrong with a request the parser rejected, in words for the client: never a dump
    of the bytes it sent."""
    if isinstance(exc, http_exceptions.LineTooLong):
        limit = exc.args[1] if len(exc.args) > 1 else "the limit of"
        return f"the request line or a header is longer than {limit} bytes"
    if isinstance(exc, http_exceptions.InvalidHeader):
        return "a header has a character that is not allowed in it"
    if isinstance(exc, http_exceptions.BadHttpMethod):
        if "HTTPS" in exc.message:
            return "this port speaks plain HTTP, not HTTPS"
        return "the request method is not one this server knows"
    if isinstance(exc, http_exceptions.HttpProcessingError):
        if exc.message.startswith("Pause on PRI"):  # the HTTP/2 connection preface
            return "this port speaks HTTP/1.1, not HTTP/2"
        reason = _reason(exc.message)
        if reason is not None:
            return f"malformed HTTP request: {reason}"
    return "malformed HTTP request"


class _Reporter:
    """Logs rejected requests: one line at INFO at most every REPORT_EVERY seconds (saying how
    many were logged only at DEBUG since), the others at DEBUG; never a traceback."""

    def __init__(self) -> None:
        self._next = 0.0
        self._quiet = 0

    def report(self, now: float, peer: object, problem: str) -> None:
        if now < self._next:
            self._quiet += 1
            log.debug("bad HTTP request from %s: %s", peer, problem)
            return
        also = f" (and {self._quiet} more since, logged at debug level)" if self._quiet else ""
        log.info("bad HTTP request from %s: %s%s", peer, problem, also)
        self._next = now + REPORT_EVERY
        self._quiet = 0


# -- connections ----------------------------------------------------------------------------------


class Protocol(web.RequestHandler):
    """aiohttp's handler of one connection, answering the requests its parser rejects in JSON."""

    def __init__(
        self,
        manager: web.Server,
        *,
        loop: asyncio.AbstractEventLoop,
        reporter: _Reporter,
        **kwargs: Any,
    ) -> None:
        super().__init__(manager, loop=loop, **kwargs)
        self._event_loop = loop
        self._reporter = reporter

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """The answer to a request the parser rejected (or, status 500, to an exception that
        escaped the application: a bug, logged with its traceback)."""
        if status >= 500:
            log.error("error handling a request from %s", request.remote, exc_info=exc)
            problem = "internal error"
        else:
            problem = describe_protocol_error(exc)
            self._reporter.report(self._event_loop.time(), request.remote, problem)
        if request.writer.output_size > 0:
            raise ConnectionError("an answer was already started; closing the connection")
        response = error_response(status, problem)
        response.force_close()
        return response


class _Server(web.Server):
    """aiohttp's Server, making a :class:`Protocol` for each connection."""

    def __init__(
        self,
        handler: RequestHandler,
        request_factory: Any,
        *,
        loop: asyncio.AbstractEventLoop,
        **protocol_kwargs: Any,
    ) -> None:
        super().__init__(
            _outermost(handler),
            request_factory=request_factory,
            handler_cancellation=True,
            loop=loop,
            **protocol_kwargs,
        )
        self._new_protocol = functools.partial(
            Protocol, self, loop=loop, reporter=_Reporter(), **protocol_kwargs
        )

    def __call__(self) -> web.RequestHandler:
        return self._new_protocol()


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
        return _Server(
            made.request_handler,
            made.request_factory,
            loop=asyncio.get_running_loop(),
            **self._protocol_kwargs,
        )
