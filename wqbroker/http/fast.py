"""The fast lane: the requests producers and workers make all day, served without aiohttp's
per-request machinery, and every other request handed to aiohttp.

Each HTTP connection starts with a :class:`FastProtocol`. It reads each request's head itself,
strictly (a request line and header lines of printable ASCII, nothing a parser could read two
ways), and:

- **serves it** if it is one of the hot requests in its plain form: a row of the route table
  marked hot (``core.ROUTES``: ``POST /jobs``, ``POST /jobs/batch``, ``GET /jobs/next``,
  ``GET /jobs/next/batch``, ``POST /jobs/settle``, ``POST /jobs/{id}/ack|nack|extend``), over
  HTTP/1.1, with path parameters of letters, digits, ``_``, ``-`` and ``~``, a query of such
  characters (plus ``.`` and ``,``), one ``Host``, a body of at most the limit by
  ``Content-Length``, none of ``Expect``, ``Content-Encoding``, ``Transfer-Encoding`` or
  ``Upgrade``, no header aiohttp takes once seen twice, and at most 128 header lines. The row's
  handler (the one aiohttp's way runs too) answers, over the lane's view of the request, and
  the answer is the very one aiohttp's way gives (``tests/http/test_fast_lane.py`` sends each case
  both ways and compares the bytes): the token check, the errors as JSON, the metrics, the
  time-outs, keep-alive and ``Connection: close``, pipelining in order;
- **passes it to aiohttp**, for this request only, if its head reads cleanly but it is anything
  else (another route or method, HTTP/1.0, a percent-encoded path, a body over the limit, a
  compressed one, ``Expect``, no ``Host``, a token the check refuses): an aiohttp handler of the
  connection (a ``lane.SlowPath``: ``server.py`` makes it, and this module never imports that
  one) is given exactly that request's bytes, answers it, and says when it is done; the fast
  lane then goes on with what follows;
- **hands the connection to aiohttp for good** if the head cannot be read that strictly, or its
  end cannot be known without a parser's judgement (``Transfer-Encoding``, ``Content-Length``
  twice or unreadable, ``Upgrade``, a head over 8 KiB): from that request on, aiohttp reads the
  bytes and answers as it always has (with the JSON errors of ``server.py``).

A request that ends the connection (``Connection: close``; HTTP/1.0 without keep-alive, which
aiohttp answers) is the last one read: nothing after it is (RFC 9112, section 9.6). aiohttp's
parser answers 400 instead when more bytes come in the same read as such a request, and drops
the requests it parsed in a read that ends in bytes it refuses; the lane answers each request it
read before those bytes (``tests/http/test_fast_lane.py`` sends the same bytes to a broker with the
lane and one without).

A lane request's body is read whole before its handler runs (aiohttp's handlers read theirs
first thing); one that does not come within the body time-out gets 408 and the connection is
closed, as aiohttp's way does. A route that reads no body (a claim) with a body still to come is
passed to aiohttp, which answers at once and skips it (ack and extend read one: an optional
result, an optional progress). Time-outs (head, body, idle) are kept by one timer per connection
(``lane.Deadline``, as aiohttp's side keeps its own).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from typing import Final

from aiohttp.tcp_helpers import tcp_keepalive

from wqbroker.errors import WqError
from wqbroker.http.auth import check_route
from wqbroker.http.core import HEADERS, ROUTES, Route, error_parts, render_error
from wqbroker.http.lane import Deadline, Lane, SlowPath
from wqbroker.http.transport import (
    RequestTimeout,
    answer_bytes,
    body_late,
    error_body,
    header_timeout_answer,
)

log = logging.getLogger("wqbroker.http")

# A head longer than this is aiohttp's to judge (its limit is 8190 bytes a line: no line of a
# head this long can be over it).
MAX_HEAD: Final = 8190
# A request with more header lines than this is aiohttp's to refuse (its own limit).
MAX_HEADERS: Final = 128
# Requests read ahead of the one being answered before reading stops (pipelining).
MAX_PIPELINED: Final = 16

_TOKEN: Final = rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
# A head read strictly: a request line, then header lines of printable ASCII (no obs-fold, no
# bare CR or LF, no control bytes, no bytes above 0x7E).
_HEAD: Final = re.compile(
    rb"(" + _TOKEN + rb") ([!-~]*) HTTP/1\.([01])((?:\r\n" + _TOKEN + rb":[\t -~]*)*)"
)
# What the bytes of a head not yet all in may be, as far as they go: a request line, header lines,
# and the start of the next line (a parser says at once what is wrong with anything else).
_REQUEST_LINE: Final = re.compile(rb"(?:" + _TOKEN + rb") [!-~]* HTTP/1\.[01]")
_HEADER_LINE: Final = re.compile(_TOKEN + rb":[\t -~]*")
_VERSION_START: Final = rb"(?:H(?:T(?:T(?:P(?:/(?:1(?:\.[01]?)?)?)?)?)?)?)?"  # of "HTTP/1.x"
_LINE_START: Final = re.compile(
    rb"[!#$%&'*+.^_`|~0-9A-Za-z-]*(?: [!-~]*(?: " + _VERSION_START + rb")?)?\r?"
)
_HEADER_START: Final = re.compile(rb"(?:[!#$%&'*+.^_`|~0-9A-Za-z-]+(?::[\t -~]*)?)?\r?")


def _could_be_head(data: bytes) -> bool:
    """Whether ``data`` (no end of head in it yet) may be the start of a head read strictly."""
    lines = data.split(b"\r\n")
    if len(lines) == 1:
        return _LINE_START.fullmatch(lines[0]) is not None
    if _REQUEST_LINE.fullmatch(lines[0]) is None:
        return False
    if any(_HEADER_LINE.fullmatch(line) is None for line in lines[1:-1]):
        return False
    return _HEADER_START.fullmatch(lines[-1]) is not None


# A path parameter the lane serves (``{id}`` of ``/jobs/{id}/ack``), and a query: nothing a URL
# parser would decode.
_SEGMENT: Final = "[A-Za-z0-9_~-]+"
_PARAM: Final = r"[A-Za-z0-9_.~-]+=[A-Za-z0-9_.,~-]*"
_QUERY: Final = re.compile(f"{_PARAM}(?:&{_PARAM})*")
_PLACEHOLDER: Final = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


class _Hot:
    """A row the lane serves, and where its path parameters are in its method's pattern."""

    __slots__ = ("route", "groups")

    def __init__(self, route: Route, groups: dict[str, int]) -> None:
        self.route = route
        self.groups = groups  # parameter -> group of the pattern's match


