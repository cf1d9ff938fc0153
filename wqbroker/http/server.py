"""How the application is served: aiohttp's server, with the transport's settings.

- ``handler_cancellation``: a long-poll whose client disconnects is cancelled at once, so it leaves
  the queue of waiting consumers and is never handed a task.
- ``auto_decompress=False``: a body is never inflated (a compressed one is refused, see
  ``transport.py``).
- ``lingering_time=0``: aiohttp never drains an unread body after an answer (it would, for up to
  ten seconds, whatever it costs, and never after an answer that closes the connection, such as
  a 413); ``transport.finish_body`` does, within its own bounds (a small body is skipped and
  the connection kept; before a close, the rest is read and dropped for a bounded time and
  amount, so a client that sends its whole body before it reads gets the answer), and the
  connection is closed if more is left.
- Time-outs (Go's net/http has the same three): a request's line and headers must arrive within
  the head time-out of its first byte (of the connection's start, for its first request), else
  408 and the connection is closed; a kept connection is closed, without an answer, when the
  next request has not begun within the idle time-out of the last answer; the body time-out is
  in ``transport.py``. None runs while the application works on a request, so a long-poll is
  never cut off.
- The requests producers and workers make all day take the fast lane (``fast.py``): the same
  answers, without aiohttp's per-request machinery; every other request is aiohttp's. With the
  lane switched off (``-http-fast-lane=false``; or the access log on), every request is.
- Whatever escapes the application (an HTTP error raised before the middlewares run, such as
  aiohttp's own ``Expect`` handling on an unknown path) is answered in JSON.
- What aiohttp's parser rejects (an oversized line or header, too many headers, Content-Length
  with Transfer-Encoding, bytes that are not allowed, an unknown method) gets a JSON 400 naming
  the problem without repeating the bytes sent, and the connection is closed; it is logged in one
  line, at INFO at most once every ten seconds (the rest at DEBUG), never with a traceback.

aiohttp has no public hook for that last one (aio-libs/aiohttp#3287): :class:`Runner` serves the
application with :class:`Protocol`, a ``web.RequestHandler`` whose ``handle_error`` (the method
aiohttp calls to answer those requests) is replaced, and which keeps the head and idle time-outs
(aiohttp has neither as such: its keep-alive timer runs from the end of the last answer until a
whole request is in, and closes a connection whose next request is still arriving).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Final, Literal

from aiohttp import http_exceptions, web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http_parser import RawRequestMessage
from aiohttp.streams import StreamReader

from wqbroker.http.fast import FastProtocol
from wqbroker.http.lane import LANE, Deadline, Lane
from wqbroker.http.transport import (
    BODY,
    DEFAULT_MAX_BODY,
    error_response,
    finish_body,
    header_timeout_answer,
)
from wqbroker.protected import PROBES, REFUSAL, RefusalLog, describe_peer, local_peer

log = logging.getLogger("wqbroker.http")

DEFAULT_READ_HEADER_TIMEOUT: Final = 10.0
DEFAULT_IDLE_TIMEOUT: Final = 75.0

# aiohttp's keep-alive time-out for a connection the fast lane keeps: never (the lane keeps it).
_NEVER: Final = 10.0**9

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
    if isinstance(exc, http_exceptions.InvalidURLError) and "\n" not in exc.message:
        return "the request target is not a valid URL"  # (aiohttp's message is the target)
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
    """aiohttp's handler of one connection, with the head and idle time-outs, answering the
    requests its parser rejects in JSON.

    One timer per connection (a :class:`~wqbroker.http.lane.Deadline`, as the fast lane's) keeps
    both time-outs: until the request's first byte, the idle one (or, on a new connection, the
    head one, as Go does); from its first byte until it reaches the application, the head one;
    none while the application works on it."""

    def __init__(
        self,
        manager: web.Server,
        *,
        loop: asyncio.AbstractEventLoop,
        read_header_timeout: float,
        idle_timeout: float,
        reporter: _Reporter,
        lane: FastProtocol | None = None,
        handler: RequestHandler | None = None,
        **kwargs: Any,
    ) -> None:
        # aiohttp's own keep-alive timer (from an answer until the next request is complete)
        # stays as a backstop, later than ours ever is; none while the fast lane keeps the
        # connection (it keeps the time-outs then).
        backstop = 2 * (idle_timeout + read_header_timeout) + 1
        keepalive = backstop if lane is None else _NEVER
        super().__init__(manager, loop=loop, keepalive_timeout=keepalive, **kwargs)
        if handler is not None:  # (a refused connection's: see _refusing)
            self._request_handler = handler
        self._event_loop = loop
        self._reporter = reporter
        self._header_timeout = read_header_timeout
        self._idle_timeout = idle_timeout
        self._phase: Literal["head", "busy", "idle"] = "head"
        self._deadline = Deadline(loop, self._time_out)
        self._begun = False  # bytes of the next request have arrived
        # The fast lane whose connection this is (it gives this handler the requests it passes
        # on, one at a time), until it hands the connection over (``take_over``).
        self._lane = lane

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self._lane is None:
            self._wait(self._header_timeout)

    def take_over(self, transport: asyncio.Transport) -> None:
        """The connection is this handler's from now on (the fast lane has let it go): its
        bytes come straight from the transport, and the time-outs are kept here."""
        self._lane = None
        self._phase = "idle" if self._phase == "busy" else self._phase
        transport.set_protocol(self)
        self._wait(self._header_timeout)

    def data_received(self, data: bytes) -> None:
        if self._lane is not None:  # (a request the fast lane passed on: no time-out of ours)
            super().data_received(data)
            return
        if data and not self._begun and self._phase != "busy":
            self._begun = True
            if self._phase == "idle":  # the first byte of the next request: its head is due
                self._phase = "head"
                self._wait(self._header_timeout)
        super().data_received(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._deadline.cancel()
        super().connection_lost(exc)

    def request_started(self) -> None:
        """A request's head is in: it is handed to the application (no time-out runs)."""
        self._phase = "busy"
        self._deadline.clear()
        self._begun = False

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            self._phase = "idle"  # until the next request's first byte
            if self._lane is not None:
                self._lane.slow_done()  # the fast lane goes on with what follows
            else:
                self._wait(self._idle_timeout)

    def _wait(self, timeout: float) -> None:
        self._deadline.set(self._event_loop.time() + timeout)

    def _time_out(self) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        peer = transport.get_extra_info("peername")
        if self._begun:
            transport.write(header_timeout_answer(self._header_timeout))
            log.debug("closing the connection from %s: no request head in time", peer)
        else:
            log.debug("closing the idle connection from %s", peer)
        self.force_close()

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


