"""``AsyncClient`` (asyncio) and ``Client`` (blocking): the same methods over HTTP or gRPC.

The transport is chosen by the URL: ``http://host:8080`` for the HTTP/JSON API, ``grpc://host:50051``
for gRPC (``https://``, ``grpcs://`` over TLS); or pass one (``transport=``), any
:class:`~wqclient.transport.Transport`. Connections are reused: one keep-alive HTTP session, or one
gRPC channel, per client. A broker that wants a bearer token gets ``token=`` (or ``$WQ_TOKEN``); a
TLS broker whose certificate the system does not trust, ``ca_file=`` (or ``$WQ_CA_FILE``).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ipaddress
import json
import math
import os
import threading
import weakref
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterable,
    Iterator,
    Sequence,
)
from datetime import datetime
from types import TracebackType
from typing import Any, TypeVar
from urllib.parse import urlsplit

from wqclient._http import HttpTransport
from wqclient._tls import check_token, env_default, ssl_context
from wqclient.clock import Clock, SystemClock
from wqclient.errors import InvalidArgument, Unavailable, Unsupported, WqError
from wqclient.limits import DEFAULT_TIMEOUT, DEFAULT_URL, MAX_WAIT_MS
from wqclient.models import (
    DEFAULT_QUEUE,
    Delivery,
    Enqueued,
    EnqueueItem,
    Limits,
    QueueInfo,
    RateLimit,
    Schedule,
    ScheduleSpec,
    Stats,
    Task,
    TaskPage,
    TaskResult,
)
from wqclient.transport import AsyncStream, StreamingTransport, Transport

T = TypeVar("T")

ENV_BROKER = "WQ_BROKER"
"""The environment variable a client, an App and the commands take their broker URL from when
given none."""

ENV_TOKEN = "WQ_TOKEN"
"""The environment variable a client takes its bearer token from when given none."""

ENV_CA_FILE = "WQ_CA_FILE"
"""The environment variable a client takes its CA file from when given none."""


def encode_payload(payload: Any) -> bytes:
    """JSON-encode a payload (``bytes`` are taken to be JSON text already)."""
    if isinstance(payload, (bytes, bytearray)):
        return bytes(payload)
    try:
        return json.dumps(payload, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise InvalidArgument(f"payload cannot be encoded as JSON: {e}") from None


_INT64 = 2**63


def _option(name: str, value: int | None) -> int | None:
    """An optional integer option, checked only as far as the wire needs (the broker checks
    ranges and says why)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{name} must be an integer, got {type(value).__name__}")
    if not -_INT64 <= value < _INT64:
        raise InvalidArgument(f"{name} is out of range: {value}")
    return value


def _text(name: str, value: str | None) -> str | None:
    """An optional text option (a queue name, an idempotency key): only its type is checked
    here; the broker checks the rest and says why."""
    if value is not None and not isinstance(value, str):
        raise InvalidArgument(f"{name} must be a string, got {type(value).__name__}")
    return value


def _queues(value: str | Sequence[str] | None) -> list[str] | None:
    """The queues a claim or stream takes from, in order of preference: a list of names, or
    one string of names separated by commas (``"a,b"``, as in ``-queue a,b``). None: the
    broker's default (``["default"]``)."""
    if value is None:
        return None
    names = value.split(",") if isinstance(value, str) else list(value)
    for name in names:
        if not isinstance(name, str):
            raise InvalidArgument(f"queues must be strings, got {type(name).__name__}")
    return names


def _given(**options: Any) -> dict[str, Any]:
    """The options that are set (not None, not False), to pass by keyword: a transport written
    before they existed still serves the calls that leave them unset."""
    return {
        name: value for name, value in options.items() if value is not None and value is not False
    }


def _flag(name: str, value: bool) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgument(f"{name} must be true or false, got {type(value).__name__}")
    return value


def _item(
    payload: Any,
    max_attempts: int | None,
    delay_ms: int | None,
    queue: str | None,
    priority: int | None,
    expires_in_ms: int | None = None,
    timeout_ms: int | None = None,
    result_ttl_ms: int | None = None,
    index: int = 0,
) -> EnqueueItem:
    """One task of a batch (the ``index``-th): an EnqueueItem as given (its options left unset
    take the call's), or a payload with the call's options."""
    if not isinstance(payload, EnqueueItem):
        return EnqueueItem(
            encode_payload(payload),
            max_attempts,
            delay_ms,
            queue,
            priority,
            expires_in_ms=expires_in_ms,
            timeout_ms=timeout_ms,
            result_ttl_ms=result_ttl_ms,
        )
    return EnqueueItem(
        encode_payload(payload.payload_json),
        _either(_option("max_attempts", payload.max_attempts), max_attempts),
        _either(_option("delay_ms", payload.delay_ms), delay_ms),
        _either(_text("queue", payload.queue), queue),
        _either(_option("priority", payload.priority), priority),
        _text("idempotency_key", payload.idempotency_key),
        _either(_option("expires_in_ms", payload.expires_in_ms), expires_in_ms),
        _either(_option("timeout_ms", payload.timeout_ms), timeout_ms),
        _flag("unique", payload.unique),
        after_refs(payload.after, f"tasks[{index}].after", batch=True),
        _either(_option("result_ttl_ms", payload.result_ttl_ms), result_ttl_ms),
    )


def parent_id(parent: Any) -> str | None:
    """The task id a parent stands for: an id (an :class:`~wqclient.Enqueued` too), or
    anything with a string ``id`` (a Task, a Delivery, a workflow's handle); None if it is none
    of these."""
    if isinstance(parent, str):
        return str(parent)
    task_id = getattr(parent, "id", None)
    return task_id if isinstance(task_id, str) else None


def after_refs(value: Any, name: str = "after", *, batch: bool = False) -> tuple[Any, ...] | None:
    """An enqueue's ``after`` as the transports take it: a tuple of task ids, and (in a batch,
    ``batch``) of indices of earlier items; None for none (``None``, or an empty list). One
    parent may be given alone (an id, a handle). Only the kinds are checked here: the broker
    checks the rest (how many, none twice, an index that names an earlier item) and says why."""
    if value is None:
        return None
    if parent_id(value) is not None:
        value = [value]
    elif isinstance(value, (bytes, bytearray)) or not hasattr(value, "__iter__"):
        raise InvalidArgument(
            f"{name} must be a list of task ids (or handles), got {type(value).__name__}"
        )
    refs: list[str | int] = []
    for j, parent in enumerate(value):
        task_id = parent_id(parent)
        if task_id is not None:
            refs.append(task_id)
        elif isinstance(parent, int) and not isinstance(parent, bool):
            if not batch:
                raise InvalidArgument(
                    f"{name}[{j}] must be a task id (an index names an earlier item of a batch: "
                    "enqueue_many)"
                )
            if parent < 0:
                raise InvalidArgument(
                    f"{name}[{j}] must name an earlier item of the batch, got {parent}"
                )
            refs.append(parent)
        else:
            what = "a task id or the index of an earlier item" if batch else "a task id"
            raise InvalidArgument(f"{name}[{j}] must be {what}, got {type(parent).__name__}")
    return tuple(refs) or None


