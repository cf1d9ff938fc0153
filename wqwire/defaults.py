"""The wire contract's figures and names, as the broker applies them and the client expects them.

The broker applies these to what a request leaves out (``wqbroker.limits`` checks and clamps with
them); the client uses them to size its own time-outs and batches. A figure here is part of the
documented API (docs/, the .proto and the OpenAPI document state it): changing one changes
what every client sees.
"""

from __future__ import annotations

from typing import Final

DEFAULT_QUEUE: Final = "default"
"""The queue a task goes to, and a claim takes from, when none is named."""

DEFAULT_MAX_ATTEMPTS: Final = 3
"""Deliveries a task gets when its enqueue does not say (the spec's default)."""

DEFAULT_WAIT_MS: Final = 20_000
"""How long a claim waits for a task when it does not say (the spec's default)."""

MAX_WAIT_MS: Final = 30_000
"""The longest a claim can wait: longer waits are clamped to this."""

DEFAULT_LEASE_MS: Final = 30_000
"""How long a claimed task is held when the claim does not say (the spec's default)."""

MAX_LEASE_MS: Final = 300_000
"""The longest lease granted, on a claim or an extension (longer ones are capped to this)."""

MAX_PRIORITY: Final = 9
"""Priorities run from 0 to this; higher is served first."""

MAX_BATCH: Final = 10_000
"""Tasks in one batch enqueue, and acks (and as many nacks) in one settle request."""

MAX_CLAIM_BATCH: Final = 1_000
"""Tasks in one batch claim (a larger ``max`` is clamped to this)."""

DEFAULT_MAX_BODY: Final = 1024 * 1024
"""The largest request body (and gRPC message) a broker takes by default (-max-body-bytes)."""

HTTP_PORT: Final = 8080
"""The port of the HTTP/JSON API when none is given (the broker's -addr, the client's URL)."""

GRPC_PORT: Final = 50051
"""The port of the gRPC API when none is given (the broker's -grpc-addr)."""

# The HTTP API's extensions beyond the spec's routes.
BATCH_PATH: Final = "/jobs/batch"  # many tasks in one request
CLAIM_BATCH_PATH: Final = "/jobs/next/batch"  # up to ``max`` tasks in one long-poll
SETTLE_PATH: Final = "/jobs/settle"  # many acks and nacks in one request

IDEMPOTENCY_KEY_HEADER: Final = "Idempotency-Key"
"""The HTTP header of POST /jobs that keys a task (its own member, over gRPC and in batches)."""

MAX_GRPC_MESSAGE: Final = 64 * 1024 * 1024
"""The largest gRPC message either side lets through its channel (the broker's body limit still
applies to what a request carries)."""

RETRY_AFTER_MS_KEY: Final = "retry-after-ms"
"""The gRPC trailing metadata of a RESOURCE_EXHAUSTED refusal: milliseconds to wait (HTTP says
it with ``Retry-After``, in seconds)."""

CANCELLED_KEY: Final = "wq-cancelled"
"""The gRPC trailing metadata (value ``1``) of a FAILED_PRECONDITION refusal because the task was
cancelled (an ExtendLease): stop working on it, do not retry it (HTTP says it with
``"cancelled": true`` in the 409's body; a stream with ``Settled.cancelled``)."""