RequestFactory = Callable[
    [RawRequestMessage, StreamReader, web.RequestHandler, AbstractStreamWriter, Any],
    web.BaseRequest,
]


class _Server(web.Server):
    """aiohttp's Server, making a :class:`~wqbroker.http.fast.FastProtocol` for each connection
    (with ``lane``; else a :class:`Protocol`), and telling a Protocol when a request reaches the
    application."""

    def __init__(
        self,
        handler: RequestHandler,
        request_factory: RequestFactory,
        *,
        loop: asyncio.AbstractEventLoop,
        read_header_timeout: float,
        idle_timeout: float,
        lane: Lane | None = None,
        local_only: bool = False,
        max_body: int = DEFAULT_MAX_BODY,
        **protocol_kwargs: Any,
    ) -> None:
        def make_request(
            message: RawRequestMessage,
            payload: StreamReader,
            protocol: web.RequestHandler,
            writer: AbstractStreamWriter,
            task: Any,
        ) -> web.BaseRequest:
            if isinstance(protocol, Protocol):
                protocol.request_started()
            return request_factory(message, payload, protocol, writer, task)

        super().__init__(
            _outermost(handler),
            request_factory=make_request,
            handler_cancellation=True,
            loop=loop,
            **protocol_kwargs,
        )
        self._new_protocol = functools.partial(
            Protocol,
            self,
            loop=loop,
            read_header_timeout=read_header_timeout,
            idle_timeout=idle_timeout,
            reporter=_Reporter(),
            **protocol_kwargs,
        )
        self._fast: set[FastProtocol] = set()  # the connections the fast lane keeps
        self._new_fast = (
            None
            if lane is None
            else functools.partial(
                FastProtocol,
                lane,
                lambda owner: self._new_protocol(lane=owner),
                loop=loop,
                read_header_timeout=read_header_timeout,
                idle_timeout=idle_timeout,
                connections=self._fast,
            )
        )
        # Protected mode (wqbroker/protected.py): each connection's peer is looked at once, when
        # it is accepted (by a _Gate); one not on this machine gets a Protocol that refuses.
        self._refusals = RefusalLog("HTTP") if local_only else None
        self._refuse = _outermost(_refusing(handler, max_body))

    def __call__(self) -> asyncio.Protocol:  # type: ignore[override]
        if self._refusals is not None:
            return _Gate(self)
        return self._connection()

    def _connection(self) -> asyncio.Protocol:
        if self._new_fast is not None:
            return self._new_fast()
        return self._new_protocol()

    def admit(self, transport: asyncio.BaseTransport) -> asyncio.Protocol:
        """The protocol of a new connection (protected mode): the usual one for a peer on this
        machine, else one whose every request (but the probes) is refused."""
        peer = transport.get_extra_info("peername")
        if local_peer(peer):
            return self._connection()
        assert self._refusals is not None
        self._refusals.refused(self._loop.time(), describe_peer(peer))
        return self._new_protocol(handler=self._refuse)

    def pre_shutdown(self) -> None:
        """The server stops taking connections: each closes once the request it is answering is
        answered (an idle one at once)."""
        super().pre_shutdown()
        for conn in list(self._fast):
            conn.close_when_done()

    async def shutdown(self, timeout: float | None = None) -> None:
        await asyncio.gather(
            super().shutdown(timeout), *(conn.shutdown(timeout) for conn in list(self._fast))
        )


