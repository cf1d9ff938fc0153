"""One error tree for the whole broker.

The service and the stores raise these; each protocol adapter maps them with one table
(``wqbroker.http.errors`` for HTTP status codes, ``wqbroker.grpc`` for gRPC status codes).
Every error carries a message meant for the client, naming the offending field where there is one.
"""

from __future__ import annotations


class WqError(Exception):
    """Base of every error the broker reports to a client."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(WqError):
    """The request is malformed: a wrong type, a value out of range, a missing field."""


class NotFound(WqError):
    """No such task, or nobody holds it (for ack/nack), or it is not dead (for requeue)."""


class LeaseLost(WqError):
    """The task is held, but under a different lease: the caller's lease is no longer valid."""


class PayloadTooLarge(WqError):
    """The request body or payload is over the configured size limit."""


class Unavailable(WqError):
    """The broker is shutting down or cannot serve the request right now."""


class StoreError(WqError):
    """The storage backend failed (disk full, database unreachable, ...)."""
