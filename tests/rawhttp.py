"""HTTP/1.1 over a bare socket, for the tests that must send what no HTTP client library will:
malformed request lines, forbidden header bytes, bodies that never finish, headers one byte at a
time, ``Expect: 100-continue`` with no body behind it.

:class:`RawConnection` writes bytes and reads answers (status, headers, body by Content-Length),
each read bounded by a time-out so a broker that hangs fails the test instead of stalling it.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

READ_TIMEOUT = 10.0


@dataclass
class RawResponse:
    status: int
    reason: str
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    version: str = "HTTP/1.1"

    def header(self, name: str) -> str | None:
        """The last value of a header (case-insensitive), or None."""
        found = None
        for key, value in self.headers:
            if key.lower() == name.lower():
                found = value
        return found

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def closes(self) -> bool:
        """The answer says the server will close the connection after it (HTTP/1.0: unless it
        says keep-alive)."""
        connection = (self.header("Connection") or "").lower()
        return connection == "close" or (self.version == "HTTP/1.0" and connection != "keep-alive")


class RawConnection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def response(self, *, head: bool = False, timeout: float = READ_TIMEOUT) -> RawResponse:
        """The next answer; interim (1xx) answers are returned too. ``head``: an answer to HEAD,
        which has no body whatever its Content-Length says."""
        return await asyncio.wait_for(self._response(head), timeout)

    async def _response(self, head: bool) -> RawResponse:
        status_line = await self.reader.readuntil(b"\r\n")
        version, status, reason = status_line.decode("latin-1").rstrip("\r\n").split(" ", 2)
        assert version.startswith("HTTP/1."), status_line
        response = RawResponse(int(status), reason, version=version)
        while True:
            line = await self.reader.readuntil(b"\r\n")
            if line == b"\r\n":
                break
            name, _, value = line.decode("latin-1").partition(":")
            response.headers.append((name.strip(), value.strip()))
        length = response.header("Content-Length")
        if not head and length is not None and response.status >= 200:
            response.body = await self.reader.readexactly(int(length))
        return response

    async def closed(self, timeout: float = READ_TIMEOUT) -> bool:
        """Wait for the server to close the connection (True), reading and dropping anything it
        still sends; False if it is still open after ``timeout`` seconds."""
        try:
            async with asyncio.timeout(timeout):
                while await self.reader.read(65536):
                    pass
        except TimeoutError:
            return False
        except ConnectionError:
            pass
        return True

    async def close(self) -> None:
        self.writer.close()
        with suppress(ConnectionError):
            await self.writer.wait_closed()


@asynccontextmanager
async def raw_connection(address: str) -> AsyncIterator[RawConnection]:
    """A connection to ``host:port`` (as in ``Broker.http_addresses``)."""
    host, _, port = address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    connection = RawConnection(reader, writer)
    try:
        yield connection
    finally:
        await connection.close()


async def exchange(address: str, data: bytes, *, head: bool = False) -> RawResponse:
    """Send ``data`` on a new connection and read one answer."""
    async with raw_connection(address) as connection:
        await connection.send(data)
        return await connection.response(head=head)


def _parse(data: bytes) -> RawResponse:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    version, status, reason = lines[0].split(" ", 2)
    response = RawResponse(int(status), reason, version=version)
    for line in lines[1:]:
        name, _, value = line.partition(":")
        response.headers.append((name.strip(), value.strip()))
    length = response.header("Content-Length")
    response.body = body[: int(length)] if length is not None else body
    return response


@dataclass
class Upload:
    response: RawResponse
    sent: int  # body bytes sent before the server closed the connection (or all of them)
    closed: bool  # the server closed the connection after its answer


def _stubborn_upload(address: str, head: bytes, chunks: Iterable[bytes]) -> Upload:
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=READ_TIMEOUT) as sock:
        sent = 0
        try:
            sock.sendall(head)
            for chunk in chunks:
                sock.sendall(chunk)
                sent += len(chunk)
        except TimeoutError:
            raise
        except OSError:  # the server closed the connection (a reset, while we were sending)
            pass
        received = b""
        closed = True
        try:
            while data := sock.recv(65536):
                received += data
        except TimeoutError:
            closed = False
        except OSError:  # the reset; what arrived before it was still read
            pass
    return Upload(_parse(received), sent, closed)


async def stubborn_upload(address: str, head: bytes, chunks: Iterable[bytes]) -> Upload:
    """Send ``head`` and then every chunk without reading, as a client that sends its whole body
    before it reads (urllib, requests) does, until done or the server closes; then read the answer
    and wait for the connection to end."""
    return await asyncio.to_thread(_stubborn_upload, address, head, chunks)


def request(
    method: str,
    target: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> bytes:
    """A well-formed HTTP/1.1 request (Content-Length set from the body unless given)."""
    lines = [f"{method} {target} HTTP/1.1", "Host: wq"]
    fields = dict(headers or {})
    if body is not None and not any(k.lower() == "content-length" for k in fields):
        fields["Content-Length"] = str(len(body))
    lines += [f"{name}: {value}" for name, value in fields.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")
