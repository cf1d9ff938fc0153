"""The HTTP API's one route table, and what each route does with what a request carries, for
both ways a request is served: aiohttp's (``app.py`` registers every row with its router) and
the fast lane's (``fast.py`` serves the rows marked ``hot``, in their plain form).

A row (:class:`Route`) is a method, a path as aiohttp registers it (``/jobs/{id}/ack``), a
handler, whether it reads a body and whether it is hot. A handler takes the service and a small
view of the request (:class:`Request`: path parameters, query values, header values, the body,
and a way to write the answer at once, for the claims) and gives the answer's status and JSON
body, or raises an error of the tree; one table (``STATUS``) maps those to statuses. A new route
or member is written here once, and both ways serve it. Rendering the records as JSON is here
too, byte for byte the same for both.
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

from wqbroker import codec
from wqbroker.errors import (
    Cancelled,
    Conflict,
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
from wqbroker.models import (
    CANCELLING,
    DEAD,
    SUCCEEDED,
    Delivery,
    Limits,
    Outcome,
    ParentResult,
    QueueStats,
    Schedule,
    Stats,
    Task,
    TaskState,
)
from wqbroker.service import ScheduleSubmission, Service, Submission
from wqwire import defaults

# The one table from the error tree to HTTP status codes (a subclass maps as its parent).
STATUS: Final[dict[type[WqError], int]] = {
    WqError: 400,
    InvalidArgument: 400,
    NotFound: 404,
    LeaseLost: 409,  # Cancelled and TimeLimitReached are ones
    Conflict: 409,
    PayloadTooLarge: 413,
    Unavailable: 503,  # StoreError is one
    Unauthenticated: 401,
    PermissionDenied: 403,
    Overloaded: 429,
}

_ENQUEUE_RAW: Final = frozenset({"payload"})
_EXTEND_RAW: Final = frozenset({"progress"})
# An ack's result (docs/design/results.md): kept as its text, as payloads are.
_ACK_RAW: Final = frozenset({"result"})

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
                f'"last_error":{error},"queue":"{task.queue}","priority":{task.priority}'
            ).encode(),
            _extensions(task)
            if task.expires_at is not None
            or task.timeout is not None
            or task.progress is not None
            or task.cancelling
            or task.result is not None
            or task.finished_at is not None
            or task.result_ttl is not None
            or task.after is not None
            or task.schedule is not None
            or task.buried_at is not None
            else b"}",
        )
    )


def _extensions(task: Task) -> bytes:
    """The members of docs/design/control.md, results.md and schedules.md a task view shows,
    each only when set (a client that sends none of them sees the view it always saw), and the
    view's closing brace."""
    parts = []
    if task.expires_at is not None:
        parts.append(f',"expires_at":"{codec.rfc3339(task.expires_at)}"'.encode())
    if task.timeout is not None:
        parts.append(f',"timeout_ms":{round(task.timeout * 1000)}'.encode())  # (as given)
    if task.progress is not None:
        parts.append(b',"progress":' + task.progress)
    if task.cancelling:
        parts.append(b',"cancelling":true')
    _results(task, parts)
    if task.schedule is not None:  # docs/design/schedules.md: fired by a schedule
        parts.append(_fired(task.schedule, task.scheduled_for))
    if task.buried_at is not None:  # dead: when it was buried
        parts.append(f',"buried_at":"{codec.rfc3339(task.buried_at)}"'.encode())
    parts.append(b"}")
    return b"".join(parts)


def _results(task: Task, parts: list[bytes]) -> None:
    """The members of docs/design/results.md a task view shows, each only when set."""
    if task.result is not None:
        parts.append(b',"result":' + task.result)  # (JSON text, as received)
    if task.finished_at is not None:
        parts.append(f',"finished_at":"{codec.rfc3339(task.finished_at)}"'.encode())
    if task.result_ttl is not None:
        parts.append(f',"result_ttl_ms":{round(task.result_ttl * 1000)}'.encode())  # (as given)
    if task.after:  # (None, or (): no parents)
        parts.append(b',"after":' + codec.dumps(list(task.after)))
        if task.waiting_for:
            parts.append(f',"waiting_for":{task.waiting_for}'.encode())


