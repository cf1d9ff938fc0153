"""The client's defaults, in one place.

The broker applies its own defaults and caps to whatever a request leaves out (``wait_ms`` 20 s,
at most 30 s; ``lease_ms`` 30 s); the figures here are the client's side of the same contract:
what the worker and the commands ask for when told nothing, and how long a long-poll may take
before the client gives up on its answer.
"""

from __future__ import annotations

from typing import Final

from wqwire.defaults import DEFAULT_LEASE_MS as DEFAULT_LEASE_MS
from wqwire.defaults import DEFAULT_WAIT_MS as DEFAULT_WAIT_MS
from wqwire.defaults import HTTP_PORT
from wqwire.defaults import MAX_CLAIM_BATCH as MAX_CLAIM_BATCH
from wqwire.defaults import MAX_LEASE_MS as MAX_LEASE_MS
from wqwire.defaults import MAX_WAIT_MS as MAX_WAIT_MS

DEFAULT_URL: Final = f"http://localhost:{HTTP_PORT}"
"""The broker the client, the worker and the commands talk to when given no URL."""

DEFAULT_TIMEOUT: Final = 30.0
"""Seconds to wait for a connection, or for the answer to a call that does not long-poll."""

POLL_SLACK: Final = 15.0
"""Seconds allowed beyond a long-poll's wait before its answer is taken to be lost."""


def poll_timeout(wait_ms: int | None) -> float:
    """The client-side timeout, in seconds, for a claim that long-polls up to ``wait_ms``.

    ``None`` stands for the broker's default wait; waits beyond :data:`MAX_WAIT_MS` count as
    the cap (the broker clamps them), negative ones as no wait (the broker refuses them).
    """
    wait = DEFAULT_WAIT_MS if wait_ms is None else max(0, min(wait_ms, MAX_WAIT_MS))
    return wait / 1000.0 + POLL_SLACK
