"""A TCP proxy that adds a fixed delay each way (a slow link between a broker and its database).

    python -m bench.delayproxy PORT TARGET_HOST:TARGET_PORT DELAY_MS

Listens on 127.0.0.1:PORT (0: any free port; the port is printed as one JSON line,
``{"port": N}``, once it listens) and forwards every connection to the target. Each chunk read is
written on the other side DELAY_MS after it arrived: chunks keep their order, and the reading
goes on while earlier chunks wait (a chunk is scheduled at arrival + delay, never after the one
before it is written), so the link's throughput is not cut, only its latency raised: a round trip
costs twice the delay more.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import sys
from typing import Final

CHUNK: Final = 256 * 1024


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    """Copy ``reader`` to ``writer``, each chunk ``delay`` seconds after it was read."""
    loop = asyncio.get_running_loop()
    queued: collections.deque[tuple[float, bytes]] = collections.deque()
    more = asyncio.Event()

    async def read() -> None:
        try:
            while chunk := await reader.read(CHUNK):
                queued.append((loop.time() + delay, chunk))
                more.set()
        except (ConnectionError, OSError):
            pass
        queued.append((loop.time() + delay, b""))  # the end, as late as the rest
        more.set()

    reading = asyncio.ensure_future(read())
    try:
        while True:
            while not queued:
                more.clear()
                await more.wait()
            due, chunk = queued.popleft()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if not chunk:
                with contextlib.suppress(OSError):
                    if writer.can_write_eof():
                        writer.write_eof()
                return
            writer.write(chunk)
            await writer.drain()
    except (ConnectionError, OSError):
        return
    finally:
        reading.cancel()


class DelayProxy:
    """The proxy in this event loop: ``await start()``, then connect to :attr:`port`."""

    def __init__(self, target: tuple[str, int], delay: float) -> None:
        self.target = target
        self.delay = delay
        self.port = 0
        self._server: asyncio.Server | None = None
        self._links: set[asyncio.Task[None]] = set()

    async def start(self, port: int = 0) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", port)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._links.add(task)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            self._links.discard(task)
            return
        try:
            await asyncio.gather(
                _pipe(reader, up_writer, self.delay), _pipe(up_reader, writer, self.delay)
            )
        finally:
            for w in (writer, up_writer):
                w.close()
            self._links.discard(task)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._links):
            task.cancel()
        await asyncio.gather(*self._links, return_exceptions=True)


async def main(port: int, target: str, delay_ms: float) -> None:
    host, _, target_port = target.rpartition(":")
    proxy = DelayProxy((host, int(target_port)), delay_ms / 1000)
    print(json.dumps({"port": await proxy.start(port)}), flush=True)
    await asyncio.Event().wait()  # until killed


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main(int(sys.argv[1]), sys.argv[2], float(sys.argv[3])))
