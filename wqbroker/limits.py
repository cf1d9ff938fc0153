"""The spec's defaults and caps, our own limits, and the checks that apply them.

Every value a client sends passes through one of these functions (called by the service, never by a
protocol adapter), so a rule holds the same over every protocol. Each raises
:class:`~wqbroker.errors.InvalidArgument` (or PayloadTooLarge) with a message naming the field.
Durations come back in seconds.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Final, Protocol

from wqbroker import codec
from wqbroker.errors import InvalidArgument, PayloadTooLarge
from wqbroker.models import DEFAULT_QUEUE, LIST_STATES, Limits, RateLimit, Schedule, ScheduleTask

# The spec's defaults and caps, and ours on what it leaves open, as the wire contract states them
# (wqwire.defaults: the client reads the same figures).
from wqwire.defaults import DEFAULT_LEASE_MS as DEFAULT_LEASE_MS
from wqwire.defaults import DEFAULT_MAX_ATTEMPTS as DEFAULT_MAX_ATTEMPTS
from wqwire.defaults import DEFAULT_MAX_BODY
from wqwire.defaults import DEFAULT_WAIT_MS as DEFAULT_WAIT_MS
from wqwire.defaults import MAX_BATCH as MAX_BATCH
from wqwire.defaults import MAX_CLAIM_BATCH as MAX_CLAIM_BATCH
from wqwire.defaults import MAX_LEASE_MS as MAX_LEASE_MS
from wqwire.defaults import MAX_PRIORITY as MAX_PRIORITY
from wqwire.defaults import MAX_WAIT_MS as MAX_WAIT_MS

DEFAULT_SWEEP_INTERVAL: Final = 0.25
# Seconds between polls for ready tasks by a broker on a shared store (a lost wake-up's cost).
DEFAULT_POLL_INTERVAL: Final = 1.0
DEFAULT_MAX_PAYLOAD: Final = DEFAULT_MAX_BODY

# Our own limits on values the spec leaves open (documented in docs/ and the .proto).
MAX_MAX_ATTEMPTS: Final = 2**31 - 1
MAX_DELAY_MS: Final = 365 * 24 * 3600 * 1000  # a year
MAX_PREFETCH: Final = 10_000
MAX_ERROR_BYTES: Final = 8 * 1024  # a nack's error text is cut to this (UTF-8), saying so

# Control over tasks (docs/design/control.md).
MAX_EXPIRES_IN_MS: Final = MAX_DELAY_MS  # a year
MAX_TIMEOUT_MS: Final = MAX_DELAY_MS
MAX_PROGRESS_BYTES: Final = 4096
DEFAULT_LIST_LIMIT: Final = 100
# docs/design/results.md
DEFAULT_RESULT_TTL_MS: Final = 3_600_000  # an hour, as arq's keep_result
MAX_RESULT_TTL_MS: Final = MAX_DELAY_MS  # a year
MAX_PARENTS: Final = 10_000  # parents a task may wait for (its ``after``)
DEFAULT_RESULT_WAIT_MS: Final = 0  # GET /jobs/{id}/result answers at once unless asked to wait
MAX_CHILDREN_SHOWN: Final = 100  # children ids in a task's view
MAX_LIST_LIMIT: Final = 1000

# Queues, priorities, idempotency keys.
MAX_QUEUE_NAME: Final = 64
QUEUE_NAME_RULE: Final = "1-64 characters of A-Z a-z 0-9 _ . -"
MAX_QUEUES_PER_CLAIM: Final = 64
MAX_KEY_CHARS: Final = 256
DEFAULT_DEDUP_WINDOW_MS: Final = 300_000  # five minutes, as SQS FIFO
_DEFAULT_QUEUES: Final = (DEFAULT_QUEUE,)
_QUEUE_NAME: Final = re.compile(r"[A-Za-z0-9_.\-]{1,64}")

# Limits per queue (docs/design/schedules.md): a rate ({"tasks", "per_ms", "burst"}) and a
# concurrency.
MAX_RATE_TASKS: Final = 1_000_000
MAX_RATE_PER_MS: Final = 86_400_000  # a day
MAX_RATE_BURST: Final = 1_000_000
MAX_CONCURRENCY: Final = 1_000_000
RATE_MEMBERS: Final = ("tasks", "per_ms", "burst")

# Backpressure (flags -max-tasks and -max-waiters; 0 means no limit).
DEFAULT_MAX_TASKS: Final = 10_000_000  # tasks held: ready, delayed and handed out
DEFAULT_MAX_QUEUES: Final = 10_000  # named queues (a queue is kept, with its totals, for good)
DEFAULT_MAX_SCHEDULES: Final = 10_000  # schedules (each kept until deleted, its task with it)
DEFAULT_MAX_WAITERS: Final = 50_000  # parked long-polls and open streams
RETRY_AFTER: Final = 1.0  # seconds a refused client is told to wait


def describe(value: object) -> str:
    """What a client sent, in words, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, float):
        return f"the number {value!r}"
    if isinstance(value, (list, tuple)):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def integer(name: str, value: object) -> int:
    # bool is an int subclass in Python; JSON true/false is not a number.
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{name} must be an integer, got {describe(value)}")
    return value


