"""The transport seam: one protocol, an HTTP and a gRPC implementation.

Both speak to the broker with the same operations and return the same models and errors; the
client picks one by the URL's scheme. Foreign exceptions (aiohttp, grpc) are mapped to
``wqclient.errors`` here, at the boundary, and nowhere else.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from wqclient.models import Delivery, Stats, Task


class AsyncStream(Protocol):
    """Tasks pushed by the broker (gRPC StreamJobs): iterate for deliveries, settle each."""

    def __aiter__(self) -> AsyncStream: ...

    async def __anext__(self) -> Delivery: ...

    async def ack(self, delivery: Delivery) -> None: ...

    async def nack(self, delivery: Delivery, error: str | None = None) -> None: ...

    async def drain(self) -> None:
        """Ask for no new tasks; those already pushed still arrive and must be settled."""
        ...

    async def close(self) -> None:
        """End the stream. Unsettled tasks are reclaimed by the broker at once."""
        ...


class Transport(Protocol):
    async def enqueue(
        self, payload_json: bytes, max_attempts: int | None, delay_ms: int | None
    ) -> str: ...

    async def enqueue_many(
        self, items: Sequence[tuple[bytes, int | None, int | None]]
    ) -> list[str]: ...

    async def claim(self, wait_ms: int | None, lease_ms: int | None) -> Delivery | None: ...

    async def ack(self, task_id: str, lease_id: str) -> None: ...

    async def nack(self, task_id: str, lease_id: str, error: str | None) -> None: ...

    async def stats(self) -> Stats: ...

    async def dead_letters(self, limit: int | None) -> list[Task]: ...

    async def requeue(self, task_id: str) -> None: ...

    async def stream(self, prefetch: int, lease_ms: int | None) -> AsyncStream: ...

    async def close(self) -> None: ...
