"""The OpenAPI 3.1 document of the HTTP API, served at ``GET /openapi.json`` (no token needed).

One dict, built at import (with a twin for a broker run with ``-metrics-public``): every route
the app registers (the spec's, the extensions, the operator's: ``/healthz``, ``/metrics``, the
dashboard's ``/ui``, this document), each with its parameters, request body, and every status it
can answer, with the body and headers of each. Limits and defaults come from
:mod:`wqbroker.limits` and the security of each operation from the rules of :mod:`wqbroker.auth`,
so neither can drift from the code. ``tests/http/test_openapi.py`` checks that the document and the
app's routes name the same operations, that it is valid OpenAPI 3.1, and runs Schemathesis
against a live broker with it.

What every operation shares is said once in ``components``:

- ``Error``: the body of every 4xx and 5xx, ``{"error": "<message naming the problem>"}``.
- Answers the transport gives on any route, before a handler runs (``transport.py``,
  ``server.py``): 400 for malformed HTTP, 408 for a request too slow to arrive, 413 for a body
  over the limit, 415 for a compressed one, 417 for an ``Expect`` other than ``100-continue``.
- 401 (with ``WWW-Authenticate``) and 403 with a token file, as the route's rule says.
- 503 on every route that reaches the store (the broker is shutting down, or its store failed).

A wrong method on a path answers 405 with an ``Allow`` header; as no operation answers it, it is
described in ``info`` and as the reusable response ``MethodNotAllowed``. ``HEAD`` is allowed on
every ``GET`` but ``GET /jobs/next`` (the ``GET`` answer without its body); it is not listed as
operations of its own.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Collection
from dataclasses import fields
from typing import Any, Final

from aiohttp import web

from wqbroker import limits
from wqbroker.auth import SCOPES, Access, http_rule, scopes_of
from wqbroker.http.metrics import ROUTE as METRICS
from wqbroker.models import LIST_STATES, Totals

Json = dict[str, Any]

JSON: Final = "application/json"
PATH: Final = "/openapi.json"

_NAME: Final = rf"[A-Za-z0-9_.\-]{{1,{limits.MAX_QUEUE_NAME}}}"  # (limits.QUEUE_NAME_RULE)
_QUEUE_NAME_PATTERN: Final = f"^{_NAME}$"
_QUEUE_LIST_PATTERN: Final = rf"^{_NAME}(,{_NAME}){{0,{limits.MAX_QUEUES_PER_CLAIM - 1}}}$"


def _ref(kind: str, name: str) -> Json:
    return {"$ref": f"#/components/{kind}/{name}"}


def _schema(name: str) -> Json:
    return _ref("schemas", name)


def _json(schema: Json, description: str, headers: Json | None = None) -> Json:
    answer: Json = {"description": description, "content": {JSON: {"schema": schema}}}
    if headers:
        answer["headers"] = headers
    return answer


def _empty(description: str) -> Json:
    return {"description": description}


def _object(properties: Json, required: list[str] | None = None, **extra: Any) -> Json:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
        **extra,
    }


def _count(description: str | None = None) -> Json:
    schema: Json = {"type": "integer", "minimum": 0}
    if description:
        schema["description"] = description
    return schema


# -- schemas ------------------------------------------------------------------------------------

_TASK_PROPERTIES: Final[Json] = {
    "id": {"type": "string", "minLength": 1, "description": "The task's id."},
    "payload": {"description": "The payload, any JSON value, exactly as it was enqueued."},
    "attempts": _count("Deliveries so far (a delivery counts when the task is handed out)."),
    "max_attempts": {"type": "integer", "minimum": 1, "maximum": limits.MAX_MAX_ATTEMPTS},
    "created_at": _schema("Timestamp"),
    "available_at": _schema("Timestamp"),
    "last_error": {
        "type": ["string", "null"],
        "description": "The error of the previous failed attempt, or null.",
    },
    "queue": _schema("QueueName"),
    "priority": _schema("Priority"),
}
# The members of docs/design/control.md: each only when set (a client that sends none of it
# sees none of them).
_TASK_CONTROLS: Final[Json] = {
    "expires_at": {
        **_ref("schemas", "Timestamp"),
        "description": "Only when enqueued with `expires_in_ms`: the task is never handed out "
        "at or after this time (it is dropped, counted `expired`).",
    },
    "timeout_ms": {
        "type": "integer",
        "minimum": 1,
        "maximum": limits.MAX_TIMEOUT_MS,
        "description": "Only when enqueued with `timeout_ms`: the most one attempt may run.",
    },
    "progress": {
        "description": "Only while it is handed out and its holder reported progress (POST "
        "/jobs/{id}/extend): that JSON value, exactly as sent."
    },
    "cancelling": {
        "const": True,
        "description": "Only when true: it is handed out and was cancelled (DELETE /jobs/{id}); "
        "it will not be retried.",
    },
}

# The members of docs/design/results.md: each only when set, as those above.
_TASK_RESULTS: Final[Json] = {
    "result": {
        "description": "Only once it has succeeded (acked with a result, kept for its result "
        "TTL): the result, any JSON value (null too), exactly as acked."
    },
    "finished_at": {
        **_ref("schemas", "Timestamp"),
        "description": "Only once it has succeeded: when it was acked.",
    },
    "result_ttl_ms": {
        "type": "integer",
        "minimum": 0,
        "maximum": limits.MAX_RESULT_TTL_MS,
        "description": "Only when enqueued with `result_ttl_ms`: how long its result is kept.",
    },
    "after": {
        "type": "array",
        "items": {"type": "string", "minLength": 1},
        "minItems": 1,
        "description": "Only for a task enqueued with `after`: its parents' ids, in order.",
    },
    "waiting_for": {
        "type": "integer",
        "minimum": 1,
        "description": "Only while it is waiting: how many of its parents have not yet succeeded.",
    },
}

# docs/design/schedules.md: only for a task a schedule enqueued, as those above.
_TASK_SCHEDULES: Final[Json] = {
    "schedule": {
        **_ref("schemas", "ScheduleName"),
        "description": "Only for a task a schedule enqueued: the schedule's name.",
    },
    "scheduled_for": {
        **_ref("schemas", "Timestamp"),
        "description": "Only with `schedule`: the scheduled time of the fire that enqueued it.",
    },
    "buried_at": {
        **_ref("schemas", "Timestamp"),
        "description": "Only while it is dead: when it was buried (the dead-letter queue is in "
        "that order). Left out for a task buried by a broker that did not keep it.",
    },
}

_GAUGES: Final[Json] = {
    "ready": _count("Tasks waiting to be claimed."),
    "handed_out": _count("Tasks out with a worker, not yet settled."),
    "delayed": _count("Tasks waiting out a backoff or a delay."),
    "dead": _count("Tasks in the dead-letter queue."),
    "waiting": _count("Tasks waiting for their parents (`after`) to succeed."),
    "succeeded": _count(
        "Results held: tasks acked with a result, kept for their result TTL (they were "
        "counted `acked`)."
    ),
}
_STATES: Final = ["ready", "handed_out", "delayed", "dead", "waiting", "succeeded"]
_RESULT_TTL: Final[Json] = {
    "type": ["integer", "null"],
    "minimum": 0,
    "maximum": limits.MAX_RESULT_TTL_MS,
    "description": "How long a result is kept once the task is acked with one (`GET "
    "/jobs/{id}/result`); 0 keeps none. Default: the broker's `-result-ttl-ms` (an hour).",
}
_AFTER_TEXT: Final = (
    f"The tasks this one waits for (1 to {limits.MAX_PARENTS}, none twice): it is `waiting` "
    "until every one of them has succeeded, then ready (or delayed by `delay_ms` from then); "
    "its delivery carries their results (`parents`). A task that is not live (unknown, acked "
    "without a result, cancelled, expired) is a 400 naming it (`after[1]`); a dead one buries "
    "this task at once."
)
_RESULT_TEXT: Final = (
    "The task's result, any JSON value (null too), kept byte for byte (within the body limit): "
    "the task is kept, succeeded, for its result TTL (`GET /jobs/{id}/result`). Left out: no "
    "result, the task is forgotten."
)

_TOTALS: Final[tuple[str, ...]] = tuple(f.name for f in fields(Totals))

# What JSON Schema cannot say: its integers include 3.0, which the broker refuses (as Go's
# encoding/json does): an integer is written as one.
_MEMBERS: Final = (
    "Unknown members are ignored; null for an optional member is its default. Integers are "
    "written without a fraction or an exponent: `3.0` and `3e0` are refused (400)."
)

_SCHEMAS: Final[Json] = {
    "Error": _object(
        {
            "error": {"type": "string", "description": "What was wrong, naming the field."},
            "cancelled": {
                "const": True,
                "description": "Only on the 409 of a call refused because its task was "
                "cancelled (an extend): stop working on it, and do not retry it.",
            },
        },
        required=["error"],
        description="The body of every error answer (4xx and 5xx).",
        examples=[{"error": "max_attempts must be an integer, got a string"}],
    ),
    "Timestamp": {
        "type": "string",
        "format": "date-time",
        "pattern": r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{6}Z$",
        "description": "RFC 3339 in UTC with microseconds.",
        "examples": ["2026-11-29T23:07:38.123456Z"],
    },
    "QueueName": {
        "type": "string",
        "pattern": _QUEUE_NAME_PATTERN,
        "description": f"A queue's name: {limits.QUEUE_NAME_RULE}.",
        "examples": ["default", "mail"],
    },
    "Priority": {
        "type": "integer",
        "minimum": 0,
        "maximum": limits.MAX_PRIORITY,
        "description": "Higher is served first (within a queue); 0 by default.",
    },
    "Task": _object(
        {**_TASK_PROPERTIES, **_TASK_CONTROLS, **_TASK_RESULTS, **_TASK_SCHEDULES},
        required=list(_TASK_PROPERTIES),
        description="A task as clients see it.",
    ),
    "TaskState": _object(
        {
            **_TASK_PROPERTIES,
            "state": {"type": "string", "enum": _STATES},
            **_TASK_CONTROLS,
            **_TASK_RESULTS,
            **_TASK_SCHEDULES,
        },
        required=[*_TASK_PROPERTIES, "state"],
        description="A task and the state it is in (never its lease id).",
    ),
    "TaskDetail": _object(
        {
            **_TASK_PROPERTIES,
            "state": {"type": "string", "enum": _STATES},
            **_TASK_CONTROLS,
            **_TASK_RESULTS,
            **_TASK_SCHEDULES,
            "children": {
                "type": "array",
                "items": {"type": "string", "minLength": 1},
                "minItems": 1,
                "maxItems": limits.MAX_CHILDREN_SHOWN,
                "description": "Only when it has live children (tasks that name it in their "
                f"`after` and are not gone): the first {limits.MAX_CHILDREN_SHOWN}, oldest "
                "first.",
            },
            "children_count": {
                "type": "integer",
                "minimum": 1,
                "description": "Only with `children`: how many there are in all.",
            },
        },
        required=[*_TASK_PROPERTIES, "state"],
        description="A task, the state it is in (never its lease id), and its live children.",
    ),
    "ParentResult": _object(
        {
            "id": {"type": "string", "minLength": 1, "description": "The parent's id."},
            "result": {
                "description": "Its result, exactly as acked; left out when none is held "
                "(acked without one, or with a result TTL of 0)."
            },
        },
        required=["id"],
    ),
    "Result": {
        "oneOf": [
            _object(
                {
                    "id": {"type": "string", "minLength": 1},
                    "state": {"const": "succeeded"},
                    "result": {
                        "description": "The result, exactly as acked; left out for a task "
                        "acked without one while the caller waited (afterwards it is gone: 404)."
                    },
                    "finished_at": _schema("Timestamp"),
                },
                required=["id", "state", "finished_at"],
            ),
            _object(
                {
                    "id": {"type": "string", "minLength": 1},
                    "state": {"const": "dead"},
                    "last_error": {"type": ["string", "null"]},
                    "attempts": _count(),
                },
            ),
            _object(
                {
                    "id": {"type": "string", "minLength": 1},
                    "state": {"type": "string", "enum": ["cancelled", "expired"]},
                },
                description="It ended so while the caller waited (afterwards it is gone: 404).",
            ),
        ],
        "description": "How a task ended.",
    },
    "TaskPage": _object(
        {
            "tasks": {"type": "array", "items": _schema("TaskState")},
            "next_cursor": {
                "type": ["string", "null"],
                "description": "Where the next page starts (pass it as `cursor`); null when "
                "this page reached the end.",
            },
        },
        description="A page of a queue's tasks in one state, in that state's order.",
    ),
    "Cancelling": _object(
        {"state": {"const": "cancelling"}},
        description="The task is handed out: it will not be retried. Its holder is told (a "
        "gRPC stream at once; others at their next extend, a 409); its ack still counts, its "
        "nack or its lease running out drops it.",
    ),
    "Emptied": _object(
        {"cancelled": _count("How many ready, delayed and waiting tasks were cancelled.")}
    ),
    "Delivery": _object(
        {
            "task": _schema("Task"),
            "lease_id": {"type": "string", "minLength": 1},
            "deadline": _schema("Timestamp"),
            "parents": {
                "type": "array",
                "items": _schema("ParentResult"),
                "minItems": 1,
                "description": "Only for a task enqueued with `after`: its parents, in that "
                "order, with their results.",
            },
        },
        required=["task", "lease_id", "deadline"],
        description="A task handed out under a lease: settle it with the lease id.",
    ),
    "Enqueued": _object({"id": {"type": "string", "minLength": 1}}),
    "Duplicate": _object(
        {"id": {"type": "string", "minLength": 1}, "duplicate": {"const": True}},
        description="The idempotency key matched: nothing was created; the first task's id.",
    ),
    "Deadline": _object({"deadline": _schema("Timestamp")}),
    "Stats": _object(
        {
            **_GAUGES,
            "totals": _object(
                {name: _count() for name in _TOTALS},
                description="Lifetime counters since the broker started.",
            ),
        },
        description="Gauges (tasks in each collection now) and lifetime totals.",
    ),
    "Queue": _object(
        {
            "name": _schema("QueueName"),
            **_GAUGES,
            "paused": {"type": "boolean"},
            "oldest_ready_at": {
                "anyOf": [_schema("Timestamp"), {"type": "null"}],
                "description": "When the oldest ready task (the earliest among the heads of "
                "the queue's priority lanes) became ready; null when none is ready.",
            },
            "limits": {
                "anyOf": [_schema("Limits"), {"type": "null"}],
                "description": "Its rate and concurrency limits (`PUT /queues/{name}/limits`); "
                "null when it has none. The concurrency in use is `handed_out`.",
            },
            "tokens": {
                "type": ["number", "null"],
                "minimum": 0,
                "description": "The rate-limit tokens it has now (hand-outs it may make at "
                "once); null without a rate limit.",
            },
        },
    ),
    "Requeued": _object({"requeued": _count("How many dead tasks were requeued.")}),
    "Health": _object(
        {
            "status": {"type": "string", "enum": ["ok", "ready", "unavailable"]},
            "error": {"type": "string", "description": "Why the broker cannot serve."},
        },
        required=["status"],
    ),
    "EnqueueRequest": {
        "type": "object",
        "required": ["payload"],
        "description": _MEMBERS,
        "properties": {
            "payload": {"description": "Any JSON value (null too), kept byte for byte."},
            "max_attempts": {
                "type": ["integer", "null"],
                "minimum": 1,
                "maximum": limits.MAX_MAX_ATTEMPTS,
                "default": limits.DEFAULT_MAX_ATTEMPTS,
            },
            "delay_ms": {
                "type": ["integer", "null"],
                "minimum": 0,
                "maximum": limits.MAX_DELAY_MS,
                "default": 0,
                "description": "Hold the task back this long before it can be claimed.",
            },
            "queue": {
                "anyOf": [_schema("QueueName"), {"type": "null"}],
                "default": "default",
            },
            "priority": {"anyOf": [_schema("Priority"), {"type": "null"}], "default": 0},
            "expires_in_ms": {
                "type": ["integer", "null"],
                "minimum": 1,
                "maximum": limits.MAX_EXPIRES_IN_MS,
                "description": "Drop the task (counted `expired`) if it is not handed out within "
                "this long of its enqueue, nor any retry after that. Default: never.",
            },
            "timeout_ms": {
                "type": ["integer", "null"],
                "minimum": 1,
                "maximum": limits.MAX_TIMEOUT_MS,
                "description": "The most one attempt may run: a lease is never extended past "
                "hand-out + `timeout_ms` (409), so the task is retried (or buried) once it runs "
                "out. Default: as long as it is extended.",
            },
            "unique": {
                "type": ["boolean", "null"],
                "default": False,
                "description": "true, with an idempotency key: the key holds while the task is "
                "ready, delayed or handed out (not for the window); once it is acked, dead, "
                "cancelled or expired, the key makes a new task. Without a key: 400.",
            },
            "after": {
                "type": ["array", "null"],
                "items": {"type": "string", "minLength": 1},
                "minItems": 1,
                "maxItems": limits.MAX_PARENTS,
                "uniqueItems": True,
                "description": _AFTER_TEXT,
            },
            "result_ttl_ms": _RESULT_TTL,
        },
        "examples": [{"payload": {"line": "hello"}, "max_attempts": 3, "delay_ms": 0}],
    },
    "AckRequest": {
        "type": "object",
        "description": _MEMBERS,
        "properties": {"result": {"description": _RESULT_TEXT}},
        "examples": [{"result": {"sent": 3}}],
    },
    "ExtendRequest": {
        "type": "object",
        "description": _MEMBERS,
        "properties": {
            "progress": {
                "description": "How far the work has come: any JSON value, at most "
                f"{limits.MAX_PROGRESS_BYTES} bytes of text, kept as sent and shown in the "
                "task's `progress` while it is handed out (null: none).",
            }
        },
        "examples": [{"progress": {"done": 40, "of": 100}}],
    },
    "NackRequest": {
        "type": "object",
        "description": _MEMBERS,
        "properties": {
            "error": {
                "type": ["string", "null"],
                "description": f"What went wrong (cut to {limits.MAX_ERROR_BYTES} bytes).",
            },
            "delay_ms": {
                "type": ["integer", "null"],
                "minimum": 0,
                "maximum": limits.MAX_DELAY_MS,
                "description": "Retry after exactly this long instead of the backoff.",
            },
            "terminal": {
                "type": ["boolean", "null"],
                "description": "true: bury the task now (not with delay_ms).",
            },
        },
        # A terminal nack takes no delay: a buried task is not retried.
        "if": {"properties": {"terminal": {"const": True}}, "required": ["terminal"]},
        "then": {"properties": {"delay_ms": {"type": "null"}}},
        "examples": [{"error": "the SMTP server said 451", "delay_ms": 60000}],
    },
}

# A task of a batch: as POST /jobs takes one, its idempotency key as a member (there is one header
# per request, not per task).
_SCHEMAS["BatchTask"] = {
    **_SCHEMAS["EnqueueRequest"],
    "properties": {
        **_SCHEMAS["EnqueueRequest"]["properties"],
        "idempotency_key": {
            "type": ["string", "null"],
            "minLength": 1,
            "maxLength": limits.MAX_KEY_CHARS,
            "pattern": "^[^\\x00-\\x1f\\x7f]*$",
            "description": "As the Idempotency-Key header of POST /jobs.",
        },
        # In a batch, an earlier item may be named by its index too.
        "after": {
            **_SCHEMAS["EnqueueRequest"]["properties"]["after"],
            "items": {
                "anyOf": [
                    {"type": "string", "minLength": 1},
                    {
                        "type": "integer",
                        "minimum": 0,
                        "description": "The index of an earlier task of the batch (below this "
                        "one's own): a whole graph goes in one request.",
                    },
                ]
            },
        },
    },
    # (unique needs the key: a member here, the header for POST /jobs)
    "if": {"properties": {"unique": {"const": True}}, "required": ["unique"]},
    "then": {
        "required": ["idempotency_key"],
        "properties": {"idempotency_key": {"type": "string"}},
    },
    "examples": [{"payload": {"line": "hello"}, "priority": 5, "idempotency_key": "order-17"}],
}
_SCHEMAS["EnqueueBatchRequest"] = {
    "type": "object",
    "required": ["tasks"],
    "description": _MEMBERS,
    "properties": {
        # (At most MAX_BATCH tasks, said in words: as a maxItems it would invite arrays that are
        # refused for their size first, with 413.)
        "tasks": {"type": "array", "items": _schema("BatchTask")}
    },
}
_SCHEMAS["EnqueuedBatch"] = _object(
    {
        "ids": {"type": "array", "items": {"type": "string", "minLength": 1}},
        "duplicates": {
            "type": "array",
            "items": {"type": "boolean"},
            "description": "For each task, whether its idempotency key matched (its id is then "
            "the first task's).",
        },
    },
    description="The tasks' ids, in the order they were sent.",
)

_SCHEMAS["Deliveries"] = _object(
    {"deliveries": {"type": "array", "items": _schema("Delivery"), "minItems": 1}},
    description="The tasks claimed, each yours until its deadline.",
)
# A settlement of POST /jobs/settle: the task and the lease, as the path and query of an ack.
_SETTLEMENT: Final[Json] = {
    "id": {"type": "string", "minLength": 1, "description": "The task's id."},
    "lease_id": {"type": "string", "minLength": 1, "description": "The delivery's lease."},
}
_SCHEMAS["SettleRequest"] = {
    "type": "object",
    "description": _MEMBERS,
    "properties": {
        "acks": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["id", "lease_id"],
                "properties": {**_SETTLEMENT, "result": {"description": _RESULT_TEXT}},
            },
        },
        "nacks": {
            "type": "array",
            "items": {
                **_SCHEMAS["NackRequest"],
                "required": ["id", "lease_id"],
                "properties": {**_SETTLEMENT, **_SCHEMAS["NackRequest"]["properties"]},
                "examples": [{"id": "0123456789abcdef", "lease_id": "f49cbe1ef2e4fdb1"}],
            },
        },
    },
    "examples": [{"acks": [{"id": "0123456789abcdef", "lease_id": "f49cbe1ef2e4fdb1"}]}],
}
_OUTCOME: Final[Json] = {
    "anyOf": [
        {"type": "null", "description": "Done."},
        _object(
            {
                "error": {"type": "string", "description": "Why it was refused."},
                "status": {
                    "type": "integer",
                    "description": "The status its own request (POST /jobs/{id}/ack or nack) "
                    "would have been answered with: 404 or 409.",
                },
            }
        ),
    ]
}
_SCHEMAS["Settled"] = _object(
    {
        "acks": {"type": "array", "items": _OUTCOME},
        "nacks": {"type": "array", "items": _OUTCOME},
    },
    description="Each ack's and each nack's outcome, in the order they were sent.",
)

# -- schedules and limits (docs/design/schedules.md) ----------------------------------------------

_MIN_EVERY_MS: Final = 1000
_MAX_EVERY_MS: Final = 365 * 24 * 3600 * 1000  # a year
_CRON_TEXT: Final = (
    "A cron rule: five fields (minute hour day-of-month month day-of-week; ranges, steps, lists, "
    "names such as `MON` and `JAN`, `L` and `#`) or a macro: `@yearly` (`@annually`), "
    "`@monthly`, `@weekly`, `@daily` (`@midnight`), `@hourly`. Kept as given."
)
_TIMEZONE_TEXT: Final = (
    "The cron rule's timezone, an IANA name (`Europe/Paris`); only with `cron`. A time in a "
    "skipped hour (daylight saving) fires once just after it, a repeated hour fires once."
)
_EVERY_TEXT: Final = (
    "A fixed interval: the first fire is this long after the schedule is put (or resumed), then "
    "one every `every_ms` after the previous scheduled time."
)
_SCHEMAS["ScheduleName"] = {
    "type": "string",
    "pattern": _QUEUE_NAME_PATTERN,
    "description": f"A schedule's name: {limits.QUEUE_NAME_RULE}.",
    "examples": ["nightly-report"],
}
_SCHEDULE_TASK: Final[Json] = {
    name: _SCHEMAS["EnqueueRequest"]["properties"][name]
    for name in ("max_attempts", "queue", "priority", "timeout_ms", "result_ttl_ms")
}
_SCHEMAS["ScheduleRequest"] = {
    "type": "object",
    "required": ["payload"],
    "description": "A schedule: exactly one of `cron` and `every_ms` (a 400 names the member "
    "that is wrong: a rule that does not parse, an unknown timezone, both or neither), and the "
    "task each fire enqueues, as `POST /jobs` takes it. " + _MEMBERS,
    "properties": {
        "cron": {"type": ["string", "null"], "minLength": 1, "description": _CRON_TEXT},
        "timezone": {
            "type": ["string", "null"],
            "minLength": 1,
            "default": "UTC",
            "description": _TIMEZONE_TEXT,
        },
        "every_ms": {
            "type": ["integer", "null"],
            "minimum": _MIN_EVERY_MS,
            "maximum": _MAX_EVERY_MS,
            "description": _EVERY_TEXT,
        },
        "payload": {
            "description": "The payload of each task it enqueues: any JSON value (null too), "
            "kept byte for byte."
        },
        **_SCHEDULE_TASK,
        "expires_in_ms": {
            **_SCHEMAS["EnqueueRequest"]["properties"]["expires_in_ms"],
            "description": "Drop each task it enqueues (counted `expired`) if it is not handed "
            "out within this long of its fire. Default: never.",
        },
        "paused": {
            "type": ["boolean", "null"],
            "default": False,
            "description": "Put it paused: it does not fire until resumed.",
        },
    },
    "oneOf": [
        {
            "required": ["cron"],
            "properties": {"cron": {"type": "string"}, "every_ms": {"type": "null"}},
        },
        {
            "required": ["every_ms"],
            "properties": {
                "every_ms": {"type": "integer"},
                "cron": {"type": "null"},
                "timezone": {"enum": [None, "UTC"]},  # (UTC: the default, said again)
            },
        },
    ],
    "examples": [
        {"cron": "0 3 * * *", "timezone": "Europe/Paris", "payload": {"report": "nightly"}},
        {"every_ms": 60000, "payload": None, "queue": "ticks"},
    ],
}
_NULLABLE_MS: Final = {"type": ["integer", "null"], "minimum": 0}
_SCHEMAS["Schedule"] = _object(
    {
        "name": _schema("ScheduleName"),
        "cron": {"type": ["string", "null"], "description": "The cron rule; null for an interval."},
        "timezone": {
            "type": ["string", "null"],
            "description": "The cron rule's timezone; null for an interval.",
        },
        "every_ms": {
            "type": ["integer", "null"],
            "minimum": _MIN_EVERY_MS,
            "maximum": _MAX_EVERY_MS,
            "description": "The interval; null for a cron rule.",
        },
        "queue": _schema("QueueName"),
        "payload": {"description": "The payload of each task it enqueues, exactly as put."},
        "priority": _schema("Priority"),
        "max_attempts": {"type": "integer", "minimum": 1, "maximum": limits.MAX_MAX_ATTEMPTS},
        "expires_in_ms": {**_NULLABLE_MS, "description": "As put; null: not set."},
        "timeout_ms": {**_NULLABLE_MS, "description": "As put; null: not set."},
        "result_ttl_ms": {**_NULLABLE_MS, "description": "As put; null: the broker's default."},
        "paused": {"type": "boolean"},
        "created_at": _schema("Timestamp"),
        "updated_at": _schema("Timestamp"),
        "next_fire_at": {
            "anyOf": [_schema("Timestamp"), {"type": "null"}],
            "description": "The scheduled time of its next fire; null while paused.",
        },
        "last_fire_at": {
            "anyOf": [_schema("Timestamp"), {"type": "null"}],
            "description": "The scheduled time of its last fire; null before the first.",
        },
        "last_task_id": {
            "type": ["string", "null"],
            "description": "The task its last fire enqueued; null before the first (or when "
            "that fire's enqueue was refused).",
        },
        "fires": _count("Its fires so far, by every broker."),
    },
    description="A schedule (cron rule or interval) and the task each fire enqueues. Each "
    "fire enqueues exactly one task, on any number of brokers; after downtime it fires once, "
    "for its most recent missed time. A task it enqueued has `schedule` and `scheduled_for`.",
)
_SCHEMAS["Schedules"] = _object(
    {"schedules": {"type": "array", "items": _schema("Schedule")}},
    description="Every schedule, by name.",
)
_RATE_MEMBERS: Final[Json] = {
    "tasks": {"type": "integer", "minimum": 1, "maximum": limits.MAX_RATE_TASKS},
    "per_ms": {"type": "integer", "minimum": 1, "maximum": limits.MAX_RATE_PER_MS},
    "burst": {
        "type": "integer",
        "minimum": 1,
        "maximum": limits.MAX_RATE_BURST,
        "description": "The bucket's capacity: hand-outs it may make at once. Default: `tasks`.",
    },
}
_CONCURRENCY: Final[Json] = {
    "type": ["integer", "null"],
    "minimum": 1,
    "maximum": limits.MAX_CONCURRENCY,
    "description": "At most this many of the queue's tasks handed out at once; null: no limit.",
}
_SCHEMAS["RateLimit"] = _object(
    _RATE_MEMBERS,
    description="At most `tasks` hand-outs per `per_ms`, from a token bucket of `burst` tokens.",
)
_SCHEMAS["Limits"] = _object(
    {
        "rate": {"anyOf": [_schema("RateLimit"), {"type": "null"}]},
        "concurrency": _CONCURRENCY,
    },
    description="A queue's limits; null for a kind it has none of.",
)
_SCHEMAS["LimitsRequest"] = {
    "type": "object",
    "description": "A queue's limits: `rate` and `concurrency`, each null or absent for none "
    "of that kind (both: the queue has no limits). " + _MEMBERS,
    "properties": {
        "rate": {
            "anyOf": [
                {
                    "type": "object",
                    "required": ["tasks", "per_ms"],
                    "additionalProperties": False,
                    "properties": {
                        **_RATE_MEMBERS,
                        "burst": {**_RATE_MEMBERS["burst"], "type": ["integer", "null"]},
                    },
                },
                {"type": "null"},
            ],
            "description": "A token bucket per queue, refilled at `tasks` per `per_ms`; each "
            "hand-out takes a token. It starts full. Members other than these three are "
            "refused (400).",
        },
        "concurrency": _CONCURRENCY,
    },
    "examples": [{"rate": {"tasks": 20, "per_ms": 1000, "burst": 20}, "concurrency": 4}],
}
_SCHEMAS["QueueLimits"] = _object(
    {
        "queue": _schema("QueueName"),
        "limits": {
            "anyOf": [_schema("Limits"), {"type": "null"}],
            "description": "The limits in force; null: none.",
        },
    }
)

# -- responses ----------------------------------------------------------------------------------

_ERROR: Final = _schema("Error")


def _header(description: str, schema: Json) -> Json:
    """A header the answer always carries."""
    return {"description": description, "required": True, "schema": schema}


_RESPONSES: Final[Json] = {
    "MalformedRequest": _json(
        _ERROR, "Malformed HTTP, or a bad parameter (the message names it). Any route."
    ),
    "Unauthorized": _json(
        _ERROR,
        "With a token file: no token, an unknown one, not `Bearer …`, or two headers.",
        {"WWW-Authenticate": _header('Always `Bearer realm="wq"`.', {"type": "string"})},
    ),
    "Forbidden": _json(_ERROR, "With a token file: a valid token without the scope needed."),
    "NoSuchPath": _json(
        _ERROR,
        "The path names no route: a path parameter that is empty, holds `/`, `{` or `}`, "
        "or is `.` or `..` (which clients resolve away).",
    ),
    "RequestTimeout": _json(
        _ERROR,
        "The request line and headers (or the body) did not arrive in time; the connection is "
        "closed.",
    ),
    "PayloadTooLarge": _json(
        _ERROR,
        "A request body (or a payload) over `-max-body-bytes` (1 MiB by default); the "
        "connection is closed.",
    ),
    "UnsupportedMediaType": _json(
        _ERROR,
        "A compressed body (`Content-Encoding` other than `identity`, or a transfer-coding "
        "other than `chunked`): bodies are never inflated. The connection is closed.",
        {"Accept-Encoding": _header("Always `identity`.", {"type": "string"})},
    ),
    "ExpectationFailed": _json(
        _ERROR, "An `Expect` header other than `100-continue`; the connection is closed."
    ),
    "TooManyRequests": _json(
        _ERROR,
        "A limit is reached (`-max-tasks`, `-max-waiters` or `-max-queues`): try again later.",
        {
            "Retry-After": _header(
                "Seconds to wait before trying again.", {"type": "integer", "minimum": 1}
            )
        },
    ),
    "Unavailable": _json(_ERROR, "The broker is shutting down, or its store failed."),
    "MethodNotAllowed": _json(
        _ERROR,
        "A method the path does not take (any path; no operation here answers it).",
        {"Allow": _header("The methods the path takes.", {"type": "string"})},
    ),
}


def _linked(answer: Json, **links: Json) -> Json:
    """``answer`` with links to the operations (by id) its body gives the parameters of."""
    answer["links"] = {
        operation: {"operationId": operation, "parameters": parameters}
        for operation, parameters in links.items()
    }
    return answer


# A delivery's task, held under its lease: what ack, nack, extend and release take.
_HELD: Final = {"id": "$response.body#/task/id", "lease_id": "$response.body#/lease_id"}


def _response(name: str) -> Json:
    return _ref("responses", name)


# -- parameters ---------------------------------------------------------------------------------


def _query(name: str, schema: Json, description: str, required: bool = False) -> Json:
    return {
        "name": name,
        "in": "query",
        "required": required,
        "schema": schema,
        "description": description,
    }


def _path(name: str, description: str, schema: Json | None = None) -> Json:
    return {
        "name": name,
        "in": "path",
        "required": True,
        "schema": schema or {"type": "string", "minLength": 1},
        "description": description,
    }


_TASK_ID: Final = _path("id", "The task's id.")
# A fixed word at the same place is another operation (OpenAPI matches a concrete path first):
# `GET /jobs/next` claims, and `DELETE /dlq/requeue` is no purge (405).
_LOOKUP_ID: Final = _path("id", "The task's id (`next` is none: `GET /jobs/next` claims).")
_DEAD_ID: Final = _path("id", "The dead task's id (`requeue` is none: that is `/dlq/requeue`).")
_LEASE_ID: Final = _query(
    "lease_id",
    {"type": "string", "minLength": 1},
    "The lease id the task was handed out with.",
    required=True,
)
_LEASE_MS: Final = _query(
    "lease_ms",
    {"type": "integer", "minimum": 1, "default": limits.DEFAULT_LEASE_MS},
    f"How long the task is yours, in ms; values above {limits.MAX_LEASE_MS} (5 minutes) are "
    f"clamped to {limits.MAX_LEASE_MS}.",
)

# A claim's parameters (GET /jobs/next and GET /jobs/next/batch).
_CLAIMING: Final = (
    _query(
        "wait_ms",
        {"type": "integer", "minimum": 0, "default": limits.DEFAULT_WAIT_MS},
        f"How long to wait for a task, in ms; values above {limits.MAX_WAIT_MS} are "
        f"clamped to {limits.MAX_WAIT_MS}; 0 answers at once.",
    ),
    _LEASE_MS,
    _query(
        "queue",
        {"type": "string", "pattern": _QUEUE_LIST_PATTERN},
        f"The queues to claim from, comma-separated, at most "
        f"{limits.MAX_QUEUES_PER_CLAIM} (default: `default`).",
    ),
)
_ONE_QUEUE: Final = _query("queue", _schema("QueueName"), "Only this queue (default: all).")

# -- operations ---------------------------------------------------------------------------------

_SCOPE_TEXT: Final = {
    "produce": "enqueue",
    "consume": "claim, ack, nack, extend and release; list a queue's tasks",
    "admin": "the dead-letter queue; pausing, emptying and deleting queues; cancelling tasks; "
    "listing a queue's tasks; changing schedules and queue limits",
    "metrics": "scrape `GET /metrics` (unless the broker runs with `-metrics-public`)",
}


def _security(method: str, path: str, public: Collection[str]) -> list[Json]:
    route = f"{method.upper()} {path}"
    rule = Access.OPEN if route in public else http_rule(method.upper(), path)
    if rule is Access.OPEN:
        return []
    if rule is Access.ANY:
        return [{"bearer": []}]
    return [{"bearer": [scope]} for scope in scopes_of(rule)]  # (alternatives: any one will do)


def _operation(
    method: str,
    path: str,
    *,
    summary: str,
    description: str,
    answers: Json,
    parameters: list[Json] | None = None,
    body: Json | None = None,
    tag: str,
    public: Collection[str],
    store: bool = True,
) -> Json:
    """One operation, with the answers every route shares added to ``answers``: the transport's,
    the token rules' (``public``: routes opened to all), and 503 if it reaches the store."""
    security = _security(method, path, public)
    responses: Json = dict(answers)
    responses.setdefault("400", _response("MalformedRequest"))
    if security:
        responses["401"] = _response("Unauthorized")
        if security[0]["bearer"]:
            responses["403"] = _response("Forbidden")
    if "{" in path:
        responses.setdefault("404", _response("NoSuchPath"))
    responses["408"] = _response("RequestTimeout")
    responses["413"] = _response("PayloadTooLarge")
    responses["415"] = _response("UnsupportedMediaType")
    responses["417"] = _response("ExpectationFailed")
    if store:
        responses["503"] = _response("Unavailable")
    operation: Json = {
        "operationId": summary,
        "summary": _summary(description),
        "description": description,
        "tags": [tag],
        "security": security,
        "responses": dict(sorted(responses.items())),
    }
    if parameters:
        operation["parameters"] = parameters
    if body is not None:
        operation["requestBody"] = body
    return operation


