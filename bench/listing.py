"""Listing a queue's tasks a page at a time (GET /jobs, gRPC ListTasks), with many tasks in it:
the cost of a page should not grow with the queue (O(limit + log n)).

    python -m bench.listing fill GRPC_TARGET N STATE   # N tasks: ready, or delayed (not timed)
    python -m bench.listing pages GRPC_TARGET STATE LIMIT

``fill`` enqueues N tasks in batches (``delayed``: each due in an hour and a bit more, so they
are ordered by due time). ``pages`` reads the whole listing page after page of LIMIT, timing each
call; it prints one JSON line: ``{"pages", "tasks", "first_ms", "median_ms", "p99_ms",
"last_ms"}`` (the first page, the median and 99th percentile of all, the last one: the pages at
the end of a long queue cost what those at its head cost if the cursor is a position).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from typing import Any

from bench.load import _loop_policy

BATCH = 1000


async def fill(target: str, n: int, state: str) -> dict[str, Any]:
    import grpc

    from wqwire.pb import broker_pb2 as pb
    from wqwire.pb import broker_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.BrokerStub(channel)
        starts = iter(range(0, n, BATCH))

        async def batches() -> None:
            for start in starts:
                tasks = [
                    pb.EnqueueRequest(
                        payload=b'{"n": %d}' % i,
                        delay_ms=3_600_000 + i if state == "delayed" else None,
                    )
                    for i in range(start, min(n, start + BATCH))
                ]
                await stub.EnqueueBatch(pb.EnqueueBatchRequest(tasks=tasks))

        await asyncio.gather(*(batches() for _ in range(4)))
    return {"n": n}


async def pages(target: str, state: str, limit: int) -> dict[str, Any]:
    import grpc

    from wqwire.pb import broker_pb2 as pb
    from wqwire.pb import broker_pb2_grpc as pb_grpc

    times: list[float] = []
    tasks = 0
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.BrokerStub(channel)
        cursor = ""
        while True:
            started = time.perf_counter()
            page = await stub.ListTasks(
                pb.ListTasksRequest(state=state, limit=limit, cursor=cursor)
            )
            times.append((time.perf_counter() - started) * 1000)
            tasks += len(page.tasks)
            if not page.next_cursor:
                break
            cursor = page.next_cursor
    ordered = sorted(times)
    return {
        "pages": len(times),
        "tasks": tasks,
        "first_ms": times[0],
        "median_ms": statistics.median(times),
        "p99_ms": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
        "last_ms": times[-1],
    }


def main(argv: list[str]) -> None:
    _loop_policy()
    what = argv[0]
    if what == "fill":
        result = asyncio.run(fill(argv[1], int(argv[2]), argv[3]))
    elif what == "pages":
        result = asyncio.run(pages(argv[1], argv[2], int(argv[3])))
    else:
        raise SystemExit(f"unknown measurement {what}")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
