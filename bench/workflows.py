"""Workflows at scale (docs/design/results.md): a fan-in of N parents into one child, a fan-out
of one parent into N children, over gRPC against a running broker.

    python -m bench.workflows fan-in GRPC_TARGET N
    python -m bench.workflows fan-out GRPC_TARGET N

``fan-in`` enqueues N parents and one child waiting for all of them (in another queue, where a
claim is parked), drains the parents on a stream that acks each as it comes, and times the
child's hand-out from the answer to the last parent's ack: ``{"release_ms", "deliveries",
"parents_on_delivery", "drain_s"}`` (``release_ms`` may be below 0: the child is pushed as soon as
the ack that released it commits, which can be before the ack's own answer reaches the stream).

``fan-out`` enqueues one parent and N children waiting for it, parks a stream on the children's
queue, acks the parent, and times the ack (which releases every child in its transaction) and the
hand-out of the first and the last child: ``{"ack_ms", "first_ms", "last_ms", "deliveries"}``.
Each prints one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

from bench.load import _loop_policy

BATCH = 5000


async def _enqueue(stub: Any, pb: Any, tasks: list[Any]) -> list[str]:
    ids: list[str] = []
    for start in range(0, len(tasks), BATCH):
        answer = await stub.EnqueueBatch(pb.EnqueueBatchRequest(tasks=tasks[start : start + BATCH]))
        ids.extend(answer.ids)
    return ids


async def fan_in(target: str, n: int) -> dict[str, Any]:
    import grpc

    from wqwire.pb import broker_pb2 as pb
    from wqwire.pb import broker_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.BrokerStub(channel)
        parents = await _enqueue(
            stub,
            pb,
            [pb.EnqueueRequest(payload=b"%d" % i, queue="fanin-parents") for i in range(n)],
        )
        after = [pb.TaskRef(id=i) for i in parents]
        await stub.Enqueue(pb.EnqueueRequest(payload=b'"child"', queue="fanin-child", after=after))
        got: list[tuple[float, Any]] = []

        async def child() -> None:
            answer = await stub.NextJob(
                pb.NextJobRequest(wait_ms=30_000, lease_ms=60_000, queues=["fanin-child"])
            )
            if answer.HasField("delivery"):
                got.append((time.perf_counter(), answer.delivery))

        waiting = asyncio.ensure_future(child())
        await asyncio.sleep(0.2)  # (parked before the parents run)
        acks: asyncio.Queue[Any] = asyncio.Queue()
        opening = pb.StreamJobsRequest(
            open=pb.StreamOpen(prefetch=1000, lease_ms=60_000, queues=["fanin-parents"])
        )
        await acks.put(opening)

        async def requests() -> Any:
            while True:
                item = await acks.get()
                if item is None:
                    return
                yield item

        started = time.perf_counter()
        call = stub.StreamJobs(requests())
        settled = 0
        last_ack = 0.0
        async for response in call:
            if response.deliveries:
                await acks.put(
                    pb.StreamJobsRequest(
                        acks=[
                            pb.AckRequest(id=d.task.id, lease_id=d.lease_id)
                            for d in response.deliveries
                        ]
                    )
                )
            settled += sum(1 for s in response.settled if s.code == 0)
            if settled >= n:
                last_ack = time.perf_counter()
                break
        await acks.put(None)
        call.cancel()
        await asyncio.wait_for(waiting, 30)
        again = await stub.NextJob(pb.NextJobRequest(wait_ms=300, queues=["fanin-child"]))
    when, delivery = got[0]
    return {
        "release_ms": (when - last_ack) * 1000,
        "deliveries": len(got) + (1 if again.HasField("delivery") else 0),
        "parents_on_delivery": len(delivery.parents),
        "drain_s": last_ack - started,
    }


async def fan_out(target: str, n: int) -> dict[str, Any]:
    import grpc

    from wqwire.pb import broker_pb2 as pb
    from wqwire.pb import broker_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.BrokerStub(channel)
        parent = await stub.Enqueue(pb.EnqueueRequest(payload=b'"root"', queue="fanout-root"))
        ref = pb.TaskRef(id=parent.id)
        await _enqueue(
            stub,
            pb,
            [
                pb.EnqueueRequest(payload=b"%d" % i, queue="fanout-kids", after=[ref])
                for i in range(n)
            ],
        )
        claimed = await stub.NextJob(pb.NextJobRequest(wait_ms=1000, queues=["fanout-root"]))
        opening = pb.StreamJobsRequest(
            open=pb.StreamOpen(prefetch=10_000, lease_ms=60_000, queues=["fanout-kids"])
        )
        requests: asyncio.Queue[Any] = asyncio.Queue()
        await requests.put(opening)

        async def feed() -> Any:
            while True:
                item = await requests.get()
                if item is None:
                    return
                yield item

        call = stub.StreamJobs(feed())
        seen: list[float] = []

        async def children() -> None:
            async for response in call:
                seen.extend(time.perf_counter() for _ in response.deliveries)
                if len(seen) >= n:
                    return

        reading = asyncio.ensure_future(children())
        await asyncio.sleep(0.2)  # (the stream open and parked before the ack)
        started = time.perf_counter()
        d = claimed.delivery
        await stub.Ack(pb.AckRequest(id=d.task.id, lease_id=d.lease_id))
        acked = time.perf_counter()
        await asyncio.wait_for(reading, 60)
        await requests.put(None)
        call.cancel()
    return {
        "ack_ms": (acked - started) * 1000,
        "first_ms": (seen[0] - started) * 1000,
        "last_ms": (seen[-1] - started) * 1000,
        "deliveries": len(seen),
    }


def main(argv: list[str]) -> None:
    _loop_policy()
    what, target, n = argv[0], argv[1], int(argv[2])
    if what == "fan-in":
        result = asyncio.run(fan_in(target, n))
    elif what == "fan-out":
        result = asyncio.run(fan_out(target, n))
    else:
        raise SystemExit(f"unknown measurement {what}")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