class _Routes:
    """The rows of the route table the lane serves (``core.ROUTES``, those marked hot), as it
    finds a request's: a path without parameters by a dict; one with parameters by one pattern
    per method (an alternative per row, each parameter a segment of :data:`_SEGMENT`), the row
    told by the last group matched."""

    def __init__(self, routes: Sequence[Route]) -> None:
        self.plain: dict[tuple[str, str], _Hot] = {}
        self.templated: dict[str, tuple[re.Pattern[str], dict[int, _Hot]]] = {}
        alternatives: dict[str, list[str]] = {}
        ends: dict[str, dict[int, _Hot]] = {}
        for route in routes:
            names = _PLACEHOLDER.findall(route.path)
            if not names:
                self.plain[route.method, route.path] = _Hot(route, {})
                continue
            if route.patterns:  # (its parameters are not any segment: aiohttp's to match)
                raise ValueError(f"{route.method} {route.path}: the lane serves no patterns")
            pieces = _PLACEHOLDER.split(route.path)  # literal, name, literal, name, ..., literal
            alternatives.setdefault(route.method, []).append(
                "".join(
                    re.escape(piece) if i % 2 == 0 else f"({_SEGMENT})"
                    for i, piece in enumerate(pieces)
                )
            )
            found = ends.setdefault(route.method, {})
            first = max(found, default=0) + 1
            groups = {name: first + i for i, name in enumerate(names)}
            found[first + len(names) - 1] = _Hot(route, groups)
        for method, regexes in alternatives.items():
            pattern = re.compile("|".join(f"(?:{r})" for r in regexes))
            self.templated[method] = (pattern, ends[method])

    def find(self, method: str, path: str) -> tuple[_Hot, re.Match[str] | None] | None:
        """The row of this method and path, and the match of its parameters (None: it has
        none); None: not a hot request."""
        hot = self.plain.get((method, path))
        if hot is not None:
            return hot, None
        templated = self.templated.get(method)
        if templated is None:
            return None
        pattern, ends = templated
        match = pattern.fullmatch(path)
        if match is None or match.lastindex is None:
            return None
        return ends[match.lastindex], match