def _fired(schedule: str, scheduled_for: float | None) -> bytes:
    """A fired task's ``"schedule"`` and ``"scheduled_for"`` (docs/design/schedules.md)."""
    at = "null" if scheduled_for is None else f'"{codec.rfc3339(scheduled_for)}"'
    return b',"schedule":' + codec.dumps(schedule) + f',"scheduled_for":{at}'.encode()


def render_task_state(found: TaskState) -> bytes:
    """The task view plus its ``state`` (never a lease id)."""
    return render_task(found.task)[:-1] + f',"state":"{found.state}"}}'.encode()


def render_children(view: bytes, children: Sequence[str], count: int) -> bytes:
    """A task's view (``render_task_state``) with its live children (docs/design/results.md):
    ``"children"`` (the first few ids) and ``"children_count"``, when it has any."""
    if not count:
        return view
    return b"".join(
        (
            view[:-1],
            b',"children":',
            codec.dumps(list(children)),
            f',"children_count":{count}}}'.encode(),
        )
    )


def render_queue(queue: QueueStats, oldest_ready: float | None = None) -> bytes:
    return codec.dumps(
        {
            "name": queue.name,
            "ready": queue.ready,
            "handed_out": queue.handed_out,
            "delayed": queue.delayed,
            "dead": queue.dead,
            "waiting": queue.waiting,
            "succeeded": queue.succeeded,
            "paused": queue.paused,
            # When the oldest ready task (at the head of a priority lane) became ready.
            "oldest_ready_at": None if oldest_ready is None else codec.rfc3339(oldest_ready),
            # docs/design/schedules.md: its limits, and the rate tokens available now.
            "limits": limits_view(queue.limits),
            "tokens": None if queue.tokens is None else round(queue.tokens, 3),
        }
    )


def _ms(seconds: float | None) -> int | None:
    return None if seconds is None else round(seconds * 1000)


def _time(ts: float | None) -> str | None:
    return None if ts is None else codec.rfc3339(ts)


def limits_view(limits: Limits | None) -> dict[str, object] | None:
    """A queue's limits as JSON: ``{"rate": {"tasks", "per_ms", "burst"} | null, "concurrency":
    n | null}``; None (null) when it has none."""
    if limits is None or limits.empty():
        return None
    rate = limits.rate
    return {
        "rate": None
        if rate is None
        else {"tasks": rate.tasks, "per_ms": round(rate.per * 1000), "burst": rate.burst},
        "concurrency": limits.concurrency,
    }


def render_limits(queue: str, limits: Limits | None) -> bytes:
    """The answer of PUT /queues/{name}/limits: ``{"queue", "limits"}``."""
    return codec.dumps({"queue": queue, "limits": limits_view(limits)})


def render_schedule(schedule: Schedule) -> bytes:
    """A schedule's view (docs/design/schedules.md): its rule (``cron`` and ``timezone``, or
    ``every_ms``; the other null), its task's members (the payload as its text, null where
    not set), whether it is paused, and its times (as the task views give them)."""
    task = schedule.task
    cron = schedule.cron
    head = codec.dumps(
        {
            "name": schedule.name,
            "cron": cron,
            "timezone": None if cron is None else schedule.timezone,
            "every_ms": _ms(schedule.every),
            "queue": task.queue,
        }
    )
    tail = codec.dumps(
        {
            "priority": task.priority,
            "max_attempts": task.max_attempts,
            "expires_in_ms": _ms(task.expires_in),
            "timeout_ms": _ms(task.timeout),
            "result_ttl_ms": _ms(task.result_ttl),
            "paused": schedule.paused,
            "created_at": _time(schedule.created_at),
            "updated_at": _time(schedule.updated_at),
            "next_fire_at": _time(schedule.next_fire_at),
            "last_fire_at": _time(schedule.last_fire_at),
            "last_task_id": schedule.last_task_id,
            "fires": schedule.fires,
        }
    )
    return b"".join((head[:-1], b',"payload":', task.payload, b",", tail[1:]))


def render_schedules(schedules: Sequence[Schedule]) -> bytes:
    """GET /schedules: ``{"schedules": [...]}``."""
    return b'{"schedules":[' + b",".join(render_schedule(s) for s in schedules) + b"]}"


