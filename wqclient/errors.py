"""One error tree for both transports. Each error carries the broker's own message."""

from __future__ import annotations


class WqError(Exception):
    """Base of every error the client raises."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(WqError):
    """The broker rejected the request as malformed (HTTP 400, gRPC INVALID_ARGUMENT)."""


class PayloadTooLarge(InvalidArgument):
    """The request or payload is over the broker's size limit (HTTP 413, RESOURCE_EXHAUSTED)."""


class NotFound(WqError):
    """No such task, or nobody holds it any more (HTTP 404, gRPC NOT_FOUND)."""


class LeaseLost(WqError):
    """The task is held under another lease: yours is no longer valid (HTTP 409,
    gRPC FAILED_PRECONDITION). Another worker may be running the task."""


class Cancelled(LeaseLost):
    """The task was cancelled while you held it (``cancel()``, ``wq cancel``): its lease is not
    extended any more (HTTP 409 with ``"cancelled": true``, gRPC FAILED_PRECONDITION with
    ``wq-cancelled: 1``). Stop working on it and nack it: the broker then drops it, counted
    cancelled, without a retry (an ack still counts as usual)."""


class TimeLimitReached(LeaseLost):
    """The task's lease cannot be extended past its time limit (``timeout_ms`` from hand-out,
    HTTP 409, gRPC FAILED_PRECONDITION): it runs out there, and the task is retried (or
    buried)."""


class Conflict(WqError):
    """The request cannot be done in the present state: a queue to delete still holds tasks
    (HTTP 409, gRPC FAILED_PRECONDITION); the message names the counts."""


class Unavailable(WqError):
    """The broker cannot be reached, or is shutting down (connection refused, HTTP 503,
    gRPC UNAVAILABLE). Worth retrying later."""


class CertificateError(Unavailable):
    """The broker's TLS certificate failed verification: issued by a CA this client does not
    trust (give it with ``ca_file``, ``$WQ_CA_FILE``, the commands' ``-ca-file``), expired, or
    not issued for the host in the URL. The broker cannot be reached safely, and unlike the
    other reasons, asking again cannot help: the configuration is to be fixed. A
    :class:`~wqclient.Worker` stops on it as on a refused token."""


class StreamEnded(Unavailable):
    """The stream is over (the broker ended it, or the connection broke). Tasks it delivered and
    that were not settled are reclaimed by the broker: open a new stream."""


class ProtocolError(WqError):
    """The broker answered something this client does not understand."""


class Unsupported(WqError):
    """The broker does not have this operation (an extension it predates, or a broker built to
    the specification only): HTTP 404 or 405 on the operation's own route, gRPC UNIMPLEMENTED.
    Nothing was done."""


class Unauthenticated(WqError):
    """The broker wants a token and got none it knows (HTTP 401, gRPC UNAUTHENTICATED)."""


class PermissionDenied(WqError):
    """The token is valid but lacks the scope this operation needs (HTTP 403,
    gRPC PERMISSION_DENIED)."""


class Overloaded(Unavailable):
    """The broker is at a limit (too many tasks held, too many waiting consumers): HTTP 429, gRPC
    RESOURCE_EXHAUSTED with a retry-after. Retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class TaskNotSucceeded(WqError):
    """A workflow handle's ``result()`` (docs/design/results.md): the task ended without
    succeeding, so it has no result to give. ``state`` says how: ``"dead"`` (``last_error`` is
    its last error; a task waiting on a parent that failed is buried naming it), ``"cancelled"``
    or ``"expired"``."""

    def __init__(
        self, message: str, *, task_id: str, state: str, last_error: str | None = None
    ) -> None:
        super().__init__(message)
        self.task_id = task_id
        self.state = state
        self.last_error = last_error


class ResultTimeout(WqError, TimeoutError):
    """A workflow handle's ``result(timeout)``: the task was still pending (waiting, ready,
    delayed or handed out) when the timeout ran out. It goes on: ask again later."""

    def __init__(self, message: str, *, task_id: str) -> None:
        super().__init__(message)
        self.task_id = task_id