class _Unset:
    """The default of an argument for which None is a value (a progress of JSON null)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<unset>"


UNSET: Any = _Unset()


def encode_progress(value: Any) -> bytes:
    """A progress report as JSON text (``bytes`` are taken to be JSON text already). The
    broker takes at most 4 KiB of it, and says so."""
    try:
        return encode_payload(value)
    except InvalidArgument as e:
        raise InvalidArgument("progress" + e.message.removeprefix("payload")) from None


def _task_id(task: Delivery | Task | str) -> str:
    if isinstance(task, Delivery):
        return task.task.id
    if isinstance(task, Task):
        return task.id
    if not isinstance(task, str):
        raise InvalidArgument(f"a task id must be a string, got {type(task).__name__}")
    return str(task)


def encode_result(value: Any) -> bytes:
    """A task's result as JSON text (``bytes`` are taken to be JSON text already)."""
    try:
        return encode_payload(value)
    except InvalidArgument as e:
        raise InvalidArgument("result" + e.message.removeprefix("payload")) from None


def _either(value: T | None, default: T | None) -> T | None:
    return default if value is None else value


def make_transport(
    url: str,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    token: str | None = None,
    ca_file: str | None = None,
) -> Transport:
    """The transport for a broker URL: ``http://`` or ``https://`` (also a bare ``host:port``)
    for the HTTP API, ``grpc://host:port`` or ``grpcs://host:port`` (TLS) for gRPC (a
    :class:`StreamingTransport`). Either may name several brokers, ``http://a:port,b:port``
    (spread over in turn, one that cannot be reached skipped: ``_brokers.py``; for gRPC see
    :func:`grpc_target`). ``timeout``: seconds for a connection, or for the answer to a call
    that does not long-poll. ``token``: a bearer token sent with every call. ``ca_file``: PEM CA
    certificates to verify a TLS broker with (default: the system's store; unused without TLS).
    Raises WqError for a URL of any other kind (or without a host, or with a port that is not
    one), a token that cannot be sent, or a CA file that cannot be read."""
    parts = urlsplit(url if "://" in url else "http://" + url)
    if token is not None:
        check_token(token)
    if parts.scheme in ("http", "https"):
        return HttpTransport(
            f"{parts.scheme}://{parts.netloc}{parts.path}",
            timeout=timeout,
            token=token,
            ssl_context=ssl_context(ca_file) if parts.scheme == "https" else None,
        )
    if parts.scheme in ("grpc", "grpcs"):
        if not parts.netloc:
            raise WqError(f"broker URL {url!r} has no host:port")
        from wqclient import _grpc  # (only a client that speaks gRPC loads grpc)

        credentials = _grpc.channel_credentials(ca_file) if parts.scheme == "grpcs" else None
        rest = url.split("://", 1)[1]
        target = rest if rest.startswith("dns:") else grpc_target(parts.netloc)
        return _grpc.GrpcTransport(target, timeout=timeout, token=token, credentials=credentials)
    raise WqError(
        f"broker URL {url!r}: use http://host:port or grpc://host:port (https://, grpcs:// for TLS)"
    )


def grpc_target(netloc: str) -> str:
    """The gRPC target for a URL's ``host:port``, or for several brokers, ``a:port,b:port`` (IP
    addresses: calls are balanced over them, round robin). For brokers behind one DNS name
    with several addresses, a URL of ``grpc://dns:///name:port`` is passed on as it is (by
    :func:`make_transport`)."""
    if "," not in netloc:
        return netloc
    addresses = [a.strip() for a in netloc.split(",")]
    if all(a.startswith("[") for a in addresses):
        return "ipv6:" + ",".join(addresses)
    if any(not _ipv4_address(a) for a in addresses):
        raise WqError(
            f"brokers {netloc!r}: several brokers must be given as IP addresses with ports "
            "(a:port,b:port); for a DNS name with several addresses, use grpc://dns:///name:port"
        )
    return "ipv4:" + ",".join(addresses)


def _ipv4_address(text: str) -> bool:
    host, _, port = text.rpartition(":")
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return False
    return port.isdigit()


def _name(what: str, value: str) -> str:
    """A schedule's or queue's name (a string: the broker checks the rest and says why)."""
    if not isinstance(value, str):
        raise InvalidArgument(f"{what} must be a string, got {type(value).__name__}")
    return value


def _rate(value: RateLimit | None) -> RateLimit | None:
    """A rate limit as given to set_limits, its figures checked as the wire needs."""
    if value is None:
        return None
    if not isinstance(value, RateLimit):
        raise InvalidArgument(
            f"rate must be a RateLimit (RateLimit(tasks, per_ms, burst)), got "
            f"{type(value).__name__}"
        )
    _option("rate.tasks", value.tasks)
    _option("rate.per_ms", value.per_ms)
    _option("rate.burst", value.burst)
    return value


def _ids(task: Delivery | str, lease_id: str | None) -> tuple[str, str]:
    if isinstance(task, Delivery):
        return task.task.id, lease_id or task.lease_id
    if lease_id is None:
        raise InvalidArgument("lease_id is required")
    return task, lease_id