def render_delivery(delivery: Delivery) -> bytes:
    lease = f',"lease_id":"{delivery.lease_id}","deadline":"{codec.rfc3339(delivery.deadline)}"'
    return b"".join(
        (
            b'{"task":',
            render_task(delivery.task),
            lease.encode(),
            _parents(delivery.parents) if delivery.parents else b"}",
        )
    )


def _parents(parents: Sequence[ParentResult]) -> bytes:
    """A delivery's ``"parents"`` (docs/design/results.md), in the order of the task's ``after``:
    each ``{"id", "result"}``, or ``{"id"}`` when no result of it is held; and the closing
    brace."""
    return b"".join(
        (
            b',"parents":[',
            b",".join(
                b'{"id":' + codec.dumps(p.id) + b"}"
                if p.result is None
                else b'{"id":' + codec.dumps(p.id) + b',"result":' + p.result + b"}"
                for p in parents
            ),
            b"]}",
        )
    )


def render_outcome(outcome: Outcome) -> bytes:
    """The answer of a result wait (docs/design/results.md): ``{"id", "state", ...}``: a
    succeeded task's ``result`` (none when it was acked without one) and ``finished_at``; a dead
    one's ``last_error`` and ``attempts``; nothing more for a cancelled or expired one."""
    head = b'{"id":' + codec.dumps(outcome.task_id) + f',"state":"{outcome.state}"'.encode()
    parts = [head]
    if outcome.state == SUCCEEDED:
        if outcome.result is not None:
            parts.append(b',"result":' + outcome.result)
        if outcome.finished_at is not None:
            parts.append(f',"finished_at":"{codec.rfc3339(outcome.finished_at)}"'.encode())
    elif outcome.state == DEAD:
        error = outcome.last_error
        parts.append(b',"last_error":' + (b"null" if error is None else codec.dumps(error)))
        parts.append(f',"attempts":{outcome.attempts}'.encode())
    parts.append(b"}")
    return b"".join(parts)


def render_deliveries(deliveries: Sequence[Delivery]) -> bytes:
    """A batch claim's answer: ``{"deliveries": [...]}``."""
    return b'{"deliveries":[' + b",".join(render_delivery(d) for d in deliveries) + b"]}"


def render_stats(stats: Stats) -> bytes:
    return codec.dumps(stats.as_dict())


def render_page(tasks: Sequence[TaskState], next_cursor: str | None) -> bytes:
    """A listing's page: ``{"tasks": [views with "state"], "next_cursor": "..." | null}``."""
    cursor = "null" if next_cursor is None else codec.dumps(next_cursor).decode("ascii")
    return b"".join(
        (
            b'{"tasks":[',
            b",".join(render_task_state(t) for t in tasks),
            f'],"next_cursor":{cursor}}}'.encode(),
        )
    )


def render_error(error: WqError) -> bytes:
    """The body of an error answer: ``{"error": "..."}``; a refusal because the task was
    cancelled says so, ``"cancelled": true`` (the worker stops, and does not retry it)."""
    if isinstance(error, Cancelled):
        return codec.dumps({"error": error.message, "cancelled": True})
    return codec.dumps({"error": error.message})


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


def _optional_object(body: bytes, raw: frozenset[str] = frozenset()) -> dict[str, object]:
    """A body that may be empty (nothing but whitespace) or a JSON object (the members in
    ``raw`` kept as their text, see codec.parse_object)."""
    if not body.strip(b" \t\r\n"):
        return {}
    return codec.parse_object(body, raw)


# -- the routes ---------------------------------------------------------------------------------


class Request(Protocol):
    """What a route's handler sees of a request, whichever way it is served (``app.py`` gives
    aiohttp's request this face, ``fast.py`` its own)."""

    def match(self, name: str) -> str:
        """A path parameter's value (``id`` of ``/jobs/{id}/ack``)."""
        ...

    def query(self, name: str) -> Sequence[str]:
        """Every value the query gave this parameter, in order (none: empty)."""
        ...

    def header(self, name: str) -> Sequence[str]:
        """Every value of this request header, in order; ``name`` is one of :data:`HEADERS`."""
        ...

    async def body(self) -> bytes:
        """The whole body (PayloadTooLarge, or transport.RequestTimeout, when it cannot be had);
        only a route that ``reads_body`` asks for it."""
        ...

    async def write(self, body: bytes) -> None:
        """Write the answer (200, this JSON body) now, before the handler returns: a claim does,
        before the service lets go of the tasks it carries (if the client is gone or the answer
        cannot be written, it raises, nobody saw them, and they go back). The handler then
        returns :data:`WRITTEN`."""
        ...


