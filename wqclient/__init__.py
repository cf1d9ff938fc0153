"""wqclient: the Python client for the wq job-queue broker.

>>> from wqclient import Client
>>> with Client("http://localhost:8080") as wq:      # or grpc://localhost:50051
...     task_id = wq.enqueue({"line": "hello"}, max_attempts=3)
...     delivery = wq.claim(wait_ms=1000)
...     wq.ack(delivery, result={"words": 1})
...     print(wq.wait_result(task_id, timeout=5).result)

Workflows (:mod:`wqclient.workflow`): ``chain``, ``group``, ``chord`` of ``signature`` objects.
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
    ResultTimeout,
    StreamEnded,
    TaskNotSucceeded,
    TimeLimitReached,
    Unauthenticated,
    Unavailable,
    Unsupported,
    WqError,
)
from wqclient.models import (
    Delivery,
    Enqueued,
    EnqueueItem,
    Limits,
    ParentResult,
    QueueInfo,
    RateLimit,
    Schedule,
    Stats,
    Task,
    TaskPage,
    TaskResult,
    Totals,
)
from wqclient.transport import AsyncStream, StreamingTransport, Transport
from wqclient.workflow import (
    AsyncChainHandle,
    AsyncGroupHandle,
    AsyncTaskHandle,
    Chain,
    ChainHandle,
    Group,
    GroupHandle,
    Signature,
    TaskHandle,
    Workflow,
    chain,
    chord,
    group,
    signature,
)

if TYPE_CHECKING:
    from wqclient.app import (
        App,
        Context,
        ProgressSink,
        SyncRunner,
        TaskArgumentError,
        TaskFunction,
        ThreadRunner,
        current_context,
    )
    from wqclient.worker import Fail, Retry, TaskFailed, Worker

# The task framework (docs/design/tasks.md), imported on first use as the worker runner is.
_APP_NAMES = frozenset(
    {
        "App",
        "Context",
        "ProgressSink",
        "SyncRunner",
        "TaskArgumentError",
        "TaskFunction",
        "ThreadRunner",
        "current_context",
    }
)


def __getattr__(name: str) -> Any:
    # Imported lazily: a producer needs no worker runner.
    if name in ("Worker", "TaskFailed", "Retry", "Fail"):
        from wqclient import worker

        return getattr(worker, name)
    if name in _APP_NAMES:
        from wqclient import app

        return getattr(app, name)
    raise AttributeError(f"module 'wqclient' has no attribute {name!r}")


__all__ = [
    "App",
    "AsyncChainHandle",
    "AsyncClient",
    "AsyncGroupHandle",
    "AsyncStream",
    "AsyncTaskHandle",
    "Cancelled",
    "CertificateError",
    "Chain",
    "ChainHandle",
    "Client",
    "Conflict",
    "Context",
    "Delivery",
    "EnqueueItem",
    "Enqueued",
    "Fail",
    "Group",
    "GroupHandle",
    "InvalidArgument",
    "LeaseLost",
    "Limits",
    "NotFound",
    "Overloaded",
    "ParentResult",
    "PayloadTooLarge",
    "PermissionDenied",
    "ProgressSink",
    "ProtocolError",
    "QueueInfo",
    "RateLimit",
    "ResultTimeout",
    "Retry",
    "Schedule",
    "Signature",
    "Stats",
    "Stream",
    "StreamEnded",
    "StreamingTransport",
    "SyncRunner",
    "Task",
    "TaskArgumentError",
    "TaskFailed",
    "TaskFunction",
    "TaskHandle",
    "TaskNotSucceeded",
    "TaskPage",
    "TaskResult",
    "ThreadRunner",
    "TimeLimitReached",
    "Totals",
    "Transport",
    "Unauthenticated",
    "Unavailable",
    "Unsupported",
    "Worker",
    "Workflow",
    "WqError",
    "chain",
    "chord",
    "current_context",
    "group",
    "signature",
]