_EXTENSION = "An extension (not in the specification): "


def _summary(description: str) -> str:
    """An operation's one-line summary: its description's first clause (up to the first ``. ``,
    ``: `` or ``; `` outside parentheses), without the extension note."""
    text = description.removeprefix(_EXTENSION)
    depth = 0
    for i, c in enumerate(text):
        depth += (c == "(") - (c == ")")
        if depth == 0 and c in ".:;" and text[i + 1 : i + 2] in (" ", ""):
            text = text[:i]
            break
    return text[:1].upper() + text[1:]


def _paths(public: Collection[str]) -> Json:
    paths: Json = {}

    def add(method: str, path: str, **kw: Any) -> None:
        paths.setdefault(path, {})[method] = _operation(method, path, public=public, **kw)

    add(
        "post",
        "/jobs",
        summary="enqueue",
        tag="tasks",
        description=(
            "Enqueue a task. With an `Idempotency-Key` seen in the same queue within the "
            "broker's window (`-dedup-window-ms`, five minutes by default), nothing is "
            "created: 200 with the first task's id. With `after`, the task waits for other "
            "tasks to succeed (a workflow); `result_ttl_ms` says how long its result is kept. "
            "The body's `Content-Type` is not checked."
        ),
        parameters=[
            {
                "name": "Idempotency-Key",
                "in": "header",
                "required": False,
                "schema": {
                    "type": "string",
                    "minLength": 1,
                    "maxLength": limits.MAX_KEY_CHARS,
                    "pattern": "^[^\\x00-\\x1f\\x7f]*$",
                },
                "description": (
                    f"1 to {limits.MAX_KEY_CHARS} characters without control characters, "
                    "given once; its bytes are read as UTF-8 (bytes that are not are a 400)."
                ),
            }
        ],
        body={"required": True, "content": {JSON: {"schema": _schema("EnqueueRequest")}}},
        answers={
            "201": _linked(
                _json(_schema("Enqueued"), "Enqueued."),
                lookup={"id": "$response.body#/id"},
                claim={"wait_ms": "0"},
                result={"id": "$response.body#/id"},
            ),
            "200": _json(_schema("Duplicate"), "The idempotency key matched: a duplicate."),
            "400": _json(
                _ERROR,
                "A bad body or key: invalid JSON or UTF-8, not an object, no `payload`, a "
                "member of the wrong type or out of range, an `after` naming a task that is not "
                "live (or malformed HTTP).",
            ),
            "413": _response("PayloadTooLarge"),
            "429": _response("TooManyRequests"),
        },
    )
    add(
        "get",
        "/jobs",
        summary="listTasks",
        tag="tasks",
        description=(
            "A page of a queue's tasks in one state, each with its state (never its lease id): "
            "ready in the order they would be claimed (priority high to low, then oldest "
            "first), delayed by due time, handed out by lease deadline, dead by burial, "
            "waiting by enqueue, succeeded by finish time. Pass "
            "`next_cursor` back as `cursor` for the next page: a task that stays in its state "
            "is never repeated nor skipped (a handed-out task whose lease is extended moves to "
            "its new deadline). `HEAD` too."
        ),
        parameters=[
            _query("queue", _schema("QueueName"), "The queue (default: `default`)."),
            _query(
                "state",
                {"type": "string", "enum": list(LIST_STATES), "default": LIST_STATES[0]},
                "The state listed.",
            ),
            _query(
                "limit",
                {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": limits.MAX_LIST_LIMIT,
                    "default": limits.DEFAULT_LIST_LIMIT,
                },
                "At most this many tasks.",
            ),
            _query(
                "cursor",
                {"type": "string", "pattern": "^[A-Za-z0-9_-]*$"},
                "Where the previous page ended: its `next_cursor`, as it came (for the same "
                "state; empty: from the start).",
            ),
        ],
        answers={
            "200": _json(_schema("TaskPage"), "The page."),
            "400": _json(
                _ERROR,
                "A bad parameter, named: not a queue name, an unknown state, a limit out of "
                "range, a cursor this broker did not give or gave for another state (or "
                "malformed HTTP).",
            ),
        },
    )
    add(
        "post",
        "/jobs/batch",
        summary="enqueueBatch",
        tag="tasks",
        description=(
            "An extension (not in the specification): enqueue many tasks in one request, all "
            "or none, as gRPC's EnqueueBatch. Each task is what POST /jobs takes, its "
            "idempotency key as the member `idempotency_key`. An invalid task is named by its "
            f"index (`tasks[3].priority ...`) and nothing is enqueued. At most {limits.MAX_BATCH} "
            "tasks, and the body within the broker's body limit. The `Idempotency-Key` header is "
            "refused (400): it cannot say which task it keys. A task's `after` may name an "
            "earlier task of the batch by its index (`[0, 2]`): a whole graph of tasks in one "
            "request; an index that is not of an earlier task is refused, named "
            "(`tasks[2].after[0] ...`)."
        ),
        body={"required": True, "content": {JSON: {"schema": _schema("EnqueueBatchRequest")}}},
        answers={
            "201": _json(_schema("EnqueuedBatch"), "Enqueued (or matched), in order."),
            "400": _json(
                _ERROR,
                "A bad body: invalid JSON or UTF-8, no `tasks` array, a task that is not an "
                "object or that POST /jobs would refuse (named by its index), too many tasks.",
            ),
            "413": _response("PayloadTooLarge"),
            "429": _response("TooManyRequests"),
        },
    )
    add(
        "get",
        "/jobs/next",
        summary="claim",
        tag="tasks",
        description=(
            "Claim the next ready task of the queues listed (in order of preference; then the "
            "highest priority, then the oldest), long-polling up to `wait_ms` for one. `HEAD` "
            "is refused (405): it would claim."
        ),
        parameters=[
            *_CLAIMING,
        ],
        answers={
            "200": _linked(
                _json(_schema("Delivery"), "A task, now yours until the deadline."),
                **{op: _HELD for op in ("ack", "nack", "extend", "release")},
                lookup={"id": "$response.body#/task/id"},
            ),
            "204": _empty("The wait elapsed with nothing available: ask again."),
            "429": _response("TooManyRequests"),
        },
    )
    add(
        "get",
        "/jobs/next/batch",
        summary="claimBatch",
        tag="tasks",
        description=(
            "An extension (not in the specification): claim up to `max` ready tasks in one "
            "long-poll, as GET /jobs/next claims one. It waits up to `wait_ms` for the first, "
            "then answers with as many as are ready with it (it does not wait for more). "
            "`HEAD` is refused (405): it would claim."
        ),
        parameters=[
            _query(
                "max",
                {"type": "integer", "minimum": 1, "default": 1},
                f"At most this many tasks; values above {limits.MAX_CLAIM_BATCH} are clamped "
                f"to {limits.MAX_CLAIM_BATCH}.",
            ),
            *_CLAIMING,
        ],
        answers={
            "200": _json(_schema("Deliveries"), "One task or more, yours until their deadlines."),
            "204": _empty("The wait elapsed with nothing available: ask again."),
            "429": _response("TooManyRequests"),
        },
    )
    add(
        "post",
        "/jobs/settle",
        summary="settle",
        tag="tasks",
        description=(
            "An extension (not in the specification): many acks and nacks in one request, as "
            "a gRPC stream settles them: the acks, then the nacks, each as its own request would "
            "settle it (an ack's `result` as POST /jobs/{id}/ack takes it, a nack's members as "
            "POST /jobs/{id}/nack takes them). Each one's outcome "
            "comes back in order; a refused one (404, 409) changes nothing. A malformed one "
            "(what its own request would answer 400) refuses the request, naming it "
            f"(`nacks[2].delay_ms ...`), and nothing is settled. At most {limits.MAX_BATCH} in all."
        ),
        body={"required": True, "content": {JSON: {"schema": _schema("SettleRequest")}}},
        answers={
            "200": _json(_schema("Settled"), "Each one's outcome, in order."),
            "400": _json(
                _ERROR,
                "A bad body: invalid JSON or UTF-8, not an object, `acks` or `nacks` not an "
                "array of objects, one of them malformed (named), too many (or malformed HTTP).",
            ),
            "413": _response("PayloadTooLarge"),
        },
    )
    add(
        "get",
        "/jobs/{id}",
        summary="lookup",
        tag="tasks",
        description=(
            "A task and its state (never its lease id); with the tasks that wait for it (or "
            "waited for it) and are not gone, if any (`children`). `HEAD` too."
        ),
        parameters=[_LOOKUP_ID],
        answers={
            "200": _json(_schema("TaskDetail"), "The task."),
            "404": _json(
                _ERROR,
                "No such task: unknown, acked without a result (or its result's time is up), "
                "cancelled, expired or purged (or no such path).",
            ),
        },
    )
    add(
        "get",
        "/jobs/{id}/result",
        summary="result",
        tag="tasks",
        description=(
            "How a task ended, once it has: succeeded (its result, when it was acked with one), "
            "or dead (its last error); waiting up to `wait_ms` for it to end (a long poll, as a "
            "claim's; many waiters of one task share one wake-up, on any broker of a cluster). "
            "A task that was cancelled, expired or acked without a result while the caller "
            "waited is answered so; afterwards it is gone (404). `HEAD` too."
        ),
        parameters=[
            _LOOKUP_ID,
            _query(
                "wait_ms",
                {"type": "integer", "minimum": 0, "default": limits.DEFAULT_RESULT_WAIT_MS},
                f"How long to wait for the task to end, in ms; values above {limits.MAX_WAIT_MS} "
                f"are clamped to {limits.MAX_WAIT_MS}; 0 (the default) answers at once.",
            ),
        ],
        answers={
            "200": _json(_schema("Result"), "It has ended: how."),
            "204": _empty(
                "It is still pending (ready, delayed, handed out or waiting) when the wait ends."
            ),
            "400": _json(_ERROR, "A bad `wait_ms` (or malformed HTTP)."),
            "404": _json(
                _ERROR,
                "No such task: unknown, or gone before the call (acked without a result, its "
                "result's time up, cancelled, expired, purged), or no such path.",
            ),
            "429": _response("TooManyRequests"),
        },
    )
    add(
        "delete",
        "/jobs/{id}",
        summary="cancel",
        tag="tasks",
        description=(
            "Cancel a task. A ready or delayed one is gone at once (counted `cancelled`): 204. "
            "A handed-out one becomes cancelling: 202; it will not be retried, its holder is "
            'told (on a gRPC stream at once, else at its next extend: 409 with `"cancelled": '
            "true`); its ack still counts, its nack or its lease running out drops it (counted "
            "`cancelled`). A dead one is purged, as `DELETE /dlq/{id}`: 204. A waiting one is "
            "gone too, and so is every task waiting for it (each counted `cancelled`); the "
            "tasks waiting for a cancelled ready or delayed one are buried."
        ),
        parameters=[_path("id", "The task's id (`next`, `batch`, `settle` are none).")],
        answers={
            "204": _empty("Gone: cancelled (it was ready or delayed) or purged (it was dead)."),
            "202": _json(_schema("Cancelling"), "A worker holds it: cancelling."),
            "404": _json(_ERROR, "No such task: unknown, acked or gone (or no such path)."),
        },
    )
    settle = [_TASK_ID, _LEASE_ID]
    not_held = _json(_ERROR, "Nobody holds the task: unknown, settled, delayed, dead, expired.")
    other_lease = _json(_ERROR, "The task is held under a different lease.")
    add(
        "post",
        "/jobs/{id}/ack",
        summary="ack",
        tag="tasks",
        description=(
            'Report success. An optional body `{"result": ...}` is the task\'s result: the task '
            "is kept, succeeded, for its result TTL (`GET /jobs/{id}/result`), and the tasks "
            "waiting for it get it with their deliveries. No body, an empty one or `{}`: no "
            "result (the task is forgotten). Either way, the tasks waiting for it whose last "
            "pending parent it was become ready."
        ),
        parameters=settle,
        body={"required": False, "content": {JSON: {"schema": _schema("AckRequest")}}},
        answers={
            "204": _empty("Acked."),
            "400": _json(
                _ERROR,
                "No `lease_id`, or a bad body: invalid JSON or UTF-8, not an object (or "
                "malformed HTTP). The task is not acked.",
            ),
            "404": not_held,
            "409": other_lease,
            "413": _response("PayloadTooLarge"),
        },
    )
    add(
        "post",
        "/jobs/{id}/nack",
        summary="nack",
        tag="tasks",
        description=(
            "Report failure: retry after the backoff (or exactly `delay_ms`), or bury the task "
            "(`terminal`, or no attempts left). A refused nack changes nothing."
        ),
        parameters=settle,
        body={"required": False, "content": {JSON: {"schema": _schema("NackRequest")}}},
        answers={
            "204": _empty("Nacked."),
            "404": not_held,
            "409": other_lease,
            "413": _response("PayloadTooLarge"),
        },
    )
    add(
        "post",
        "/jobs/{id}/extend",
        summary="extend",
        tag="tasks",
        description=(
            "Extend a lease: the new deadline is now + `lease_ms`, never past the task's time "
            "limit (hand-out + `timeout_ms`: cut to it). An optional body records the work's "
            "`progress`, shown by `GET /jobs/{id}` while the task is handed out."
        ),
        parameters=[*settle, _LEASE_MS],
        body={"required": False, "content": {JSON: {"schema": _schema("ExtendRequest")}}},
        answers={
            "200": _json(_schema("Deadline"), "The new deadline."),
            "404": not_held,
            "409": _json(
                _ERROR,
                "Not extended: the task is held under a different lease; or it was cancelled "
                '(with `"cancelled": true`: stop, do not retry it); or its lease is at its time '
                "limit already (it runs out, and the task is retried or buried).",
            ),
            "413": _response("PayloadTooLarge"),
        },
    )
    add(
        "post",
        "/jobs/{id}/release",
        summary="release",
        tag="tasks",
        description=(
            "An extension (not in the specification): hand the task back without counting the "
            "attempt (a worker that is stopping): it is ready again at the head of its queue, "
            "its `attempts` as before it was handed out (a cancelling task is gone, counted "
            "`cancelled`). It counts no failure: `delivered` goes down by one, as the attempt "
            "it gives back. A refused release changes nothing."
        ),
        parameters=settle,
        answers={
            "204": _empty("Released."),
            "404": not_held,
            "409": other_lease,
        },
    )
    add(
        "get",
        "/stats",
        summary="stats",
        tag="broker",
        description="Gauges and lifetime totals, of the broker or of one queue. `HEAD` too.",
        parameters=[
            _query("queue", _schema("QueueName"), "Only this queue (one never seen: all zeros).")
        ],
        answers={"200": _json(_schema("Stats"), "The gauges and totals.")},
    )
    add(
        "get",
        "/queues",
        summary="queues",
        tag="queues",
        description="Every queue known, sorted by name. `HEAD` too.",
        answers={"200": _json({"type": "array", "items": _schema("Queue")}, "The queues.")},
    )
    for verb, what in (("pause", "Stop handing out"), ("resume", "Hand out again")):
        add(
            "post",
            f"/queues/{{name}}/{verb}",
            summary=verb,
            tag="queues",
            description=(
                f"{what} the queue's tasks (idempotent; a queue never seen is created). "
                "A body, if any, is ignored."
            ),
            parameters=[_path("name", "The queue's name.", _schema("QueueName"))],
            answers={
                "204": _empty("Done."),
                "400": _json(_ERROR, "Not a queue name (or malformed HTTP)."),
                "429": _response("TooManyRequests"),
            },
        )
    add(
        "post",
        "/queues/{name}/empty",
        summary="emptyQueue",
        tag="queues",
        description=(
            "Cancel every ready, delayed and waiting task of the queue (counted `cancelled`, "
            "each as `DELETE /jobs/{id}` would); handed-out ones run their course. A body, if "
            "any, is ignored."
        ),
        parameters=[_path("name", "The queue's name.", _schema("QueueName"))],
        answers={
            "200": _json(_schema("Emptied"), "How many tasks were cancelled."),
            "400": _json(_ERROR, "Not a queue name (or malformed HTTP)."),
            "404": _json(_ERROR, "No queue of that name was ever seen."),
        },
    )
    add(
        "delete",
        "/queues/{name}",
        summary="deleteQueue",
        tag="queues",
        description=(
            "Forget a queue that holds nothing (its four gauges and `waiting` 0): it leaves "
            "`GET /queues`, its paused flag, its totals and the results it holds are forgotten "
            "(the broker's totals keep what it counted). A task enqueued to it later makes it "
            "again, new."
        ),
        parameters=[_path("name", "The queue's name.", _schema("QueueName"))],
        answers={
            "204": _empty("Deleted."),
            "400": _json(_ERROR, "Not a queue name (or malformed HTTP)."),
            "404": _json(_ERROR, "No queue of that name was ever seen."),
            "409": _json(
                _ERROR, "The queue holds tasks: the message names how many in each state."
            ),
        },
    )
    _limits(add)
    _schedules(add)
    add(
        "get",
        "/dlq",
        summary="dead_letters",
        tag="dead letters",
        description="The dead tasks, oldest burial first. `HEAD` too.",
        parameters=[
            _query("limit", {"type": "integer", "minimum": 0}, "At most this many."),
            _ONE_QUEUE,
        ],
        answers={"200": _json({"type": "array", "items": _schema("Task")}, "The dead tasks.")},
    )
    add(
        "post",
        "/dlq/requeue",
        summary="requeue_all",
        tag="dead letters",
        description="Give every dead task (of one queue) a clean start.",
        parameters=[_ONE_QUEUE],
        answers={"200": _json(_schema("Requeued"), "How many were requeued.")},
    )
    add(
        "post",
        "/dlq/{id}/requeue",
        summary="requeue",
        tag="dead letters",
        description="Give a dead task a clean start: attempts 0, no last error, ready again.",
        parameters=[_TASK_ID],
        answers={
            "204": _empty("Requeued."),
            "404": _json(_ERROR, "The task is not in the dead-letter queue."),
        },
    )
    add(
        "delete",
        "/dlq/{id}",
        summary="purge",
        tag="dead letters",
        description="Drop a dead task for good.",
        parameters=[_DEAD_ID],
        answers={
            "204": _empty("Purged."),
            "404": _json(_ERROR, "The task is not in the dead-letter queue."),
        },
    )
    add(
        "get",
        "/healthz",
        summary="health",
        tag="broker",
        description=(
            "Liveness, without a token. `HEAD` too. 200 while the broker's process and event loop "
            "answer, whatever its store says (that is `/readyz`)."
        ),
        answers={"200": _json(_schema("Health"), 'Alive: `{"status": "ok"}`.')},
    )
    add(
        "get",
        "/readyz",
        summary="ready",
        tag="broker",
        description=(
            "Readiness, without a token. `HEAD` too. 200 while the broker can serve; 503 while "
            "its store cannot be reached (as its probe found it, within a second or two: every "
            "broker of a cluster says the same) or it is shutting down. For a load balancer's "
            "health check and an orchestrator's readiness probe."
        ),
        answers={
            "200": _json(_schema("Health"), 'Ready: `{"status": "ready"}`.'),
            "503": _json(_schema("Health"), "Shutting down, or the store cannot be reached."),
        },
    )
    add(
        "get",
        PATH,
        summary="openapi",
        tag="broker",
        description="This document, without a token. `HEAD` too.",
        store=False,
        answers={"200": _json({"type": "object"}, "The OpenAPI 3.1 document.")},
    )
    add(
        "get",
        METRICS,
        summary="metrics",
        tag="broker",
        description=(
            "The Prometheus text format (version 0.0.4): per queue gauges, the totals as "
            "counters, latency histograms, requests by route and status. With a token file, "
            "a token with the `metrics` scope, unless the broker runs with `-metrics-public`. "
            "`HEAD` too."
        ),
        store=False,
        answers={
            "200": {
                "description": "The metrics.",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            }
        },
    )
    _dashboard(add)
    return paths


