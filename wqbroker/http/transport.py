"""The HTTP transport's handling of request bodies: what a body may cost before a handler sees it
and after its answer.

- Nothing is ever inflated: a body with a ``Content-Encoding`` other than ``identity``, or a
  transfer-coding other than ``chunked``, gets 415 (the API never needs compressed bodies),
  before a byte of it is read.
- A body over the limit gets 413: from its Content-Length, before it is read; for a chunked one,
  once the limit is passed. The connection is closed after the answer.
- ``Expect: 100-continue`` is answered from the headers, so a client told 413 or 415 never sends
  the body; any other expectation gets 417.
- A body must arrive within the body time-out once a handler reads it (408 after it, and the
  connection is closed).
- A body nobody reads (an ack's, a 404's) is skipped if it ends within the limit and a second;
  otherwise the connection is closed.
- Before a connection is closed with a body still coming (after a 413, a 415, or a body that did
  not end within that skip), the rest of the body is read and dropped, for at most
  :data:`LINGER_SECONDS` and :data:`LINGER_BYTES`, and until nothing has come for
  :data:`LINGER_IDLE` (nginx's "lingering close", and its lingering time-out): a client that
  writes its whole body before it reads (Python's ``http.client``, ``requests``, ``urllib``) then
  reads the answer, where closing at once would reset the connection under it (the kernel
  answers a close with unread bytes, and every byte after it, with a reset, and the client's
  write fails before it reads). A client still sending past either bound is cut off: no request
  is drained without end (aiohttp's own draining is switched off, see ``server.py``), and what
  it costs is reading and dropping bytes, never keeping them. A broker that stops reads no more:
  it waits for a connection in its lingering close as for a request in hand, until the client
  goes away or the lingering time ends (at most the shutdown's grace).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from http import HTTPStatus
from typing import Final, cast

from aiohttp import HttpVersion11, web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.helpers import rfc822_formatted_time
from aiohttp.http import SERVER_SOFTWARE
from aiohttp.streams import StreamReader

from wqbroker import codec
from wqbroker.errors import PayloadTooLarge
from wqbroker.limits import DEFAULT_MAX_PAYLOAD

DEFAULT_MAX_BODY: Final = DEFAULT_MAX_PAYLOAD
DEFAULT_READ_BODY_TIMEOUT: Final = 30.0

# How long an unread body is skipped after the answer (at most the body limit's worth of it)
# for the connection to be kept.
SKIP_SECONDS: Final = 1.0
# A connection closed with a body still coming reads and drops the rest of it first (lingering
# close), for at most this many seconds from the answer and this many bytes, and until nothing
# has come for LINGER_IDLE seconds (a client that sends nothing more is not waited for); then
# it is closed (reset, if the client is still sending).
LINGER_SECONDS: Final = 5.0
LINGER_BYTES: Final = 64 << 20
LINGER_IDLE: Final = 1.0

_JSON: Final = "application/json"


# -- JSON answers -------------------------------------------------------------------------------

_SERVER: Final = f"Server: {SERVER_SOFTWARE}\r\n\r\n".encode()
_CLOSE_SERVER: Final = f"Server: {SERVER_SOFTWARE}\r\nConnection: close\r\n\r\n".encode()
_REASONS: Final = {200: "OK", 201: "Created", 204: "No Content"}


class Answer(web.Response):
    """An answer as the handlers make them (a JSON body, or none with 204), written in one piece:
    the same bytes aiohttp would send (status line; Content-Type and Content-Length with a body;
    Date; Server; Connection: close when the connection ends; ``test_http_edge`` compares them),
    without aiohttp's general path, which took about a tenth of the broker's CPU per request.
    Anything else (HTTP/1.0, HEAD, a status of another kind, a body other than bytes, a header a
    middleware added, a response hook, an aiohttp whose writer differs) goes aiohttp's way."""

    async def prepare(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        if (
            self._eof_sent
            or self._payload_writer is not None
            or request.version != HttpVersion11
            or request.method == "HEAD"
            or self._status not in _REASONS
            or len(self._headers) != (0 if self._status == 204 else 1)
            or (self._status == 204 and self._body is not None)
            or (
                self._status != 204
                and (self._headers.get("Content-Type") != _JSON or type(self._body) is not bytes)
            )
            or self._cookies
            or self._compression
            or self._chunked
            or not isinstance(request, web.Request)
            or request.app.on_response_prepare
            or not hasattr(request._payload_writer, "_write")
        ):
            return await super().prepare(request)
        keep_alive = self._keep_alive
        if keep_alive is None:
            keep_alive = request.keep_alive
        self._keep_alive = keep_alive
        writer = request._payload_writer
        body = cast(bytes | None, self._body)  # (bytes, or None with 204: checked above)
        # StreamWriter's own write: it counts the bytes, and refuses a closing transport.
        writer._write(answer_bytes(self._status, body, close=not keep_alive))
        self._eof_sent = True
        self._body_length = len(body or b"")
        await writer.drain()
        return None


def answer_bytes(
    status: int, body: bytes | None, close: bool, headers: tuple[tuple[str, str], ...] = ()
) -> bytes:
    """A JSON answer's bytes (None: 204, no body), as aiohttp writes them: the status line;
    Content-Type and Content-Length, then ``headers``; Date; Server; Connection: close when the
    connection ends. (``Answer`` writes the handlers' answers with it, the fast lane all its
    answers, errors included.)"""
    tail = _CLOSE_SERVER if close else _SERVER
    if body is None:
        return f"HTTP/1.1 204 No Content\r\nDate: {rfc822_formatted_time()}\r\n".encode() + tail
    reason = _REASONS.get(status) or HTTPStatus(status).phrase
    extra = "".join(f"{name}: {value}\r\n" for name, value in headers)
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: {_JSON}\r\n"
        f"Content-Length: {len(body)}\r\n{extra}Date: {rfc822_formatted_time()}\r\n"
    )
    return head.encode() + tail + body


