"""The HTTP/JSON gateway: the spec's API, exactly, and its extensions (queues, priorities,
leases, keys, lookups, DLQ bulk operations, batches), over aiohttp and the fast lane, from one
route table (``core.ROUTES``)."""

from wqbroker.http.app import create_app, make_runner
from wqbroker.http.server import DEFAULT_IDLE_TIMEOUT, DEFAULT_READ_HEADER_TIMEOUT
from wqbroker.http.transport import DEFAULT_MAX_BODY, DEFAULT_READ_BODY_TIMEOUT

__all__ = [
    "DEFAULT_IDLE_TIMEOUT",
    "DEFAULT_MAX_BODY",
    "DEFAULT_READ_BODY_TIMEOUT",
    "DEFAULT_READ_HEADER_TIMEOUT",
    "create_app",
    "make_runner",
]