class AsyncClient:
    """An asyncio client for a wq broker.

    >>> async with AsyncClient("grpc://localhost:50051") as wq:
    ...     task_id = await wq.enqueue({"line": "hello"})
    ...     delivery = await wq.claim(wait_ms=1000)
    ...     await wq.ack(delivery)

    ``url`` picks the transport (see :func:`make_transport`; default ``$WQ_BROKER``, else
    ``http://localhost:8080``)
    and the rest configure it: ``timeout`` (seconds for a connection, or for the answer to a call
    that does not long-poll; default 30), ``token`` (a bearer token for a broker that wants one;
    default ``$WQ_TOKEN``, ``""`` for none) and ``ca_file`` (PEM CA certificates to verify an
    ``https://`` or ``grpcs://`` broker with; default ``$WQ_CA_FILE``, else the system's store).
    Or pass ``transport``, any :class:`~wqclient.transport.Transport` (a fake one in tests,
    say): the client then uses it as it is, ``url`` is only a label, and ``timeout``, ``token``
    and ``ca_file`` must not be given. The client closes its transport when it is closed.
    ``clock``: what a result wait longer than the broker's cap measures its time with (tests
    pass a fake; default the system's).
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        transport: Transport | None = None,
        timeout: float | None = None,
        token: str | None = None,
        ca_file: str | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.url: str | None = url
        self._clock: Clock = clock or SystemClock()
        if transport is None:
            self.url = url if url is not None else os.environ.get(ENV_BROKER) or DEFAULT_URL
            transport = make_transport(
                self.url,
                timeout=DEFAULT_TIMEOUT if timeout is None else timeout,
                token=env_default(token, ENV_TOKEN),
                ca_file=env_default(ca_file, ENV_CA_FILE),
            )
        elif (timeout, token, ca_file) != (None, None, None):
            raise WqError(
                "timeout, token and ca_file apply to the transport made from a URL: "
                "set them on yours"
            )
        self._transport: Transport = transport

    @property
    def transport(self) -> Transport:
        """The transport this client talks through."""
        return self._transport

    @property
    def can_stream(self) -> bool:
        """Whether :meth:`stream` is available: the transport is a
        :class:`~wqclient.transport.StreamingTransport` (gRPC is; HTTP is not)."""
        return isinstance(self._transport, StreamingTransport)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def enqueue(
        self,
        payload: Any,
        *,
        max_attempts: int | None = None,
        delay_ms: int | None = None,
        queue: str | None = None,
        priority: int | None = None,
        idempotency_key: str | None = None,
        expires_in_ms: int | None = None,
        timeout_ms: int | None = None,
        unique: bool = False,
        after: Any = None,
        result_ttl_ms: int | None = None,
    ) -> Enqueued:
        """Enqueue a task and return its id. ``payload``: any JSON value, or JSON bytes.

        ``queue``: the named queue (1-64 characters of ``[A-Za-z0-9_.-]``; default
        ``"default"``); ``priority``: 0-9, higher is served first (default 0);
        ``idempotency_key``: within the broker's window (default 5 minutes) a second enqueue
        with the same key to the same queue creates nothing and returns the first task's id
        (``unique=True``: instead of the window, the key holds as long as its task is ready,
        delayed or handed out). ``expires_in_ms``: the task is dropped (counted ``expired``)
        if it is not handed out within this long. ``timeout_ms``: the most one attempt may
        run (the broker extends no lease past it; a Worker cancels its handler there). The
        id is an :class:`~wqclient.Enqueued`, a ``str`` whose ``duplicate`` says which
        happened.

        ``after``: the tasks this one waits for (a list of ids, or of anything with an ``id``:
        what enqueue returned, a Task, a workflow's handle; one may be given alone), 1 to
        10,000: it is ``"waiting"`` until every one of them has succeeded (been acked), then
        ready (or delayed by ``delay_ms`` from then); its delivery carries their results
        (``delivery.parents``). A parent that ends dead, cancelled or expired buries it (dead,
        its last error naming the parent); an unknown parent is InvalidArgument.
        ``result_ttl_ms``: how long its result is kept once it is acked with one (0 to a year;
        0 keeps none; default the broker's, an hour). See docs/design/results.md."""
        if (
            max_attempts is None
            and delay_ms is None
            and queue is None
            and priority is None
            and idempotency_key is None
            and expires_in_ms is None
            and timeout_ms is None
            and unique is False
            and after is None
            and result_ttl_ms is None
        ):  # (the usual call: nothing to check or pass but the payload)
            return await self._transport.enqueue(encode_payload(payload), None, None)
        return await self._transport.enqueue(
            encode_payload(payload),
            _option("max_attempts", max_attempts),
            _option("delay_ms", delay_ms),
            **_given(
                queue=_text("queue", queue),
                priority=_option("priority", priority),
                idempotency_key=_text("idempotency_key", idempotency_key),
                expires_in_ms=_option("expires_in_ms", expires_in_ms),
                timeout_ms=_option("timeout_ms", timeout_ms),
                unique=_flag("unique", unique),
                after=after_refs(after),
                result_ttl_ms=_option("result_ttl_ms", result_ttl_ms),
            ),
        )

    async def enqueue_many(
        self,
        payloads: Iterable[Any],
        *,
        max_attempts: int | None = None,
        delay_ms: int | None = None,
        queue: str | None = None,
        priority: int | None = None,
        expires_in_ms: int | None = None,
        timeout_ms: int | None = None,
        result_ttl_ms: int | None = None,
    ) -> list[Enqueued]:
        """Enqueue several tasks (one batch call, all or none); returns their ids in order.

        Each of ``payloads`` is a payload (taking the options given here) or an
        :class:`~wqclient.EnqueueItem` (``EnqueueItem(b'{"n":1}', priority=9,
        idempotency_key="k1", unique=True)``: its options, those it leaves unset taking the ones
        given here). A duplicate (an idempotency key seen within the window, or held by a task
        still active for a ``unique`` one) comes back as the first task's id with ``duplicate``
        set. ``expires_in_ms``, ``timeout_ms``, ``result_ttl_ms``: as for :meth:`enqueue`.

        An item's ``after`` may name earlier items of the same batch by their index, beside
        task ids: ``[EnqueueItem(b'1'), EnqueueItem(b'2', after=[0])]`` enqueues a task and
        one that waits for it, a whole graph in one all-or-none call (an index that is not
        earlier is InvalidArgument naming ``tasks[i].after[j]``). :mod:`wqclient.workflow`
        builds chains, groups and chords this way."""
        options = (
            _option("max_attempts", max_attempts),
            _option("delay_ms", delay_ms),
            _text("queue", queue),
            _option("priority", priority),
            _option("expires_in_ms", expires_in_ms),
            _option("timeout_ms", timeout_ms),
            _option("result_ttl_ms", result_ttl_ms),
        )
        items = [_item(p, *options, index=i) for i, p in enumerate(payloads)]
        return list(await self._transport.enqueue_many(items)) if items else []

    async def claim(
        self,
        *,
        wait_ms: int | None = None,
        lease_ms: int | None = None,
        queues: str | Sequence[str] | None = None,
    ) -> Delivery | None:
        """Claim the next ready task, waiting up to ``wait_ms`` for one (unset: the broker's
        default, 20 s; at most 30 s: see :mod:`wqclient.limits`), and hold it for ``lease_ms``.
        ``queues``: the queues to take from, in order of preference (the first with a ready
        task wins; within a queue, the highest priority, then the oldest), a list or ``"a,b"``;
        default ``["default"]``. None if nothing came. Cancelling the call while it is parked
        loses no task (the broker never hands a task to a caller that went away); but a task
        handed out at the very moment of the cancel is only returned when its lease runs
        out."""
        return await self._transport.claim(
            _option("wait_ms", wait_ms),
            _option("lease_ms", lease_ms),
            **_given(queues=_queues(queues)),
        )

    @property
    def claims_many(self) -> bool:
        """Whether :meth:`claim_many` takes its tasks in one call (over HTTP, from a broker
        with GET /jobs/next/batch: until one answers that it has none); else it takes one."""
        return bool(getattr(self._transport, "claims_many", False))

    async def claim_many(
        self,
        max_tasks: int,
        *,
        wait_ms: int | None = None,
        lease_ms: int | None = None,
        queues: str | Sequence[str] | None = None,
    ) -> list[Delivery]:
        """Claim up to ``max_tasks`` ready tasks at once, waiting up to ``wait_ms`` for the first
        (then taking as many as are ready with it: it does not wait for more); each held for
        ``lease_ms``. ``queues``, and cancelling, as for :meth:`claim`. Over HTTP it is one
        request (GET /jobs/next/batch); over gRPC (and from an HTTP broker without that route)
        it takes one task, as :meth:`claim` does: a stream is the way to many there."""
        count = _option("max_tasks", max_tasks)
        if count is None or count < 1:
            raise InvalidArgument("max_tasks must be at least 1")
        wait, lease = _option("wait_ms", wait_ms), _option("lease_ms", lease_ms)
        names = _queues(queues)
        many = getattr(self._transport, "claim_many", None)
        if many is not None:
            claimed: list[Delivery] = await many(count, wait, lease, names)
            return claimed
        one = await self._transport.claim(wait, lease, **_given(queues=names))
        return [] if one is None else [one]

    async def ack(
        self, task: Delivery | str, lease_id: str | None = None, *, result: Any = UNSET
    ) -> None:
        """Report success. Raises LeaseLost if the lease is no longer yours, NotFound if nobody
        holds the task any more. (Over HTTP, the acks and nacks made in the same turn of the
        event loop go to the broker in one request; each caller gets its own outcome.)

        ``result``: the task's result, any JSON value (``None`` is JSON null; ``bytes`` are
        taken as JSON text): the broker keeps the task, ``"succeeded"``, with it for the
        task's result TTL, for :meth:`wait_result` and the deliveries of the tasks that wait
        for it. Without one the task is forgotten, as always."""
        if result is UNSET:
            await self._transport.ack(*_ids(task, lease_id))
        else:
            await self._transport.ack(*_ids(task, lease_id), result=encode_result(result))

    async def nack(
        self,
        task: Delivery | str,
        lease_id: str | None = None,
        *,
        error: str | None = None,
        delay_ms: int | None = None,
        terminal: bool = False,
    ) -> None:
        """Report failure; the task is retried after a backoff or buried in the DLQ.
        ``delay_ms``: retry after exactly this long instead (still an attempt: a task with none
        left is buried); ``terminal=True``: bury it now, whatever attempts remain (not with
        ``delay_ms``)."""
        await self._transport.nack(
            *_ids(task, lease_id),
            error,
            **_given(delay_ms=_option("delay_ms", delay_ms), terminal=_flag("terminal", terminal)),
        )

    async def release(self, task: Delivery | str, lease_id: str | None = None) -> None:
        """Hand a task you hold back without counting the attempt, as a worker that is stopping
        does: it is ready again at the head of its queue, its ``attempts`` as before you got
        it, and its ``last_error`` unchanged (a task cancelled while you held it is dropped, as
        a nack would). Raises LeaseLost or NotFound as nack does, and
        :class:`~wqclient.Unsupported` from a broker without the operation (an extension:
        nack with ``delay_ms=0`` there, which counts the attempt)."""
        release = getattr(self._transport, "release", None)
        if release is None:
            raise Unsupported("this client's transport has no release")
        await release(*_ids(task, lease_id))

    async def extend(
        self,
        task: Delivery | str,
        lease_ms: int | None = None,
        *,
        lease_id: str | None = None,
        progress: Any = UNSET,
    ) -> datetime:
        """Extend a lease you hold to now + ``lease_ms`` (unset: the broker's default, 30 s; at
        most 300 s, and never past the task's ``timeout_ms`` from hand-out) and return the new
        deadline. ``progress``: how far the work has come, any JSON value (at most 4 KiB
        encoded; ``bytes`` are JSON text), recorded on the task while it is handed out.
        Raises LeaseLost or NotFound as ack does; :class:`~wqclient.Cancelled` (a LeaseLost)
        if the task was cancelled (nack it: it is then dropped, without a retry),
        :class:`~wqclient.TimeLimitReached` (a LeaseLost) once the lease is at the time
        limit. (A :class:`~wqclient.Worker` extends its tasks' leases itself.)"""
        ids = _ids(task, lease_id)
        lease = _option("lease_ms", lease_ms)
        if progress is UNSET:
            return await self._transport.extend(*ids, lease)
        return await self._transport.extend(*ids, lease, progress=encode_progress(progress))

    async def get_task(self, task_id: str) -> Task:
        """Look a task up: a Task with its ``state`` (``"ready"``, ``"handed_out"``,
        ``"delayed"`` or ``"dead"``; ``"waiting"`` for its parents, ``"succeeded"`` with its
        ``result`` and ``finished_at``), its parents (``after``) and its live ``children``
        (the first 100, and ``children_count``). Raises NotFound once it is acked without a
        result (or if it never was)."""
        return await self._transport.get_task(task_id)

    async def wait_result(
        self, task: Delivery | Task | str, *, timeout: float | None = None
    ) -> TaskResult | None:
        """Wait for a task to end, up to ``timeout`` seconds (None: for as long as it takes;
        0: answer at once), and say how: a :class:`~wqclient.TaskResult` whose ``state`` is
        ``"succeeded"`` (its ``result``, decoded, and ``result_json``; None for a task acked
        without one while this waited), ``"dead"`` (its ``last_error``), ``"cancelled"`` or
        ``"expired"``. None if it is still pending (waiting, ready, delayed or handed out) when
        the timeout runs out. Raises NotFound for a task the broker does not have: never
        known, acked without a result (or with a TTL of 0) before the wait began, cancelled or
        expired before it, its result's time up.

        The broker holds one wait for at most 30 s: a longer one is asked again, in turn, until
        ``timeout`` (measured on the client's clock) runs out. Waiting costs the broker no
        polling (GET /jobs/{id}/result, gRPC WaitResult)."""
        task_id = _task_id(task)
        if timeout is not None and (isinstance(timeout, bool) or not timeout >= 0):
            raise InvalidArgument(f"timeout must be a number of seconds from 0, got {timeout!r}")
        clock = self._clock
        deadline = None if timeout is None or math.isinf(timeout) else clock.monotonic() + timeout
        while True:
            asked = clock.monotonic()
            left = None if deadline is None else max(0.0, deadline - asked)
            if left is None or left * 1000 >= MAX_WAIT_MS:
                wait_ms = MAX_WAIT_MS
            else:
                wait_ms = math.ceil(left * 1000)
            answer = await self._transport.wait_result(task_id, wait_ms)
            if answer is not None:
                return answer
            now = clock.monotonic()
            if (deadline is not None and now >= deadline) or wait_ms == 0:
                return None
            if now - asked < wait_ms / 2000:
                # A wait answered well before its time (a broker that does not hold them):
                # asked again after a pause, not at once.
                pause = 1.0 if deadline is None else min(1.0, deadline - now)
                await clock.sleep(pause)

    async def stats(self, queue: str | None = None) -> Stats:
        """Gauges (tasks in each collection now) and lifetime totals: of the whole broker, or
        of one ``queue`` (a queue never seen counts zeros)."""
        return await self._transport.stats(**_given(queue=_text("queue", queue)))

    async def queues(self) -> list[QueueInfo]:
        """Every queue the broker knows, by name: its gauges, and whether it is paused."""
        return await self._transport.queues()

    async def dead_letters(
        self, limit: int | None = None, *, queue: str | None = None
    ) -> list[Task]:
        """The dead-letter queue (of one ``queue``, or all), oldest burial first, each task with
        its last_error."""
        return await self._transport.dead_letters(
            _option("limit", limit), **_given(queue=_text("queue", queue))
        )

    async def requeue(self, task_id: str) -> None:
        """Give a dead task a clean start (attempts 0, back of ready)."""
        await self._transport.requeue(task_id)

    async def requeue_all(self, queue: str | None = None) -> int:
        """Requeue every dead task (of one ``queue``, or all); returns how many."""
        return await self._transport.requeue_all(_text("queue", queue))

    async def purge(self, task_id: str) -> None:
        """Drop a dead task for good (the ``purged`` total counts it). Raises NotFound if the
        task is not in the dead-letter queue."""
        await self._transport.purge(task_id)

    async def pause(self, queue: str) -> None:
        """Pause a queue: it still accepts tasks but hands none out until resumed."""
        await self._transport.pause(_text("queue", queue) or "")

    async def resume(self, queue: str) -> None:
        """Resume a paused queue (resuming one that is not paused does nothing)."""
        await self._transport.resume(_text("queue", queue) or "")

    async def cancel(self, task: Delivery | Task | str) -> str:
        """Cancel a task (its id, or the task or delivery): returns ``"cancelled"`` (it was
        ready or delayed: it is gone, counted ``cancelled``), ``"cancelling"`` (it is handed
        out: it will not be retried; its holder is told, a Worker cancels its handler; the
        task is gone once it is nacked or its lease runs out, while an ack still counts) or
        ``"purged"`` (it was dead: dropped, as :meth:`purge` does). Raises NotFound for a
        task the broker does not have (never known, acked, gone)."""
        return await self._transport.cancel(_task_id(task))

    async def list_tasks(
        self,
        queue: str = DEFAULT_QUEUE,
        state: str = "ready",
        limit: int = 100,
        cursor: str | None = None,
    ) -> TaskPage:
        """A page of a queue's tasks in one ``state`` (``"ready"``, ``"delayed"``,
        ``"handed_out"`` or ``"dead"``), each with its ``state``: ready ones in the order they
        would be claimed, delayed ones by due time, handed-out ones by lease deadline, dead
        ones by burial. ``limit``: 1 to 1000. ``cursor``: where the previous page ended (its
        ``next_cursor``); a task that stays in its state is neither repeated nor skipped
        from page to page. ``next_cursor`` is None once a page reaches the end. See
        :meth:`iter_tasks` for every page."""
        return await self._transport.list_tasks(
            _text("queue", queue),
            _text("state", state),
            _option("limit", limit),
            _text("cursor", cursor),
        )

    async def iter_tasks(
        self,
        queue: str = DEFAULT_QUEUE,
        state: str = "ready",
        limit: int = 100,
        cursor: str | None = None,
    ) -> AsyncIterator[Task]:
        """Every task of a queue in one ``state``, page after page of ``limit`` (from
        ``cursor``, or the start), as :meth:`list_tasks` lists them.

        >>> async for task in wq.iter_tasks("emails", state="dead"):
        ...     print(task.id, task.last_error)
        """
        while True:
            page = await self.list_tasks(queue, state, limit, cursor)
            for task in page.tasks:
                yield task
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    async def empty_queue(self, queue: str) -> int:
        """Cancel every ready and delayed task of a queue (handed-out ones run their course);
        returns how many (counted ``cancelled``). NotFound for a queue never seen."""
        return await self._transport.empty_queue(_text("queue", queue) or "")

    async def delete_queue(self, queue: str) -> None:
        """Forget a queue that holds nothing: it leaves :meth:`queues`, its paused flag and
        totals are forgotten. Raises :class:`~wqclient.Conflict` (naming its counts) if it
        holds tasks, NotFound for a queue never seen."""
        await self._transport.delete_queue(_text("queue", queue) or "")

    # -- schedules and limits (docs/design/schedules.md) ------------------------------------

    async def put_schedule(
        self,
        name: str,
        *,
        payload: Any,
        cron: str | None = None,
        every_ms: int | None = None,
        timezone: str | None = None,
        queue: str | None = None,
        priority: int | None = None,
        max_attempts: int | None = None,
        expires_in_ms: int | None = None,
        timeout_ms: int | None = None,
        result_ttl_ms: int | None = None,
        paused: bool = False,
    ) -> Schedule:
        """Create or replace the schedule ``name`` (1-64 characters of ``[A-Za-z0-9_.-]``) and
        return it as the broker stores it (with its ``next_fire_at``).

        Its rule, exactly one of: ``cron``, five fields (minute hour day-of-month month
        day-of-week: ``"*/5 * * * *"``, ``"0 9 * * MON-FRI"``) or a macro (``@hourly``,
        ``@daily``, ``@weekly``, ``@monthly``, ``@yearly``), in ``timezone`` (an IANA name such
        as ``"Europe/Paris"``; default UTC; daylight-saving changes are handled as cron does);
        or ``every_ms``, a fixed interval (1,000 ms to a year; the first fire comes that long
        after the put). Each fire enqueues one task: ``payload`` (any JSON value, or JSON
        bytes) with ``queue``, ``priority``, ``max_attempts``, ``expires_in_ms`` (counted
        from the fire), ``timeout_ms`` and ``result_ttl_ms``, as :meth:`enqueue` takes them;
        the task's ``schedule`` and ``scheduled_for`` say which schedule fired it, for which
        time. ``paused``: put it paused (it fires once resumed).

        A replace keeps the schedule's ``created_at``, ``fires`` and last fire. Each
        scheduled time enqueues exactly one task, however many brokers share the store; after
        downtime a schedule fires once, for its most recent missed time. InvalidArgument
        (naming the member) for a rule that does not parse, an unknown timezone, both rules
        or neither, or a bad task member."""
        spec = ScheduleSpec(
            encode_payload(payload),
            cron=_text("cron", cron),
            timezone=_text("timezone", timezone),
            every_ms=_option("every_ms", every_ms),
            queue=_text("queue", queue),
            priority=_option("priority", priority),
            max_attempts=_option("max_attempts", max_attempts),
            expires_in_ms=_option("expires_in_ms", expires_in_ms),
            timeout_ms=_option("timeout_ms", timeout_ms),
            result_ttl_ms=_option("result_ttl_ms", result_ttl_ms),
            paused=_flag("paused", paused),
        )
        return await self._transport.put_schedule(_name("name", name), spec)

    async def get_schedule(self, name: str) -> Schedule:
        """One schedule, with its next and last fires; NotFound if there is none of that
        name."""
        return await self._transport.get_schedule(_name("name", name))

    async def list_schedules(self) -> list[Schedule]:
        """Every schedule, by name."""
        return await self._transport.list_schedules()

    async def delete_schedule(self, name: str) -> None:
        """Delete a schedule (the tasks it fired stay); NotFound if there is none."""
        await self._transport.delete_schedule(_name("name", name))

    async def pause_schedule(self, name: str) -> Schedule:
        """Stop a schedule's fires until it is resumed (its ``next_fire_at`` is then None);
        returns it. NotFound if there is none."""
        return await self._transport.pause_schedule(_name("name", name))

    async def resume_schedule(self, name: str) -> Schedule:
        """Fire a paused schedule again, from its next rule time after now (the times missed
        while it was paused are not fired); returns it. NotFound if there is none."""
        return await self._transport.resume_schedule(_name("name", name))

    async def set_limits(
        self, queue: str, *, rate: RateLimit | None = None, concurrency: int | None = None
    ) -> Limits | None:
        """Set a queue's limits, replacing those it had: ``rate``, at most ``rate.tasks``
        hand-outs per ``rate.per_ms`` (a token bucket of ``rate.burst`` tokens, default
        ``tasks``: ``RateLimit(20, 1000)`` is 20 a second), and ``concurrency``, at most that
        many of its tasks handed out at once; None: no limit of that kind (neither: no limits,
        as :meth:`clear_limits`). They hold over every worker and every broker of a shared
        store; a queue not known yet is created. Returns the limits in force (None: none);
        :meth:`queues` shows them, with the rate tokens available now."""
        limits = Limits(_rate(rate), _option("concurrency", concurrency))
        return await self._transport.set_limits(_name("queue", queue), limits)

    async def clear_limits(self, queue: str) -> None:
        """Take a queue's limits away (both kinds)."""
        await self._transport.set_limits(_name("queue", queue), None)

    async def stream(
        self,
        *,
        prefetch: int = 1,
        lease_ms: int | None = None,
        queues: str | Sequence[str] | None = None,
    ) -> AsyncStream:
        """Consume tasks pushed by the broker: at most ``prefetch`` unsettled at once, each held
        for ``lease_ms``, from ``queues`` (as for :meth:`claim`). Needs a transport that can
        stream (:attr:`can_stream`: gRPC); raises WqError otherwise.

        >>> stream = await wq.stream(prefetch=8)
        >>> async for delivery in stream:
        ...     await stream.ack(delivery)

        ``await stream.ack(d)`` returns at once: the ack is queued and goes out with the
        others made meanwhile, in one message, before anything sent later on the stream. A
        refusal (the lease was lost) is logged and returned by ``await stream.flush()``, which
        waits for the broker's answer to everything sent. ``ack(d, confirm=True)`` waits for
        that one ack to be applied and raises its refusal. If the stream breaks, an ack not yet
        answered may or may not have been applied: a task whose ack was lost is handed out
        again (at least once, as with any lost ack).
        """
        transport = self._transport
        if not isinstance(transport, StreamingTransport):
            raise WqError(
                f"cannot stream over {type(transport).__name__}: streamed consumption needs a "
                "transport that streams, such as gRPC (a grpc://host:port broker URL)"
            )
        prefetch = _option("prefetch", prefetch) or 0
        return await transport.stream(
            prefetch, _option("lease_ms", lease_ms), **_given(queues=_queues(queues))
        )

    async def close(self) -> None:
        """Close the transport (its connections)."""
        await self._transport.close()


class _LoopThread:
    """A private event loop on a daemon thread, for the blocking client."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="wqclient", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()


class Stream:
    """A blocking view of an AsyncStream: iterate for deliveries, then ack or nack each."""

    def __init__(self, runner: _LoopThread, stream: AsyncStream) -> None:
        self._runner = runner
        self._stream = stream

    def __iter__(self) -> Iterator[Delivery]:
        return self

    def __next__(self) -> Delivery:
        try:
            return self._runner.run(self._next())
        except StopAsyncIteration:
            raise StopIteration from None

    async def _next(self) -> Delivery:
        return await self._stream.__anext__()

    def ack(self, delivery: Delivery, *, confirm: bool = False, result: Any = UNSET) -> None:
        """Settle a delivery as done: queued on the stream (``confirm``: applied by the broker,
        raising its refusal), as :meth:`AsyncStream.ack <wqclient.AsyncStream.ack>`.
        ``result``: the task's result, as for AsyncClient.ack."""
        if result is UNSET:
            self._runner.run(self._stream.ack(delivery, confirm=confirm))
        else:
            data = encode_result(result)
            self._runner.run(self._stream.ack(delivery, confirm=confirm, result=data))

    def nack(
        self,
        delivery: Delivery,
        error: str | None = None,
        *,
        delay_ms: int | None = None,
        terminal: bool = False,
        confirm: bool = False,
    ) -> None:
        """Settle a delivery as failed, with ``error`` (``delay_ms``, ``terminal``: as for
        AsyncClient.nack; ``confirm``: as for :meth:`ack`)."""
        self._runner.run(
            self._stream.nack(
                delivery,
                error,
                **_given(
                    delay_ms=_option("delay_ms", delay_ms), terminal=_flag("terminal", terminal)
                ),
                confirm=confirm,
            )
        )

    def flush(self) -> list[tuple[Delivery, WqError]]:
        """Wait for the broker's answer to every settlement sent; the unconfirmed acks and
        nacks it refused since the last flush, each with its error."""
        return self._runner.run(self._stream.flush())

    def extend(
        self, delivery: Delivery, lease_ms: int | None = None, *, progress: Any = UNSET
    ) -> datetime:
        """Extend a delivery's lease to now + ``lease_ms``; returns the new deadline.
        ``progress``: as for AsyncClient.extend."""
        lease = _option("lease_ms", lease_ms)
        if progress is UNSET:
            return self._runner.run(self._stream.extend(delivery, lease))
        return self._runner.run(
            self._stream.extend(delivery, lease, progress=encode_progress(progress))
        )

    def take_cancels(self) -> list[tuple[str, str]]:
        """The tasks this stream delivered that were cancelled while held (``(task_id,
        lease_id)``, oldest first, each once): stop working on them and nack them. Empty for
        a stream that is not told of cancels."""
        take = getattr(self._stream, "take_cancels", None)
        return [] if take is None else self._runner.run(self._take(take))

    @staticmethod
    async def _take(take: Callable[[], list[tuple[str, str]]]) -> list[tuple[str, str]]:
        return take()

    def set_prefetch(self, prefetch: int) -> None:
        """Change the stream's prefetch (as AsyncStream.set_prefetch)."""
        self._runner.run(self._set_prefetch(prefetch))

    async def _set_prefetch(self, prefetch: int) -> None:
        self._stream.set_prefetch(prefetch)

    def drain(self) -> int:
        """Ask for no new tasks; those already pushed still arrive. Returns how many
        deliveries are still unsettled (those on their way included), as the broker counts."""
        return self._runner.run(self._stream.drain())

    def close(self) -> None:
        """End the stream; unsettled tasks are reclaimed by the broker at once."""
        self._runner.run(self._stream.close())


def _close_open_clients() -> None:
    """At exit: close the blocking clients a program left open (a script that ends without
    ``close()``), so their sessions and channels end cleanly, not with aiohttp's "Unclosed
    client session" warnings as the interpreter collects them."""
    for client in list(_OPEN_CLIENTS):
        with contextlib.suppress(Exception):
            client.close()


_OPEN_CLIENTS: weakref.WeakSet[Client] = weakref.WeakSet()
atexit.register(_close_open_clients)


class Client:
    """A blocking client with the same methods as AsyncClient.

    >>> with Client("http://localhost:8080") as wq:
    ...     wq.enqueue({"line": "hello"})
    ...     print(wq.stats())

    The arguments are AsyncClient's (``token`` and ``ca_file`` included). The client runs an
    event loop of its own on a daemon thread; a ``transport`` you pass is used (and closed) on
    that loop, so it must not be bound to another one.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        transport: Transport | None = None,
        timeout: float | None = None,
        token: str | None = None,
        ca_file: str | None = None,
        clock: Clock | None = None,
    ) -> None:
        self._runner = _LoopThread()
        try:
            self._client = self._runner.run(
                self._make(
                    url, transport, timeout=timeout, token=token, ca_file=ca_file, clock=clock
                )
            )
        except BaseException:
            self._runner.stop()
            raise
        self.url = self._client.url
        _OPEN_CLIENTS.add(self)

    @staticmethod
    async def _make(url: str | None, transport: Transport | None, **options: Any) -> AsyncClient:
        # Built on the private loop: gRPC channels and aiohttp sessions belong to one loop.
        return AsyncClient(url, transport=transport, **options)

    @property
    def can_stream(self) -> bool:
        """Whether :meth:`stream` is available (see AsyncClient.can_stream)."""
        return self._client.can_stream

    def _run(self, method: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        """Run ``method(*args, **kwargs)`` (a coroutine function) on the private loop."""
        if self._runner.loop.is_closed():
            raise Unavailable("the client is closed")

        async def call() -> T:
            return await method(*args, **kwargs)

        return self._runner.run(call())

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def enqueue(
        self,
        payload: Any,
        *,
        max_attempts: int | None = None,
        delay_ms: int | None = None,
        queue: str | None = None,
        priority: int | None = None,
        idempotency_key: str | None = None,
        expires_in_ms: int | None = None,
        timeout_ms: int | None = None,
        unique: bool = False,
        after: Any = None,
        result_ttl_ms: int | None = None,
    ) -> Enqueued:
        """Enqueue a task and return its id (see AsyncClient.enqueue)."""
        return self._run(
            self._client.enqueue,
            payload,
            max_attempts=max_attempts,
            delay_ms=delay_ms,
            queue=queue,
            priority=priority,
            idempotency_key=idempotency_key,
            expires_in_ms=expires_in_ms,
            timeout_ms=timeout_ms,
            unique=unique,
            after=after,
            result_ttl_ms=result_ttl_ms,
        )

    def enqueue_many(
        self,
        payloads: Iterable[Any],
        *,
        max_attempts: int | None = None,
        delay_ms: int | None = None,
        queue: str | None = None,
        priority: int | None = None,
        expires_in_ms: int | None = None,
        timeout_ms: int | None = None,
        result_ttl_ms: int | None = None,
    ) -> list[Enqueued]:
        """Enqueue several tasks; returns their ids (see AsyncClient.enqueue_many)."""
        return self._run(
            self._client.enqueue_many,
            payloads,
            max_attempts=max_attempts,
            delay_ms=delay_ms,
            queue=queue,
            priority=priority,
            expires_in_ms=expires_in_ms,
            timeout_ms=timeout_ms,
            result_ttl_ms=result_ttl_ms,
        )

    def claim(
        self,
        *,
        wait_ms: int | None = None,
        lease_ms: int | None = None,
        queues: str | Sequence[str] | None = None,
    ) -> Delivery | None:
        """Claim the next ready task, or None (see AsyncClient.claim)."""
        return self._run(self._client.claim, wait_ms=wait_ms, lease_ms=lease_ms, queues=queues)

    def claim_many(
        self,
        max_tasks: int,
        *,
        wait_ms: int | None = None,
        lease_ms: int | None = None,
        queues: str | Sequence[str] | None = None,
    ) -> list[Delivery]:
        """Claim up to ``max_tasks`` ready tasks at once (see AsyncClient.claim_many)."""
        return self._run(
            self._client.claim_many, max_tasks, wait_ms=wait_ms, lease_ms=lease_ms, queues=queues
        )

    def ack(
        self, task: Delivery | str, lease_id: str | None = None, *, result: Any = UNSET
    ) -> None:
        """Report success, with the task's ``result`` if given (see AsyncClient.ack)."""
        self._run(self._client.ack, task, lease_id, result=result)

    def nack(
        self,
        task: Delivery | str,
        lease_id: str | None = None,
        *,
        error: str | None = None,
        delay_ms: int | None = None,
        terminal: bool = False,
    ) -> None:
        """Report failure (see AsyncClient.nack)."""
        self._run(
            self._client.nack, task, lease_id, error=error, delay_ms=delay_ms, terminal=terminal
        )

    def release(self, task: Delivery | str, lease_id: str | None = None) -> None:
        """Hand a task back without counting the attempt (see AsyncClient.release)."""
        self._run(self._client.release, task, lease_id)

    def extend(
        self,
        task: Delivery | str,
        lease_ms: int | None = None,
        *,
        lease_id: str | None = None,
        progress: Any = UNSET,
    ) -> datetime:
        """Extend a lease, recording ``progress`` if given; returns the new deadline (see
        AsyncClient.extend)."""
        return self._run(self._client.extend, task, lease_ms, lease_id=lease_id, progress=progress)

    def get_task(self, task_id: str) -> Task:
        """Look a task up, with its state (see AsyncClient.get_task)."""
        return self._run(self._client.get_task, task_id)

    def wait_result(
        self, task: Delivery | Task | str, *, timeout: float | None = None
    ) -> TaskResult | None:
        """Wait up to ``timeout`` seconds for a task to end, and say how; None if it is still
        pending then (see AsyncClient.wait_result)."""
        return self._run(self._client.wait_result, task, timeout=timeout)

    def stats(self, queue: str | None = None) -> Stats:
        """Gauges and lifetime totals, of the broker or of one queue."""
        return self._run(self._client.stats, queue)

    def queues(self) -> list[QueueInfo]:
        """Every queue the broker knows (see AsyncClient.queues)."""
        return self._run(self._client.queues)

    def dead_letters(self, limit: int | None = None, *, queue: str | None = None) -> list[Task]:
        """The dead-letter queue, oldest burial first (see AsyncClient.dead_letters)."""
        return self._run(self._client.dead_letters, limit, queue=queue)

    def requeue(self, task_id: str) -> None:
        """Give a dead task a clean start (see AsyncClient.requeue)."""
        self._run(self._client.requeue, task_id)

    def requeue_all(self, queue: str | None = None) -> int:
        """Requeue every dead task (of one queue); returns how many."""
        return self._run(self._client.requeue_all, queue)

    def purge(self, task_id: str) -> None:
        """Drop a dead task for good (see AsyncClient.purge)."""
        self._run(self._client.purge, task_id)

    def pause(self, queue: str) -> None:
        """Pause a queue (see AsyncClient.pause)."""
        self._run(self._client.pause, queue)

    def resume(self, queue: str) -> None:
        """Resume a paused queue (see AsyncClient.resume)."""
        self._run(self._client.resume, queue)

    def cancel(self, task: Delivery | Task | str) -> str:
        """Cancel a task: ``"cancelled"``, ``"cancelling"`` or ``"purged"`` (see
        AsyncClient.cancel)."""
        return self._run(self._client.cancel, task)

    def list_tasks(
        self,
        queue: str = DEFAULT_QUEUE,
        state: str = "ready",
        limit: int = 100,
        cursor: str | None = None,
    ) -> TaskPage:
        """A page of a queue's tasks in one state (see AsyncClient.list_tasks)."""
        return self._run(self._client.list_tasks, queue, state, limit, cursor)

    def iter_tasks(
        self,
        queue: str = DEFAULT_QUEUE,
        state: str = "ready",
        limit: int = 100,
        cursor: str | None = None,
    ) -> Iterator[Task]:
        """Every task of a queue in one state, a page of ``limit`` fetched at a time (see
        AsyncClient.iter_tasks)."""
        while True:
            page = self.list_tasks(queue, state, limit, cursor)
            yield from page.tasks
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    def empty_queue(self, queue: str) -> int:
        """Cancel every ready and delayed task of a queue; returns how many (see
        AsyncClient.empty_queue)."""
        return self._run(self._client.empty_queue, queue)

    def delete_queue(self, queue: str) -> None:
        """Forget a queue that holds nothing; Conflict if it holds tasks (see
        AsyncClient.delete_queue)."""
        self._run(self._client.delete_queue, queue)

    def put_schedule(
        self,
        name: str,
        *,
        payload: Any,
        cron: str | None = None,
        every_ms: int | None = None,
        timezone: str | None = None,
        queue: str | None = None,
        priority: int | None = None,
        max_attempts: int | None = None,
        expires_in_ms: int | None = None,
        timeout_ms: int | None = None,
        result_ttl_ms: int | None = None,
        paused: bool = False,
    ) -> Schedule:
        """Create or replace a schedule (see AsyncClient.put_schedule)."""
        return self._run(
            self._client.put_schedule,
            name,
            payload=payload,
            cron=cron,
            every_ms=every_ms,
            timezone=timezone,
            queue=queue,
            priority=priority,
            max_attempts=max_attempts,
            expires_in_ms=expires_in_ms,
            timeout_ms=timeout_ms,
            result_ttl_ms=result_ttl_ms,
            paused=paused,
        )

    def get_schedule(self, name: str) -> Schedule:
        """One schedule (see AsyncClient.get_schedule)."""
        return self._run(self._client.get_schedule, name)

    def list_schedules(self) -> list[Schedule]:
        """Every schedule, by name."""
        return self._run(self._client.list_schedules)

    def delete_schedule(self, name: str) -> None:
        """Delete a schedule (see AsyncClient.delete_schedule)."""
        self._run(self._client.delete_schedule, name)

    def pause_schedule(self, name: str) -> Schedule:
        """Stop a schedule's fires until resumed (see AsyncClient.pause_schedule)."""
        return self._run(self._client.pause_schedule, name)

    def resume_schedule(self, name: str) -> Schedule:
        """Fire a paused schedule again (see AsyncClient.resume_schedule)."""
        return self._run(self._client.resume_schedule, name)

    def set_limits(
        self, queue: str, *, rate: RateLimit | None = None, concurrency: int | None = None
    ) -> Limits | None:
        """Set a queue's rate and concurrency limits (see AsyncClient.set_limits)."""
        return self._run(self._client.set_limits, queue, rate=rate, concurrency=concurrency)

    def clear_limits(self, queue: str) -> None:
        """Take a queue's limits away (see AsyncClient.clear_limits)."""
        self._run(self._client.clear_limits, queue)

    def stream(
        self,
        *,
        prefetch: int = 1,
        lease_ms: int | None = None,
        queues: str | Sequence[str] | None = None,
    ) -> Stream:
        """A blocking stream of pushed tasks (see AsyncClient.stream; needs can_stream)."""
        return Stream(
            self._runner,
            self._run(self._client.stream, prefetch=prefetch, lease_ms=lease_ms, queues=queues),
        )

    def close(self) -> None:
        """Close the transport and stop the client's event loop. Safe to call more than once."""
        _OPEN_CLIENTS.discard(self)
        if self._runner.loop.is_closed():
            return
        self._run(self._client.close)
        self._runner.stop()
