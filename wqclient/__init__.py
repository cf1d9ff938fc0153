"""wqclient: the Python client for the wq job-queue broker.

>>> from wqclient import Client
>>> with Client("http://localhost:8080") as wq:      # or grpc://localhost:50051
...     task_id = wq.enqueue({"line": "hello"}, max_attempts=3)
...     delivery = wq.claim(wait_ms=1000)
...     wq.ack(delivery)
"""

from typing import TYPE_CHECKING, Any

from wqclient.client import AsyncClient, Client, Stream
from wqclient.errors import (
    Cancelled,
    CertificateError,
    Conflict,
    InvalidArgument,
    LeaseLost,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    PermissionDenied,
    ProtocolError,
    StreamEnded,
    TimeLimitReached,
    Unauthenticated,
    Unavailable,
    WqError,
)
from wqclient.models import (
    Delivery,
    Enqueued,
    EnqueueItem,
    QueueInfo,
    Stats,
    Task,
    TaskPage,
    Totals,
)
from wqclient.transport import AsyncStream, StreamingTransport, Transport

if TYPE_CHECKING:
    from wqclient.worker import Fail, Retry, TaskFailed, Worker


def __getattr__(name: str) -> Any:
    # Imported lazily: a producer needs no worker runner.
    if name in ("Worker", "TaskFailed", "Retry", "Fail"):
        from wqclient import worker

        return getattr(worker, name)
    raise AttributeError(f"module 'wqclient' has no attribute {name!r}")


__all__ = [
    "AsyncClient",
    "AsyncStream",
    "Cancelled",
    "CertificateError",
    "Client",
    "Conflict",
    "Delivery",
    "EnqueueItem",
    "Enqueued",
    "Fail",
    "InvalidArgument",
    "LeaseLost",
    "NotFound",
    "Overloaded",
    "PayloadTooLarge",
    "PermissionDenied",
    "ProtocolError",
    "QueueInfo",
    "Retry",
    "Stats",
    "Stream",
    "StreamEnded",
    "StreamingTransport",
    "Task",
    "TaskFailed",
    "TaskPage",
    "TimeLimitReached",
    "Totals",
    "Transport",
    "Unauthenticated",
    "Unavailable",
    "Worker",
    "WqError",
]
