"""The HTTP/JSON transport (aiohttp), one keep-alive session per client; over several brokers
when its URL names them (``http://a:8080,b:8080``: see ``_brokers.py``)."""

from __future__ import annotations

import asyncio
import functools
import json
import re
import ssl
from collections.abc import AsyncGenerator, Awaitable, Sequence
from datetime import datetime
from typing import Any, Final, NoReturn
from urllib.parse import quote, urlencode

import aiohttp

from wqclient._brokers import Brokers, split_brokers
from wqclient._coalesce import Coalescer, Unbatched
from wqclient._tls import certificate_error
from wqclient.clock import Clock, SystemClock
from wqclient.errors import (
    Cancelled,
    Conflict,
    InvalidArgument,
    LeaseLost,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    PermissionDenied,
    ProtocolError,
    TimeLimitReached,
    Unauthenticated,
    Unavailable,
    Unsupported,
    WqError,
)
from wqclient.limits import DEFAULT_TIMEOUT, poll_timeout
from wqclient.models import (
    CANCEL_STATES,
    CANCELLED,
    PURGED,
    Delivery,
    Enqueued,
    EnqueueItem,
    Limits,
    QueueInfo,
    Schedule,
    ScheduleSpec,
    Stats,
    Task,
    TaskPage,
    TaskResult,
)
from wqwire.defaults import BATCH_PATH, CLAIM_BATCH_PATH, IDEMPOTENCY_KEY_HEADER, SETTLE_PATH
from wqwire.scan import JsonText, read_members, scanner, skip

_ERRORS: dict[int, type[WqError]] = {
    400: InvalidArgument,
    404: NotFound,
    409: LeaseLost,
    401: Unauthenticated,
    403: PermissionDenied,
    413: PayloadTooLarge,
    429: Overloaded,
    503: Unavailable,
}

# How a 409 says the lease cannot be extended because of the task's time limit (the answer has no
# member of its own for it: docs/design/control.md words it "has reached its time limit of N ms").
_TIME_LIMIT = re.compile(r"\btime limit\b")


def _lease_refusal(message: str, cancelled: object) -> LeaseLost:
    """The LeaseLost a 409 stands for: Cancelled when the answer says ``"cancelled": true``,
    TimeLimitReached when it names the task's time limit."""
    if cancelled is True:
        return Cancelled(message)
    if _TIME_LIMIT.search(message):
        return TimeLimitReached(message)
    return LeaseLost(message)


# -- reading answers while keeping each payload's exact JSON text ---------------------------------
# The broker splices a payload into its answers exactly as it was enqueued; decoding and
# re-encoding it would change it (1e400 would become Infinity, 1.10 would become 1.1, ...), so
# "payload" members are kept as their raw text.

_scan_once = scanner(json.JSONDecoder())
# (A task's progress is JSON its holder reported, kept byte for byte as payloads are; so is a
# result, a task's own or a parent's in a delivery: docs/design/results.md.)
_PAYLOAD: Final = frozenset({"payload", "progress", "result"})


def _value(text: str, i: int) -> tuple[Any, int]:
    if text.startswith("{", i):
        return _object(text, i)
    if text.startswith("[", i):
        return _array(text, i)
    return _scan_once(text, i)


def _object(text: str, i: int) -> tuple[dict[str, Any], int]:
    out: dict[str, Any] = {}
    return out, read_members(text, i + 1, out, _PAYLOAD, _value, _scan_once)


def _array(text: str, i: int) -> tuple[list[Any], int]:
    out: list[Any] = []
    i = skip(text, i + 1)
    if text.startswith("]", i):
        return out, i + 1
    while True:
        value, i = _value(text, i)
        out.append(value)
        i = skip(text, i)
        if text.startswith(",", i):
            i = skip(text, i + 1)
        elif text.startswith("]", i):
            return out, i + 1
        else:
            raise ValueError(f"expected ',' or ']' at {i}")


# How the broker begins a delivery and a task: the one "payload" member comes right after an id
# with no escapes (the broker's ids are hexadecimal).
_LEADING_PAYLOAD = re.compile(r'\{(?:"task":\{)?"id":"[^"\\]*","payload":[ \t\n\r]*')


def _loads_led(text: str) -> Any:
    """A delivery or a task as the broker writes them, read as :func:`_loads` reads it, else
    None: the payload's extent found by the C scanner, the rest parsed by json.loads (with null
    for the payload), the payload's text put back. (The general parser walks every member in
    Python: five times as slow.) Anything unusual is left to the general parser: a "payload"
    member anywhere else (it keeps them all as text), a text that is not JSON."""
    match = _LEADING_PAYLOAD.match(text)
    if match is None:
        return None
    start = match.end()
    try:
        _, end = _scan_once(text, start)
        rest = text[end:]
        wrapped = text.startswith('{"task":')
        if (
            '"payload"' in rest
            or '"progress"' in rest
            or '"result"' in rest
            or (wrapped and '"task"' in rest)
        ):
            return None
        value = json.loads(text[:start] + "null" + rest)
    except (ValueError, StopIteration, RecursionError):
        return None
    task = value["task"] if wrapped else value
    if task.get("payload", 0) is not None:  # (not the member the scanner found)
        return None
    task["payload"] = JsonText(text[start:end].encode())
    return value


