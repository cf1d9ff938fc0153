"""Prometheus metrics: the registry of one broker (:class:`Metrics`) and what it renders.

This module speaks no protocol: ``GET /metrics`` and the HTTP counts are served by
``wqbroker.http.metrics``, the gRPC counts by an interceptor in ``wqbroker.grpc.metrics``, and the
task timings come from the service's events (``wqbroker.events``). What is measured, and where:

- The store's state (each queue's gauges, totals and the age of its oldest ready task) is read at
  scrape time, by one :meth:`Store.queue_report` call: no per-task work, whatever the backlog (the
  stores keep counters; the oldest ready task is an index lookup per priority lane). The call is
  made before the registry is rendered, and the custom collector (:class:`_StateCollector`) only
  turns that snapshot into families. The dispatcher's parked long-polls and open streams, and the
  service's result waits, are read at the same moment. So are the schedules
  (:meth:`Service.list_schedules`: their next and last fire times and their fires, every broker's,
  as the store counts them) and each queue's limits (docs/design/schedules.md), which the
  queue report carries.
- Task timings and store latency are observed as they happen: :class:`Metrics` is the service's
  listener (an :class:`~wqbroker.events.Events`), told of each batch of hand-outs, settlements
  and leases gone, and of the time each store call that changes something took (a commit, in a
  durable store). From those: the wait of each task handed out (from when it became ready to its
  hand-out), the time from each hand-out to its ack or nack, the store's latency by operation;
  how late each of this broker's schedule fires was, and how many were refused
  (``Events.fired``).
- HTTP requests by route and status: :meth:`Metrics.count_answer`, called by the application's
  one middleware (through ``wqbroker.http.metrics.count_http``) for every answer, refusals (auth,
  bodies) included, and by the fast lane (``wqbroker.http.fast``) for the requests it serves
  itself.
- gRPC calls by method and code: one server interceptor (``wqbroker.grpc.metrics``), outside the
  auth interceptor, counting into :attr:`Metrics.grpc_requests`.

Every broker has a registry of its own (never the process-wide default), so several brokers in one
process (the tests) do not share series. Counters never go down while the broker runs: the store's
totals are reported as the highest value seen (``delivered`` is decremented when a hand-out that
nobody saw is undone; Prometheus would take a drop for a restart).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import fields
from typing import TYPE_CHECKING, Final

from prometheus_client import CollectorRegistry, disable_created_metrics, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from wqbroker.clock import Clock
from wqbroker.errors import WqError
from wqbroker.events import OPERATIONS, Events, Operation
from wqbroker.models import Delivery, QueueReport, Schedule, Totals

if TYPE_CHECKING:
    from wqbroker.service import Service

log = logging.getLogger("wqbroker.metrics")

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
    "cancelled": "Tasks cancelled: ready or delayed ones at once (a cancel, a queue emptied), "
    "cancelling ones once nacked or their lease ran out.",
    "expired": "Tasks dropped unhanded at their expiry (expires_in_ms).",
}
_GAUGES: Final = {
    "ready": "Tasks ready to be handed out.",
    "handed_out": "Tasks out with a worker under a lease.",
    "delayed": "Tasks waiting for their delay or retry backoff.",
    "dead": "Tasks in the dead-letter queue.",
    # docs/design/results.md
    "waiting": "Tasks waiting for their parents (enqueued with after) to succeed.",
    "succeeded": "Results held: tasks acked with a result, kept for their result TTL.",
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


class Metrics(Events):
    """The registry of one broker and everything that feeds it; the service's listener (wired
    by the broker: ``Service(..., events=metrics)``). It holds nothing of the store's state but
    the hand-outs not yet settled (lease id -> when), to time their settlement."""

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
        # docs/design/schedules.md: this broker's fires.
        self.fire_delay = _Histogram(
            "wq_schedule_fire_delay_seconds",
            "How late each schedule fire of this broker was: from its scheduled time to the "
            "fire (refused ones included).",
            _TASK_BUCKETS,
        ).labels()
        self.fire_errors = _Counts(
            "wq_schedule_fire_errors",
            "Schedule fires of this broker whose enqueue was refused (a limit, a payload over "
            "the size limit); the schedule still moved on to its next time.",
            (),
        )
        self.fire_errors.counts[()] = 0  # (shown from the start)
        self.registry.register(self.fire_errors)
        histograms: list[_Histogram] = [
            self.task_wait.family,
            self.task_processing,
            self.store_latency,
            self.fire_delay.family,
        ]
        for histogram in histograms:
            self.registry.register(histogram)
        # Every series of an operation or an outcome shows from the start (at 0).
        self._ops = {op: self.store_latency.labels(op) for op in OPERATIONS}
        self._acked = self.task_processing.labels("acked")
        self._nacked = self.task_processing.labels("nacked")
        self._handed_out: dict[str, float] = {}  # lease id -> when it was handed out
        self._service: Service | None = None

    # -- wiring -----------------------------------------------------------------------------

    def watch(self, service: Service) -> None:
        """The service whose state a scrape reports."""
        self._service = service

    # -- scraping ---------------------------------------------------------------------------

    async def exposition(self) -> bytes:
        """The text format of every metric: the store's state is read first (the one call that
        may wait), then everything is rendered at once."""
        service = self._service
        reports: list[QueueReport] | None = None
        schedules: list[Schedule] | None = None
        if service is not None:
            try:
                reports = await service.queue_report()
                schedules = await service.list_schedules()
            except WqError as e:  # the store is away: the rest is still worth reporting
                log.debug("metrics without the store's state: %s", e.message)
            self._state.update(
                reports,
                self.clock.now(),
                service.parked_polls,
                service.open_streams,
                service.result_waiters,
                schedules,
            )
        return generate_latest(self.registry)

    # -- requests ---------------------------------------------------------------------------

    def count_answer(self, method: str, route: str, status: int) -> None:
        """Counts an HTTP answer to ``method`` on ``route`` (as registered: ``/jobs/{id}/ack``;
        ``unmatched`` for a path with no route). Labels come only from bounded sets: the routes
        registered, a few methods."""
        self.http_requests.add((method if method in _METHODS else "other", route, str(status)))

    # -- the service's events ----------------------------------------------------------------

    def handed_out(self, deliveries: Sequence[Delivery]) -> None:
        now = self.clock.now()
        observe = self.task_wait.observe
        held = self._handed_out
        for delivery in deliveries:
            observe(max(0.0, now - delivery.task.available_at))
            if len(held) >= _MAX_LEASES:
                del held[next(iter(held))]
            held[delivery.lease_id] = now

    def settled(self, acked: Sequence[str], nacked: Sequence[str]) -> None:
        # (A loop for each outcome, written out: this runs for every ack.)
        now = self.clock.now()
        pop = self._handed_out.pop
        for lease_id in acked:
            at = pop(lease_id, None)
            if at is not None:
                self._acked.observe(max(0.0, now - at))
        for lease_id in nacked:
            at = pop(lease_id, None)
            if at is not None:
                self._nacked.observe(max(0.0, now - at))

    def leases_gone(self, lease_ids: Sequence[str]) -> None:
        pop = self._handed_out.pop
        for lease_id in lease_ids:
            pop(lease_id, None)

    def fired(self, schedule: str, late: float, failed: bool = False) -> None:
        self.fire_delay.observe(max(0.0, late))
        if failed:
            self.fire_errors.add(())

    def store_call(self, operation: Operation, seconds: float) -> None:
        self._ops[operation].observe(seconds)


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
        self._result_waiters = 0
        self._schedules: list[Schedule] | None = None
        self._high: dict[tuple[str, str], int] = {}  # (total, queue) -> highest value reported

    def update(
        self,
        reports: list[QueueReport] | None,
        now: float,
        parked: int,
        streams: int,
        result_waiters: int = 0,
        schedules: list[Schedule] | None = None,
    ) -> None:
        self._reports, self._now, self._parked, self._streams = reports, now, parked, streams
        self._result_waiters = result_waiters
        self._schedules = schedules

    def describe(self) -> Iterable[Metric]:
        return ()  # (nothing to check at registration: names are fixed here)

    def collect(self) -> Iterator[Metric]:
        parked = GaugeMetricFamily("wq_parked_long_polls", "Long-polling claims waiting now.")
        parked.add_metric((), self._parked)
        streams = GaugeMetricFamily("wq_open_streams", "gRPC task streams open now.")
        streams.add_metric((), self._streams)
        waiters = GaugeMetricFamily(
            "wq_result_waiters",
            "Result waits (GET /jobs/{id}/result, WaitResult) waiting now.",
        )
        waiters.add_metric((), self._result_waiters)
        up = GaugeMetricFamily("wq_store_up", "1 if the store answered this scrape, else 0.")
        up.add_metric((), 0 if self._reports is None else 1)
        yield from (parked, streams, waiters, up)
        if self._reports is not None:
            yield from self._queues(self._reports)
            yield from _limits(self._reports)
        if self._schedules is not None:
            yield from _schedules(self._schedules)

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
        if len(high) > len(reports) * len(_TOTALS):
            # A queue deleted (DELETE /queues/{name}) forgot its totals: so do these, so that
            # one made again under its name counts from 0 (a counter reset), not from its peak.
            names = {report.queue.name for report in reports}
            for key in [key for key in high if key[1] not in names]:
                del high[key]
        yield from gauges.values()
        yield from (paused, age)
        yield from totals.values()


def _limits(reports: Sequence[QueueReport]) -> Iterator[Metric]:
    """Each queue's limits (docs/design/schedules.md), for the queues that have them: the rate
    tokens available now and the rate, in tasks a second; the concurrency limit (the
    concurrency in use is ``wq_queue_handed_out``)."""
    tokens = GaugeMetricFamily(
        "wq_queue_rate_limit_tokens",
        "Rate-limit tokens a queue has now (hand-outs it may make at once), for queues with a "
        "rate limit.",
        labels=("queue",),
    )
    rate = GaugeMetricFamily(
        "wq_queue_rate_limit_tasks_per_second",
        "A queue's rate limit, in hand-outs a second (its bucket refills at this rate).",
        labels=("queue",),
    )
    concurrency = GaugeMetricFamily(
        "wq_queue_concurrency_limit",
        "A queue's concurrency limit: the most of its tasks handed out at once (in use: "
        "wq_queue_handed_out).",
        labels=("queue",),
    )
    for report in reports:
        row, label = report.queue, (report.queue.name,)
        limits = row.limits
        if row.tokens is not None:
            tokens.add_metric(label, row.tokens)
        if limits is None:
            continue
        if limits.rate is not None and limits.rate.per > 0:
            rate.add_metric(label, limits.rate.tasks / limits.rate.per)
        if limits.concurrency is not None:
            concurrency.add_metric(label, limits.concurrency)
    yield from (tokens, rate, concurrency)


def _schedules(schedules: Sequence[Schedule]) -> Iterator[Metric]:
    """Each schedule's next and last fire times and its fires (every broker's, as the store
    counts them; docs/design/schedules.md)."""
    next_fire = GaugeMetricFamily(
        "wq_schedule_next_fire_timestamp_seconds",
        "When a schedule fires next (its scheduled time, Unix seconds); none while paused.",
        labels=("schedule",),
    )
    last_fire = GaugeMetricFamily(
        "wq_schedule_last_fire_timestamp_seconds",
        "The scheduled time of a schedule's last fire (Unix seconds); none before its first.",
        labels=("schedule",),
    )
    fires = CounterMetricFamily(
        "wq_schedule_fires",
        "Fires of a schedule, by every broker (each enqueued one task, or was refused).",
        labels=("schedule",),
    )
    for schedule in schedules:
        label = (schedule.name,)
        if schedule.next_fire_at is not None:
            next_fire.add_metric(label, schedule.next_fire_at)
        if schedule.last_fire_at is not None:
            last_fire.add_metric(label, schedule.last_fire_at)
        fires.add_metric(label, schedule.fires)
    yield from (next_fire, last_fire, fires)