_HOT: Final = _Routes([route for route in ROUTES if route.hot])

# Headers aiohttp refuses to see twice in a request (its parser's list).
_SINGLETONS: Final = frozenset(
    {
        b"content-length",
        b"content-location",
        b"content-range",
        b"content-type",
        b"etag",
        b"host",
        b"max-forwards",
        b"server",
        b"transfer-encoding",
        b"user-agent",
    }
)


class _Request:
    """A request the lane serves: what its row's handler sees of it (``core.Request``)."""

    __slots__ = (
        "route",
        "groups",
        "matched",
        "params",
        "headers",
        "close",
        "data",
        "left",
        "head_at",
        "conn",
    )

    def __init__(
        self,
        hot: _Hot,
        matched: re.Match[str] | None,
        params: dict[str, list[str]],
        fields: _Fields,
        length: int,
        conn: FastProtocol,
    ) -> None:
        self.route = hot.route
        self.groups = hot.groups
        self.matched = matched  # its path parameters (in ``groups``)
        self.params = params  # the query's
        self.headers = fields.headers  # those of core.HEADERS it has
        self.close = fields.close  # the client asked for Connection: close
        self.data = bytearray()  # the body
        self.left = length  # body bytes still to come
        self.head_at = 0.0  # when its head was in (its body is due a time-out after)
        self.conn = conn

    def match(self, name: str) -> str:
        matched = self.matched
        if matched is None:
            raise LookupError(f"{self.route.path} has no parameter {name}")
        return matched[self.groups[name]]

    def query(self, name: str) -> Sequence[str]:
        return self.params.get(name, ())

    def header(self, name: str) -> Sequence[str]:
        return self.headers.get(name, ())

    async def body(self) -> bytes:
        return bytes(self.data)  # (read whole before the handler runs)

    def write(self, body: bytes) -> Coroutine[None, None, None]:
        return self.conn._write(answer_bytes(200, body, self.close))


class _Passed:
    """A request passed to aiohttp: its bytes, and how many of its body's are still to come."""

    __slots__ = ("raw", "left", "active")

    def __init__(self, head: bytes, length: int) -> None:
        self.raw = bytearray(head)
        self.left = length
        self.active = False  # its bytes are being given to aiohttp (the rest as they come)


_Item = _Request | _Passed


class _Fields:
    """What the lane reads of a request's header lines."""

    __slots__ = ("length", "close", "headers", "auth", "hosts", "plain", "for_good", "seen")

    def __init__(self) -> None:
        self.length: int | None = 0  # Content-Length (None: unreadable)
        self.close = False  # Connection: close
        self.headers: dict[str, list[str]] = {}  # those of core.HEADERS (a handler reads them)
        self.auth: list[str] = []  # Authorization
        self.hosts = 0
        self.plain = True  # nothing in them that is aiohttp's to deal with
        self.for_good = False  # ... nor to read the rest of the connection from
        self.seen: set[bytes] = set()  # the singletons seen

    def add(self, name: bytes, raw: bytes) -> None:
        if name in _SINGLETONS:
            if name in self.seen:
                self.plain = False
                if name in (b"content-length", b"transfer-encoding"):
                    self.for_good = True
            self.seen.add(name)
        reader = _READERS.get(name)  # (the headers the lane looks at; any other is let be)
        if reader is not None:
            reader(self, raw.strip(b" \t"))

    def _length(self, value: bytes) -> None:
        # (More digits than any body has: a parser's to judge, not int()'s to be asked.)
        self.length = int(value) if value.isdigit() and len(value) <= 15 else None

    def _host(self, value: bytes) -> None:
        self.hosts += 1

    def _connection(self, value: bytes) -> None:
        self.close = self.close or b"close" in [t.strip().lower() for t in value.split(b",")]

    def _authorization(self, value: bytes) -> None:
        self.auth.append(value.decode("ascii"))

    def _switch(self, value: bytes) -> None:
        self.for_good = True  # Transfer-Encoding, Upgrade: where the request ends, or what follows

    def _aiohttps(self, value: bytes) -> None:
        self.plain = False  # Content-Encoding, Expect, Sec-WebSocket-Key1: aiohttp's rules