def max_attempts_value(value: object | None) -> int:
    if value is None:
        return DEFAULT_MAX_ATTEMPTS
    n = integer("max_attempts", value)
    if n < 1:
        raise InvalidArgument(f"max_attempts must be at least 1, got {n}")
    if n > MAX_MAX_ATTEMPTS:
        raise InvalidArgument(f"max_attempts must be at most {MAX_MAX_ATTEMPTS}, got {n}")
    return n


def delay_seconds(value: object | None) -> float:
    if value is None:
        return 0.0
    n = integer("delay_ms", value)
    if n < 0:
        raise InvalidArgument(f"delay_ms must not be negative, got {n}")
    if n > MAX_DELAY_MS:
        raise InvalidArgument(f"delay_ms must be at most {MAX_DELAY_MS} (a year), got {n}")
    return n / 1000.0


def _capped_ms(name: str, value: object | None, default: int, minimum: int, cap: int) -> float:
    """A duration in ms: ``default`` when absent, at least ``minimum``, clamped to ``cap`` (the
    spec clamps values above a cap rather than refusing them). Returns seconds."""
    if value is None:
        return default / 1000.0
    n = integer(name, value)
    if n < minimum:
        rule = "must not be negative" if minimum == 0 else f"must be at least {minimum}"
        raise InvalidArgument(f"{name} {rule}, got {n}")
    return min(n, cap) / 1000.0


def wait_seconds(value: object | None) -> float:
    """``wait_ms``: default 20 s, values above 30 s are clamped to 30 s."""
    return _capped_ms("wait_ms", value, DEFAULT_WAIT_MS, 0, MAX_WAIT_MS)


def lease_seconds(value: object | None) -> float:
    """``lease_ms``: default 30 s, at least 1 ms, values above 5 min are clamped to 5 min."""
    return _capped_ms("lease_ms", value, DEFAULT_LEASE_MS, 1, MAX_LEASE_MS)


def prefetch_value(value: object | None) -> int:
    """A stream's ``prefetch``: as :func:`_count`, up to MAX_PREFETCH."""
    return _count("prefetch", value, MAX_PREFETCH)


def claim_count_value(value: object | None) -> int:
    """A batch claim's ``max``: as :func:`_count`, up to MAX_CLAIM_BATCH."""
    return _count("max", value, MAX_CLAIM_BATCH)


def _count(name: str, value: object | None, cap: int) -> int:
    """How many: at least 1 (default 1); above ``cap``, clamped to it."""
    if value is None:
        return 1
    n = integer(name, value)
    if n < 1:
        raise InvalidArgument(f"{name} must be at least 1, got {n}")
    return min(n, cap)


def limit_value(value: object | None) -> int | None:
    """A listing's ``limit``: none by default, never negative."""
    if value is None:
        return None
    n = integer("limit", value)
    if n < 0:
        raise InvalidArgument(f"limit must not be negative, got {n}")
    return n