def json_response(body: bytes, status: int = 200) -> web.Response:
    return Answer(body=body, status=status, content_type=_JSON)


def no_content() -> web.Response:
    """204, no body."""
    return Answer(status=204)


def error_body(message: str) -> bytes:
    return codec.dumps({"error": message})


def error_response(status: int, message: str) -> web.Response:
    return json_response(error_body(message), status)


def raw_answer(status: int, reason: str, message: str) -> bytes:
    """A whole JSON error answer that closes the connection, for when there is no request to
    answer (its head never arrived)."""
    body = error_body(message)
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def header_timeout_answer(timeout: float) -> bytes:
    """408 for a request whose line and headers did not arrive within ``timeout`` seconds."""
    ms = round(timeout * 1000)
    return raw_answer(
        408, "Request Timeout", f"request line and headers not received within {ms} ms"
    )


# -- bodies -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BodyRules:
    max_bytes: int = DEFAULT_MAX_BODY
    read_timeout: float = DEFAULT_READ_BODY_TIMEOUT  # seconds


BODY: Final = web.AppKey("body", BodyRules)


class RequestTimeout(Exception):
    """The request body did not arrive in time (answered 408; the connection is closed)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def _too_large(limit: int) -> str:
    return f"request body is larger than the limit of {limit} bytes"


def _codings(request: web.BaseRequest, header: str, plain: str) -> str | None:
    """The codings a header lists other than ``plain`` (as a short text for a message), or None
    if it lists none."""
    tokens = [
        token.strip()
        for value in request.headers.getall(header, [])
        for token in value.split(",")
        if token.strip()
    ]
    if all(token.lower() == plain for token in tokens):
        return None
    shown = ", ".join(tokens)
    return shown if len(shown) <= 40 and shown.isascii() and shown.isprintable() else "given"


def body_refusal(request: web.BaseRequest, rules: BodyRules) -> web.Response | None:
    """The answer to a request whose body is refused from its headers alone (415: compressed;
    413: Content-Length over the limit), or None."""
    if not request.body_exists:
        return None
    headers = request.headers
    if "Content-Encoding" in headers or "Transfer-Encoding" in headers:
        refusal = _coding_refusal(request)
        if refusal is not None:
            return refusal
    length = request.content_length
    if length is not None and length > rules.max_bytes:
        return error_response(413, _too_large(rules.max_bytes))
    return None


def _coding_refusal(request: web.BaseRequest) -> web.Response | None:
    """415 for a body sent compressed (or in a transfer-coding other than chunked), or None."""
    encoding = _codings(request, "Content-Encoding", "identity")
    transfer = _codings(request, "Transfer-Encoding", "chunked")
    if encoding is not None or transfer is not None:
        if encoding is not None:
            problem = f"Content-Encoding {encoding} is not supported"
        else:
            problem = f"Transfer-Encoding {transfer} is not supported (only chunked is)"
        response = error_response(415, f"{problem}: send the request body uncompressed")
        response.headers["Accept-Encoding"] = "identity"
        return response
    return None


async def read_body(request: web.Request) -> bytes:
    """The whole request body: at most the limit (else PayloadTooLarge), within the body time-out
    (else RequestTimeout)."""
    rules = request.app[BODY]
    try:
        if request.content.is_eof():  # all of it is here already (a small body, usually)
            return await request.read()
        async with asyncio.timeout(rules.read_timeout):
            return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(_too_large(rules.max_bytes)) from None
    except TimeoutError:
        raise body_late(rules.read_timeout) from None


def body_late(read_timeout: float) -> RequestTimeout:
    """The refusal of a body that did not arrive within ``read_timeout`` seconds."""
    return RequestTimeout(f"request body not received within {round(read_timeout * 1000)} ms")


async def _skip(payload: StreamReader, budget: int, until: float, idle: float) -> bool:
    """Read and drop up to ``budget`` bytes of an unread body, until ``until`` (the loop's time)
    or until nothing has come for ``idle`` seconds; True if the body ended."""
    loop = asyncio.get_running_loop()
    try:
        while budget >= 0 and not payload.is_eof():
            async with asyncio.timeout_at(min(until, loop.time() + idle)):
                chunk = await payload.readany()
            if not chunk:
                break
            budget -= len(chunk)
    except Exception:  # a body that ends badly (reset, malformed), or in time, ends the skipping
        pass
    return payload.is_eof()


# An answer with one of these statuses closes the connection when the body was not read to its
# end; the value says whether to read and drop the rest first, within the lingering bounds (so a
# client that sends its whole body before it reads gets the answer rather than a reset), or not
# (it will not come, or too slowly).
_CLOSING: Final = {413: True, 415: True, 408: False, 417: False}


async def finish_body(
    request: web.Request, response: web.StreamResponse, max_bytes: int | None = None
) -> web.StreamResponse:
    """After the answer to a request whose body was not read to its end: send the answer, then
    skip the rest of the body if it is small (the connection is kept), or else read and drop it
    within the lingering bounds and have aiohttp close the connection (it closes one whose answer
    says so, or whose body is unfinished: it is run with ``lingering_time=0``). ``max_bytes``:
    what "small" is, for a request that never reached the application (else its body limit)."""
    linger = _CLOSING.get(response.status, True)
    if response.status in _CLOSING:
        response.force_close()
    if not response.prepared:
        await response.prepare(request)
        await response.write_eof()
    if not linger:
        return response
    payload = request.content
    now = asyncio.get_running_loop().time()
    if response.keep_alive:
        small = request.app[BODY].max_bytes if max_bytes is None else max_bytes
        if await _skip(payload, small, now + SKIP_SECONDS, SKIP_SECONDS):
            return response  # (the connection is kept)
        response.force_close()  # (closed after the answer already sent, as ever)
    await _skip(payload, LINGER_BYTES, now + LINGER_SECONDS, LINGER_IDLE)
    return response


async def expect_continue(request: web.Request) -> web.StreamResponse | None:
    """Every route's ``Expect`` handler: ``100 Continue`` only for a body that will be accepted, so
    a refused body is never sent; JSON 417 for any other expectation. The connection is closed
    after a refusal (the body the headers announced is never read)."""
    if request.version != HttpVersion11:
        return None
    refusal: web.Response | None
    if request.headers.get("Expect", "").strip().lower() != "100-continue":
        refusal = error_response(417, "the Expect header supports only 100-continue")
    else:
        refusal = body_refusal(request, request.app[BODY])
    if refusal is not None:
        refusal.force_close()
        return refusal
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0  # the answer proper has not started
    return None
