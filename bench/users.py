"""The library as users write it: producer and consumer processes using wqclient's public API,
and the same workload through other brokers' Python clients, for comparison.

    python -m bench.users produce URL MODE N CONCURRENCY
    python -m bench.users consume URL MODE N CONCURRENCY

URL is the broker (``http://...`` or ``grpc://...``). Producer MODEs:

- ``one``: ``await wq.enqueue(payload)``, CONCURRENCY calls in flight (tasks one per call);
- ``many``: ``await wq.enqueue_many(100 payloads)``, CONCURRENCY calls in flight.

Consumer MODEs:

- ``worker``: ``Worker(url, handler, concurrency=CONCURRENCY).run()``;
- ``stream``: ``async for d in stream: await stream.ack(d)`` (``prefetch=CONCURRENCY``).

The peers (``URL`` is theirs; MODE is ignored but by NATS):

- ``rabbit-produce`` / ``rabbit-consume``: :mod:`bench.rabbit`'s (aio-pika, publisher confirms
  awaited per message, manual acks, prefetch CONCURRENCY);
- ``nats-produce`` / ``nats-consume``: nats-py JetStream, each PubAck awaited, a pull consumer
  fetching up to CONCURRENCY, an ack per message; MODE is the stream's storage, ``file`` (the
  default) or ``memory``;
- ``beanstalk-produce`` / ``beanstalk-consume``: greenstalk (a blocking client: CONCURRENCY
  threads, each with its own connection), put / reserve + delete.

Each prints one JSON line: ``{"first", "last", "n"}`` (``time.time()``, so processes compare).

    python -m bench.users latency URL - N GAP_MS

A lone task's latency as a user sees it: ``await wq.enqueue(...)`` of one task at a time (each
carrying the time it was sent), every GAP_MS, to a ``Worker`` in the same process that is
waiting for it; the time from the call to the handler's start. Prints ``{"n", "p50_ms",
"p99_ms"}``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

from bench import rabbit
from bench.load import PAYLOAD, _loop_policy

BATCH = 100
_QUEUE = "wqbench"  # the peers' queue (stream, tube); the caller may name another


# -- wqclient --------------------------------------------------------------------------------------


async def produce(url: str, mode: str, n: int, concurrency: int) -> dict[str, Any]:
    from wqclient import AsyncClient

    async with AsyncClient(url) as wq:
        # Connected before the clock starts, as the peers' producers are (their connect, and
        # NATS' stream or RabbitMQ's channel, come first).
        await wq.stats()
        first = time.time()
        if mode == "one":
            counter = iter(range(n))

            async def one() -> None:
                for _ in counter:
                    await wq.enqueue(PAYLOAD)

            await asyncio.gather(*(one() for _ in range(concurrency)))
        elif mode == "many":
            starts = iter(range(0, n, BATCH))

            async def many() -> None:
                for start in starts:
                    await wq.enqueue_many([PAYLOAD] * min(BATCH, n - start))

            await asyncio.gather(*(many() for _ in range(concurrency)))
        else:
            raise SystemExit(f"unknown producer mode {mode!r}")
        last = time.time()  # (before the client closes, as the peers' producers take theirs)
    return {"first": first, "last": last, "n": n}


async def consume(url: str, mode: str, n: int, concurrency: int) -> dict[str, Any]:
    from wqclient import AsyncClient, Task, Worker

    done = 0
    last = 0.0
    if mode == "worker":
        worker: Worker | None = None

        async def handler(_task: Task) -> None:
            nonlocal done, last
            done += 1
            last = time.time()
            if done >= n and worker is not None:
                worker.stop()

        worker = Worker(url, handler, concurrency=concurrency)
        await worker.run()
    elif mode == "stream":
        async with AsyncClient(url) as wq:
            stream = await wq.stream(prefetch=concurrency)
            async for d in stream:
                await stream.ack(d)
                done += 1
                last = time.time()
                if done >= n:
                    break
            await stream.close()
    else:
        raise SystemExit(f"unknown consumer mode {mode!r}")
    return {"last": last, "n": done}


async def latency(url: str, n: int, gap_ms: float) -> dict[str, Any]:
    from wqclient import AsyncClient, Task, Worker

    samples: list[float] = []
    started = asyncio.Event()

    async def handler(task: Task) -> None:
        samples.append(time.time() - task.payload["sent"])
        started.set()

    worker = Worker(url, handler, concurrency=1)
    running = asyncio.ensure_future(worker.run())
    async with AsyncClient(url) as wq:
        await wq.stats()  # connected
        await asyncio.sleep(0.5)  # the worker waiting
        for _ in range(n):
            started.clear()
            await wq.enqueue({"sent": time.time()})
            await asyncio.wait_for(started.wait(), 10)
            await asyncio.sleep(gap_ms / 1000)
    worker.stop()
    await running
    samples.sort()
    return {
        "n": len(samples),
        "p50_ms": samples[len(samples) // 2] * 1000,
        "p99_ms": samples[min(len(samples) - 1, int(len(samples) * 0.99))] * 1000,
    }


# -- NATS JetStream (nats-py) ----------------------------------------------------------------------


async def _nats_stream(js: Any, storage: str) -> None:
    """The stream, in files (JetStream's default) or in memory (as wq's memory store,
    RabbitMQ's non-durable queue and beanstalkd without a binlog keep theirs)."""
    from nats.js.api import StorageType

    kind = StorageType.MEMORY if storage == "memory" else StorageType.FILE
    await js.add_stream(name=_QUEUE, subjects=[_QUEUE], storage=kind)


async def nats_produce(url: str, storage: str, n: int, concurrency: int) -> dict[str, Any]:
    import nats

    nc = await nats.connect(url)
    js = nc.jetstream()
    await _nats_stream(js, storage)
    counter = iter(range(n))
    first = time.time()

    async def publish() -> None:
        for _ in counter:
            await js.publish(_QUEUE, PAYLOAD)  # awaits the PubAck

    await asyncio.gather(*(publish() for _ in range(concurrency)))
    last = time.time()
    await nc.close()
    return {"first": first, "last": last, "n": n}


async def nats_consume(url: str, storage: str, n: int, batch: int) -> dict[str, Any]:
    import nats
    from nats.errors import TimeoutError as NatsTimeout

    nc = await nats.connect(url)
    js = nc.jetstream()
    await _nats_stream(js, storage)
    sub = await js.pull_subscribe(_QUEUE, durable="bench")
    done = 0
    last = 0.0
    while done < n:
        try:
            messages = await sub.fetch(batch, timeout=1)
        except NatsTimeout:
            continue
        for message in messages:
            await message.ack()
            done += 1
            last = time.time()
    await js.delete_stream(_QUEUE)
    await nc.close()
    return {"last": last, "n": done}


# -- beanstalkd (greenstalk) -----------------------------------------------------------------------


def _beanstalk_address(url: str) -> tuple[str, int]:
    host, _, port = url.removeprefix("beanstalk://").partition(":")
    return host, int(port)


def _threads(concurrency: int, work: Callable[[], None]) -> None:
    threads = [threading.Thread(target=work) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def beanstalk_produce(url: str, n: int, concurrency: int) -> dict[str, Any]:
    import greenstalk

    address = _beanstalk_address(url)
    counter = iter(range(n))
    lock = threading.Lock()
    first = time.time()

    def put() -> None:
        with greenstalk.Client(address, use=_QUEUE) as client:
            while True:
                with lock:
                    if next(counter, None) is None:
                        return
                client.put(PAYLOAD.decode())

    _threads(concurrency, put)
    return {"first": first, "last": time.time(), "n": n}


def beanstalk_consume(url: str, n: int, concurrency: int) -> dict[str, Any]:
    import greenstalk

    address = _beanstalk_address(url)
    lock = threading.Lock()
    state = {"done": 0, "last": 0.0}

    def reserve() -> None:
        with greenstalk.Client(address, watch=_QUEUE) as client:
            while True:
                with lock:
                    if state["done"] >= n:
                        return
                try:
                    job = client.reserve(timeout=1)
                except greenstalk.TimedOutError:
                    continue
                client.delete(job)
                with lock:
                    state["done"] += 1
                    state["last"] = time.time()

    _threads(concurrency, reserve)
    return {"last": state["last"], "n": int(state["done"])}


def main(argv: list[str]) -> None:
    role, url, mode, n, k = argv[0], argv[1], argv[2], int(argv[3]), int(argv[4])
    global _QUEUE
    if len(argv) > 5:
        _QUEUE = argv[5]
    runs: dict[str, Callable[[], Coroutine[Any, Any, dict[str, Any]]]] = {
        "produce": lambda: produce(url, mode, n, k),
        "consume": lambda: consume(url, mode, n, k),
        "latency": lambda: latency(url, n, k),
        "rabbit-produce": lambda: rabbit.produce(url, _QUEUE, n, k),
        "rabbit-consume": lambda: rabbit.consume(url, _QUEUE, n, k),
        "nats-produce": lambda: nats_produce(url, mode, n, k),
        "nats-consume": lambda: nats_consume(url, mode, n, k),
    }
    if role == "beanstalk-produce":
        result = beanstalk_produce(url, n, k)
    elif role == "beanstalk-consume":
        result = beanstalk_consume(url, n, k)
    elif role in runs:
        _loop_policy()
        result = asyncio.run(runs[role]())
    else:
        raise SystemExit(f"unknown role {role!r}")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
