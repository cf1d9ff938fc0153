"""What the routes do with what a request carries, for both ways an HTTP request is served:
aiohttp's handlers (``app.py``) and the fast lane (``fast.py``, the hot routes). Each takes the
values a request sent (a body, a query parameter's values, a header's) and gives the answer's
JSON body (and status), or raises an error of the tree; one table maps those to statuses.
Rendering the records as JSON is here too, byte for byte the same for both.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Final

from wqbroker import codec
from wqbroker.errors import (
    InvalidArgument,
    LeaseLost,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
    WqError,
    lookup,
)
from wqbroker.models import Delivery, QueueStats, Stats, Task, TaskState
from wqbroker.service import Service, Submission
from wqwire import defaults

# The one table from the error tree to HTTP status codes (a subclass maps as its parent).
STATUS: Final[dict[type[WqError], int]] = {
    WqError: 400,
    InvalidArgument: 400,
    NotFound: 404,
    LeaseLost: 409,
    PayloadTooLarge: 413,
    Unavailable: 503,  # StoreError is one
    Unauthenticated: 401,
    PermissionDenied: 403,
    Overloaded: 429,
}

_ENQUEUE_RAW: Final = frozenset({"payload"})

IDEMPOTENCY_KEY: Final = defaults.IDEMPOTENCY_KEY_HEADER

BATCH_ROUTE: Final = defaults.BATCH_PATH  # an extension: many tasks in one request
CLAIM_BATCH_ROUTE: Final = defaults.CLAIM_BATCH_PATH  # an extension: up to max tasks in a claim
SETTLE_ROUTE: Final = defaults.SETTLE_PATH  # an extension: many acks and nacks in one request


# -- rendering ----------------------------------------------------------------------------------


def render_task(task: Task) -> bytes:
    ts = codec.rfc3339
    error = "null" if task.last_error is None else codec.dumps(task.last_error).decode("utf-8")
    return b"".join(
        (
            f'{{"id":"{task.id}","payload":'.encode(),
            task.payload,
            (
                f',"attempts":{task.attempts},"max_attempts":{task.max_attempts},'
                f'"created_at":"{ts(task.created_at)}","available_at":"{ts(task.available_at)}",'
                f'"last_error":{error},"queue":"{task.queue}","priority":{task.priority}}}'
            ).encode(),
        )
    )


def render_task_state(found: TaskState) -> bytes:
    """The task view plus its ``state`` (never a lease id)."""
    return render_task(found.task)[:-1] + f',"state":"{found.state}"}}'.encode()


def render_queue(queue: QueueStats, oldest_ready: float | None = None) -> bytes:
    return codec.dumps(
        {
            "name": queue.name,
            "ready": queue.ready,
            "handed_out": queue.handed_out,
            "delayed": queue.delayed,
            "dead": queue.dead,
            "paused": queue.paused,
            # When the oldest ready task (at the head of a priority lane) became ready.
            "oldest_ready_at": None if oldest_ready is None else codec.rfc3339(oldest_ready),
        }
    )


def render_delivery(delivery: Delivery) -> bytes:
    return b"".join(
        (
            b'{"task":',
            render_task(delivery.task),
            f',"lease_id":"{delivery.lease_id}","deadline":"{codec.rfc3339(delivery.deadline)}"}}'.encode(),
        )
    )


def render_deliveries(deliveries: Sequence[Delivery]) -> bytes:
    """A batch claim's answer: ``{"deliveries": [...]}``."""
    return b'{"deliveries":[' + b",".join(render_delivery(d) for d in deliveries) + b"]}"


def render_stats(stats: Stats) -> bytes:
    return codec.dumps(stats.as_dict())


# -- request values -----------------------------------------------------------------------------


def one_value(name: str, values: Sequence[str]) -> str | None:
    """A query parameter's value as sent (``values``: every value it was given), or None."""
    if len(values) > 1:
        raise InvalidArgument(f"{name} is given more than once")
    return values[0] if values else None


def _quoted(text: str) -> str:
    """What a client sent, quoted for an error message (JSON-escaped, cut short if long)."""
    if len(text) <= 40:
        return json.dumps(text)
    return f'{json.dumps(text[:16])[:-1]}..." ({len(text)} characters)'


def int_value(name: str, raw: str | None) -> int | None:
    """A query parameter's integer (None: not given)."""
    if raw is None:
        return None
    text = raw.strip()
    digits = text[1:] if text[:1] in ("+", "-") else text
    # Plain ASCII digits only: int() would also take "1_000" and other scripts' digits.
    if not (digits.isascii() and digits.isdigit()):
        raise InvalidArgument(f"{name} must be an integer, got {_quoted(raw)}")
    return codec.parse_int(text)  # never converts more than int64's 19 digits


def required_lease_id(lease_id: str | None) -> str:
    if lease_id is None:
        raise InvalidArgument("lease_id is required (a query parameter)")
    return lease_id