Answer = tuple[int, bytes | None]
"""A route's answer: its status and JSON body; no body with :data:`NO_CONTENT` (204) and with
:data:`WRITTEN` (the handler wrote it, see :meth:`Request.write`)."""

NO_CONTENT: Final[Answer] = (204, None)
WRITTEN: Final[Answer] = (200, None)

HEADERS: Final = (IDEMPOTENCY_KEY,)
"""The request headers a handler may read (the fast lane gathers these and no other); none of
the transport's own (``Content-Length``, ``Host``, ``Connection``, ``Authorization`` ...)."""


def _query(request: Request, name: str) -> str | None:
    return one_value(name, request.query(name))


def _query_int(request: Request, name: str) -> int | None:
    return int_value(name, one_value(name, request.query(name)))


def _lease_id(request: Request) -> str:
    return required_lease_id(one_value("lease_id", request.query("lease_id")))


async def enqueue(service: Service, request: Request) -> Answer:
    """POST /jobs: 201 {"id"} for a new task; 200 {"id", "duplicate": true} when a key matched."""
    key = idempotency_key(request.header(IDEMPOTENCY_KEY))
    fields = codec.parse_object(await request.body(), _ENQUEUE_RAW)
    enqueued = await service.enqueue(
        fields.get("payload"),
        fields.get("max_attempts"),
        fields.get("delay_ms"),
        queue=fields.get("queue"),
        priority=fields.get("priority"),
        key=key,
        expires_in_ms=fields.get("expires_in_ms"),
        timeout_ms=fields.get("timeout_ms"),
        unique=fields.get("unique"),
        after=fields.get("after"),
        result_ttl_ms=fields.get("result_ttl_ms"),
    )
    if enqueued.duplicate:
        return 200, f'{{"id":"{enqueued.id}","duplicate":true}}'.encode()
    return 201, f'{{"id":"{enqueued.id}"}}'.encode()


async def enqueue_batch(service: Service, request: Request) -> Answer:
    """POST /jobs/batch, an extension: ``{"tasks": [...]}``, each task as POST /jobs takes one (its
    idempotency key as the member ``idempotency_key``), all enqueued or none (an invalid one is
    named by its index); 201 ``{"ids": [...], "duplicates": [...]}`` in order, as gRPC's
    EnqueueBatch. The ``Idempotency-Key`` header is refused rather than ignored: it cannot say
    which task it keys."""
    if request.header(IDEMPOTENCY_KEY):
        raise InvalidArgument(
            f"the {IDEMPOTENCY_KEY} header is not taken by {BATCH_ROUTE}: give each task its "
            "own idempotency_key member"
        )
    items = codec.parse_objects(await request.body(), "tasks", _ENQUEUE_RAW)
    results = await service.enqueue_many(
        [
            Submission(
                fields.get("payload"),
                fields.get("max_attempts"),
                fields.get("delay_ms"),
                fields.get("queue"),
                fields.get("priority"),
                fields.get("idempotency_key"),
                fields.get("expires_in_ms"),
                fields.get("timeout_ms"),
                fields.get("unique"),
                fields.get("after"),  # (ids, or indices of earlier items)
                fields.get("result_ttl_ms"),
            )
            for fields in items
        ],
        what="tasks",
    )
    ids = ",".join(f'"{r.id}"' for r in results)
    duplicates = ",".join("true" if r.duplicate else "false" for r in results)
    return 201, f'{{"ids":[{ids}],"duplicates":[{duplicates}]}}'.encode()


async def claim(service: Service, request: Request) -> Answer:
    """GET /jobs/next: 200, the task (written before the service lets go of it), or 204 if none
    came within ``wait_ms``."""
    written = False

    async def hand_over(delivery: Delivery) -> None:
        nonlocal written
        await request.write(render_delivery(delivery))
        written = True

    await service.claim(
        _query_int(request, "wait_ms"),
        _query_int(request, "lease_ms"),
        hand_over,
        queues=_query(request, "queue"),
    )
    return WRITTEN if written else NO_CONTENT