def _limits(add: Callable[..., None]) -> None:
    """``PUT`` and ``DELETE /queues/{name}/limits`` (docs/design/schedules.md)."""
    name = [_path("name", "The queue's name.", _schema("QueueName"))]
    add(
        "put",
        "/queues/{name}/limits",
        summary="setLimits",
        tag="queues",
        description=(
            "Set a queue's rate and concurrency limits (replacing those it had; a queue never "
            "seen is created). They hold over every worker, and every broker of a shared store: "
            "a claim takes from a limited queue at most what its limits allow, then moves on to "
            "the next queue it names. Both null or absent: no limits (as `DELETE`)."
        ),
        parameters=name,
        body={"required": True, "content": {JSON: {"schema": _schema("LimitsRequest")}}},
        answers={
            "200": _json(_schema("QueueLimits"), "The limits in force."),
            "400": _json(
                _ERROR,
                "Not a queue name, or a bad body, named: invalid JSON or UTF-8, not an object, "
                "a `rate` that is not an object or lacks `tasks` or `per_ms`, a member of the "
                "wrong type or out of range (or malformed HTTP).",
            ),
            "413": _response("PayloadTooLarge"),
            "429": _response("TooManyRequests"),
        },
    )
    add(
        "delete",
        "/queues/{name}/limits",
        summary="clearLimits",
        tag="queues",
        description="Remove a queue's limits (it hands out as fast and as many as asked).",
        parameters=name,
        answers={
            "204": _empty("It has no limits."),
            "400": _json(_ERROR, "Not a queue name (or malformed HTTP)."),
            "404": _json(_ERROR, "No queue of that name was ever seen (or no such path)."),
        },
    )


