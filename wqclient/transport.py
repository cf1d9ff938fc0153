"""The transport seam: what a client needs from the wire, as two protocols.

:class:`Transport` is the unary operations every broker offers; :class:`StreamingTransport` adds
``stream()``, tasks pushed by the broker. The HTTP transport is a ``Transport``, the gRPC one a
``StreamingTransport``; :class:`~wqclient.AsyncClient` picks one by the URL's scheme, or takes one
you pass (``AsyncClient(transport=...)``, for tests or a transport of your own). Either way they
return the same models and raise the same errors: foreign exceptions (aiohttp, grpc) are mapped to
``wqclient.errors`` in the transport, at the boundary, and nowhere else.

Arguments reach a transport already encoded and type-checked by the client (payloads as JSON
bytes; ``None`` for an option left to the broker's default); the broker checks ranges.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

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
    """The unary operations, one call each (see :class:`~wqclient.AsyncClient` for their
    meaning). ``items`` in ``enqueue_many`` are ``(payload_json, max_attempts, delay_ms)``."""

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

    async def close(self) -> None:
        """Release connections. The transport is not used again."""
        ...


@runtime_checkable
class StreamingTransport(Transport, Protocol):
    """A transport that can also consume tasks pushed by the broker (gRPC StreamJobs).

    Whether a transport streams is decided by this protocol (it has ``stream``), so a transport
    that cannot stream simply has no ``stream`` method."""

    async def stream(self, prefetch: int, lease_ms: int | None) -> AsyncStream:
        """Open a stream: at most ``prefetch`` deliveries unsettled at once. Raise (``Unavailable``,
        ``InvalidArgument``, ...) if the broker does not accept it."""
        ...
