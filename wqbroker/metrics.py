"""Prometheus metrics: ``GET /metrics``, one :class:`Metrics` per broker, applied once.

What is measured, and where:

- The store's state (each queue's gauges, totals and the age of its oldest ready task) is read at
  scrape time, by one :meth:`Store.queue_report` call: no per-task work, whatever the backlog (the
  stores keep counters; the oldest ready task is an index lookup per priority lane). The call is
  made before the registry is rendered, and the custom collector (:class:`_StateCollector`) only
  turns that snapshot into families. The dispatcher's parked long-polls and open streams are read
  at the same moment.
- Task timings and store latency are observed as they happen, by :class:`MeteredStore`, a store
  that delegates every call of the contract to the real one: the wait of each task handed out
  (from when it became ready to its hand-out), the time from each hand-out to its ack or nack, and
  the latency of every store call that writes (a commit, in a durable store).
- HTTP requests by route and status: :meth:`Metrics.count_http`, called by the application's
  one middleware (``wqbroker.http.app``) for every answer, refusals (auth, bodies) included, and
  :meth:`Metrics.count_answer` by the fast lane (``wqbroker.http.fast``) for the requests it
  serves itself.
- gRPC calls by method and code: one server interceptor (:class:`MetricsInterceptor`), outside
  the auth interceptor.

Every broker has a registry of its own (never the process-wide default), so several brokers in one
process (the tests) do not share series. Counters never go down while the broker runs: the store's
totals are reported as the highest value seen (``delivered`` is decremented when a hand-out that
nobody saw is undone; Prometheus would take a drop for a restart).
"""

from __future__ import annotations

import asyncio
import bisect
import inspect
import itertools
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import fields
from typing import TYPE_CHECKING, Any, Final, TypeVar

import grpc
from aiohttp import web
from prometheus_client import CollectorRegistry, disable_created_metrics, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from wqbroker.clock import Clock
from wqbroker.errors import WqError
from wqbroker.grpc.auth import behavior_of, with_behavior
from wqbroker.models import (
    DEFAULT_QUEUE,
    Delivery,
    Enqueued,
    Failure,
    NackItem,
    NewTask,
    QueueReport,
    QueueStats,
    Stats,
    SweepResult,
    Task,
    TaskState,
    Totals,
)
from wqbroker.store import ReadyListener, Store

if TYPE_CHECKING:
    from wqbroker.service import Service

log = logging.getLogger("wqbroker.metrics")

R = TypeVar("R")

#: The route, as the token rules and the app name it.
ROUTE: Final = "/metrics"

_TOTALS: Final = tuple(f.name for f in fields(Totals))
_TOTAL_HELP: Final = {
    "enqueued": "Tasks accepted (a duplicate enqueue, by idempotency key, counts nothing).",
    "delivered": "Tasks handed out to workers (each attempt).",
    "acked": "Tasks acked (done).",
    "nacked": "Deliveries nacked by their workers.",
    "reclaimed": "Leases reclaimed (expired, or their stream ended).",
    "retried": "Failed deliveries put back for a retry.",
    "buried": "Tasks moved to the dead-letter queue.",
    "requeued": "Dead tasks requeued.",
    "purged": "Dead tasks dropped for good.",
}
_GAUGES: Final = {
    "ready": "Tasks ready to be handed out.",
    "handed_out": "Tasks out with a worker under a lease.",
    "delayed": "Tasks waiting for their delay or retry backoff.",
    "dead": "Tasks in the dead-letter queue.",
}

# Seconds: the wait of a task and the time a handler holds it (milliseconds to an hour).
_TASK_BUCKETS: Final = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600,
)  # fmt: skip
# Seconds: a store call (microseconds in memory, a disk sync or a round trip for the others).
_STORE_BUCKETS: Final = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5,
)  # fmt: skip
# Hand-outs remembered to time their ack or nack; past this many unsettled, the oldest are
# forgotten (their settlement is then not timed).
_MAX_LEASES: Final = 1_000_000
_METHODS: Final = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})