def _gather(name: str) -> Callable[[_Fields, bytes], None]:
    """The reader of a header a handler reads (``core.HEADERS``): its values, kept."""

    def gather(fields: _Fields, value: bytes) -> None:
        fields.headers.setdefault(name, []).append(value.decode("ascii"))

    return gather


# The headers the lane looks at (lower case), and what it does with each; any other is let be.
_READERS: Final[dict[bytes, Callable[[_Fields, bytes], None]]] = {
    **{name.lower().encode("ascii"): _gather(name) for name in HEADERS},
    b"content-length": _Fields._length,
    b"host": _Fields._host,
    b"connection": _Fields._connection,
    b"authorization": _Fields._authorization,
    b"transfer-encoding": _Fields._switch,
    b"upgrade": _Fields._switch,
    b"content-encoding": _Fields._aiohttps,
    b"expect": _Fields._aiohttps,
    b"sec-websocket-key1": _Fields._aiohttps,
}


class FastProtocol(asyncio.Protocol):
    """One HTTP connection, served by the fast lane while its requests are the hot ones (see the
    module's text). ``slow`` makes the aiohttp handler that requests are passed to."""

    def __init__(
        self,
        lane: Lane,
        slow: Callable[[FastProtocol], SlowPath],
        *,
        loop: asyncio.AbstractEventLoop,
        read_header_timeout: float,
        idle_timeout: float,
        connections: set[FastProtocol],
    ) -> None:
        self._lane = lane
        self._make_slow = slow
        self._loop = loop
        self._header_timeout = read_header_timeout
        self._idle_timeout = idle_timeout
        self._connections = connections
        # Bytes buffered beyond this (a body not yet passed on, what aiohttp is to read) stop
        # the reading until they are dealt with.
        self._max_buffered = lane.max_body + 2 * MAX_HEAD
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()  # read, not yet parsed
        self._pending: deque[_Item] = deque()  # parsed, not yet answered (the first: now)
        self._open: _Item | None = None  # the last of them, while its body is still to come
        self._for_good: bytearray | None = None  # the bytes from which aiohttp reads on its own
        self._slow: SlowPath | None = None
        self._slow_done: asyncio.Future[None] | None = None
        self._server: asyncio.Task[None] | None = None  # the task answering, while it runs
        self._wake: asyncio.Future[None] | None = None  # it waits for a request
        self._body_wait: asyncio.Future[None] | None = None  # it waits for a body
        self._writing_paused = False
        self._drain: asyncio.Future[None] | None = None
        self._reading_paused = False
        self._closed = False
        self._stopping = False  # the server stops: no request after the one being answered
        # The time-outs (one timer), and what the connection does when the one set passes.
        self._deadline = Deadline(loop, self._time_out)
        self._timeout = "head"
        self._head_from = 0.0  # the first byte of the head awaited (or the connection's start)

    # -- asyncio's calls -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # (a stream's transport)
        tcp_keepalive(self._transport)  # type: ignore[arg-type]
        self._connections.add(self)
        self._head_from = self._loop.time()  # the first request's head is due from now
        self._timeout = "head"
        self._deadline.set(self._head_from + self._header_timeout)

    def data_received(self, data: bytes) -> None:
        if self._closed or self._stopping:
            return
        if not self._buf and self._timeout == "idle":
            self._head_from = self._loop.time()  # the first byte of the next request
        if self._open is not None:
            data = self._fill(self._open, data)
        if self._for_good is not None:
            self._for_good += data
        elif data:
            self._buf += data
            self._read()
        self._flow()
        self._watch()

    def eof_received(self) -> bool | None:
        return None  # (the transport closes, as aiohttp's does)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._closed = True
        self._connections.discard(self)
        self._deadline.cancel()
        if self._server is not None:
            self._server.cancel()  # a long-poll leaves its line (a store call runs to its end)
        for waiter in (self._drain, self._slow_done):
            if waiter is not None and not waiter.done():
                waiter.set_exception(ConnectionResetError("the connection was lost"))
                waiter.exception()
        if self._slow is not None:
            self._slow.connection_lost(exc)

    def pause_writing(self) -> None:
        self._writing_paused = True
        if self._slow is not None:
            self._slow.pause_writing()

    def resume_writing(self) -> None:
        self._writing_paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        if self._slow is not None:
            self._slow.resume_writing()

    # -- reading -------------------------------------------------------------------------------

    def _fill(self, item: _Item, data: bytes) -> bytes:
        """Give ``item`` the body bytes of ``data`` it still waits for; the rest of ``data``."""
        take = data[: item.left]
        item.left -= len(take)
        if isinstance(item, _Request):
            item.data += take
        elif item.active:
            assert self._slow is not None
            self._slow.data_received(take)
        else:
            item.raw += take
        if item.left == 0:
            self._open = None
            if self._pending and item is self._pending[0]:
                self._wake_body()
        return data[len(take) :]

    def _read(self) -> None:
        """Parse the requests whose heads are in (up to MAX_PIPELINED waiting), until one's body
        is still to come. (The buffer is cut once, at the end: a flood of pipelined requests
        costs a copy of each, not of all that follows each.)"""
        buf = self._buf
        pending = self._pending
        pos, size = 0, len(buf)
        while pos < size and self._open is None and self._for_good is None:
            if len(pending) >= MAX_PIPELINED:
                break  # (parsed on as answers go out)
            end = buf.find(b"\r\n\r\n", pos, pos + MAX_HEAD + 4)
            if end < 0:
                if size - pos > MAX_HEAD or not _could_be_head(bytes(buf[pos:])):
                    self._for_good = bytearray(buf[pos:])  # (aiohttp says what is wrong, now)
                    pos = size
                break
            item = self._item(bytes(buf[pos:end]), size - end - 4)
            if item is None:
                self._for_good = bytearray(buf[pos:])  # the connection is aiohttp's from here
                pos = size
                break
            pos = end + 4
            if item.left:
                take = min(item.left, size - pos)
                self._fill(item, bytes(buf[pos : pos + take]))
                pos += take
                if item.left:
                    self._open = item
            pending.append(item)
            self._head_from = self._loop.time()
        del buf[:pos]
        if pending or self._for_good is not None:
            self._start()

    def _item(self, head: bytes, buffered: int) -> _Item | None:
        """What to do with the request of this head (``buffered``: the bytes in after it): serve
        it (a _Request), pass it to aiohttp (a _Passed), or (None) leave the connection to
        aiohttp from it on."""
        match = _HEAD.fullmatch(head)
        if match is None:
            return None
        method, target, minor, lines = match.groups()
        headers = lines.split(b"\r\n")[1:] if lines else []
        fields = _Fields()
        for line in headers:
            name, _, value = line.partition(b":")
            fields.add(name.lower(), value)
        if fields.for_good or fields.length is None:
            return None  # where the request ends (or what follows) is a parser's judgement
        length = fields.length
        # What aiohttp refuses or treats its own way (a request without Host, too many headers,
        # a header twice that may be there once, an Expect, a Content-Encoding) is its to answer.
        plain = minor == b"1" and fields.plain and fields.hosts == 1 and len(headers) <= MAX_HEADERS
        request = self._request(method, target, fields) if plain else None
        if (
            request is None
            or (length > buffered and not request.route.reads_body)
            or not self._admitted(request, fields.auth)
        ):
            # (A route that reads no body answers at once aiohttp's way, and skips the body.)
            return _Passed(head + b"\r\n\r\n", length)
        return request

    def _request(
        self, method_bytes: bytes, target_bytes: bytes, fields: _Fields
    ) -> _Request | None:
        """The request, if its method, target and length are ones the lane serves."""
        length = fields.length
        if length is None or length > self._lane.max_body:
            return None  # (aiohttp answers 413, drops the rest within its bounds, and closes)
        method = method_bytes.decode("ascii")
        path, _, query = target_bytes.decode("ascii").partition("?")
        found = _HOT.find(method, path)
        if found is None:
            return None
        params: dict[str, list[str]] = {}
        if query:
            if _QUERY.fullmatch(query) is None:
                return None
            for part in query.split("&"):
                name, _, value = part.partition("=")
                params.setdefault(name, []).append(value)
        hot, matched = found
        return _Request(hot, matched, params, fields, length, self)

    def _admitted(self, request: _Request, auth: list[str]) -> bool:
        """Whether the token lets the request through (a refusal is aiohttp's to answer, with
        the request's body, read or not, dealt with as aiohttp deals with it)."""
        tokens = self._lane.tokens
        if tokens is None:
            return True
        route = request.route
        try:
            check_route(tokens, auth, route.method, route.path)
        except WqError:
            return False
        return True

    def _flow(self) -> None:
        """Stop reading while too much is buffered or waiting; go on once it is not."""
        transport = self._transport
        if transport is None or self._closed:
            return
        held = len(self._buf) + (len(self._for_good) if self._for_good is not None else 0)
        if isinstance(self._open, _Passed) and not self._open.active:
            held += len(self._open.raw)
        stop = held > self._max_buffered or len(self._pending) >= MAX_PIPELINED
        if stop and not self._reading_paused:
            self._reading_paused = True
            transport.pause_reading()
        elif not stop and self._reading_paused:
            self._reading_paused = False
            transport.resume_reading()

    # -- answering -----------------------------------------------------------------------------

    def _start(self) -> None:
        if self._server is None:
            self._server = self._loop.create_task(self._serve())
        elif self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def _wake_body(self) -> None:
        if self._body_wait is not None and not self._body_wait.done():
            self._body_wait.set_result(None)

    async def _serve(self) -> None:
        """Answer the requests parsed, in order; then hand the connection over if it is to be."""
        pending = self._pending
        try:
            while not self._closed:
                if not pending:
                    if self._for_good is not None:
                        self._hand_over()
                        return
                    self._wake = self._loop.create_future()
                    try:
                        await self._wake
                    finally:
                        self._wake = None
                    continue
                item = pending[0]
                if isinstance(item, _Passed):
                    await self._pass(item)
                else:
                    await self._answer(item)
                pending.popleft()
                if self._stopping:
                    self._close()
                if self._closed:
                    return
                self._head_from = self._loop.time()  # (a head begun meanwhile: from now)
                if self._buf and self._open is None:
                    self._read()  # what waited behind the queue
                self._flow()
                self._watch()
        except ConnectionError:
            self._close()
        except Exception:  # (a bug: the connection ends, nobody else's request with it)
            log.exception("the fast lane failed on a connection; closing it")
            self._close()
        finally:
            self._server = None

    async def _pass(self, item: _Passed) -> None:
        """Have aiohttp answer the request (its bytes as they come), and wait until it has."""
        slow = self._slow_handler()
        self._slow_done = self._loop.create_future()
        item.active = True
        raw, item.raw = item.raw, bytearray()
        slow.data_received(bytes(raw))
        try:
            await self._slow_done
        finally:
            self._slow_done = None
        while item.left and not self._closed:  # the body aiohttp did not wait for
            await self._body_ready()

    def _slow_handler(self) -> SlowPath:
        slow = self._slow
        if slow is None:
            slow = self._slow = self._make_slow(self)
            slow.connection_made(self._transport)  # type: ignore[arg-type]
            if self._writing_paused:
                slow.pause_writing()
        return slow

    def slow_done(self) -> None:
        """aiohttp has answered the request passed to it (``server.Protocol`` says so)."""
        if self._slow_done is not None and not self._slow_done.done():
            self._slow_done.set_result(None)

    def _hand_over(self) -> None:
        """Give the connection to aiohttp for good, with the bytes it is to read from."""
        transport = self._transport
        rest, self._for_good = self._for_good or bytearray(), None
        if transport is None or self._closed:
            return
        slow = self._slow_handler()
        self._closed = True  # (nothing more of this connection is the lane's)
        self._connections.discard(self)
        self._deadline.cancel()
        slow.take_over(transport)
        if self._reading_paused:
            self._reading_paused = False
            transport.resume_reading()
        if rest:
            slow.data_received(bytes(rest))

    async def _body_ready(self) -> None:
        self._body_wait = self._loop.create_future()
        self._watch()
        try:
            await self._body_wait
        finally:
            self._body_wait = None

    async def _answer(self, request: _Request) -> None:
        lane = self._lane
        status = 500
        close = request.close
        counted = True
        try:
            try:
                if request.left:
                    request.head_at = self._head_from
                    while request.left:
                        await self._body_ready()
                status, body = await request.route.handler(lane.service, request)
                if body is not None or status == 204:  # (else: written by the handler)
                    await self._write(answer_bytes(status, body, close))
            except asyncio.CancelledError:
                counted = False  # (the client went away: aiohttp's way counts nothing either)
                raise
            except ConnectionError:
                raise
            except Exception as e:
                status, body, headers = self._failed(request, e)
                close = close or status == 408
                await self._write(answer_bytes(status, body, close, headers))
        finally:
            if counted:
                lane.metrics.count_answer(request.route.method, request.route.path, status)
        if close:
            self._close()

    def _failed(
        self, request: _Request, error: Exception
    ) -> tuple[int, bytes, tuple[tuple[str, str], ...]]:
        """The answer to an error: its status, body and the headers it calls for."""
        if isinstance(error, WqError):
            status, headers = error_parts(error)
            return status, render_error(error), headers
        if isinstance(error, RequestTimeout):
            return 408, error_body(error.message), ()
        route = request.route
        log.error("unexpected error in %s %s", route.method, route.path, exc_info=error)
        return 500, error_body("internal error"), ()

    async def _write(self, data: bytes) -> None:
        transport = self._transport
        if transport is None or self._closed or transport.is_closing():
            raise ConnectionResetError("the client went away")
        transport.write(data)
        if self._writing_paused:
            self._drain = self._loop.create_future()
            try:
                await self._drain
            finally:
                self._drain = None

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            self._deadline.cancel()
            if self._transport is not None:
                self._transport.close()

    def close_when_done(self) -> None:
        """Take no further request: close once the one being answered is (at once if none)."""
        self._stopping = True
        if not self._pending or self._server is None:
            self._close()

    async def shutdown(self, timeout: float | None) -> None:
        """The server stops: let the request being answered finish (within ``timeout``
        seconds), then close."""
        server = self._server
        if server is not None and self._pending:
            # (However the request ends: answered, failed, or cancelled by the connection's end.)
            await asyncio.wait([server], timeout=timeout)
        self._close()

    # -- time-outs -----------------------------------------------------------------------------

    def _watch(self) -> None:
        """Set when the connection times out, for what it waits for now: a request's head, the
        body of the request being answered, or (idle) the next request."""
        if self._closed:
            return
        if self._pending:
            front = self._pending[0]
            if self._body_wait is not None and isinstance(front, _Request):
                self._timeout = "body"
                self._deadline.set(front.head_at + self._lane.read_body_timeout)
            else:
                self._deadline.clear()  # busy: no time-out while a request is answered
        elif self._buf or self._for_good:
            self._timeout = "head"
            self._deadline.set(self._head_from + self._header_timeout)
        else:
            self._timeout = "idle"
            self._deadline.set(self._loop.time() + self._idle_timeout)

    def _time_out(self) -> None:
        """The deadline set has passed."""
        transport = self._transport
        if self._closed or transport is None:
            return
        if self._timeout == "body":
            if self._body_wait is not None and not self._body_wait.done():
                self._body_wait.set_exception(body_late(self._lane.read_body_timeout))
            return
        peer = transport.get_extra_info("peername")
        if self._timeout == "head":
            transport.write(header_timeout_answer(self._header_timeout))
            log.debug("closing the connection from %s: no request head in time", peer)
        else:
            log.debug("closing the idle connection from %s", peer)
        self._close()
