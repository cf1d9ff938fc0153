"""The null gRPC broker of ``make bench`` carries the users' gRPC workload as wq does (wqclient's
producing stream in, a Worker's stream out, every task once): its CPU figure is a floor only if
it does the same traffic."""

from __future__ import annotations

import asyncio

from bench.nullgrpc import make_server
from wqclient import AsyncClient, Task, Worker


async def test_the_null_grpc_broker_hands_each_task_enqueued_to_a_worker_once() -> None:
    server, port = make_server()
    await server.start()
    try:
        url = f"grpc://127.0.0.1:{port}"
        seen: list[int] = []
        worker: Worker | None = None

        async def handler(task: Task) -> None:
            seen.append(task.payload["i"])
            if len(seen) == 300 and worker is not None:
                worker.stop()

        worker = Worker(url, handler, concurrency=16)
        running = asyncio.ensure_future(worker.run())
        async with AsyncClient(url) as wq:
            ids = await asyncio.gather(*(wq.enqueue({"i": i}) for i in range(200)))
            ids += await wq.enqueue_many([{"i": i} for i in range(200, 300)])
        assert len(set(ids)) == 300
        await asyncio.wait_for(running, 20)
        assert sorted(seen) == list(range(300))
        assert worker.succeeded == 300
    finally:
        await server.stop(None)
