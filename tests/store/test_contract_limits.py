"""The store contract's limits per queue (docs/design/schedules.md), checked against every backend:
a rate limit (a token bucket: ``burst`` at once, then ``tasks`` per ``per``) and a concurrency
limit hold on every claim path (claim, claim_many, settle_claim), a claim over several queues
takes from a limited one what its limits allow and moves on, ``set_limits`` sets, changes (a new
rate refills the bucket) and clears them, ``queues``/``queue_report`` show them with the tokens
available at ``now``, ``limit_hint`` says when a token comes, and a freed concurrency slot is told
by ``take_released``. SQLite keeps the limits over a restart (its bucket starts full again).

Then a property (Hypothesis, on the memory store, whose calls never suspend): for random
sequences of claims, acks, nacks, releases and advances of time, the hand-outs of a queue in any
window of ``per`` seconds are at most ``tasks + burst``, and it never holds more than its
concurrency.

Every call passes an explicit ``now``; on PostgreSQL, the store uses those times too (not the
database's clock)."""

from __future__ import annotations

import asyncio
import bisect
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import examples
from tests.store.test_contract import LEASE, NOW, PAYLOAD, expect
from wqbroker.models import (
    DEFAULT_QUEUE,
    Delivery,
    Limits,
    NackItem,
    NewTask,
    QueueStats,
    RateLimit,
)
from wqbroker.retry import Backoff
from wqbroker.store import Store
from wqbroker.store.memory import MemoryStore
from wqbroker.store.sqlite import SqliteStore

Q = "limited"
OTHER = "other"


@pytest.fixture(autouse=True)
async def _structures_agree(store: Store) -> AsyncIterator[None]:
    """After each test, the memory store's own structures agree with each other."""
    yield
    if isinstance(store, MemoryStore):
        store.check_invariants()


def rate(tasks: int, per: float, burst: int | None = None) -> Limits:
    return Limits(RateLimit(tasks, per, tasks if burst is None else burst))


async def fill(store: Store, n: int, queue: str = Q, now: float = NOW) -> list[str]:
    done = await store.enqueue_many([NewTask(PAYLOAD, 3, 0.0, queue) for _ in range(n)], now=now)
    return [e.id for e in done]


async def take(store: Store, n: int, now: float, queues: tuple[str, ...] = (Q,)) -> list[Delivery]:
    return await store.claim_many([LEASE] * n, now=now, queues=queues)


async def row(store: Store, name: str = Q, now: float | None = None) -> QueueStats:
    (found,) = [r for r in await store.queues(now=now) if r.name == name]
    return found


# -- rate ----------------------------------------------------------------------------------------


async def test_a_rate_limit_hands_out_a_burst_then_tasks_per_period(store: Store) -> None:
    await store.set_limits(Q, rate(2, 1.0, burst=3), now=NOW)
    await fill(store, 10)
    assert len(await take(store, 10, NOW)) == 3  # the bucket starts full: the burst
    assert await take(store, 10, NOW) == []
    assert await store.claim(lease=LEASE, now=NOW + 0.4, queues=(Q,)) is None  # 0.8 of a token
    assert len(await take(store, 10, NOW + 0.5)) == 1  # a token every half second
    assert await take(store, 10, NOW + 0.5) == []
    assert len(await take(store, 10, NOW + 1.5)) == 2
    assert len(await take(store, 10, NOW + 60)) == 3  # never more than the burst
    assert await take(store, 10, NOW + 60) == []
    await expect(store, ready=1, handed_out=9, enqueued=10, delivered=9)


async def test_tokens_are_taken_only_by_hand_outs(store: Store) -> None:
    await store.set_limits(Q, rate(1, 10.0, burst=2), now=NOW)
    assert await take(store, 5, NOW) == []  # nothing ready: the bucket stays full
    await fill(store, 3)
    assert len(await take(store, 5, NOW + 1)) == 2
    assert (await row(store, now=NOW + 1)).tokens == pytest.approx(0.0, abs=1e-6)
    assert (await row(store, now=NOW + 6)).tokens == pytest.approx(0.5)