def text_value(name: str, value: str) -> str:
    """Text a client sent, which the broker keeps or echoes: it must be valid Unicode (encodable
    as UTF-8 in every protocol and every store). JSON can spell a lone surrogate (``"\ud800"``),
    which is not: it is refused here, before anything is stored."""
    if value.isascii():  # (most text: nothing to look for)
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidArgument(
            f"{name} is not valid Unicode: character {e.start} is a lone surrogate "
            f"(U+{ord(value[e.start]):04X})"
        ) from None
    return value


def error_value(value: object | None) -> str | None:
    """A nack's error text: valid Unicode, cut to MAX_ERROR_BYTES (UTF-8) with a note saying
    how long it was."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidArgument(f"error must be a string, got {describe(value)}")
    data = text_value("error", value).encode("utf-8")
    if len(data) <= MAX_ERROR_BYTES:
        return value
    note = f"… [truncated: the error was {len(data)} bytes]"
    kept = data[: MAX_ERROR_BYTES - len(note.encode("utf-8"))].decode("utf-8", "ignore")
    return kept + note


def id_value(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(f"{name} must be a string, got {describe(value)}")
    if not value:
        raise InvalidArgument(f"{name} is required")
    return text_value(name, value)


def payload_value(data: bytes | None, max_bytes: int, what: str = "payload") -> bytes:
    """A payload: present, at most ``max_bytes``, one JSON value (text the codec already parsed
    from a request is not scanned again). Returned unchanged: payloads are kept as received."""
    if not data:
        raise InvalidArgument(f"{what} is required")
    if len(data) > max_bytes:
        raise PayloadTooLarge(f"{what} is larger than the limit of {max_bytes} bytes")
    if isinstance(data, codec.JsonText):
        return data
    return codec.validate_json(data, what)


def batch_size(name: str, n: int) -> None:
    if n > MAX_BATCH:
        raise InvalidArgument(f"{name} has {n} entries; at most {MAX_BATCH} per call")


def _quote(text: str) -> str:
    shown = text if len(text) <= 80 else text[:77] + "..."
    return repr(shown)


@functools.lru_cache(maxsize=4096)
def _is_queue_name(text: str) -> bool:
    """(Cached: the same few names come with every task and every claim.)"""
    return _QUEUE_NAME.fullmatch(text) is not None


def queue_value(value: object | None, name: str = "queue") -> str:
    """A queue's name: ``default`` when absent."""
    if value is None or value == DEFAULT_QUEUE:
        return DEFAULT_QUEUE
    if not isinstance(value, str):
        raise InvalidArgument(f"{name} must be a string, got {describe(value)}")
    if not _is_queue_name(value):
        raise InvalidArgument(f"{name} {_quote(value)} is not a queue name ({QUEUE_NAME_RULE})")
    return value


def queues_value(value: object | None) -> tuple[str, ...]:
    """The queues a claim takes from, in order of preference: ``None`` or an empty list for the
    default queue, a comma-separated string (``?queue=a,b``) or a sequence of names. A name
    listed twice counts once."""
    if value is None or value == DEFAULT_QUEUE:
        return _DEFAULT_QUEUES
    if isinstance(value, str):
        names: Sequence[object] = value.split(",")
    elif isinstance(value, (list, tuple)):
        names = value
    else:
        raise InvalidArgument(f"queue must be a list of queue names, got {describe(value)}")
    if not names:
        return (DEFAULT_QUEUE,)
    if len(names) > MAX_QUEUES_PER_CLAIM:
        raise InvalidArgument(
            f"queue lists {len(names)} queues; at most {MAX_QUEUES_PER_CLAIM} per claim"
        )
    return tuple(dict.fromkeys(queue_value(n) for n in names))


def priority_value(value: object | None) -> int:
    """A task's priority: 0-9, higher first; 0 when absent."""
    if value is None:
        return 0
    n = integer("priority", value)
    if not 0 <= n <= MAX_PRIORITY:
        raise InvalidArgument(f"priority must be from 0 to {MAX_PRIORITY}, got {n}")
    return n