class Metrics:
    """The registry of one broker and everything that feeds it."""

    def __init__(self, clock: Clock) -> None:
        # The _created series (when each series was made) would double the output for nothing a
        # dashboard of ours uses (this switch is process-wide: it changes only what is rendered).
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry()
        self.clock = clock
        self._state = _StateCollector()
        self.registry.register(self._state)
        # Counted in plain dicts (one per request: the library's counters take a lock each
        # time), rendered at scrape time.
        self.http_requests = _Counts(
            "wq_http_requests",
            "HTTP requests answered, by method, route (as registered) and status.",
            ("method", "route", "status"),
        )
        self.grpc_requests = _Counts(
            "wq_grpc_requests",
            "gRPC calls finished, by service, method and status code.",
            ("service", "method", "code"),
        )
        self.registry.register(self.http_requests)
        self.registry.register(self.grpc_requests)
        # Histograms of our own, as the counters above: several observations per task.
        self.task_wait = _Histogram(
            "wq_task_wait_seconds",
            "From when a task became ready (enqueued, or its delay or backoff over, or "
            "requeued) to its hand-out.",
            _TASK_BUCKETS,
        ).labels()
        self.task_processing = _Histogram(
            "wq_task_processing_seconds",
            "From a hand-out to its ack or nack (by this broker), by outcome.",
            _TASK_BUCKETS,
            ("outcome",),
        )
        self.store_latency = _Histogram(
            "wq_store_commit_seconds",
            "Store calls that change something (a commit in a durable store), by operation.",
            _STORE_BUCKETS,
            ("operation",),
        )
        histograms: list[_Histogram] = [
            self.task_wait.family,
            self.task_processing,
            self.store_latency,
        ]
        for histogram in histograms:
            self.registry.register(histogram)
        self._service: Service | None = None

    # -- wiring -----------------------------------------------------------------------------

    def metered(self, store: Store) -> MeteredStore:
        """``store``, with its calls observed (what the service is to be given)."""
        return MeteredStore(store, self)

    def watch(self, service: Service) -> None:
        """The service whose state a scrape reports."""
        self._service = service

    # -- scraping ---------------------------------------------------------------------------

    async def exposition(self) -> bytes:
        """The text format of every metric: the store's state is read first (the one call that
        may wait), then everything is rendered at once."""
        service = self._service
        reports: list[QueueReport] | None = None
        if service is not None:
            try:
                reports = await service.queue_report()
            except WqError as e:  # the store is away: the rest is still worth reporting
                log.debug("metrics without the store's state: %s", e.message)
            self._state.update(
                reports, self.clock.now(), service.parked_polls, service.open_streams
            )
        return generate_latest(self.registry)

    async def handle(self, request: web.Request) -> web.Response:
        """``GET /metrics``."""
        body = await self.exposition()
        # The classic text format (every name here is a legacy one: the output is the same in
        # version 1.0.0), which every Prometheus reads.
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})

    # -- HTTP -------------------------------------------------------------------------------

    def count_http(self, request: web.Request, status: int) -> None:
        """Counts an answer by method, route and status."""
        # Labels come only from bounded sets: the routes registered, a few methods.
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        self.count_answer(request.method, route, status)

    def count_answer(self, method: str, route: str, status: int) -> None:
        """Counts an answer to ``method`` on ``route`` (as registered: ``/jobs/{id}/ack``)."""
        self.http_requests.add((method if method in _METHODS else "other", route, str(status)))

    # -- gRPC -------------------------------------------------------------------------------

    def interceptor(self) -> MetricsInterceptor:
        return MetricsInterceptor(self.grpc_requests)


class _Counts:
    """A counter with labels, kept as a dict of label values -> count (the event loop's thread
    alone adds to it) and rendered as a counter family by the registry."""

    def __init__(self, name: str, text: str, labels: tuple[str, ...]) -> None:
        self._name = name
        self._text = text
        self._labels = labels
        self.counts: dict[tuple[str, ...], int] = {}

    def add(self, labels: tuple[str, ...]) -> None:
        counts = self.counts
        counts[labels] = counts.get(labels, 0) + 1

    def describe(self) -> Iterable[Metric]:
        return ()

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self._name, self._text, labels=self._labels)
        for labels, count in self.counts.items():
            family.add_metric(labels, count)
        yield family


class _Observed:
    """One series of a :class:`_Histogram`: counts per bucket (not cumulative) and the sum."""

    __slots__ = ("family", "counts", "total")

    def __init__(self, family: _Histogram) -> None:
        self.family = family
        self.counts = [0] * (len(family.bounds) + 1)  # the last: above every bound
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.family.bounds, value)] += 1
        self.total += value