async def test_the_rate_counts_hand_outs_not_acks(store: Store) -> None:
    await store.set_limits(Q, rate(1, 1.0), now=NOW)
    await fill(store, 3)
    (d,) = await take(store, 3, NOW)
    await store.ack(d.task.id, d.lease_id, now=NOW)
    assert await take(store, 3, NOW) == []  # an ack gives no token back
    assert len(await take(store, 3, NOW + 1)) == 1


async def test_limit_hint_says_when_a_token_comes(store: Store) -> None:
    assert store.limit_hint((Q,), NOW) is None  # no limits at all
    await store.set_limits(Q, rate(4, 1.0, burst=1), now=NOW)
    await fill(store, 5)
    assert len(await take(store, 5, NOW)) == 1
    assert await take(store, 5, NOW + 0.1) == []
    hint = store.limit_hint((OTHER, Q), NOW + 0.1)
    assert hint is not None
    assert hint == pytest.approx(NOW + 0.25, abs=0.002)
    assert len(await take(store, 5, hint)) == 1
    assert await take(store, 5, hint) == []


async def test_limit_hint_is_now_once_the_token_has_come(store: Store) -> None:
    # (A store that waits for its commits answers a claim a moment after it looked: by then the
    # token may have come, and the dispatcher must look again at once, not never.)
    await store.set_limits(Q, rate(1, 1.0), now=NOW)
    await fill(store, 3)
    assert len(await take(store, 3, NOW)) == 1
    assert await take(store, 3, NOW + 0.5) == []
    hint = store.limit_hint((Q,), NOW + 5)
    assert hint is not None
    assert hint <= NOW + 5.01


async def test_limit_hint_is_none_when_the_limited_queue_has_nothing_ready(store: Store) -> None:
    await store.set_limits(Q, rate(1, 1.0), now=NOW)
    await fill(store, 1)
    assert len(await take(store, 2, NOW)) == 1
    assert await take(store, 2, NOW) == []
    assert store.limit_hint((Q,), NOW) is None  # nothing ready: no token to wait for


# -- concurrency ---------------------------------------------------------------------------------


async def test_a_concurrency_limit_holds_over_claims(store: Store) -> None:
    await store.set_limits(Q, Limits(concurrency=2), now=NOW)
    await fill(store, 6)
    a, b = await take(store, 6, NOW)
    assert await store.claim(lease=LEASE, now=NOW, queues=(Q,)) is None
    await store.ack(a.task.id, a.lease_id, now=NOW)
    (c,) = await take(store, 6, NOW)
    failure = await store.nack(b.task.id, b.lease_id, "no", now=NOW)
    assert not failure.buried
    assert len(await take(store, 6, NOW)) == 1
    assert await take(store, 6, NOW) == []
    await store.reclaim(c.task.id, c.lease_id, "gone", now=NOW)
    (e,) = await take(store, 6, NOW)
    assert await store.release(e.task.id, e.lease_id, now=NOW)
    (f,) = await take(store, 6, NOW)
    assert f.task.id == e.task.id
    assert (await store.stats(Q)).handed_out == 2
    # A lease that runs out frees its slot as well.
    await store.sweep(now=NOW + LEASE + 1)
    assert len(await take(store, 6, NOW + LEASE + 1)) == 2


async def test_a_freed_slot_of_a_full_queue_is_told_as_released(store: Store) -> None:
    await store.set_limits(Q, Limits(concurrency=1), now=NOW)
    await fill(store, 3)
    store.take_released()
    (a,) = await take(store, 3, NOW)
    await store.ack(a.task.id, a.lease_id, now=NOW)
    released = store.take_released()
    assert released is not None
    assert Q in released.queues
    (b,) = await take(store, 3, NOW)
    await store.nack(b.task.id, b.lease_id, "again", now=NOW)
    released = store.take_released()
    assert released is not None
    assert Q in released.queues