def key_value(value: object | None) -> str | None:
    """An idempotency key: 1-256 characters, no control characters; None when absent."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidArgument(f"idempotency key must be a string, got {describe(value)}")
    if not value:
        raise InvalidArgument("idempotency key must not be empty")
    if len(value) > MAX_KEY_CHARS:
        raise InvalidArgument(
            f"idempotency key must be at most {MAX_KEY_CHARS} characters, got {len(value)}"
        )
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise InvalidArgument("idempotency key must not hold control characters")
    return text_value("idempotency key", value)


def flag_value(name: str, value: object | None) -> bool:
    """A boolean option: false when absent."""
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidArgument(f"{name} must be a boolean, got {describe(value)}")
    return value


def retry_delay_seconds(value: object | None) -> float | None:
    """A nack's ``delay_ms``: retry after exactly this long (None: the backoff decides)."""
    return None if value is None else delay_seconds(value)


def _duration_ms(name: str, value: object | None, cap: int) -> float | None:
    """An optional duration of 1 ms to ``cap`` ms (refused outside): seconds, or None."""
    if value is None:
        return None
    n = integer(name, value)
    if not 1 <= n <= cap:
        raise InvalidArgument(f"{name} must be from 1 to {cap} (a year), got {n}")
    return n / 1000.0


def expires_in_seconds(value: object | None) -> float | None:
    """``expires_in_ms``: 1 ms to a year; None when absent (never expires)."""
    return _duration_ms("expires_in_ms", value, MAX_EXPIRES_IN_MS)


def timeout_seconds(value: object | None) -> float | None:
    """``timeout_ms``: 1 ms to a year; None when absent (no time limit)."""
    return _duration_ms("timeout_ms", value, MAX_TIMEOUT_MS)


def progress_value(data: bytes | None) -> bytes | None:
    """A progress report: one JSON value, at most MAX_PROGRESS_BYTES of text; None when absent.
    Kept as received."""
    if data is None:
        return None
    if len(data) > MAX_PROGRESS_BYTES:
        raise InvalidArgument(
            f"progress must be at most {MAX_PROGRESS_BYTES} bytes of JSON, got {len(data)}"
        )
    if isinstance(data, codec.JsonText):
        return data
    if not data:
        raise InvalidArgument("progress must be one JSON value, got nothing")
    return codec.validate_json(data, "progress")


def result_ttl_seconds(value: object | None, default: float) -> float:
    """``result_ttl_ms``: 0 (keep nothing) to a year; ``default`` (seconds) when absent."""
    if value is None:
        return default
    n = integer("result_ttl_ms", value)
    if not 0 <= n <= MAX_RESULT_TTL_MS:
        raise InvalidArgument(
            f"result_ttl_ms must be from 0 to {MAX_RESULT_TTL_MS} (a year), got {n}"
        )
    return n / 1000.0


def result_value(data: bytes | None, max_bytes: int) -> bytes | None:
    """An ack's result: one JSON value (any, null too), within ``max_bytes``; None when absent
    (no result). Kept as received."""
    if data is None:
        return None
    return payload_value(data, max_bytes, "result")


def result_wait_seconds(value: object | None) -> float:
    """``wait_ms`` of a result wait: default 0 (answer at once), above 30 s clamped to 30 s."""
    return _capped_ms("wait_ms", value, DEFAULT_RESULT_WAIT_MS, 0, MAX_WAIT_MS)


