"""Load generators, each run in a process of its own by the benchmark.

    python -m bench.load produce URL MODE N CONCURRENCY
    python -m bench.load consume URL MODE N CONCURRENCY
    python -m bench.load latency URL MODE N GAP_MS [DELAY_MS]

MODE is ``http`` (one task per request: POST /jobs, GET /jobs/next, POST ack), ``unary`` (gRPC
Enqueue, NextJob, Ack) or ``stream`` (gRPC EnqueueBatch, StreamJobs with batched acks). Each prints
one JSON line with its figures; times are ``time.time()`` so processes can be compared.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

import aiohttp

PAYLOAD = b'{"line":"benchmark task","pad":"' + b"x" * 40 + b'"}'
BATCH = 500


def _loop_policy() -> None:
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:  # pragma: no cover - uvloop is a dependency
        pass


# -- producers ------------------------------------------------------------------------------------


async def produce_http(url: str, n: int, concurrency: int) -> dict[str, Any]:
    body = b'{"payload":' + PAYLOAD + b"}"
    counter = iter(range(n))
    first = time.time()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def post() -> None:
            for _ in counter:
                async with session.post(url + "/jobs", data=body) as resp:
                    assert resp.status == 201, resp.status
                    await resp.read()

        await asyncio.gather(*(post() for _ in range(concurrency)))
    return {"first": first, "last": time.time(), "n": n}


async def produce_grpc(target: str, n: int, concurrency: int, batch: bool) -> dict[str, Any]:
    import grpc

    from wqwire.pb import broker_pb2 as pb
    from wqwire.pb import broker_pb2_grpc as pb_grpc

    first = time.time()
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.BrokerStub(channel)
        if batch:
            full_batch = pb.EnqueueBatchRequest(
                tasks=[pb.EnqueueRequest(payload=PAYLOAD) for _ in range(BATCH)]
            )
            batches = iter(range(0, n, BATCH))

            async def send_batches() -> None:
                for start in batches:
                    size = min(BATCH, n - start)
                    req = (
                        full_batch
                        if size == BATCH
                        else pb.EnqueueBatchRequest(
                            tasks=[pb.EnqueueRequest(payload=PAYLOAD) for _ in range(size)]
                        )
                    )
                    await stub.EnqueueBatch(req)

            await asyncio.gather(*(send_batches() for _ in range(min(concurrency, 4))))
        else:
            counter = iter(range(n))
            request = pb.EnqueueRequest(payload=PAYLOAD)

            async def send() -> None:
                for _ in counter:
                    await stub.Enqueue(request)

            await asyncio.gather(*(send() for _ in range(concurrency)))
    return {"first": first, "last": time.time(), "n": n}


# -- consumers ------------------------------------------------------------------------------------


Step = Callable[[], Awaitable[int]]


async def until_done(n: int, concurrency: int, make_step: Callable[[], Step]) -> dict[str, Any]:
    """Run ``concurrency`` loops, each repeating its own step (which returns how many tasks it
    finished), until ``n`` are done; report when the last one finished."""
    done = 0
    finished = asyncio.Event()

    async def loop() -> None:
        nonlocal done
        step = make_step()
        while not finished.is_set():
            count = await step()  # not `done += await ...`: that would race the other loops
            done += count
            if done >= n:
                finished.set()

    workers = [asyncio.ensure_future(loop()) for _ in range(concurrency)]
    await finished.wait()
    last = time.time()
    for w in workers:
        w.cancel()
    await asyncio.gather(*workers, return_exceptions=True)
    return {"last": last, "n": done}


async def consume_http(url: str, n: int, concurrency: int) -> dict[str, Any]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        def make_step() -> Step:
            async def step() -> int:
                async with session.get(url + "/jobs/next?wait_ms=1000") as resp:
                    if resp.status == 204:
                        return 0
                    body = json.loads(await resp.read())
                ack = f"{url}/jobs/{body['task']['id']}/ack?lease_id={body['lease_id']}"
                async with session.post(ack) as resp:
                    assert resp.status == 204, resp.status
                return 1

            return step

        return await until_done(n, concurrency, make_step)


async def consume_unary(target: str, n: int, concurrency: int) -> dict[str, Any]:
    import grpc

    from wqwire.pb import broker_pb2 as pb
    from wqwire.pb import broker_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.BrokerStub(channel)
        request = pb.NextJobRequest(wait_ms=1000)

        def make_step() -> Step:
            async def step() -> int:
                response = await stub.NextJob(request)
                if not response.HasField("delivery"):
                    return 0
                d = response.delivery
                await stub.Ack(pb.AckRequest(id=d.task.id, lease_id=d.lease_id))
                return 1

            return step

        return await until_done(n, concurrency, make_step)


async def consume_unary_piggyback(target: str, n: int, concurrency: int) -> dict[str, Any]:
    """NextJob carrying the ack of the previous task: one call per task (and a last Ack)."""
    import grpc

    from wqwire.pb import broker_pb2 as pb
    from wqwire.pb import broker_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.BrokerStub(channel)
        left = n  # tasks not yet claimed by any loop

        def make_step() -> Step:
            pending: list[Any] = []

            async def step() -> int:
                nonlocal pending, left
                response = await stub.NextJob(pb.NextJobRequest(wait_ms=1000, acks=pending))
                finished = len(response.settled)
                pending = []
                if response.HasField("delivery"):
                    d = response.delivery
                    ack = pb.AckRequest(id=d.task.id, lease_id=d.lease_id)
                    left -= 1
                    if left <= 0:  # nothing more will come to carry it: ack it now
                        await stub.Ack(ack)
                        finished += 1
                    else:
                        pending = [ack]
                return finished

            return step

        return await until_done(n, concurrency, make_step)


async def consume_stream(target: str, n: int, prefetch: int) -> dict[str, Any]:
    import grpc

    from wqwire.pb import broker_pb2 as pb
    from wqwire.pb import broker_pb2_grpc as pb_grpc

    done = 0
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.BrokerStub(channel)
        call = stub.StreamJobs(None)
        await call.write(pb.StreamJobsRequest(open=pb.StreamOpen(prefetch=prefetch)))
        eof: object = grpc.aio.EOF  # type: ignore[attr-defined]  # not in grpc-stubs
        while done < n:
            read = await call.read()
            if read is eof:
                break
            response = cast(pb.StreamJobsResponse, read)
            if response.deliveries:
                # Ack everything this response brought, in one request.
                acks = [
                    pb.AckRequest(id=d.task.id, lease_id=d.lease_id) for d in response.deliveries
                ]
                await call.write(pb.StreamJobsRequest(acks=acks))
                done += len(acks)
        last = time.time()
        await call.write(pb.StreamJobsRequest(drain=True))
        await call.done_writing()
        call.cancel()
    return {"last": last, "n": done}


# -- latency --------------------------------------------------------------------------------------


async def latency(url: str, mode: str, n: int, gap_ms: float, delay_ms: int) -> dict[str, Any]:
    """Enqueue one task every gap_ms (each carrying its due time) while a parked consumer in this
    same process takes them; report how late each arrived after it was due."""
    import grpc  # noqa: F401 - imported up front in either mode, as the figures were taken

    from wqwire.pb import broker_pb2 as pb  # noqa: F401
    from wqwire.pb import broker_pb2_grpc as pb_grpc  # noqa: F401

    samples: list[float] = []
    async with aiohttp.ClientSession() as session:
        if mode == "http":
            await _latency_http(session, url, n, gap_ms, delay_ms, samples)
        else:
            await _latency_stream(url, n, gap_ms, delay_ms, samples)
    samples.sort()
    return {
        "n": len(samples),
        "p50_ms": samples[len(samples) // 2] * 1000,
        "p99_ms": samples[min(len(samples) - 1, int(len(samples) * 0.99))] * 1000,
    }


async def _latency_http(
    session: aiohttp.ClientSession,
    base: str,
    n: int,
    gap_ms: float,
    delay_ms: int,
    samples: list[float],
) -> None:
    got = asyncio.Event()

    async def receive() -> None:
        while len(samples) < n:
            async with session.get(base + "/jobs/next?wait_ms=5000") as resp:
                if resp.status == 204:
                    continue
                raw = await resp.read()
            now = time.time()
            body = json.loads(raw)
            samples.append(now - body["task"]["payload"]["due"])
            got.set()
            ack = f"{base}/jobs/{body['task']['id']}/ack?lease_id={body['lease_id']}"
            async with session.post(ack) as r:
                await r.read()

    async def send(due: float) -> None:
        body = {"payload": {"due": due}, "delay_ms": delay_ms}
        async with session.post(base + "/jobs", json=body) as resp:
            await resp.read()

    receiver = asyncio.ensure_future(receive())
    await asyncio.sleep(0.3)  # let the consumer park
    for _ in range(n):
        got.clear()
        now = time.time()
        await send(now + delay_ms / 1000.0)
        await asyncio.wait_for(got.wait(), 10 + delay_ms / 1000.0)
        await asyncio.sleep(gap_ms / 1000.0)
    await receiver


async def _latency_stream(
    url: str, n: int, gap_ms: float, delay_ms: int, samples: list[float]
) -> None:
    import grpc

    from wqwire.pb import broker_pb2 as pb
    from wqwire.pb import broker_pb2_grpc as pb_grpc

    got = asyncio.Event()
    async with grpc.aio.insecure_channel(url) as channel:
        stub = pb_grpc.BrokerStub(channel)
        call = stub.StreamJobs(None)
        await call.write(pb.StreamJobsRequest(open=pb.StreamOpen(prefetch=1)))
        await call.read()  # the open acknowledgement

        async def receive_stream() -> None:
            while len(samples) < n:
                read = await call.read()
                now = time.time()
                response = cast(pb.StreamJobsResponse, read)
                for d in response.deliveries:
                    samples.append(now - json.loads(d.task.payload)["due"])
                    got.set()
                    await call.write(
                        pb.StreamJobsRequest(
                            acks=[pb.AckRequest(id=d.task.id, lease_id=d.lease_id)]
                        )
                    )

        receiver = asyncio.ensure_future(receive_stream())
        for _ in range(n):
            got.clear()
            now = time.time()
            due = now + delay_ms / 1000.0
            payload = json.dumps({"due": due}).encode()
            await stub.Enqueue(pb.EnqueueRequest(payload=payload, delay_ms=delay_ms))
            await asyncio.wait_for(got.wait(), 10 + delay_ms / 1000.0)
            await asyncio.sleep(gap_ms / 1000.0)
        await receiver
        call.cancel()


def main(argv: list[str]) -> None:
    _loop_policy()
    role, url, mode = argv[0], argv[1], argv[2]
    n = int(argv[3])
    if role == "produce":
        concurrency = int(argv[4])
        if mode == "http":
            result = asyncio.run(produce_http(url, n, concurrency))
        else:
            batch = mode in ("stream", "unary-batched")
            result = asyncio.run(produce_grpc(url, n, concurrency, batch=batch))
    elif role == "consume":
        concurrency = int(argv[4])
        if mode == "http":
            result = asyncio.run(consume_http(url, n, concurrency))
        elif mode == "unary":
            result = asyncio.run(consume_unary(url, n, concurrency))
        elif mode == "unary-batched":
            result = asyncio.run(consume_unary_piggyback(url, n, concurrency))
        else:
            result = asyncio.run(consume_stream(url, n, concurrency))
    elif role == "latency":
        gap = float(argv[4])
        delay = int(argv[5]) if len(argv) > 5 else 0
        result = asyncio.run(latency(url, mode, n, gap, delay))
    else:
        raise SystemExit(f"unknown role {role}")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