async def test_an_unlimited_queue_releases_nothing_on_ack(store: Store) -> None:
    await fill(store, 1, DEFAULT_QUEUE)
    d = await store.claim(lease=LEASE, now=NOW)
    assert d is not None
    await store.ack(d.task.id, d.lease_id, now=NOW)
    assert store.take_released() is None


async def test_settle_claim_takes_only_the_slots_its_settlements_free(store: Store) -> None:
    await store.set_limits(Q, Limits(concurrency=2), now=NOW)
    await fill(store, 6)
    a, b = await take(store, 6, NOW)
    acked, nacked, claimed = await store.settle_claim(
        [(a.task.id, a.lease_id)], [], [LEASE, LEASE, LEASE], now=NOW, queues=(Q,)
    )
    assert acked == [None]
    assert nacked == []
    assert len(claimed) == 1  # one slot freed, one taken again: never three
    _, _, claimed = await store.settle_claim(
        [], [NackItem(b.task.id, b.lease_id, "x")], [LEASE] * 3, now=NOW, queues=(Q,)
    )
    assert len(claimed) == 1
    assert (await store.stats(Q)).handed_out == 2


async def test_settle_claim_respects_a_rate_limit(store: Store) -> None:
    await store.set_limits(Q, rate(1, 1.0, burst=2), now=NOW)
    await fill(store, 6)
    a, b = await take(store, 6, NOW)
    _, _, claimed = await store.settle_claim(
        [(a.task.id, a.lease_id), (b.task.id, b.lease_id)], [], [LEASE] * 2, now=NOW, queues=(Q,)
    )
    assert claimed == []
    _, _, claimed = await store.settle_claim([], [], [LEASE] * 2, now=NOW + 1, queues=(Q,))
    assert len(claimed) == 1


# -- several queues ------------------------------------------------------------------------------


async def test_a_claim_over_several_queues_moves_on_past_a_limited_one(store: Store) -> None:
    await store.set_limits(Q, Limits(RateLimit(10, 1.0, 2), concurrency=5), now=NOW)
    await fill(store, 5, Q)
    await fill(store, 5, OTHER)
    got = await take(store, 5, NOW, (Q, OTHER))
    assert [d.task.queue for d in got] == [Q, Q, OTHER, OTHER, OTHER]
    got = await take(store, 5, NOW + 0.1, (Q, OTHER))  # one token came
    assert [d.task.queue for d in got] == [Q, OTHER, OTHER]
    d = await store.claim(lease=LEASE, now=NOW + 1, queues=(OTHER, Q))
    assert d is not None
    assert d.task.queue == Q


async def test_a_concurrency_limited_queue_is_passed_over_when_full(store: Store) -> None:
    await store.set_limits(Q, Limits(concurrency=1), now=NOW)
    await fill(store, 3, Q)
    await fill(store, 3, OTHER)
    first = await store.claim(lease=LEASE, now=NOW, queues=(Q, OTHER))
    second = await store.claim(lease=LEASE, now=NOW, queues=(Q, OTHER))
    assert first is not None
    assert second is not None
    assert (first.task.queue, second.task.queue) == (Q, OTHER)


async def test_limits_of_one_queue_leave_the_others_alone(store: Store) -> None:
    await store.set_limits(Q, Limits(concurrency=1), now=NOW)
    await fill(store, 4, OTHER)
    assert len(await take(store, 4, NOW, (OTHER,))) == 4


# -- set, change, clear, show --------------------------------------------------------------------


async def test_set_limits_creates_the_queue_and_queues_show_them(store: Store) -> None:
    limits = Limits(RateLimit(20, 1.0, 5), concurrency=4)
    await store.set_limits("fresh", limits, now=NOW)
    found = await row(store, "fresh", NOW)
    assert (found.ready, found.handed_out, found.paused) == (0, 0, False)
    assert found.limits == limits
    assert found.tokens == pytest.approx(5.0)
    await store.set_limits("conc", Limits(concurrency=3), now=NOW)
    found = await row(store, "conc", NOW)
    assert found.limits == Limits(concurrency=3)
    assert found.tokens is None  # no rate
    await fill(store, 1, "plain")
    found = await row(store, "plain", NOW)
    assert found.limits is None
    assert found.tokens is None
    (report,) = [r for r in await store.queue_report(now=NOW) if r.queue.name == "fresh"]
    assert report.queue.limits == limits
    assert report.queue.tokens == pytest.approx(5.0)