def after_value(value: object | None, index: int | None) -> tuple[str | int, ...]:
    """A task's ``after``: a list of 1 to MAX_PARENTS task ids, none twice; in a batch
    (``index``: the item's own index) an item may also name an earlier item by its index
    (``0 <= i < index``). Empty when absent."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise InvalidArgument(f"after must be a list of task ids, got {describe(value)}")
    if not value:
        raise InvalidArgument("after must name at least one task (leave it out for none)")
    if len(value) > MAX_PARENTS:
        raise InvalidArgument(f"after names at most {MAX_PARENTS} tasks, got {len(value)}")
    out: list[str | int] = []
    seen: set[str | int] = set()
    for j, parent in enumerate(value):
        ref = _parent_ref(f"after[{j}]", parent, index)
        if ref in seen:
            raise InvalidArgument(f"after[{j}] names {_quote(str(ref))} a second time")
        seen.add(ref)
        out.append(ref)
    return tuple(out)


def _parent_ref(name: str, parent: object, index: int | None) -> str | int:
    """One entry of an ``after``: a task id, or the index of an earlier item of the batch."""
    if isinstance(parent, int) and not isinstance(parent, bool):
        if index is None:
            raise InvalidArgument(
                f"{name} must be a task id (an index names an earlier item of a batch)"
            )
        if not 0 <= parent < index:
            earlier = f"0 to {index - 1}" if index else "the first item has none"
            raise InvalidArgument(
                f"{name} must name an earlier item of the batch ({earlier}), got {parent}"
            )
        return parent
    if isinstance(parent, str):
        return id_value(name, parent)
    raise InvalidArgument(f"{name} must be a task id, got {describe(parent)}")


def list_limit_value(value: object | None) -> int:
    """A task listing's ``limit``: 1 to MAX_LIST_LIMIT, DEFAULT_LIST_LIMIT when absent."""
    if value is None:
        return DEFAULT_LIST_LIMIT
    n = integer("limit", value)
    if not 1 <= n <= MAX_LIST_LIMIT:
        raise InvalidArgument(f"limit must be from 1 to {MAX_LIST_LIMIT}, got {n}")
    return n


def list_state_value(value: object | None) -> str:
    """A task listing's ``state``: one of LIST_STATES, ``ready`` when absent."""
    if value is None:
        return "ready"
    if not isinstance(value, str):
        raise InvalidArgument(f"state must be a string, got {describe(value)}")
    if value not in LIST_STATES:
        raise InvalidArgument(f"state {_quote(value)} is not one of {', '.join(LIST_STATES)}")
    return value


# -- limits per queue (docs/design/schedules.md) ---------------------------------------------------


def _ranged(name: str, value: object, high: int) -> int:
    """A whole number from 1 to ``high``, InvalidArgument naming ``name`` otherwise."""
    n = integer(name, value)
    if not 1 <= n <= high:
        raise InvalidArgument(f"{name} must be from 1 to {high}, got {n}")
    return n


def rate_value(value: object | None) -> RateLimit | None:
    """A queue's rate limit, the JSON object ``{"tasks", "per_ms", "burst"}`` as received:
    ``tasks`` 1 to MAX_RATE_TASKS hand-outs per ``per_ms`` 1 to MAX_RATE_PER_MS, from a bucket of
    ``burst`` 1 to MAX_RATE_BURST tokens (``tasks`` when absent). None: no rate limit."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidArgument(
            f"rate must be an object {{tasks, per_ms, burst}} (or null), got {describe(value)}"
        )
    unknown = [str(k) for k in value if k not in RATE_MEMBERS]
    if unknown:
        named = ", ".join(_quote(k) for k in unknown)
        raise InvalidArgument(
            f"rate has unknown member{'s' if len(unknown) > 1 else ''} {named} (it takes "
            f"{', '.join(RATE_MEMBERS)})"
        )
    for member in ("tasks", "per_ms"):
        if value.get(member) is None:
            raise InvalidArgument(f"rate.{member} is required")
    tasks = _ranged("rate.tasks", value["tasks"], MAX_RATE_TASKS)
    per_ms = _ranged("rate.per_ms", value["per_ms"], MAX_RATE_PER_MS)
    burst = value.get("burst")
    burst_n = tasks if burst is None else _ranged("rate.burst", burst, MAX_RATE_BURST)
    return RateLimit(tasks, per_ms / 1000.0, burst_n)


def concurrency_value(value: object | None) -> int | None:
    """A queue's concurrency limit: 1 to MAX_CONCURRENCY tasks handed out at once; None: none."""
    if value is None:
        return None
    return _ranged("concurrency", value, MAX_CONCURRENCY)