_DELIVERIES: Final = '{"deliveries":['


def _loads_deliveries(text: str) -> dict[str, list[Any]] | None:
    """A batch claim's deliveries as the broker writes them (``{"deliveries":[...]}``), each
    read by the C scanner whole, its payload's text kept from a second scan of just that; else
    None (the general parser then). (Member by member in Python, a batch took a third of a
    worker's time.)"""
    if not text.startswith(_DELIVERIES):
        return None
    i = len(_DELIVERIES)
    out: list[Any] = []
    if text[i:] == "]}":
        return {"deliveries": out}
    while True:
        match = _LEADING_PAYLOAD.match(text, i)
        if match is None or not text.startswith('{"task":', i):
            return None
        start = match.end()
        _, after_payload = _scan_once(text, start)
        value, end = _scan_once(text, i)  # (the whole delivery)
        rest = text[after_payload:end]
        task = value.get("task") if isinstance(value, dict) else None
        if not isinstance(task, dict) or '"payload"' in rest or '"task"' in rest:
            return None
        if '"progress"' in rest or '"result"' in rest:
            return None  # (kept as its text by the general parser)
        task["payload"] = JsonText(text[start:after_payload].encode())
        out.append(value)
        if text.startswith(",", end):
            i = end + 1
        elif text[end:] == "]}":
            return {"deliveries": out}
        else:
            return None


def _loads(data: bytes) -> Any:
    """Parse an answer, keeping "payload" members as raw JSON text."""
    try:
        text = data.decode("utf-8")
        value = _loads_led(text)
        if value is None:
            value = _loads_deliveries(text)
        if value is not None:
            return value
        value, end = _value(text, skip(text, 0))
        if skip(text, end) != len(text):
            raise ValueError("extra data")
        return value
    except (ValueError, StopIteration, RecursionError, UnicodeDecodeError) as e:
        raise ProtocolError(
            f"the broker sent an answer that is not JSON ({e}): {data[:200]!r}"
        ) from None


_UNRESERVED = re.compile(r"[A-Za-z0-9_.~-]*")  # what quote() leaves as it is (ids, leases)


def _q(value: str) -> str:
    return value if _UNRESERVED.fullmatch(value) else quote(value, safe="")


def _query(**params: object) -> str:
    """``?name=value&...`` of the parameters that are not None ("" if none is)."""
    given = {name: str(value) for name, value in params.items() if value is not None}
    return "?" + urlencode(given, quote_via=quote, safe=",") if given else ""


@functools.lru_cache(maxsize=64)
def _claim_path(wait_ms: int | None, lease_ms: int | None, queue: str | None) -> str:
    """A claim's path (a worker asks the same one every time)."""
    return "/jobs/next" + _query(wait_ms=wait_ms, lease_ms=lease_ms, queue=queue)


@functools.lru_cache(maxsize=64)
def _claim_many_path(
    count: int, wait_ms: int | None, lease_ms: int | None, queue: str | None
) -> str:
    return CLAIM_BATCH_PATH + _query(max=count, wait_ms=wait_ms, lease_ms=lease_ms, queue=queue)


_JSON_BODY: Final = {"Content-Type": "application/json"}
_SETTLE_GROUP: Final = 500  # acks, and as many nacks, per POST /jobs/settle (the cap: 10,000)
_OLDER: Final = (404, 405)  # what a broker without an extension answers its route


def _no_route(data: bytes) -> bool:
    """Whether a 404 says the route is missing, not the task: anything but the broker's JSON
    error, or its own word for a route it does not have."""
    try:
        message = json.loads(data)["error"]
    except (ValueError, KeyError, TypeError):
        return True
    return not isinstance(message, str) or message.startswith("no such endpoint")


class _Settlement:
    """An ack or a nack (its members) waiting to go in a POST /jobs/settle; an ack's result
    (JSON text, spliced in as it is), if it has one."""

    __slots__ = ("fields", "future", "result")

    def __init__(
        self, fields: dict[str, object], future: asyncio.Future[None], result: bytes | None = None
    ) -> None:
        self.fields = fields
        self.future = future
        self.result = result

    def member(self) -> bytes:
        """Its member of a POST /jobs/settle's list."""
        body = json.dumps(self.fields, separators=(",", ":")).encode()
        if self.result is None:
            return body
        return body[:-1] + b',"result":' + self.result + b"}"


def _certificate_error(base: str, error: BaseException) -> WqError:
    """The error for a broker whose certificate failed verification (``error``: ssl's)."""
    wrong_host = False
    if isinstance(error, ssl.SSLCertVerificationError):
        reason = f"CERTIFICATE_VERIFY_FAILED: {error.verify_message.rstrip('.')}"
        wrong_host = error.verify_code in _WRONG_HOST
    else:
        reason = str(error)
    return certificate_error(f"cannot reach the broker at {base}", reason, wrong_host)


