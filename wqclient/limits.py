"""The client's defaults, in one place.

The broker applies its own defaults and caps to whatever a request leaves out (``wait_ms`` 20 s,
at most 30 s; ``lease_ms`` 30 s); the figures here are the client's side of the same contract:
what the worker and the commands ask for when told nothing, and how long a long-poll may take
before the client gives up on its answer.
"""

from __future__ import annotations

from typing import Final

DEFAULT_URL: Final = "http://localhost:8080"
"""The broker the client, the worker and the commands talk to when given no URL."""

DEFAULT_TIMEOUT: Final = 30.0
"""Seconds to wait for a connection, or for the answer to a call that does not long-poll."""

DEFAULT_WAIT_MS: Final = 20_000
"""How long a claim waits for a task when it does not say (the broker's default)."""

MAX_WAIT_MS: Final = 30_000
"""The longest a claim can wait: the broker clamps longer waits to this."""

DEFAULT_LEASE_MS: Final = 30_000
"""How long a claimed task is held when the claim does not say (the broker's default)."""

MAX_LEASE_MS: Final = 300_000
"""The longest lease the broker grants (it caps longer ones to this), on a claim or an extension."""

POLL_SLACK: Final = 15.0
"""Seconds allowed beyond a long-poll's wait before its answer is taken to be lost."""


def poll_timeout(wait_ms: int | None) -> float:
    """The client-side timeout, in seconds, for a claim that long-polls up to ``wait_ms``.

    ``None`` stands for the broker's default wait; waits beyond :data:`MAX_WAIT_MS` count as
    the cap (the broker clamps them), negative ones as no wait (the broker refuses them).
    """
    wait = DEFAULT_WAIT_MS if wait_ms is None else max(0, min(wait_ms, MAX_WAIT_MS))
    return wait / 1000.0 + POLL_SLACK