async def test_tokens_shown_are_those_available_at_now(store: Store) -> None:
    await store.set_limits(Q, rate(10, 1.0, burst=10), now=NOW)
    await fill(store, 10)
    assert len(await take(store, 10, NOW)) == 10
    assert (await row(store, now=NOW)).tokens == pytest.approx(0.0, abs=1e-6)
    assert (await row(store, now=NOW + 0.35)).tokens == pytest.approx(3.5)
    assert (await row(store, now=NOW + 100)).tokens == pytest.approx(10.0)


async def test_clearing_limits_lets_every_task_go(store: Store) -> None:
    await store.set_limits(Q, Limits(RateLimit(1, 60.0, 1), concurrency=1), now=NOW)
    await fill(store, 4)
    assert len(await take(store, 4, NOW)) == 1
    await store.set_limits(Q, None, now=NOW)
    assert len(await take(store, 4, NOW)) == 3
    found = await row(store, now=NOW)
    assert found.limits is None
    assert found.tokens is None
    await store.set_limits(Q, Limits(), now=NOW)  # empty: none either
    assert (await row(store, now=NOW)).limits is None


async def test_a_new_rate_refills_the_bucket_and_a_new_concurrency_alone_does_not(
    store: Store,
) -> None:
    await store.set_limits(Q, rate(1, 60.0, burst=2), now=NOW)
    await fill(store, 10)
    assert len(await take(store, 10, NOW)) == 2
    await store.set_limits(Q, Limits(RateLimit(1, 60.0, 2), concurrency=5), now=NOW)
    assert await take(store, 10, NOW) == []  # the same rate: the bucket goes on as it stood
    await store.set_limits(Q, Limits(RateLimit(1, 60.0, 3), concurrency=5), now=NOW)
    assert len(await take(store, 10, NOW)) == 3  # a new rate: a full bucket (then concurrency 5)
    assert (await row(store, now=NOW)).limits == Limits(RateLimit(1, 60.0, 3), concurrency=5)


async def test_lowering_the_concurrency_takes_nothing_back(store: Store) -> None:
    await fill(store, 6)
    held = await take(store, 4, NOW)
    await store.set_limits(Q, Limits(concurrency=2), now=NOW)
    assert await take(store, 6, NOW) == []
    for d in held[:2]:
        await store.ack(d.task.id, d.lease_id, now=NOW)
    assert await take(store, 6, NOW) == []  # still 2 held: full
    await store.ack(held[2].task.id, held[2].lease_id, now=NOW)
    assert len(await take(store, 6, NOW)) == 1


async def test_a_paused_limited_queue_hands_out_nothing(store: Store) -> None:
    await store.set_limits(Q, Limits(concurrency=3), now=NOW)
    await store.set_paused(Q, True)
    await fill(store, 2)
    assert await take(store, 2, NOW) == []
    await store.set_paused(Q, False)
    assert len(await take(store, 2, NOW)) == 2
    assert (await row(store, now=NOW)).limits == Limits(concurrency=3)


# -- SQLite: over a restart ----------------------------------------------------------------------