# OpenSSL's X509_V_ERR_HOSTNAME_MISMATCH and X509_V_ERR_IP_ADDRESS_MISMATCH.
_WRONG_HOST: Final = (62, 64)


class _NotConnected(Exception):
    """No connection to the broker at ``base`` could be made: the request was not sent."""

    def __init__(self, base: str, reason: str) -> None:
        super().__init__(reason)
        self.base = base
        self.reason = reason


# A request as _call takes it: method, path, body, headers, time-out, statuses kept.
_Request = tuple[str, str, bytes | None, dict[str, str] | None, float, tuple[int, ...]]


@functools.lru_cache(maxsize=64)
def _timeout(total: float) -> aiohttp.ClientTimeout:
    """A request's time-out (one object per value: it is made for every request)."""
    return aiohttp.ClientTimeout(total=total)


class HttpTransport:
    """The HTTP/JSON API over one keep-alive aiohttp session (opened on first use). A
    :class:`~wqclient.transport.Transport`: the HTTP API has no streams.

    ``base_url`` may name several brokers (``http://a:8080,b:8080``): requests are spread over
    them, and one that cannot be connected to is skipped for a while (``_brokers.py``; ``clock``
    measures how long, default the system's). ``token``: sent with every request as
    ``Authorization: Bearer``. ``ssl_context``: how an ``https://`` broker is verified (default:
    the system's store)."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        clock: Clock | None = None,
    ) -> None:
        self._base = base_url.rstrip("/")
        bases = [base.rstrip("/") for base in split_brokers(self._base)]
        self._only = bases[0]
        self._brokers = Brokers(bases, clock or SystemClock()) if len(bases) > 1 else None
        self._timeout = timeout
        self._headers = {"Authorization": f"Bearer {token}"} if token else None
        self._ssl: ssl.SSLContext | bool = ssl_context if ssl_context is not None else True
        self._session: aiohttp.ClientSession | None = None
        self._closer: AsyncGenerator[None, None] | None = None  # (closes it: _closed_with_its_loop)
        self._batches = True  # POST /jobs/batch is there (until a broker says it is not)
        self._coalescer = Coalescer(self._enqueue, self._enqueue_batch)
        self._batch_claims = True  # GET /jobs/next/batch and POST /jobs/settle are there (...)
        self._settles = True
        # Acks and nacks made in the same turn of the loop, to go in one POST /jobs/settle.
        self._acks: list[_Settlement] = []
        self._nacks: list[_Settlement] = []
        self._settling: set[asyncio.Task[None]] = set()  # (the loop keeps weak references only)

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30, ssl=self._ssl),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self._timeout),
                headers=self._headers,
            )
            self._closer = _closed_with_its_loop(self._session)
        return self._session

    async def _call(
        self,
        method: str,
        path: str,
        *,
        body: bytes | None = None,
        timeout: float | None = None,
        headers: dict[str, str] | None = None,
        keep: tuple[int, ...] = (),
    ) -> tuple[int, bytes]:
        """The answer's status and body; an error status raises its WqError, but for those in
        ``keep``, which are returned. (With several brokers, from the first that can be
        connected to, in turn.)"""
        sent = _JSON_BODY if body is not None else None
        if headers:
            sent = {**(sent or {}), **headers}
        request = (method, path, body, sent, timeout or self._timeout, keep)
        brokers = self._brokers
        if brokers is not None:
            return await self._spread(brokers, request)
        try:
            return await self._send(self._only, *request)
        except _NotConnected as e:
            raise Unavailable(f"cannot reach the broker at {e.base}: {e.reason}") from None

    async def _spread(self, brokers: Brokers, request: _Request) -> tuple[int, bytes]:
        """A request to the first of the brokers that can be connected to, in turn."""
        reasons: list[str] = []
        for i in brokers.order():
            if reasons:
                brokers.went_on(i)
            try:
                answer = await self._send(brokers.bases[i], *request)
            except _NotConnected as e:  # (not sent: the next broker may have it)
                brokers.unreachable(i)
                reasons.append(f"{e.base}: {e.reason}")
                continue
            except WqError:
                brokers.reached(i)
                raise
            brokers.reached(i)
            return answer
        raise Unavailable("cannot reach any of the brokers (" + "; ".join(reasons) + ")")

    async def _send(
        self,
        base: str,
        method: str,
        path: str,
        body: bytes | None,
        headers: dict[str, str] | None,
        timeout: float,
        keep: tuple[int, ...],
    ) -> tuple[int, bytes]:
        """The request to the broker at ``base``. Raises _NotConnected if no connection could be
        made (nothing was sent)."""
        session = self._http()
        try:
            async with session.request(
                method, base + path, data=body, headers=headers, timeout=_timeout(timeout)
            ) as resp:
                data = await resp.read()
                if resp.status >= 400 and resp.status not in keep:
                    self._raise(resp.status, data, resp.headers.get("Retry-After"))
                return resp.status, data
        except aiohttp.ClientConnectorCertificateError as e:
            raise _certificate_error(base, e.certificate_error) from None
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
            raise _NotConnected(base, str(e)) from None
        except aiohttp.ClientConnectionError as e:
            raise Unavailable(f"cannot reach the broker at {base}: {e}") from None
        except TimeoutError:
            raise Unavailable(f"the broker at {base} did not answer in time") from None

    def _raise(self, status: int, data: bytes, retry_after: str | None = None) -> NoReturn:
        cancelled: object = None
        try:
            answer = json.loads(data)
            message = str(answer["error"])
            cancelled = answer.get("cancelled")
        except (ValueError, KeyError, TypeError, AttributeError):
            message = data.decode("utf-8", "replace").strip() or f"HTTP {status}"
        if status == 409:
            raise _lease_refusal(message, cancelled)
        if status == 429:
            seconds = retry_after.strip() if retry_after else ""
            raise Overloaded(message, retry_after=float(seconds) if seconds.isdigit() else 1.0)
        kind = _ERRORS.get(status)
        if kind is None:
            kind = Unavailable if status >= 500 else WqError
        raise kind(message)

    @staticmethod
    def _json(data: bytes) -> Any:
        try:
            return json.loads(data)
        except ValueError:
            raise ProtocolError(f"the broker sent invalid JSON: {data[:200]!r}") from None

    @staticmethod
    def _enqueue_body(item: EnqueueItem, key: bool = False) -> bytes:
        """POST /jobs's body for ``item``; with ``key``, its idempotency key too (as a task of
        POST /jobs/batch gives it)."""
        parts = [b'{"payload":', item.payload_json]
        if key and item.idempotency_key is not None:
            parts.append(b',"idempotency_key":' + json.dumps(item.idempotency_key).encode())
        if item.max_attempts is not None:
            parts.append(b',"max_attempts":%d' % item.max_attempts)
        if item.delay_ms is not None:
            parts.append(b',"delay_ms":%d' % item.delay_ms)
        if item.queue is not None:
            parts.append(b',"queue":' + json.dumps(item.queue).encode())
        if item.priority is not None:
            parts.append(b',"priority":%d' % item.priority)
        if item.expires_in_ms is not None:
            parts.append(b',"expires_in_ms":%d' % item.expires_in_ms)
        if item.timeout_ms is not None:
            parts.append(b',"timeout_ms":%d' % item.timeout_ms)
        if item.unique:
            parts.append(b',"unique":true')
        if item.after is not None or item.result_ttl_ms is not None:
            parts.append(_results_members(item))
        parts.append(b"}")
        return b"".join(parts)

    async def _enqueue(self, item: EnqueueItem) -> Enqueued:
        key = item.idempotency_key
        _, data = await self._call(
            "POST",
            "/jobs",
            body=self._enqueue_body(item),
            headers={IDEMPOTENCY_KEY_HEADER: key} if key is not None else None,
        )
        return Enqueued.from_mapping(self._json(data))

    def enqueue(
        self,
        payload_json: bytes,
        max_attempts: int | None,
        delay_ms: int | None,
        queue: str | None = None,
        priority: int | None = None,
        idempotency_key: str | None = None,
        *,
        expires_in_ms: int | None = None,
        timeout_ms: int | None = None,
        unique: bool = False,
        after: Sequence[str] | None = None,
        result_ttl_ms: int | None = None,
    ) -> Awaitable[Enqueued]:
        """One task. Enqueues made in the same turn of the event loop (concurrent callers) go
        to the broker together, in one POST /jobs/batch, each caller getting its own answer
        (see :class:`~wqclient._coalesce.Coalescer`); a lone call goes as it is, as POST /jobs.
        (The answer's future itself: no coroutine of its own per task.)"""
        item = EnqueueItem(
            payload_json,
            max_attempts,
            delay_ms,
            queue,
            priority,
            idempotency_key,
            expires_in_ms,
            timeout_ms,
            unique,
            None if after is None else tuple(after),
            result_ttl_ms,
        )
        return self._coalescer.add(item)

    async def enqueue_many(self, items: Sequence[EnqueueItem]) -> list[Enqueued]:
        """One POST /jobs/batch (all or none), in parts if the broker finds it too large; one
        POST /jobs per task, in order, to a broker without batches."""
        if not items:
            return []
        if self._batches:
            try:
                return await self._enqueue_batch(items)
            except Unbatched:
                pass
            except PayloadTooLarge as e:
                # The request over the broker's body limit (not one task over its payload
                # limit, which refuses the batch whole): send it in parts. (Not a batch whose
                # items name earlier ones by index: those name them in this batch only.)
                if (
                    len(items) == 1
                    or not e.message.startswith("request body")
                    or any(_indexed(item) for item in items)
                ):
                    raise
                half = len(items) // 2
                return await self.enqueue_many(items[:half]) + await self.enqueue_many(items[half:])
        return [await self._enqueue(item) for item in items]

    async def _enqueue_batch(self, items: Sequence[EnqueueItem]) -> list[Enqueued]:
        """POST /jobs/batch: the tasks' answers, in order. Unbatched if the broker has no such
        route (one older than it: 404 or 405; nothing was enqueued), and from then on."""
        if not self._batches:
            raise Unbatched("the broker takes no batches over HTTP")
        body = b'{"tasks":[' + b",".join(self._enqueue_body(i, key=True) for i in items) + b"]}"
        status, data = await self._call("POST", BATCH_PATH, body=body, keep=(404, 405))
        if status in (404, 405):
            self._batches = False
            raise Unbatched("the broker takes no batches over HTTP")
        answer = self._json(data)
        try:
            ids, duplicates = answer["ids"], answer["duplicates"]
            if len(ids) != len(items) or len(duplicates) != len(items):
                raise ValueError(f"{len(ids)} ids and {len(duplicates)} duplicates")
            return [Enqueued(str(i), bool(d)) for i, d in zip(ids, duplicates, strict=True)]
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(
                f"the broker's answer to a batch of {len(items)} is not one ({e}): {data[:200]!r}"
            ) from None

    async def claim(
        self, wait_ms: int | None, lease_ms: int | None, queues: Sequence[str] | None = None
    ) -> Delivery | None:
        queue = ",".join(queues) if queues else None
        path = _claim_path(wait_ms, lease_ms, queue)
        status, data = await self._call("GET", path, timeout=poll_timeout(wait_ms))
        if status == 204:
            return None
        return Delivery.from_mapping(_loads(data))

    @property
    def claims_many(self) -> bool:
        """Whether the broker takes batch claims, as far as this transport knows (until one
        answered that it does not)."""
        return self._batch_claims

    async def claim_many(
        self,
        count: int,
        wait_ms: int | None,
        lease_ms: int | None,
        queues: Sequence[str] | None = None,
    ) -> list[Delivery]:
        """Up to ``count`` tasks in one long-poll (GET /jobs/next/batch): it waits for the
        first, then takes as many as are ready with it. A broker without the route is asked
        one task at a time (GET /jobs/next) from then on."""
        if not self._batch_claims:
            claimed = await self.claim(wait_ms, lease_ms, queues)
            return [] if claimed is None else [claimed]
        queue = ",".join(queues) if queues else None
        path = _claim_many_path(count, wait_ms, lease_ms, queue)
        status, data = await self._call("GET", path, timeout=poll_timeout(wait_ms), keep=_OLDER)
        if status in _OLDER:
            self._batch_claims = False
            return await self.claim_many(count, wait_ms, lease_ms, queues)
        if status == 204:
            return []
        answer = _loads(data)
        try:
            rows = answer["deliveries"]
            if not isinstance(rows, list):
                raise TypeError("deliveries is not a list")
        except (KeyError, TypeError) as e:
            raise ProtocolError(f"the broker's batch claim has no deliveries ({e})") from None
        return [Delivery.from_mapping(row) for row in rows]

    def ack(self, task_id: str, lease_id: str, *, result: bytes | None = None) -> Awaitable[None]:
        """Acks (and nacks) made in the same turn of the event loop (concurrent callers) go to
        the broker together, in one POST /jobs/settle, each caller getting its own outcome; a
        lone one goes as it is, as POST /jobs/{id}/ack (with ``result``: a body
        ``{"result": ...}``, the JSON text as it is)."""
        return self._settle({"id": task_id, "lease_id": lease_id}, self._acks, result)

    async def _ack(self, task_id: object, lease_id: object, result: bytes | None = None) -> None:
        body = None if result is None else b'{"result":' + result + b"}"
        path = f"/jobs/{_q(str(task_id))}/ack?lease_id={_q(str(lease_id))}"
        await self._call("POST", path, body=body)

    def _settle(
        self, fields: dict[str, object], into: list[_Settlement], result: bytes | None = None
    ) -> Awaitable[None]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        if not self._acks and not self._nacks:
            loop.call_soon(self._send_settlements)
        into.append(_Settlement(fields, future, result))
        return future

    def _send_settlements(self) -> None:
        acks, self._acks = self._acks, []
        nacks, self._nacks = self._nacks, []
        loop = asyncio.get_running_loop()
        n = _SETTLE_GROUP
        for i in range(0, max(len(acks), len(nacks)), n):
            task = loop.create_task(self._settle_all(acks[i : i + n], nacks[i : i + n]))
            self._settling.add(task)
            task.add_done_callback(self._settling.discard)

    async def _settle_all(self, acks: list[_Settlement], nacks: list[_Settlement]) -> None:
        """Send the settlements together (one alone: its own request), and give each caller
        its outcome. A batch the broker refuses as a whole (one malformed settlement, or too
        large) is sent again one by one, so that each caller gets its own answer; any other
        failure of the request is every caller's."""
        everyone = [*acks, *nacks]
        try:
            if len(everyone) > 1 and self._settles:
                try:
                    outcomes = await self._settle_together(acks, nacks)
                except InvalidArgument:  # one is malformed, or they are too many: each alone
                    outcomes = None
                if outcomes is not None:
                    for settlement, outcome in zip(everyone, outcomes, strict=True):
                        _answer(settlement.future, outcome)
                    return
            await asyncio.gather(
                *(self._settle_alone(one, nack=False) for one in acks),
                *(self._settle_alone(one, nack=True) for one in nacks),
            )
        except BaseException as e:
            error = e if isinstance(e, Exception) else Unavailable("the client is closing")
            for settlement in everyone:
                if not settlement.future.done():
                    settlement.future.set_exception(error)
            if error is not e:
                raise

    async def _settle_together(
        self, acks: list[_Settlement], nacks: list[_Settlement]
    ) -> list[WqError | None] | None:
        """POST /jobs/settle: each one's outcome, in order (None: the broker has no such route,
        and is asked one by one from now on)."""
        if any(a.result is not None for a in acks):  # (results spliced in as their text)
            body = b"".join(
                (
                    b'{"acks":[',
                    b",".join(a.member() for a in acks),
                    b'],"nacks":[',
                    b",".join(n.member() for n in nacks),
                    b"]}",
                )
            )
        else:
            body = json.dumps(
                {"acks": [a.fields for a in acks], "nacks": [n.fields for n in nacks]},
                separators=(",", ":"),
            ).encode()
        status, data = await self._call("POST", SETTLE_PATH, body=body, keep=_OLDER)
        if status in _OLDER:
            self._settles = False
            return None
        answer = self._json(data)
        try:
            rows = [*answer["acks"], *answer["nacks"]]
            if len(rows) != len(acks) + len(nacks):
                raise ValueError("not one outcome for each")
            return [None if row is None else self._refusal(row) for row in rows]
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(f"the broker's answer to a settle is not one: {e}") from None

    def _refusal(self, row: dict[str, Any]) -> WqError:
        status = int(row["status"])
        if status == 409:
            return _lease_refusal(str(row["error"]), row.get("cancelled"))
        kind = _ERRORS.get(status) or (Unavailable if status >= 500 else WqError)
        return kind(str(row["error"]))

    async def _settle_alone(self, settlement: _Settlement, nack: bool) -> None:
        fields = dict(settlement.fields)
        task_id, lease_id = fields.pop("id"), fields.pop("lease_id")
        try:
            if nack:
                await self._nack(task_id, lease_id, fields)
            else:
                await self._ack(task_id, lease_id, settlement.result)
        except WqError as e:
            _answer(settlement.future, e)
        else:
            _answer(settlement.future, None)

    def nack(
        self,
        task_id: str,
        lease_id: str,
        error: str | None,
        delay_ms: int | None = None,
        terminal: bool = False,
    ) -> Awaitable[None]:
        """As :meth:`ack`: together with the others made in the same turn of the loop."""
        fields: dict[str, object] = {"id": task_id, "lease_id": lease_id}
        if error is not None:
            fields["error"] = error
        if delay_ms is not None:
            fields["delay_ms"] = delay_ms
        if terminal:
            fields["terminal"] = True
        return self._settle(fields, self._nacks)

    async def _nack(self, task_id: object, lease_id: object, fields: dict[str, object]) -> None:
        body = json.dumps(fields).encode() if fields else None
        path = f"/jobs/{_q(str(task_id))}/nack?lease_id={_q(str(lease_id))}"
        await self._call("POST", path, body=body)

    async def release(self, task_id: str, lease_id: str) -> None:
        """POST /jobs/{id}/release: the task back without counting the attempt. Unsupported
        from a broker without the route: 405, or a 404 that is not a task's (not the broker's
        JSON answer, or its ``no such endpoint``)."""
        path = f"/jobs/{_q(task_id)}/release{_query(lease_id=lease_id)}"
        status, data = await self._call("POST", path, keep=_OLDER)
        if status == 404 and not _no_route(data):
            self._raise(status, data)
        if status in _OLDER:
            raise Unsupported(f"the broker has no release (HTTP {status} on POST {path})")

    async def extend(
        self, task_id: str, lease_id: str, lease_ms: int | None, *, progress: bytes | None = None
    ) -> datetime:
        query = _query(lease_id=lease_id, lease_ms=lease_ms)
        body = None if progress is None else b'{"progress":' + progress + b"}"
        _, data = await self._call("POST", f"/jobs/{_q(task_id)}/extend{query}", body=body)
        answer = self._json(data)
        try:
            return datetime.fromisoformat(answer["deadline"])
        except (KeyError, TypeError, ValueError):
            raise ProtocolError(
                f"the broker's answer to an extend has no deadline: {data[:200]!r}"
            ) from None

    async def get_task(self, task_id: str) -> Task:
        if task_id == "next":  # GET /jobs/next claims a task; no task is called "next"
            raise NotFound("task next not found")
        _, data = await self._call("GET", f"/jobs/{_q(task_id)}")
        return Task.from_mapping(_loads(data))

    async def wait_result(self, task_id: str, wait_ms: int | None) -> TaskResult | None:
        """GET /jobs/{id}/result?wait_ms=N: 200 how it ended, 204 still pending (None)."""
        if task_id in ("next", "batch"):  # (no task is called so: those paths are others)
            raise NotFound(f"task {task_id} not found")
        path = f"/jobs/{_q(task_id)}/result" + _query(wait_ms=wait_ms)
        timeout = self._timeout if not wait_ms else poll_timeout(wait_ms)
        status, data = await self._call("GET", path, timeout=timeout)
        if status == 204:
            return None
        answer = _loads(data)
        if not isinstance(answer, dict):
            raise ProtocolError(f"the broker's answer to a result wait is not one: {data[:200]!r}")
        return TaskResult.from_mapping(answer, task_id)

    async def stats(self, queue: str | None = None) -> Stats:
        _, data = await self._call("GET", "/stats" + _query(queue=queue))
        return Stats.from_mapping(self._json(data))

    async def queues(self) -> list[QueueInfo]:
        _, data = await self._call("GET", "/queues")
        rows = self._json(data)
        if not isinstance(rows, list):
            raise ProtocolError(f"the broker's list of queues is not a list: {data[:200]!r}")
        return [QueueInfo.from_mapping(row) for row in rows]

    async def dead_letters(self, limit: int | None, queue: str | None = None) -> list[Task]:
        _, data = await self._call("GET", "/dlq" + _query(limit=limit, queue=queue))
        return [Task.from_mapping(t) for t in _loads(data)]

    async def requeue(self, task_id: str) -> None:
        await self._call("POST", f"/dlq/{_q(task_id)}/requeue")

    async def requeue_all(self, queue: str | None = None) -> int:
        _, data = await self._call("POST", "/dlq/requeue" + _query(queue=queue))
        answer = self._json(data)
        try:
            return int(answer["requeued"])
        except (KeyError, TypeError, ValueError):
            raise ProtocolError(
                f"the broker's answer to a requeue has no count: {data[:200]!r}"
            ) from None

    async def purge(self, task_id: str) -> None:
        await self._call("DELETE", f"/dlq/{_q(task_id)}")

    async def pause(self, queue: str) -> None:
        await self._call("POST", f"/queues/{_q(queue)}/pause")

    async def resume(self, queue: str) -> None:
        await self._call("POST", f"/queues/{_q(queue)}/resume")

    async def cancel(self, task_id: str) -> str:
        """DELETE /jobs/{id}. Its 204 is the same for a ready or delayed task (cancelled) and
        for a dead one (purged), so the task is looked up first to tell which it was (a task
        that dies or is requeued between the two requests is then named by its state before)."""
        if task_id == "next":  # (/jobs/next is no task: a claim)
            raise NotFound("task next not found")
        before = await self.get_task(task_id)  # (NotFound for an unknown task: nothing to do)
        status, data = await self._call("DELETE", f"/jobs/{_q(task_id)}")
        if status == 204 or not data.strip():
            return PURGED if before.state == "dead" else CANCELLED
        answer = self._json(data)
        state = answer.get("state") if isinstance(answer, dict) else None
        if state not in CANCEL_STATES:
            raise ProtocolError(f"the broker's answer to a cancel has no state: {data[:200]!r}")
        return str(state)

    async def list_tasks(
        self, queue: str | None, state: str | None, limit: int | None, cursor: str | None
    ) -> TaskPage:
        query = _query(queue=queue, state=state, limit=limit, cursor=cursor or None)
        _, data = await self._call("GET", "/jobs" + query)
        answer = _loads(data)
        if not isinstance(answer, dict):
            raise ProtocolError(f"the broker's list of tasks is not one: {data[:200]!r}")
        return TaskPage.from_mapping(answer)

    async def empty_queue(self, queue: str) -> int:
        _, data = await self._call("POST", f"/queues/{_q(queue)}/empty")
        answer = self._json(data)
        try:
            return int(answer["cancelled"])
        except (KeyError, TypeError, ValueError):
            raise ProtocolError(
                f"the broker's answer to emptying a queue has no count: {data[:200]!r}"
            ) from None

    async def delete_queue(self, queue: str) -> None:
        try:
            await self._call("DELETE", f"/queues/{_q(queue)}")
        except LeaseLost as e:  # (409 here: the queue holds tasks)
            raise Conflict(e.message) from None

    # -- schedules and limits (docs/design/schedules.md) ------------------------------------

    async def put_schedule(self, name: str, spec: ScheduleSpec) -> Schedule:
        """PUT /schedules/{name}: the schedule as stored."""
        _, data = await self._call("PUT", _schedule_path(name), body=_schedule_body(spec))
        return self._schedule(data)

    async def get_schedule(self, name: str) -> Schedule:
        _, data = await self._call("GET", _schedule_path(name))
        return self._schedule(data)

    async def list_schedules(self) -> list[Schedule]:
        _, data = await self._call("GET", "/schedules")
        answer = _loads(data)
        rows = answer.get("schedules") if isinstance(answer, dict) else None
        if not isinstance(rows, list):
            raise ProtocolError(f"the broker's list of schedules is not one: {data[:200]!r}")
        return [Schedule.from_mapping(row) for row in rows]

    async def delete_schedule(self, name: str) -> None:
        await self._call("DELETE", _schedule_path(name))

    async def pause_schedule(self, name: str) -> Schedule:
        _, data = await self._call("POST", _schedule_path(name) + "/pause")
        return self._schedule(data)

    async def resume_schedule(self, name: str) -> Schedule:
        _, data = await self._call("POST", _schedule_path(name) + "/resume")
        return self._schedule(data)

    @staticmethod
    def _schedule(data: bytes) -> Schedule:
        answer = _loads(data)
        if not isinstance(answer, dict):
            raise ProtocolError(f"the broker's schedule is not one: {data[:200]!r}")
        return Schedule.from_mapping(answer)

    async def set_limits(self, queue: str, limits: Limits | None) -> Limits | None:
        """PUT /queues/{name}/limits (DELETE for none): the limits in force."""
        path = f"/queues/{_q(queue)}/limits"
        if limits is None or limits.empty:
            await self._call("DELETE", path)
            return None
        _, data = await self._call("PUT", path, body=_limits_body(limits))
        answer = self._json(data)
        try:
            given = answer["limits"]
        except (KeyError, TypeError):
            raise ProtocolError(
                f"the broker's answer to setting limits has no limits: {data[:200]!r}"
            ) from None
        if given is None:
            return None
        if not isinstance(given, dict):
            raise ProtocolError(f"the broker's limits are not an object: {data[:200]!r}")
        found = Limits.from_mapping(given)
        return None if found.empty else found

    async def close(self) -> None:
        if self._settling:  # (the settlements on their way are let land)
            await asyncio.gather(*self._settling, return_exceptions=True)
        closer, self._closer, self._session = self._closer, None, None
        if closer is not None:
            await closer.aclose()  # (closes the session)


async def _closing(session: aiohttp.ClientSession) -> AsyncGenerator[None, None]:
    try:
        yield
    finally:
        await session.close()


def _closed_with_its_loop(session: aiohttp.ClientSession) -> AsyncGenerator[None, None]:
    """An async generator, started here (on the running loop), that closes ``session`` when it
    is closed: by the transport's close(), or else by the loop as it shuts down (asyncio.run
    closes every async generator still open: ``shutdown_asyncgens``), or once the transport is
    collected. So a program that never closes its client (the simplest script, an App's client
    in ``asyncio.run``) ends without aiohttp's "Unclosed client session" warnings."""
    closer = _closing(session)
    step = closer.asend(None)  # (the loop's first-iteration hook registers it with the loop)
    try:
        step.send(None)
    except StopIteration:  # (it ran to its yield)
        pass
    return closer


def _indexed(item: EnqueueItem) -> bool:
    """Whether an item of a batch names an earlier item by its index."""
    return item.after is not None and any(isinstance(ref, int) for ref in item.after)


def _results_members(item: EnqueueItem) -> bytes:
    """An enqueue's members of results and workflows (docs/design/results.md): ``after`` (ids,
    and indices of earlier items of a batch), ``result_ttl_ms``."""
    out = b""
    if item.after is not None:
        out += b',"after":' + json.dumps(list(item.after), separators=(",", ":")).encode()
    if item.result_ttl_ms is not None:
        out += b',"result_ttl_ms":%d' % item.result_ttl_ms
    return out


def _schedule_path(name: str) -> str:
    """/schedules/{name}, the name percent-encoded (an empty one is refused here: a path cannot
    carry it)."""
    if not name:
        raise InvalidArgument("a schedule's name must not be empty")
    return f"/schedules/{_q(name)}"


def _schedule_body(spec: ScheduleSpec) -> bytes:
    """PUT /schedules/{name}'s body: the members that are set, the payload's text as it is."""
    members: dict[str, object] = {}
    for name in _SCHEDULE_MEMBERS:
        value = getattr(spec, name)
        if value is not None:
            members[name] = value
    if spec.paused:
        members["paused"] = True
    rest = json.dumps(members, separators=(",", ":")).encode()
    return b'{"payload":' + spec.payload_json + (b"," + rest[1:] if members else b"}")


_SCHEDULE_MEMBERS: Final = (
    "cron",
    "timezone",
    "every_ms",
    "queue",
    "priority",
    "max_attempts",
    "expires_in_ms",
    "timeout_ms",
    "result_ttl_ms",
)


def _limits_body(limits: Limits) -> bytes:
    """PUT /queues/{name}/limits's body (a kind not set: null)."""
    rate: dict[str, int] | None = None
    if limits.rate is not None:
        rate = {"tasks": limits.rate.tasks, "per_ms": limits.rate.per_ms}
        if limits.rate.burst is not None:
            rate["burst"] = limits.rate.burst
    body = {"rate": rate, "concurrency": limits.concurrency}
    return json.dumps(body, separators=(",", ":")).encode()


def _answer(future: asyncio.Future[None], outcome: WqError | None) -> None:
    if future.done():
        return
    if outcome is None:
        future.set_result(None)
    else:
        future.set_exception(outcome)