def _schedules(add: Callable[..., None]) -> None:
    """The routes of schedules (docs/design/schedules.md)."""
    name = [_path("name", "The schedule's name.", _schema("ScheduleName"))]
    bad_name = _json(_ERROR, "Not a schedule name (or malformed HTTP).")
    unknown = _json(_ERROR, "No schedule of that name (or no such path).")
    add(
        "get",
        "/schedules",
        summary="listSchedules",
        tag="schedules",
        description="Every schedule, by name. `HEAD` too.",
        answers={"200": _json(_schema("Schedules"), "The schedules.")},
    )
    add(
        "put",
        "/schedules/{name}",
        summary="putSchedule",
        tag="schedules",
        description=(
            "Create or replace a schedule. A replaced one keeps its creation time, its fires "
            "and its last fire; its next fire is the first time of its rule after now (an "
            "interval's: `every_ms` from now). The task each fire enqueues has `schedule` (the "
            "name) and `scheduled_for` (the fire's time) in its view; its `expires_in_ms` runs "
            "from the fire."
        ),
        parameters=name,
        body={"required": True, "content": {JSON: {"schema": _schema("ScheduleRequest")}}},
        answers={
            "200": _json(_schema("Schedule"), "The schedule, as put."),
            "400": _json(
                _ERROR,
                "Not a schedule name, or a bad body, named: invalid JSON or UTF-8, not an "
                "object, no `payload`, both `cron` and `every_ms` or neither, a cron rule that "
                "does not parse, an unknown timezone, a member of the wrong type or out of "
                "range (or malformed HTTP).",
            ),
            "413": _response("PayloadTooLarge"),
            "429": _response("TooManyRequests"),
        },
    )
    add(
        "get",
        "/schedules/{name}",
        summary="getSchedule",
        tag="schedules",
        description="One schedule. `HEAD` too.",
        parameters=name,
        answers={
            "200": _json(_schema("Schedule"), "The schedule."),
            "400": bad_name,
            "404": unknown,
        },
    )
    add(
        "delete",
        "/schedules/{name}",
        summary="deleteSchedule",
        tag="schedules",
        description="Delete a schedule: it fires no more (the tasks it enqueued stay).",
        parameters=name,
        answers={"204": _empty("Deleted."), "400": bad_name, "404": unknown},
    )
    for verb, what in (
        ("pause", "Stop a schedule's fires until it is resumed (idempotent)"),
        ("resume", "Fire again, from the first time of its rule after now (idempotent)"),
    ):
        add(
            "post",
            f"/schedules/{{name}}/{verb}",
            summary=f"{verb}Schedule",
            tag="schedules",
            description=f"{what}. A body, if any, is ignored.",
            parameters=name,
            answers={
                "200": _json(_schema("Schedule"), "The schedule."),
                "400": bad_name,
                "404": unknown,
            },
        )