async def claim_batch(service: Service, request: Request) -> Answer:
    """GET /jobs/next/batch, an extension: up to ``max`` tasks in one long-poll (see
    Service.claim_batch): 200 ``{"deliveries": [...]}``, or 204 if none came within ``wait_ms``."""
    written = False

    async def hand_over(deliveries: list[Delivery]) -> None:
        nonlocal written  # (as for a claim: written before the service lets go of them)
        await request.write(render_deliveries(deliveries))
        written = True

    await service.claim_batch(
        _query_int(request, "wait_ms"),
        _query_int(request, "lease_ms"),
        _query_int(request, "max"),
        hand_over,
        queues=_query(request, "queue"),
    )
    return WRITTEN if written else NO_CONTENT


async def settle(service: Service, request: Request) -> Answer:
    """POST /jobs/settle, an extension (200): ``{"acks": [{"id", "lease_id", "result"}...],
    "nacks": [{"id", "lease_id", "error", "delay_ms", "terminal"}...]}``, all at once (acks, then
    nacks); each one's outcome in order: null, or ``{"error", "status"}`` as its own request
    would have been answered (404, 409). A malformed one (as its own request would have been
    refused: 400) refuses them all, and nothing is settled. An ack's ``result``
    (docs/design/results.md) is kept as its text."""
    body = await request.body()
    fields = codec.parse_object(body)
    acks = _settlements(fields, "acks")
    nacks = _settlements(fields, "nacks")
    if b'"result"' in body or (b"\\u" in body and any("result" in a for a in acks)):
        # Acks with results (the member spelled with escapes too): read again, each result
        # kept as its text (a settle without any costs a search or two of its bytes).
        items = [_ack_item(a) for a in _acks_with_results(body)]
    else:  # (the usual: plain acks)
        items = [(a.get("id"), a.get("lease_id")) for a in acks]
    acked, nacked = await service.settle_many(
        items,
        [
            (n.get("id"), n.get("lease_id"), n.get("error"), n.get("delay_ms"), n.get("terminal"))
            for n in nacks
        ],
        strict=True,
    )
    return 200, b"".join(
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


def _acks_with_results(body: bytes) -> list[dict[str, object]]:
    """The ``acks`` of a settle's body (already parsed once: a JSON object whose ``acks`` is an
    array of objects), each ack's ``result`` kept as its text."""
    text = codec.parse_object(body, frozenset({"acks"})).get("acks")
    if not isinstance(text, bytes):
        return []
    return codec.parse_objects(b'{"acks":' + text + b"}", "acks", _ACK_RAW)


def _ack_item(ack: dict[str, object]) -> tuple[object, object] | tuple[object, object, bytes]:
    """An ack of a settle, as the service takes it: with its result (JSON text) if it has one
    (``"result": null`` is one: null)."""
    result = ack.get("result")
    if isinstance(result, bytes):
        return ack.get("id"), ack.get("lease_id"), result
    return ack.get("id"), ack.get("lease_id")


def _settled(error: WqError | None) -> bytes:
    if error is None:
        return b"null"
    return codec.dumps({"error": error.message, "status": lookup(STATUS, error)})


async def ack(service: Service, request: Request) -> Answer:
    """POST /jobs/{id}/ack: 204. An optional body ``{"result": <any JSON>}`` is the task's
    result (docs/design/results.md), kept as sent; no body, an empty one or ``{}``: none."""
    task_id = request.match("id")
    lease_id = _lease_id(request)
    body = await request.body()  # (mostly none: then nothing more to do)
    result: bytes | None = None
    if body:
        value = _optional_object(body, _ACK_RAW).get("result")
        if isinstance(value, bytes):  # (JsonText; "null" too: null is a result)
            result = value
    await service.ack(task_id, lease_id, result)
    return NO_CONTENT


async def nack(service: Service, request: Request) -> Answer:
    task_id = request.match("id")
    lease_id = _lease_id(request)
    fields = _optional_object(await request.body())
    await service.nack(
        task_id,
        lease_id,
        fields.get("error"),
        delay_ms=fields.get("delay_ms"),
        terminal=fields.get("terminal"),
    )
    return NO_CONTENT


async def release(service: Service, request: Request) -> Answer:
    """POST /jobs/{id}/release (an extension): the holder hands the task back to the head of its
    queue without counting the attempt (its worker is stopping); 204. Refused as a nack is."""
    await service.release(request.match("id"), _lease_id(request))
    return NO_CONTENT


async def extend(service: Service, request: Request) -> Answer:
    """POST /jobs/{id}/extend: the new deadline. An optional body ``{"progress": <any JSON>}``
    records how far the work has come (kept as sent; null: none)."""
    task_id = request.match("id")
    lease_id = _lease_id(request)
    body = await request.body()  # (mostly none: then nothing more to do)
    progress: bytes | None = None
    if body:
        value = _optional_object(body, _EXTEND_RAW).get("progress")
        # (JsonText; null for an optional member is its default, as everywhere)
        if isinstance(value, bytes) and value != b"null":
            progress = value
    deadline = await service.extend(
        task_id, lease_id, _query_int(request, "lease_ms"), progress=progress
    )
    return 200, f'{{"deadline":"{codec.rfc3339(deadline)}"}}'.encode()


async def lookup_task(service: Service, request: Request) -> Answer:
    """GET /jobs/{id}: the task's view and state; with its live children, if it has any
    (docs/design/results.md)."""
    task_id = request.match("id")
    view = render_task_state(await service.lookup(task_id))
    children, count = await service.children(task_id)
    return 200, render_children(view, children, count)


async def result(service: Service, request: Request) -> Answer:
    """GET /jobs/{id}/result?wait_ms=: how the task ended (docs/design/results.md), at once if
    it has, else once it does within ``wait_ms`` (default 0); 204 if it is still pending then."""
    outcome = await service.wait_result(request.match("id"), _query_int(request, "wait_ms"))
    if outcome is None:
        return NO_CONTENT
    return 200, render_outcome(outcome)


async def cancel(service: Service, request: Request) -> Answer:
    """DELETE /jobs/{id}: 204 when the task is gone (it was ready or delayed: cancelled; dead:
    purged); 202 ``{"state": "cancelling"}`` when a worker holds it (it will not be retried)."""
    result = await service.cancel(request.match("id"))
    if result.state == CANCELLING:
        return 202, b'{"state":"cancelling"}'
    return NO_CONTENT


async def list_tasks(service: Service, request: Request) -> Answer:
    """GET /jobs?queue=&state=&limit=&cursor=: a page of a queue's tasks in one state."""
    tasks, next_cursor = await service.list_tasks(
        _query(request, "queue"),
        _query(request, "state"),
        _query_int(request, "limit"),
        _query(request, "cursor"),
    )
    return 200, render_page(tasks, next_cursor)


async def stats(service: Service, request: Request) -> Answer:
    return 200, render_stats(await service.stats(_query(request, "queue")))


async def queues(service: Service, request: Request) -> Answer:
    rows = await service.queue_report()
    return 200, b"[" + b",".join(render_queue(r.queue, r.oldest_ready) for r in rows) + b"]"


async def pause(service: Service, request: Request) -> Answer:
    await service.pause(request.match("name"))
    return NO_CONTENT


async def resume(service: Service, request: Request) -> Answer:
    await service.resume(request.match("name"))
    return NO_CONTENT


async def empty_queue(service: Service, request: Request) -> Answer:
    """POST /queues/{name}/empty: every ready and delayed task cancelled; how many."""
    count = await service.empty_queue(request.match("name"))
    return 200, f'{{"cancelled":{count}}}'.encode()


async def delete_queue(service: Service, request: Request) -> Answer:
    """DELETE /queues/{name}: a queue that holds nothing forgotten (409 if it holds tasks)."""
    await service.delete_queue(request.match("name"))
    return NO_CONTENT


# -- schedules and limits (docs/design/schedules.md) --------------------------------------------

_SCHEDULE_RAW: Final = frozenset({"payload"})  # kept as its text, as an enqueue's


async def put_schedule(service: Service, request: Request) -> Answer:
    """PUT /schedules/{name}: create or replace a schedule (the body: its rule and the members
    of its task, as POST /jobs takes them); 200, its view."""
    name = request.match("name")
    fields = codec.parse_object(await request.body(), _SCHEDULE_RAW)
    schedule = await service.put_schedule(
        name,
        ScheduleSubmission(
            fields.get("payload"),  # (JsonText; absent: None, which the service refuses)
            cron=fields.get("cron"),
            timezone=fields.get("timezone"),
            every_ms=fields.get("every_ms"),
            queue=fields.get("queue"),
            priority=fields.get("priority"),
            max_attempts=fields.get("max_attempts"),
            expires_in_ms=fields.get("expires_in_ms"),
            timeout_ms=fields.get("timeout_ms"),
            result_ttl_ms=fields.get("result_ttl_ms"),
            paused=fields.get("paused"),
        ),
    )
    return 200, render_schedule(schedule)


async def get_schedule(service: Service, request: Request) -> Answer:
    return 200, render_schedule(await service.get_schedule(request.match("name")))


async def list_schedules(service: Service, request: Request) -> Answer:
    return 200, render_schedules(await service.list_schedules())


async def delete_schedule(service: Service, request: Request) -> Answer:
    await service.delete_schedule(request.match("name"))
    return NO_CONTENT


async def pause_schedule(service: Service, request: Request) -> Answer:
    return 200, render_schedule(await service.pause_schedule(request.match("name")))


async def resume_schedule(service: Service, request: Request) -> Answer:
    return 200, render_schedule(await service.resume_schedule(request.match("name")))


async def set_limits(service: Service, request: Request) -> Answer:
    """PUT /queues/{name}/limits: ``{"rate": {...} | null, "concurrency": n | null}`` (absent
    as null; both null: none); 200 ``{"queue", "limits"}``, the limits in force."""
    queue = request.match("name")
    fields = codec.parse_object(await request.body())
    limits = await service.set_limits(queue, fields.get("rate"), fields.get("concurrency"))
    return 200, render_limits(queue, limits)


async def clear_limits(service: Service, request: Request) -> Answer:
    await service.clear_limits(request.match("name"))
    return NO_CONTENT


async def dlq(service: Service, request: Request) -> Answer:
    tasks = await service.dead_letters(_query_int(request, "limit"), queue=_query(request, "queue"))
    return 200, b"[" + b",".join(render_task(t) for t in tasks) + b"]"


async def requeue(service: Service, request: Request) -> Answer:
    await service.requeue(request.match("id"))
    return NO_CONTENT


async def requeue_all(service: Service, request: Request) -> Answer:
    count = await service.requeue_all(_query(request, "queue"))
    return 200, f'{{"requeued":{count}}}'.encode()


async def purge(service: Service, request: Request) -> Answer:
    await service.purge(request.match("id"))
    return NO_CONTENT


async def healthz(service: Service, request: Request) -> Answer:
    """Liveness: the process and its event loop answer (whatever the store says: an
    orchestrator that restarted a broker for its database being away would gain nothing)."""
    return 200, b'{"status":"ok"}'


async def readyz(service: Service, request: Request) -> Answer:
    """Readiness: whether this broker can serve now (its store answers, it is not shutting
    down), as the store's probe last found it: no I/O here, and every broker of a cluster says
    the same within a second (``wqbroker.store.postgres.pool``)."""
    problem = service.problem()
    if problem is not None:
        return 503, codec.dumps({"status": "unavailable", "error": problem})
    return 200, b'{"status":"ready"}'


Handler = Callable[[Service, Request], Awaitable[Answer]]


@dataclass(frozen=True, slots=True)
class Route:
    """One route: what both ways of serving a request (aiohttp's, through ``app.py``, and the
    fast lane's) know of it."""

    method: str
    path: str
    """As aiohttp registers it, with its parameters (``/jobs/{id}/ack``): the route's name in
    the metrics, the token rules (``wqbroker.auth``) and the OpenAPI document."""
    handler: Handler
    reads_body: bool = False
    """The handler reads the body (else one still to come is skipped after the answer)."""
    hot: bool = False
    """Served by the fast lane in its plain form (``fast.py`` says which form that is)."""
    head: bool = False
    """(A GET) HEAD is answered too: the route changes nothing (a claim does)."""
    patterns: tuple[tuple[str, str], ...] = ()
    """A path parameter's pattern for aiohttp's router, where the default (any segment) would
    take a fixed word of another route (the fast lane serves no route that has one)."""

    @property
    def template(self) -> str:
        """The path as aiohttp's router is given it: each parameter with its pattern, if any."""
        path = self.path
        for name, pattern in self.patterns:
            path = path.replace(f"{{{name}}}", f"{{{name}:{pattern}}}")
        return path


# A task id in a path where a fixed word sits at the same place: anything but that word (no task
# is called so). Else a method the fixed route does not take would fall through to the task's
# route: HEAD /jobs/next to the lookup of a task "next" (rather than 405: HEAD never claims),
# DELETE /dlq/requeue to the purge of a task "requeue".
_JOB_ID: Final = (("id", "(?!next$|batch$|settle$)[^{}/]+"),)
_DEAD_ID: Final = (("id", "(?!requeue$)[^{}/]+"),)

ROUTES: Final[tuple[Route, ...]] = (
    Route("POST", "/jobs", enqueue, reads_body=True, hot=True),
    Route("POST", BATCH_ROUTE, enqueue_batch, reads_body=True, hot=True),
    Route("GET", "/jobs/next", claim, hot=True),
    Route("GET", CLAIM_BATCH_ROUTE, claim_batch, hot=True),
    Route("POST", SETTLE_ROUTE, settle, reads_body=True, hot=True),
    Route("GET", "/jobs", list_tasks, head=True),
    Route("GET", "/jobs/{id}", lookup_task, head=True, patterns=_JOB_ID),
    Route("DELETE", "/jobs/{id}", cancel, patterns=_JOB_ID),
    Route("GET", "/jobs/{id}/result", result, head=True),
    Route("POST", "/jobs/{id}/ack", ack, reads_body=True, hot=True),
    Route("POST", "/jobs/{id}/nack", nack, reads_body=True, hot=True),
    Route("POST", "/jobs/{id}/extend", extend, reads_body=True, hot=True),
    Route("POST", "/jobs/{id}/release", release),
    Route("GET", "/stats", stats, head=True),
    Route("GET", "/queues", queues, head=True),
    Route("DELETE", "/queues/{name}", delete_queue),
    Route("POST", "/queues/{name}/pause", pause),
    Route("POST", "/queues/{name}/resume", resume),
    Route("POST", "/queues/{name}/empty", empty_queue),
    Route("PUT", "/queues/{name}/limits", set_limits, reads_body=True),
    Route("DELETE", "/queues/{name}/limits", clear_limits),
    Route("GET", "/schedules", list_schedules, head=True),
    Route("PUT", "/schedules/{name}", put_schedule, reads_body=True),
    Route("GET", "/schedules/{name}", get_schedule, head=True),
    Route("DELETE", "/schedules/{name}", delete_schedule),
    Route("POST", "/schedules/{name}/pause", pause_schedule),
    Route("POST", "/schedules/{name}/resume", resume_schedule),
    Route("GET", "/dlq", dlq, head=True),
    Route("POST", "/dlq/requeue", requeue_all),
    Route("POST", "/dlq/{id}/requeue", requeue),
    Route("DELETE", "/dlq/{id}", purge, patterns=_DEAD_ID),
    Route("GET", "/healthz", healthz, head=True),
    Route("GET", "/readyz", readyz, head=True),
)
"""Every route of the API, in the order aiohttp's router tries them (``app.py`` adds the
operator's: /metrics, /openapi.json, /ui)."""


# -- errors -------------------------------------------------------------------------------------


def error_parts(error: WqError) -> tuple[int, tuple[tuple[str, str], ...]]:
    """The status for an error of the tree, and the headers that status calls for (its body:
    :func:`render_error`)."""
    if error.retry_after is not None:
        return lookup(STATUS, error), (("Retry-After", str(max(1, math.ceil(error.retry_after)))),)
    if isinstance(error, Unauthenticated):
        return lookup(STATUS, error), (("WWW-Authenticate", 'Bearer realm="wq"'),)
    return lookup(STATUS, error), ()