async def test_sqlite_keeps_limits_over_a_restart(tmp_path: Path) -> None:
    path = str(tmp_path / "limits.db")
    rng = random.Random(7)
    store = await SqliteStore.open(path, Backoff(1.0, 30.0, rng), rng, sync="normal")
    limits = Limits(RateLimit(2, 1.0, 3), concurrency=2)
    await store.set_limits(Q, limits, now=NOW)
    await store.set_limits("conc", Limits(concurrency=1), now=NOW)
    await fill(store, 6)
    assert len(await take(store, 6, NOW)) == 2
    await store.close()
    store = await SqliteStore.open(path, Backoff(1.0, 30.0, rng), rng, sync="normal")
    try:
        found = {r.name: r for r in await store.queues(now=NOW)}
        assert found[Q].limits == limits
        assert found[Q].tokens == pytest.approx(3.0)  # the bucket starts full after a restart
        assert found["conc"].limits == Limits(concurrency=1)
        assert await take(store, 6, NOW) == []  # the two held still count
        await store.set_limits(Q, None, now=NOW)
        assert len(await take(store, 6, NOW)) == 4
    finally:
        await store.close()
    store = await SqliteStore.open(path, Backoff(1.0, 30.0, rng), rng, sync="normal")
    try:
        assert {r.name: r.limits for r in await store.queues()}[Q] is None
    finally:
        await store.close()


# -- the property: windows and concurrency over random steps --------------------------------------

_STEP = st.one_of(
    st.tuples(st.just("claim"), st.integers(1, 6), st.booleans()),
    st.tuples(st.just("ack"), st.integers(0, 50)),
    st.tuples(st.just("nack"), st.integers(0, 50)),
    st.tuples(st.just("release"), st.integers(0, 50)),
    st.tuples(st.just("wait"), st.sampled_from([0.0, 0.001, 0.05, 0.1, 0.33, 0.5, 1.0, 2.5])),
    st.tuples(st.just("enqueue"), st.integers(1, 10)),
)


@settings(
    max_examples=examples(200),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    tasks=st.integers(1, 5),
    per=st.sampled_from([0.1, 0.5, 1.0, 3.0]),
    burst=st.integers(1, 6),
    concurrency=st.one_of(st.none(), st.integers(1, 4)),
    steps=st.lists(_STEP, max_size=80),
)
def test_hand_outs_stay_within_the_limits_in_every_window(
    tasks: int, per: float, burst: int, concurrency: int | None, steps: list[tuple[Any, ...]]
) -> None:
    asyncio.run(_windows(tasks, per, burst, concurrency, steps))


async def _windows(
    tasks: int, per: float, burst: int, concurrency: int | None, steps: list[tuple[Any, ...]]
) -> None:
    rng = random.Random(3)
    store = MemoryStore(Backoff(0.01, 0.02, rng), rng)
    now = NOW
    await store.set_limits(Q, Limits(RateLimit(tasks, per, burst), concurrency), now=now)
    await fill(store, 20, Q, now)
    await fill(store, 20, OTHER, now)
    held: list[Delivery] = []
    times: list[float] = []  # of every hand-out of Q, in order
    for step in steps:
        kind = step[0]
        if kind == "claim":
            queues = (Q, OTHER) if step[2] else (Q,)
            got = await store.claim_many([LEASE] * step[1], now=now, queues=queues)
            mine = [d for d in got if d.task.queue == Q]
            times += [now] * len(mine)
            held += mine
        elif kind == "wait":
            now += step[1]
            swept, _ = await store.sweep(now=now)
            gone = {task_id for task_id, _ in swept.reclaimed}
            held = [d for d in held if d.task.id not in gone]
        elif kind == "enqueue":
            await fill(store, step[1], Q, now)
        elif held:
            d = held.pop(step[1] % len(held))
            if kind == "ack":
                await store.ack(d.task.id, d.lease_id, now=now)
            elif kind == "nack":
                await store.nack(d.task.id, d.lease_id, "x", now=now)
            else:
                assert await store.release(d.task.id, d.lease_id, now=now)
        stats = await store.stats(Q)
        assert stats.handed_out == len(held)
        if concurrency is not None:
            assert stats.handed_out <= concurrency
        store.check_invariants()
    # Every window [t, t + per] holds at most tasks + burst hand-outs (the bucket's bound:
    # at most burst tokens at its start, tasks more refilled within it).
    for i, t in enumerate(times):
        end = bisect.bisect_right(times, t + per + 1e-9)
        assert end - i <= tasks + burst, (t, times[i:end])
