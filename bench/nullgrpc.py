"""The "null gRPC broker": grpc.aio serving wq's ``.proto`` with the least a broker can do for the
users' gRPC workload (``Produce`` batches in, ``StreamJobs`` deliveries out, acks answered): a
deque of tasks, ids from a counter, no leases kept, no limits, nothing stored. What it costs per
task is what grpc.aio and protobuf cost, the floor under any grpc.aio broker's figure, as the
null aiohttp broker (:mod:`bench.nullbroker`) is HTTP's.

    python -m bench.nullgrpc PORT
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import grpc

from wqbroker.grpc.server import server_options
from wqbroker.limits import DEFAULT_MAX_PAYLOAD
from wqwire.pb import broker_pb2 as pb
from wqwire.pb import broker_pb2_grpc as pb_grpc

_LEASE_S = 30.0


def _split(ts: float) -> tuple[int, int]:
    seconds = int(ts)
    return seconds, int((ts - seconds) * 1e9)


class NullBroker(pb_grpc.BrokerServicer):
    def __init__(self) -> None:
        self._ready: deque[tuple[str, bytes, tuple[int, int]]] = deque()
        self._ids = itertools.count(1)
        self._wake: set[asyncio.Event] = set()  # one per stream

    async def Produce(  # type: ignore[override]
        self, request_iterator: AsyncIterator[pb.EnqueueBatchRequest], context: Any
    ) -> None:
        ready, ids = self._ready, self._ids
        async for batch in request_iterator:
            created = _split(time.time())
            out = []
            for task in batch.tasks:
                task_id = f"{next(ids):016x}"
                ready.append((task_id, task.payload, created))
                out.append(task_id)
            for event in self._wake:
                event.set()
            await context.write(pb.ProduceResponse(ids=out, duplicates=[False] * len(out)))

    async def StreamJobs(  # type: ignore[override]
        self, request_iterator: AsyncIterator[pb.StreamJobsRequest], context: Any
    ) -> None:
        requests = aiter(request_iterator)
        first = await anext(requests)
        stream = _Stream(first.open.prefetch or 1)
        self._wake.add(stream.wake)
        await context.write(pb.StreamJobsResponse())  # "open" accepted
        reader = asyncio.get_running_loop().create_task(stream.read(requests))
        try:
            while not (reader.done() and not stream.settled):
                await stream.wake.wait()
                stream.wake.clear()
                response = stream.response(self._ready)
                if response is not None:
                    await context.write(response)
        finally:
            self._wake.discard(stream.wake)
            reader.cancel()

    async def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsResponse:
        return pb.StatsResponse()


class _Stream:
    """One StreamJobs call: how many it holds, the acks to answer, a drain."""

    def __init__(self, prefetch: int) -> None:
        self.prefetch = prefetch
        self.held = 0
        self.settled: list[tuple[str, str]] = []
        self.wake = asyncio.Event()
        self.draining = False
        self.drain_answered = False

    async def read(self, requests: AsyncIterator[pb.StreamJobsRequest]) -> None:
        try:
            async for request in requests:
                for ack in request.acks:
                    self.settled.append((ack.id, ack.lease_id))
                self.held -= len(request.acks)
                self.draining = self.draining or request.drain
                self.wake.set()
        finally:
            self.wake.set()

    def response(
        self, ready: deque[tuple[str, bytes, tuple[int, int]]]
    ) -> pb.StreamJobsResponse | None:
        """The acks' outcomes and as many deliveries as there is room for; None if nothing."""
        take = 0 if self.draining else max(0, min(self.prefetch - self.held, len(ready)))
        answer_drain = self.draining and not self.drain_answered
        if not (take or self.settled or answer_drain):
            return None
        response = pb.StreamJobsResponse()
        add_settled, add_delivery = response.settled.add, response.deliveries.add
        for task_id, lease_id in self.settled:
            s = add_settled()
            s.id, s.lease_id = task_id, lease_id
        self.settled.clear()
        deadline = _split(time.time() + _LEASE_S)
        for _ in range(take):
            task_id, payload, created = ready.popleft()
            d = add_delivery()
            t = d.task
            t.id, t.payload, t.attempts, t.max_attempts = task_id, payload, 1, 3
            t.created_at.seconds, t.created_at.nanos = created
            t.available_at.seconds, t.available_at.nanos = created
            t.queue = "default"
            d.lease_id = task_id
            d.deadline.seconds, d.deadline.nanos = deadline
        self.held += take
        if answer_drain:
            self.drain_answered = True
            response.drained.unsettled = self.held
        return response


def make_server(port: int = 0) -> tuple[grpc.aio.Server, int]:
    """The server (not started) and the port it is bound to on 127.0.0.1 (0: any free one)."""
    server = grpc.aio.server(options=server_options(DEFAULT_MAX_PAYLOAD))  # (wq's options)
    # (The methods it leaves out answer UNIMPLEMENTED, as the generated base class does.)
    pb_grpc.add_BrokerServicer_to_server(NullBroker(), server)  # type: ignore[abstract]
    return server, server.add_insecure_port(f"127.0.0.1:{port}")


async def serve(port: int) -> None:
    server, _ = make_server(port)
    await server.start()
    await server.wait_for_termination()


def main(port: int) -> None:
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:  # pragma: no cover
        pass
    asyncio.run(serve(port))


if __name__ == "__main__":
    main(int(sys.argv[1]))
