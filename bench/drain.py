"""Draining a backlog: one ``Worker`` (wqclient's public runner, a handler that returns at once)
working through tasks that are all ready before it starts.

    python -m bench.drain fill URL N          # N ready tasks, by enqueue_many (not timed)
    python -m bench.drain run URL N CONCURRENCY

``run`` starts ``Worker(URL, handler, concurrency=CONCURRENCY)`` and times it from ``run()`` to
the moment the broker's ``acked`` total (``GET /stats``: read only once the handler has seen N
tasks, so the polling costs the broker nothing while the worker drains) says all N are acked.
URL is ``grpc://...`` (one stream) or ``http://...`` (batch claims), the Worker's prefetch left to
follow its handlers. Each prints one JSON line: ``{"n", "seconds", "rate"}`` for ``run``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

from bench.load import PAYLOAD, _loop_policy

FILL_BATCH = 1000


async def fill(url: str, n: int) -> dict[str, Any]:
    from wqclient import AsyncClient

    async with AsyncClient(url) as wq:
        base = (await wq.stats()).ready

        async def batches(starts: Any) -> None:
            for start in starts:
                await wq.enqueue_many([PAYLOAD] * min(FILL_BATCH, n - start))

        starts = iter(range(0, n, FILL_BATCH))
        await asyncio.gather(*(batches(starts) for _ in range(4)))
        ready = (await wq.stats()).ready
    return {"n": n, "ready": ready, "before": base}


async def run(url: str, n: int, concurrency: int) -> dict[str, Any]:
    from wqclient import AsyncClient, Task, Worker

    async with AsyncClient(url) as watcher:
        base = (await watcher.stats()).totals.acked
        seen = 0
        all_seen = asyncio.Event()

        async def handler(_task: Task) -> None:
            nonlocal seen
            seen += 1
            if seen >= n:
                all_seen.set()

        worker = Worker(url, handler, concurrency=concurrency)
        started = time.perf_counter()
        running = asyncio.ensure_future(worker.run())
        await all_seen.wait()
        while (await watcher.stats()).totals.acked - base < n:  # noqa: ASYNC110 - the broker
            await asyncio.sleep(0.002)
        seconds = time.perf_counter() - started
        worker.stop()
        await running
    return {"n": n, "seconds": seconds, "rate": n / seconds, "handled": seen}


def main(argv: list[str]) -> None:
    _loop_policy()
    what = argv[0]
    result: dict[str, Any]
    if what == "fill":
        result = asyncio.run(fill(argv[1], int(argv[2])))
    elif what == "run":
        result = asyncio.run(run(argv[1], int(argv[2]), int(argv[3])))
    else:
        raise SystemExit(f"unknown measurement {what}")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