# The dashboard's files, by the types it serves (wqbroker.http.dashboard).
_ASSET_TYPES: Final = (
    "text/html",
    "text/javascript",
    "text/css",
    "image/svg+xml",
    "image/png",
    "text/plain",
)


def _dashboard(add: Callable[..., None]) -> None:
    """``GET /ui``, ``GET /ui/`` (the page) and ``GET /ui/{file}`` (what it loads)."""
    cached = {
        "ETag": _header("The file's version.", {"type": "string"}),
        "Cache-Control": _header("How long to keep it.", {"type": "string"}),
    }
    unchanged = {
        "description": "`If-None-Match` names the file's `ETag`: unchanged.",
        "headers": cached,
    }
    files = {
        "Content-Security-Policy": _header("Only the broker's own origin.", {"type": "string"}),
        **cached,
    }
    if_none_match = {
        "name": "If-None-Match",
        "in": "header",
        "required": False,
        "schema": {"type": "string"},
        "description": "An `ETag` from before: 304 if the file is still the same.",
    }
    page = {
        "200": {
            "description": "The dashboard's page.",
            "headers": files,
            "content": {"text/html": {"schema": {"type": "string"}}},
        },
        "304": unchanged,
    }
    for path in ("/ui", "/ui/"):
        add(
            "get",
            path,
            summary="dashboard" if path == "/ui" else "dashboard_index",
            tag="dashboard",
            description=(
                "The dashboard (static files; no token: the page asks for one when the API "
                "answers 401, and sends it with its own calls). `HEAD` too."
            ),
            store=False,
            parameters=[if_none_match],
            answers=page,
        )
    add(
        "get",
        "/ui/{file}",
        summary="dashboard_file",
        tag="dashboard",
        description="A file the dashboard's page loads. `HEAD` too.",
        store=False,
        parameters=[
            _path("file", "The file's path under the dashboard (`vendor/...` holds a `/`)."),
            if_none_match,
        ],
        answers={
            "200": {
                "description": "The file.",
                "headers": files,
                "content": {media: {"schema": {}} for media in _ASSET_TYPES},
            },
            "304": unchanged,
            "404": _json(_ERROR, "No such file in the dashboard."),
        },
    )