def limits_value(rate: object | None, concurrency: object | None) -> Limits | None:
    """A queue's limits as received (see rate_value, concurrency_value); None when neither is
    given (no limits)."""
    limits = Limits(rate_value(rate), concurrency_value(concurrency))
    return None if limits.empty() else limits


# -- schedules (docs/design/schedules.md) ---------------------------------------------------------

MIN_EVERY_MS: Final = 1000  # a second
MAX_EVERY_MS: Final = MAX_DELAY_MS  # a year
SCHEDULE_NAME_RULE: Final = QUEUE_NAME_RULE


class ScheduleMembers(Protocol):
    """A schedule's members as a client sent them (None: not given): the service's
    ScheduleSubmission. ``payload``: the task's JSON text."""

    @property
    def payload(self) -> bytes | None: ...
    @property
    def cron(self) -> object | None: ...
    @property
    def timezone(self) -> object | None: ...
    @property
    def every_ms(self) -> object | None: ...
    @property
    def queue(self) -> object | None: ...
    @property
    def priority(self) -> object | None: ...
    @property
    def max_attempts(self) -> object | None: ...
    @property
    def expires_in_ms(self) -> object | None: ...
    @property
    def timeout_ms(self) -> object | None: ...
    @property
    def result_ttl_ms(self) -> object | None: ...
    @property
    def paused(self) -> object | None: ...


def schedule_name_value(value: object | None) -> str:
    """A schedule's name: as a queue's (SCHEDULE_NAME_RULE), required."""
    if value is None or value == "":
        raise InvalidArgument("name is required")
    if not isinstance(value, str):
        raise InvalidArgument(f"name must be a string, got {describe(value)}")
    if not _is_queue_name(value):
        raise InvalidArgument(f"name {_quote(value)} is not a schedule name ({SCHEDULE_NAME_RULE})")
    return value


def every_seconds(value: object) -> float:
    """``every_ms``: a second to a year. Returns seconds."""
    n = integer("every_ms", value)
    if not MIN_EVERY_MS <= n <= MAX_EVERY_MS:
        raise InvalidArgument(
            f"every_ms must be from {MIN_EVERY_MS} (a second) to {MAX_EVERY_MS} (a year), got {n}"
        )
    return n / 1000.0


def _text_member(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(f"{name} must be a string, got {describe(value)}")
    return text_value(name, value)


def schedule_value(name: str, sub: ScheduleMembers, max_payload: int) -> Schedule:
    """A schedule's members checked (as an enqueue's are, for its task): exactly one of
    ``cron`` and ``every_ms``, ``timezone`` only with ``cron``, ``paused`` a boolean. The
    rule's syntax and its zone are the rule's to check (wqbroker.schedules.Rule.parse); times
    are left 0 and ``next_fire_at`` None, for the service to fill in."""
    if sub.cron is None and sub.every_ms is None:
        raise InvalidArgument("cron or every_ms is required (exactly one of them)")
    if sub.cron is not None and sub.every_ms is not None:
        raise InvalidArgument("cron and every_ms cannot both be given (exactly one of them)")
    if sub.timezone is not None and sub.cron is None:
        raise InvalidArgument("timezone goes only with cron (every_ms counts seconds)")
    cron = None if sub.cron is None else _text_member("cron", sub.cron)
    timezone = "UTC" if sub.timezone is None else _text_member("timezone", sub.timezone)
    every = None if sub.every_ms is None else every_seconds(sub.every_ms)
    task = ScheduleTask(
        payload_value(sub.payload, max_payload),
        queue_value(sub.queue),
        priority_value(sub.priority),
        max_attempts_value(sub.max_attempts),
        expires_in_seconds(sub.expires_in_ms),
        timeout_seconds(sub.timeout_ms),
        None if sub.result_ttl_ms is None else result_ttl_seconds(sub.result_ttl_ms, 0.0),
    )
    return Schedule(name, task, cron, timezone, every, paused=flag_value("paused", sub.paused))