def idempotency_key(values: Sequence[str]) -> str | None:
    """The ``Idempotency-Key`` header as sent (the service checks it), or None."""
    if len(values) > 1:
        raise InvalidArgument(f"the {IDEMPOTENCY_KEY} header is given more than once")
    return values[0] if values else None


def _optional_object(body: bytes) -> dict[str, object]:
    """A body that may be empty (nothing but whitespace) or a JSON object."""
    if not body.strip(b" \t\r\n"):
        return {}
    return codec.parse_object(body)


# Each route's work on what the request carries, for both ways a request is served (aiohttp's
# handlers below, and the fast lane of ``fast.py``): the answer's status and JSON body, or an
# error of the tree.


async def enqueue_answer(service: Service, body: bytes, key: str | None) -> tuple[int, bytes]:
    """POST /jobs: 201 {"id"} for a new task; 200 {"id", "duplicate": true} when a key matched."""
    fields = codec.parse_object(body, _ENQUEUE_RAW)
    enqueued = await service.enqueue(
        fields.get("payload"),
        fields.get("max_attempts"),
        fields.get("delay_ms"),
        queue=fields.get("queue"),
        priority=fields.get("priority"),
        key=key,
    )
    if enqueued.duplicate:
        return 200, f'{{"id":"{enqueued.id}","duplicate":true}}'.encode()
    return 201, f'{{"id":"{enqueued.id}"}}'.encode()


async def enqueue_batch_answer(service: Service, body: bytes, keyed: bool) -> bytes:
    """POST /jobs/batch (201): ``keyed``, the request has an ``Idempotency-Key`` header."""
    if keyed:
        raise InvalidArgument(
            f"the {IDEMPOTENCY_KEY} header is not taken by {BATCH_ROUTE}: give each task its "
            "own idempotency_key member"
        )
    items = codec.parse_objects(body, "tasks", _ENQUEUE_RAW)
    results = await service.enqueue_many(
        [
            Submission(
                fields.get("payload"),
                fields.get("max_attempts"),
                fields.get("delay_ms"),
                fields.get("queue"),
                fields.get("priority"),
                fields.get("idempotency_key"),
            )
            for fields in items
        ],
        what="tasks",
    )
    ids = ",".join(f'"{r.id}"' for r in results)
    duplicates = ",".join("true" if r.duplicate else "false" for r in results)
    return f'{{"ids":[{ids}],"duplicates":[{duplicates}]}}'.encode()


async def nack_task(service: Service, task_id: str, lease_id: str, body: bytes) -> None:
    fields = _optional_object(body)
    await service.nack(
        task_id,
        lease_id,
        fields.get("error"),
        delay_ms=fields.get("delay_ms"),
        terminal=fields.get("terminal"),
    )


async def extend_answer(
    service: Service, task_id: str, lease_id: str, lease_ms: int | None
) -> bytes:
    deadline = await service.extend(task_id, lease_id, lease_ms)
    return f'{{"deadline":"{codec.rfc3339(deadline)}"}}'.encode()


async def settle_answer(service: Service, body: bytes) -> bytes:
    """POST /jobs/settle (200): ``{"acks": [{"id", "lease_id"}...], "nacks": [{"id", "lease_id",
    "error", "delay_ms", "terminal"}...]}``, all at once (acks, then nacks); each one's outcome
    in order: null, or ``{"error", "status"}`` as its own request would have been answered
    (404, 409). A malformed one (as its own request would have been refused: 400) refuses them
    all, and nothing is settled."""
    fields = codec.parse_object(body)
    acks = _settlements(fields, "acks")
    nacks = _settlements(fields, "nacks")
    acked, nacked = await service.settle_many(
        [(a.get("id"), a.get("lease_id")) for a in acks],
        [
            (n.get("id"), n.get("lease_id"), n.get("error"), n.get("delay_ms"), n.get("terminal"))
            for n in nacks
        ],
        strict=True,
    )
    return b"".join(
        (
            b'{"acks":[',
            b",".join(_settled(e) for e in acked),
            b'],"nacks":[',
            b",".join(_settled(e) for e in nacked),
            b"]}",
        )
    )


def _settlements(fields: dict[str, object], name: str) -> list[dict[str, object]]:
    items = fields.get(name, [])
    if not isinstance(items, list):
        raise InvalidArgument(f"{name} must be an array")
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise InvalidArgument(f"{name}[{i}] must be an object")
    return items


def _settled(error: WqError | None) -> bytes:
    if error is None:
        return b"null"
    return codec.dumps({"error": error.message, "status": lookup(STATUS, error)})


# -- errors -------------------------------------------------------------------------------------


def error_parts(error: WqError) -> tuple[int, tuple[tuple[str, str], ...]]:
    """The status for an error of the tree, and the headers that status calls for."""
    if isinstance(error, Overloaded):
        return lookup(STATUS, error), (("Retry-After", str(max(1, math.ceil(error.retry_after)))),)
    if isinstance(error, Unauthenticated):
        return lookup(STATUS, error), (("WWW-Authenticate", 'Bearer realm="wq"'),)
    return lookup(STATUS, error), ()
