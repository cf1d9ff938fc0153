"""How many tasks a Worker given no prefetch holds: its window (wqclient.worker._Window) follows
its handlers' time against the broker's round trip. The rule on given figures (no clock at all),
its bounds under any figures (Hypothesis), and the Worker wired to it against real brokers: fast
handlers widen the window over gRPC (the stream's prefetch changed on the fly) and over HTTP
(larger batch claims), slow ones keep it where it starts, a given prefetch never moves."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fake_clock import FakeClock
from tests.helpers import running_broker
from wqbroker.broker import Broker
from wqclient import AsyncClient, Client, InvalidArgument, Task, Worker
from wqclient.worker import AUTO_PREFETCH_MAX, PREFETCH_FACTOR, _Window

# -- the rule --------------------------------------------------------------------------------------


def window(concurrency: int = 3, cap: int = 256, budget: int = 1 << 30) -> _Window:
    return _Window(concurrency, PREFETCH_FACTOR * concurrency, cap, budget)


def test_it_starts_at_twice_the_concurrency_and_waits_for_both_figures() -> None:
    w = window()
    assert w.size == 6
    assert w.handled(0.000_01, 10) is None  # no round trip known yet
    assert w.size == 6


def test_handlers_short_against_the_round_trip_widen_it_to_cover_two_trips() -> None:
    w = window(concurrency=4)
    w.handled(0.001, 10)  # 1 ms a task
    # A 2 ms round trip: each handler does 4 tasks in two trips, 16 in all, plus the 4 running.
    assert w.answered(0.002) == 4 + 16
    assert w.size == 20


def test_handlers_that_take_no_time_widen_it_to_the_cap() -> None:
    w = window(cap=300)
    w.handled(0.0, 10)
    assert w.answered(0.001) == 300


def test_handlers_long_against_the_round_trip_keep_it_at_twice_the_concurrency() -> None:
    w = window()
    w.handled(0.5, 10)
    assert w.answered(0.002) is None
    assert w.size == 6


def test_a_handler_much_slower_than_before_narrows_it_at_once() -> None:
    w = window(cap=1000)
    w.handled(0.0001, 10)
    assert w.answered(0.01) is not None
    assert w.size > 100
    # One handler 10,000 times slower: the average jumps halfway, the window falls back.
    assert w.handled(1.0, 10) == 6
    # Fast ones bring it back only slowly (the average comes down by a twentieth a task).
    for _ in range(20):
        w.handled(0.0001, 10)
    assert w.answered(0.01) is None
    assert w.size == 6


def test_a_small_change_is_not_sent() -> None:
    w = window(concurrency=10)  # floor 20
    w.handled(0.01, 10)
    assert w.answered(0.1) == 10 + 200
    # A round trip half as long again moves the average to 0.11 s, asking for 230: less than
    # a quarter more than 210, so no change.
    assert w.answered(0.15) is None
    assert w.size == 210


def test_the_payloads_held_stay_under_the_budget() -> None:
    w = window(cap=4096, budget=1_000_000)
    w.handled(0.0, 10_000)  # (the payload average starts from 0: a fifth at a time)
    for _ in range(40):
        w.handled(0.0, 10_000)
    assert w.answered(0.01) == 100  # 1 MB of 10 kB payloads
    assert w.size == 100


def test_a_clock_that_does_not_move_changes_nothing() -> None:
    w = window()
    w.handled(0.0, 10)
    assert w.answered(0.0) is None
    assert w.size == 6


figures = st.floats(min_value=0, max_value=1e6, allow_nan=False, allow_infinity=False)


@given(
    concurrency=st.integers(1, 5000),
    cap=st.integers(1, 20_000),
    budget=st.integers(1, 1 << 40),
    steps=st.lists(
        st.tuples(st.booleans(), figures, st.integers(0, 10_000_000)), min_size=1, max_size=60
    ),
)
def test_the_window_stays_within_its_bounds_and_reports_every_change(
    concurrency: int, cap: int, budget: int, steps: list[tuple[bool, float, int]]
) -> None:
    w = _Window(concurrency, PREFETCH_FACTOR * concurrency, cap, budget)
    size = w.size
    for is_trip, seconds, payload in steps:
        changed = w.answered(seconds) if is_trip else w.handled(seconds, payload)
        assert w.floor <= w.size <= max(cap, w.floor)
        if changed is None:
            assert w.size == size
        else:
            assert changed == w.size != size
            size = w.size
        assert not w.timing


# -- the Worker, against real brokers --------------------------------------------------------------


@pytest.fixture
async def broker() -> AsyncIterator[Broker]:
    async with running_broker() as b:
        yield b


async def drained_by(url: str, **options: object) -> Worker:
    """Fill a broker with 3,000 tasks and drain them with a Worker of concurrency 3 whose
    handler returns at once; the worker, once stopped."""
    async with AsyncClient(url) as wq:
        for _ in range(3):
            await wq.enqueue_many([{"n": i} for i in range(1000)])
        seen = 0

        async def handler(_task: Task) -> None:
            nonlocal seen
            seen += 1
            if seen == 3000:
                worker.stop()

        worker = Worker(url, handler, concurrency=3, **options)  # type: ignore[arg-type]
        await asyncio.wait_for(worker.run(), 30)
        stats = await wq.stats()
    assert (stats.totals.acked, stats.ready, stats.handed_out) == (3000, 0, 0)
    assert seen == 3000
    return worker


async def test_over_grpc_fast_handlers_widen_the_stream(broker: Broker) -> None:
    worker = await drained_by("grpc://" + broker.grpc_target)
    assert worker.prefetch > 4 * PREFETCH_FACTOR * 3  # (a round trip is ms, a handler us)
    assert worker.prefetch <= AUTO_PREFETCH_MAX


async def test_over_http_fast_handlers_widen_the_batch_claims(broker: Broker) -> None:
    worker = await drained_by(broker.http_url)
    batch = worker._batch_window
    assert batch is not None
    assert batch.size > 4 * 3


async def test_a_given_prefetch_never_moves(broker: Broker) -> None:
    worker = await drained_by("grpc://" + broker.grpc_target, prefetch=5)
    assert worker.prefetch == 5


async def test_slow_handlers_keep_the_window_where_it_starts(broker: Broker) -> None:
    url = "grpc://" + broker.grpc_target
    most = 0
    async with AsyncClient(url) as wq:
        await wq.enqueue_many([{"n": i} for i in range(12)])

        async def handler(_task: Task) -> None:
            nonlocal most
            most = max(most, (await wq.stats()).handed_out)
            await asyncio.sleep(0.2)  # (against a round trip of a millisecond or two)
            if (await wq.stats()).totals.acked >= 9:
                worker.stop()

        worker = Worker(url, handler, concurrency=3)
        await asyncio.wait_for(worker.run(), 30)
    assert worker.prefetch == 6
    assert most <= 6


async def test_a_worker_on_a_clock_that_stands_still_keeps_its_window(broker: Broker) -> None:
    # Every time it measures is 0: no figure says the handlers are short.
    worker = await drained_by("grpc://" + broker.grpc_target, clock=FakeClock())
    assert worker.prefetch == 6


# -- changing a stream's prefetch by hand ----------------------------------------------------------


async def test_a_stream_s_prefetch_can_be_raised_by_hand(broker: Broker) -> None:
    async with AsyncClient("grpc://" + broker.grpc_target) as wq:
        await wq.enqueue_many(list(range(10)))
        stream = await wq.stream(prefetch=1)
        got = [await anext(stream)]
        stream.set_prefetch(4)
        got += [await anext(stream) for _ in range(3)]
        assert (await wq.stats()).handed_out == 4
        for d in got:
            await stream.ack(d)
        assert await stream.flush() == []
        await stream.close()


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "3"])
async def test_a_bad_prefetch_is_refused_before_it_is_sent(broker: Broker, bad: object) -> None:
    async with AsyncClient("grpc://" + broker.grpc_target) as wq:
        stream = await wq.stream(prefetch=1)
        with pytest.raises(InvalidArgument, match="prefetch"):
            stream.set_prefetch(bad)  # type: ignore[arg-type]
        await wq.enqueue(1)
        delivery = await anext(stream)  # the stream goes on
        await stream.ack(delivery, confirm=True)
        await stream.close()


async def test_the_blocking_stream_s_prefetch_can_be_changed(broker: Broker) -> None:
    def scenario() -> None:
        with Client("grpc://" + broker.grpc_target) as wq:
            wq.enqueue_many(list(range(5)))
            stream = wq.stream(prefetch=1)
            deliveries = iter(stream)
            first = next(deliveries)
            stream.set_prefetch(3)
            rest = [next(deliveries) for _ in range(2)]
            assert wq.stats().handed_out == 3
            for d in [first, *rest]:
                stream.ack(d, confirm=True)
            stream.close()

    await asyncio.to_thread(scenario)