class _Gate(asyncio.Protocol):
    """A connection's first protocol in protected mode: when the connection is made, it gives
    the transport the protocol the server chooses for the peer (``_Server.admit``), and is gone
    (the transport calls that one directly from then on)."""

    __slots__ = ("_server",)

    def __init__(self, server: _Server) -> None:
        self._server = server

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        protocol = self._server.admit(transport)
        transport.set_protocol(protocol)
        protocol.connection_made(transport)


_PROBE_PATHS: Final = frozenset(route.partition(" ")[2] for route in PROBES.http)  # (all GETs)


def _refusing(application: RequestHandler, max_body: int) -> RequestHandler:
    """The request handler of a refused connection: 403 with :data:`REFUSAL` to every request
    but a probe's (given to ``application``); the connection is kept for the next request, as
    after any answer (an unread body is skipped as the application's middleware skips one)."""

    async def refuse(request: web.BaseRequest) -> web.StreamResponse:
        if request.method in ("GET", "HEAD") and request.path in _PROBE_PATHS:
            return await application(request)
        response = error_response(403, REFUSAL)
        if not request.content.is_eof() and isinstance(request, web.Request):
            return await finish_body(request, response, max_body)
        return response

    return refuse


class Runner(web.AppRunner):
    """An AppRunner serving its application with the transport's settings (and the fast lane,
    unless ``fast_lane`` is false). ``local_only``: protected mode (``wqbroker.protected``)."""

    def __init__(
        self,
        app: web.Application,
        *,
        access_log: logging.Logger | None,
        read_header_timeout: float = DEFAULT_READ_HEADER_TIMEOUT,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
        shutdown_timeout: float,
        fast_lane: bool = True,
        local_only: bool = False,
    ) -> None:
        super().__init__(app, shutdown_timeout=shutdown_timeout)
        self._local_only = local_only
        self._read_header_timeout = read_header_timeout
        self._idle_timeout = idle_timeout
        self._fast_lane = fast_lane
        self._protocol_kwargs: dict[str, Any] = {
            "access_log": access_log,
            "lingering_time": 0.0,
            "auto_decompress": False,
        }

    @property
    def fast_connections(self) -> int:
        """How many connections the fast lane keeps now."""
        server = self.server
        return len(server._fast) if isinstance(server, _Server) else 0

    async def _make_server(self) -> web.Server:
        made = await super()._make_server()  # starts and freezes the application
        # The fast lane, unless it is switched off, or requests are to be logged (aiohttp's
        # access log sees only its own), or the application has none, or has more to it than
        # the lane does.
        lane = None
        if self._fast_lane and self._protocol_kwargs["access_log"] is None:
            lane = self.app.get(LANE)
        if lane is not None and not lane.serves(self.app):
            lane = None
        return _Server(
            made.request_handler,
            made.request_factory,
            loop=asyncio.get_running_loop(),
            read_header_timeout=self._read_header_timeout,
            idle_timeout=self._idle_timeout,
            lane=lane,
            local_only=self._local_only,
            max_body=rules.max_bytes if (rules := self.app.get(BODY)) else DEFAULT_MAX_BODY,
            **self._protocol_kwargs,
        )