class _Histogram:
    """A histogram with labels, without the library's locks (the event loop's thread alone
    observes); rendered as a histogram family by the registry. Buckets are upper bounds, as
    Prometheus' ``le``: a value equal to a bound counts in that bucket."""

    def __init__(
        self, name: str, text: str, bounds: Sequence[float], labels: tuple[str, ...] = ()
    ) -> None:
        self._name = name
        self._text = text
        self.bounds = tuple(bounds)
        self._labels = labels
        self._series: dict[tuple[str, ...], _Observed] = {}

    def labels(self, *values: str) -> _Observed:
        series = self._series.get(values)
        if series is None:
            series = self._series[values] = _Observed(self)
        return series

    def describe(self) -> Iterable[Metric]:
        return ()

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self._name, self._text, labels=self._labels)
        for values, series in self._series.items():
            cumulative = list(itertools.accumulate(series.counts))
            buckets = [
                (_le(bound), float(count))
                for bound, count in zip((*self.bounds, math.inf), cumulative, strict=True)
            ]
            family.add_metric(list(values), buckets, series.total)
        yield family


def _le(bound: float) -> str:
    """A bucket's bound as Prometheus writes it (``0.5``, ``1.0``, ``+Inf``)."""
    return "+Inf" if bound == math.inf else repr(float(bound))


class _StateCollector:
    """Families made from the last snapshot of the store's state (see Metrics.exposition)."""

    def __init__(self) -> None:
        self._reports: list[QueueReport] | None = None
        self._now = 0.0
        self._parked = 0
        self._streams = 0
        self._high: dict[tuple[str, str], int] = {}  # (total, queue) -> highest value reported

    def update(
        self, reports: list[QueueReport] | None, now: float, parked: int, streams: int
    ) -> None:
        self._reports, self._now, self._parked, self._streams = reports, now, parked, streams

    def describe(self) -> Iterable[Metric]:
        return ()  # (nothing to check at registration: names are fixed here)

    def collect(self) -> Iterator[Metric]:
        parked = GaugeMetricFamily("wq_parked_long_polls", "Long-polling claims waiting now.")
        parked.add_metric((), self._parked)
        streams = GaugeMetricFamily("wq_open_streams", "gRPC task streams open now.")
        streams.add_metric((), self._streams)
        up = GaugeMetricFamily("wq_store_up", "1 if the store answered this scrape, else 0.")
        up.add_metric((), 0 if self._reports is None else 1)
        yield from (parked, streams, up)
        if self._reports is not None:
            yield from self._queues(self._reports)

    def _queues(self, reports: Sequence[QueueReport]) -> Iterator[Metric]:
        gauges = {
            name: GaugeMetricFamily(f"wq_queue_{name}", text, labels=("queue",))
            for name, text in _GAUGES.items()
        }
        paused = GaugeMetricFamily(
            "wq_queue_paused", "1 if the queue is paused (it hands nothing out).", labels=("queue",)
        )
        age = GaugeMetricFamily(
            "wq_queue_oldest_ready_age_seconds",
            "How long the oldest ready task (at the head of the queue's priority lanes) has "
            "waited since it became ready; 0 when none is ready.",
            labels=("queue",),
        )
        totals = {
            name: CounterMetricFamily(
                f"wq_tasks_{name}", _TOTAL_HELP.get(name, f"Tasks {name}."), labels=("queue",)
            )
            for name in _TOTALS
        }
        high = self._high
        for report in reports:
            row, label = report.queue, (report.queue.name,)
            for name, family in gauges.items():
                family.add_metric(label, getattr(row, name))
            paused.add_metric(label, 1 if row.paused else 0)
            oldest = report.oldest_ready
            age.add_metric(label, 0.0 if oldest is None else max(0.0, self._now - oldest))
            for name in _TOTALS:
                key = (name, row.name)
                value = max(getattr(report.totals, name), high.get(key, 0))
                high[key] = value
                totals[name].add_metric(label, value)
        yield from gauges.values()
        yield from (paused, age)
        yield from totals.values()


class MetricsInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Counts every call of a known method by its final status code."""

    def __init__(self, counter: _Counts) -> None:
        self._counter = counter

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None  # UNIMPLEMENTED: not counted (its name is the caller's to choose)
        service, _, method = handler_call_details.method.lstrip("/").rpartition("/")
        counter = self._counter

        def count(context: grpc.aio.ServicerContext[Any, Any], error: BaseException | None) -> None:
            counter.add((service, method, _code(context, error)))

        behavior = behavior_of(handler)
        if inspect.isasyncgenfunction(behavior):

            async def streaming(
                request: Any, context: grpc.aio.ServicerContext[Any, Any]
            ) -> AsyncIterator[Any]:
                try:
                    async for response in behavior(request, context):
                        yield response
                except BaseException as e:
                    count(context, e)
                    raise
                count(context, None)

            return with_behavior(handler, streaming)

        async def call(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            try:
                result = await behavior(request, context)
            except BaseException as e:
                count(context, e)
                raise
            count(context, None)
            return result

        return with_behavior(handler, call)


def _code(context: grpc.aio.ServicerContext[Any, Any], error: BaseException | None) -> str:
    """The name of the status code the call ends with."""
    try:
        code: Any = context.code()
    except Exception:  # (an experimental API of grpc.aio)
        code = None
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int):
        for status in grpc.StatusCode:
            if status.value[0] == code:
                return status.name
    if error is None:
        return "OK"
    if isinstance(error, (GeneratorExit, asyncio.CancelledError)):  # the client went away
        return "CANCELLED"
    return "UNKNOWN"


class MeteredStore:
    """A store that times the calls that write and the tasks it hands out, and passes every call
    on to the real store (``inner``). It holds nothing of the store's state but the hand-outs not
    yet settled (lease id -> when), to time their settlement."""

    def __init__(self, inner: Store, metrics: Metrics) -> None:
        self.inner = inner
        self.never_suspends = inner.never_suspends
        self.shared = inner.shared
        self._clock = metrics.clock
        self._wait = metrics.task_wait
        self._processing = metrics.task_processing
        self._ops = {
            op: metrics.store_latency.labels(op)
            for op in (
                "enqueue",
                "claim",
                "settle",
                "extend",
                "reclaim",
                "release",
                "sweep",
                "requeue",
                "purge",
                "pause",
            )
        }
        self._acked = metrics.task_processing.labels("acked")
        self._nacked = metrics.task_processing.labels("nacked")
        self._handed_out: dict[str, float] = {}  # lease id -> when it was handed out

    # -- the contract's attributes -----------------------------------------------------------

    @property
    def transactions(self) -> int:
        return self.inner.transactions

    @transactions.setter
    def transactions(self, value: int) -> None:
        self.inner.transactions = value

    # -- observing ---------------------------------------------------------------------------

    async def _timed(self, op: str, call: Awaitable[R]) -> R:
        started = time.perf_counter()
        try:
            return await call
        finally:
            self._ops[op].observe(time.perf_counter() - started)

    def _out(self, deliveries: Iterable[Delivery]) -> None:
        now = self._clock.now()
        observe = self._wait.observe
        held = self._handed_out
        for delivery in deliveries:
            observe(max(0.0, now - delivery.task.available_at))
            if len(held) >= _MAX_LEASES:
                del held[next(iter(held))]
            held[delivery.lease_id] = now

    def _settled(self, lease_id: str, acked: bool) -> None:
        at = self._handed_out.pop(lease_id, None)
        if at is not None:
            histogram = self._acked if acked else self._nacked
            histogram.observe(max(0.0, self._clock.now() - at))

    def _acks_settled(self, lease_ids: Iterable[str]) -> None:
        """As ``_settled`` for acks, with one reading of the clock for all."""
        pop = self._handed_out.pop
        now = self._clock.now()
        observe = self._acked.observe
        for lease_id in lease_ids:
            at = pop(lease_id, None)
            if at is not None:
                observe(max(0.0, now - at))

    # -- the contract ------------------------------------------------------------------------

    async def enqueue_many(self, items: Sequence[NewTask], *, now: float) -> list[Enqueued]:
        return await self._timed("enqueue", self.inner.enqueue_many(items, now=now))

    async def claim(
        self, *, lease: float, now: float, queues: Sequence[str] = (DEFAULT_QUEUE,)
    ) -> Delivery | None:
        delivery = await self._timed("claim", self.inner.claim(lease=lease, now=now, queues=queues))
        if delivery is not None:
            self._out((delivery,))
        return delivery

    async def claim_many(
        self, leases: Sequence[float], *, now: float, queues: Sequence[str] = (DEFAULT_QUEUE,)
    ) -> list[Delivery]:
        deliveries = await self._timed(
            "claim", self.inner.claim_many(leases, now=now, queues=queues)
        )
        if deliveries:
            self._out(deliveries)
        return deliveries

    async def ack(self, task_id: str, lease_id: str, *, now: float) -> None:
        await self._timed("settle", self.inner.ack(task_id, lease_id, now=now))
        self._settled(lease_id, True)

    async def settle_many(
        self, acks: Sequence[tuple[str, str]], nacks: Sequence[NackItem], *, now: float
    ) -> tuple[list[WqError | None], list[Failure | WqError]]:
        acked, nacked = await self._timed("settle", self.inner.settle_many(acks, nacks, now=now))
        self._acks_settled(
            lease_id for (_, lease_id), error in zip(acks, acked, strict=True) if error is None
        )
        for item, outcome in zip(nacks, nacked, strict=True):
            if isinstance(outcome, Failure):
                self._settled(item.lease_id, False)
        return acked, nacked

    async def nack(
        self,
        task_id: str,
        lease_id: str,
        error: str | None,
        *,
        now: float,
        delay: float | None = None,
        terminal: bool = False,
    ) -> Failure:
        failure = await self._timed(
            "settle",
            self.inner.nack(task_id, lease_id, error, now=now, delay=delay, terminal=terminal),
        )
        self._settled(lease_id, False)
        return failure

    async def extend(self, task_id: str, lease_id: str, *, lease: float, now: float) -> float:
        return await self._timed(
            "extend", self.inner.extend(task_id, lease_id, lease=lease, now=now)
        )

    async def reclaim(self, task_id: str, lease_id: str, error: str, *, now: float) -> Failure:
        self._handed_out.pop(lease_id, None)
        return await self._timed("reclaim", self.inner.reclaim(task_id, lease_id, error, now=now))

    async def release(self, task_id: str, lease_id: str) -> bool:
        self._handed_out.pop(lease_id, None)
        return await self._timed("release", self.inner.release(task_id, lease_id))

    async def sweep(self, *, now: float) -> tuple[SweepResult, float | None]:
        # Timed only when it changed something (most sweeps find nothing due: no commit).
        started = time.perf_counter()
        result, due = await self.inner.sweep(now=now)
        if result.reclaimed or result.promoted:
            self._ops["sweep"].observe(time.perf_counter() - started)
        for _, lease_id in result.reclaimed:
            self._handed_out.pop(lease_id, None)
        return result, due

    async def requeue(self, task_id: str, *, now: float) -> str:
        return await self._timed("requeue", self.inner.requeue(task_id, now=now))

    async def requeue_all(self, *, queue: str | None = None, now: float) -> tuple[int, list[str]]:
        return await self._timed("requeue", self.inner.requeue_all(queue=queue, now=now))

    async def purge(self, task_id: str) -> None:
        await self._timed("purge", self.inner.purge(task_id))

    async def set_paused(self, queue: str, paused: bool) -> None:
        await self._timed("pause", self.inner.set_paused(queue, paused))

    # -- reads and hints: passed on ----------------------------------------------------------

    async def stats(self, queue: str | None = None) -> Stats:
        return await self.inner.stats(queue)

    async def queues(self) -> list[QueueStats]:
        return await self.inner.queues()

    async def queue_report(self) -> list[QueueReport]:
        return await self.inner.queue_report()

    async def lookup(self, task_id: str) -> TaskState | None:
        return await self.inner.lookup(task_id)

    async def dead_letters(
        self, *, limit: int | None = None, queue: str | None = None
    ) -> list[Task]:
        return await self.inner.dead_letters(limit=limit, queue=queue)

    def problem(self) -> str | None:
        return self.inner.problem()

    def held_hint(self) -> int | None:
        return self.inner.held_hint()

    def queue_hint(self, queue: str) -> bool | None:
        return self.inner.queue_hint(queue)

    def queue_count_hint(self) -> int | None:
        return self.inner.queue_count_hint()

    def key_hint(self, queue: str, key: str, now: float) -> bool | None:
        return self.inner.key_hint(queue, key, now)

    def ready_hint(self) -> int | None:
        return self.inner.ready_hint()

    def on_ready(self, callback: Callable[[Iterable[str] | None], None]) -> None:
        if isinstance(self.inner, ReadyListener):
            self.inner.on_ready(callback)

    async def close(self) -> None:
        await self.inner.close()
