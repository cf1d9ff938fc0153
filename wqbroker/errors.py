"""One error tree for the whole broker.

The service and the stores raise these; each protocol adapter maps them with one table (``STATUS``
in ``wqbroker.http.core`` for HTTP status codes, ``CODES`` in ``wqbroker.grpc.server`` for gRPC
status codes), looked up with :func:`lookup`, so a new subclass maps as its parent does unless the
table names it. Every error carries a message meant for the client, naming the offending field
where there is one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

T = TypeVar("T")


class WqError(Exception):
    """Base of every error the broker reports to a client."""

    #: Seconds a client should wait before trying again, where the error says when (HTTP sends
    #: it as ``Retry-After``, gRPC as ``retry-after-ms`` trailing metadata); None: it does not.
    retry_after: float | None = None

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(WqError):
    """The request is malformed: a wrong type, a value out of range, a missing field."""


class UnknownParent(InvalidArgument):
    """A task names in its ``after`` a parent that is not a live task (unknown, acked without a
    result, pruned, cancelled or expired): ``item`` is its index in the enqueue call,
    ``position`` the parent's index in its ``after``. The service names the field."""

    def __init__(self, item: int, position: int, task_id: str) -> None:
        super().__init__(
            f"task {quoted(task_id)} does not exist (or was acked without a result, cancelled "
            "or expired): a task can only wait for a live one"
        )
        self.item = item
        self.position = position
        self.task_id = task_id


class NotFound(WqError):
    """No such task, or nobody holds it (for ack/nack), or it is not dead (for requeue)."""


class LeaseLost(WqError):
    """The task is held, but under a different lease: the caller's lease is no longer valid."""


class Cancelled(LeaseLost):
    """The task was cancelled while its caller held it: its lease is not extended (an ack still
    counts; a nack, or the lease running out, drops it)."""


class TimeLimitReached(LeaseLost):
    """The task's lease cannot be extended past its time limit (``timeout_ms`` from hand-out):
    it runs out, and the task is retried or buried."""


class Conflict(WqError):
    """The request cannot be done in the present state (a queue that still holds tasks)."""


class PayloadTooLarge(WqError):
    """The request body or payload is over the configured size limit."""


class Unavailable(WqError):
    """The broker is shutting down or cannot serve the request right now."""


class StoreError(Unavailable):
    """The storage backend failed (disk full, database unreachable, ...). A client may try
    again in a second: a broker that lost its database fails fast until it is back."""

    retry_after = 1.0


class Unauthenticated(WqError):
    """No credentials, or credentials the broker does not know."""


class PermissionDenied(WqError):
    """Valid credentials without the scope the operation needs."""


class Overloaded(WqError):
    """A limit is reached (too many tasks held, too many waiting consumers): try again later."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after: float | None = retry_after


#: How much of a client's text an error message quotes (ids can be any length; messages must stay
#: small enough for every protocol, gRPC status details included).
QUOTE_CHARS = 80


def quoted(text: str) -> str:
    """``text`` for an error message: as is when short, else its start and its length."""
    if len(text) <= QUOTE_CHARS:
        return text
    return f"{text[:QUOTE_CHARS]}… ({len(text)} characters)"


def lookup(table: Mapping[type[WqError], T], error: WqError) -> T:
    """The entry for the error's class, or for its nearest ancestor that has one."""
    for cls in type(error).__mro__:
        if cls in table:
            return table[cls]
    raise LookupError(f"no entry for {type(error).__name__}")