def build(*, metrics_public: bool = False) -> Json:
    """The document; ``metrics_public``: as served by a broker run with ``-metrics-public``."""
    scopes = "\n".join(f"- `{s}`: {_SCOPE_TEXT.get(s, s)}" for s in SCOPES)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "wq broker HTTP API",
            "version": "1",
            "description": (
                "A job-queue broker: producers enqueue tasks, workers claim them under a lease "
                "and ack or nack them; failures are retried with backoff, and tasks out of "
                "attempts go to the dead-letter queue.\n\n"
                'Every error answer is JSON, `{"error": "..."}` (the `Error` schema), '
                "naming the problem. An unknown path answers 404, and a method a path does not "
                "take 405 with an `Allow` header (the response `MethodNotAllowed`). `HEAD` is "
                "allowed on every `GET` except `GET /jobs/next`, which claims a task. "
                "Timestamps are RFC 3339 in UTC with microseconds."
            ),
        },
        "tags": [
            {"name": "tasks", "description": "Enqueue, claim, settle, look up."},
            {
                "name": "queues",
                "description": "Named queues: pausing, emptying, deleting them; their limits.",
            },
            {"name": "dead letters", "description": "Tasks that ran out of attempts."},
            {
                "name": "schedules",
                "description": "Tasks enqueued on a cron rule or at a fixed interval.",
            },
            {"name": "broker", "description": "Counters, health, metrics and this document."},
            {"name": "dashboard", "description": "The web dashboard's static files."},
        ],
        "paths": _paths((f"GET {METRICS}",) if metrics_public else ()),
        "components": {
            "schemas": _SCHEMAS,
            "responses": _RESPONSES,
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": (
                        "Only with `-token-file`: `Authorization: Bearer TOKEN`, a token of the "
                        "file. Without a token file, no operation needs one. Each operation "
                        "lists the scope it needs (none: any valid token). The scopes:\n" + scopes
                    ),
                }
            },
        },
    }


DOCUMENT: Final[Json] = build()
"""The document (of a broker without ``-metrics-public``)."""

_BODIES: Final = {
    public: json.dumps(build(metrics_public=public), separators=(",", ":")).encode("utf-8")
    for public in (False, True)
}


def handler(*, metrics_public: bool = False) -> Callable[[web.Request], Awaitable[web.Response]]:
    """The handler of ``GET /openapi.json``, for a broker with or without ``-metrics-public``."""
    body = _BODIES[metrics_public]

    async def serve(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type=JSON)

    return serve
