"""Draining a backlog through a stream on a durable store: a stream's acks and the claim of the
tasks that take their places share one transaction (Store.settle_claim), within the lease rules:
never more than the prefetch in a stream's hands, an ack durable before it is answered, nothing
claimed lost when the broker stops. Run on SQLite and PostgreSQL (the memory store has no commit
to save: it keeps its two calls; the race between two streams runs on it too)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest

from tests import pg
from tests.helpers import make_store, wait_until
from wqbroker.clock import FakeClock
from wqbroker.dispatch import Stream
from wqbroker.errors import NotFound
from wqbroker.models import Delivery
from wqbroker.retry import Backoff
from wqbroker.service import Service, Submission
from wqbroker.store import Store
from wqbroker.store.postgres import PostgresStore
from wqbroker.store.sqlite import SqliteStore

DURABLE = ["sqlite", "postgres"]


@pytest.fixture(params=DURABLE)
def backend(request: pytest.FixtureRequest) -> str:
    """The durable stores only (conftest's ``store`` and ``service`` are made on it)."""
    return str(request.param)


async def fill(service: Service, n: int) -> None:
    for start in range(0, n, 100):
        await service.enqueue_many(
            [Submission(b'{"n":%d}' % i) for i in range(start, min(n, start + 100))]
        )


async def taken(stream: Stream, at_least: int = 1) -> list[Delivery]:
    await wait_until(lambda: stream.pending >= at_least, what="deliveries on the stream")
    return stream.take_ready()


def acks(deliveries: list[Delivery]) -> list[tuple[str, str]]:
    return [(d.task.id, d.lease_id) for d in deliveries]


async def test_a_stream_s_acks_and_their_successors_share_one_commit(
    service: Service, store: Store
) -> None:
    n, prefetch = 60, 6
    await fill(service, n)
    stream = await service.open_stream(prefetch, 60_000)
    before = store.transactions
    seen: list[str] = []
    while len(seen) < n:
        got = await taken(stream)
        assert len(got) == prefetch  # the whole prefetch, every round: never more
        seen += [d.task.id for d in got]
        outcomes, _ = await service.settle_many(acks(got), ())
        assert outcomes == [None] * len(got)
    # One transaction for the first fill, then one per round (its acks and the next round's
    # claims): two per round before.
    assert store.transactions - before <= n // prefetch + 1
    assert len(set(seen)) == n
    stats = await service.stats()
    assert (stats.ready, stats.handed_out, stats.totals.acked, stats.totals.delivered) == (
        0,
        0,
        n,
        n,
    )
    await stream.close()


async def test_an_ack_refused_frees_no_slot_and_the_extra_task_goes_back(
    service: Service, store: Store
) -> None:
    await fill(service, 10)
    stream = await service.open_stream(2, 60_000)
    first, second = await taken(stream, 2)
    # The same ack twice: both leases are the stream's, the second is refused (already acked).
    outcomes, _ = await service.settle_many(acks([first, first]), ())
    assert outcomes[0] is None
    assert isinstance(outcomes[1], NotFound)
    # One slot freed: one new delivery; the other task claimed with it went back, as it was.
    (refill,) = await taken(stream)
    assert refill.task.id not in (first.task.id, second.task.id)
    assert stream.take_ready() == []
    stats = await service.stats()
    assert (stats.handed_out, stats.ready, stats.totals.delivered) == (2, 7, 3)
    # Still in order: the next two ready are the ones after the refill, attempts untouched.
    outcomes, _ = await service.settle_many(acks([second, refill]), ())
    assert outcomes == [None, None]
    nxt = await taken(stream, 2)
    assert [d.task.attempts for d in nxt] == [1, 1]
    assert [d.task.payload for d in nxt] == [b'{"n":3}', b'{"n":4}']
    await stream.close()


@pytest.mark.parametrize("backend", ["memory", *DURABLE], indirect=True)
async def test_two_streams_acking_at_once_lose_nothing_and_repeat_nothing(
    service: Service, store: Store
) -> None:
    n = 120
    await fill(service, n)
    streams = [await service.open_stream(4, 60_000) for _ in range(2)]
    seen: list[str] = []

    async def work(stream: Stream) -> None:
        while True:
            await stream.wait()
            got = stream.take_ready()
            if not got:
                if stream.closed:
                    return
                continue
            seen.extend(d.task.id for d in got)
            # Each delivery acked on its own, all at once: the acks race each other.
            answers = await asyncio.gather(*(service.settle_many(acks([d]), ()) for d in got))
            assert all(outcome == ([None], []) for outcome in answers)

    workers = [asyncio.ensure_future(work(s)) for s in streams]
    await wait_until(lambda: len(seen) >= n, what="every task delivered")

    async def all_acked() -> bool:
        return (await service.stats()).totals.acked == n

    await wait_until(all_acked, what="every task acked")
    for s in streams:
        await s.close()
    await asyncio.gather(*workers)
    assert len(seen) == n
    assert len(set(seen)) == n
    stats = await service.stats()
    assert (stats.ready, stats.handed_out, stats.totals.delivered) == (0, 0, n)


async def reopened(backend: str, store: Store, rng: random.Random) -> Store:
    """The same store's data opened again, as a broker restarted on it would."""
    backoff = Backoff(1.0, 30.0, rng)
    if isinstance(store, SqliteStore):
        return await SqliteStore.open(store.path, backoff, rng, sync="normal")
    assert isinstance(store, PostgresStore)
    return await PostgresStore.open(await pg.database(), backoff, rng, pool_size=2)


async def test_a_broker_stopped_mid_drain_loses_nothing_and_brings_back_nothing_acked(
    backend: str, rng: random.Random, tmp_path: Path, clock: FakeClock
) -> None:
    store = await make_store(backend, Backoff(1.0, 30.0, rng), rng, tmp_path)
    service = Service(store, clock)  # (not started: no sweeper, nothing runs on its own)
    n, prefetch = 30, 5
    await fill(service, n)
    stream = await service.open_stream(prefetch, 10_000)
    acked: set[str] = set()
    for _ in range(3):
        got = await taken(stream)
        await service.settle_many(acks(got), ())
        acked.update(d.task.id for d in got)
    # The next round was claimed with the last acks: in the stream's hands, never acked.
    in_hand = {d.task.id for d in await taken(stream)}
    assert len(in_hand) == prefetch
    # Stopped without closing the stream (as a killed broker would: nothing handed back).
    await store.close()
    again = await reopened(backend, store, rng)
    try:
        stats = await again.stats()
        assert stats.totals.acked == len(acked)
        assert stats.handed_out == prefetch
        assert stats.ready == n - len(acked) - prefetch
        # The leases run out: the tasks in hand come back; the acked ones never do.
        clock.advance(11)
        await again.sweep(now=clock.now())  # reclaimed: retried after the backoff
        clock.advance(60)
        back: set[str] = set()
        while (d := await again.claim(lease=60, now=clock.now())) is not None:
            back.add(d.task.id)
        assert in_hand <= back
        assert not back & acked
        assert len(back) == n - len(acked)
    finally:
        await again.close()


@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
async def test_on_postgres_each_round_is_one_round_trip(
    service: Service, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over a slow link to the database every round trip costs the link's latency: a stream's
    round (its acks, the claim of their successors) is one statement, so one round trip."""
    assert isinstance(store, PostgresStore)
    n, prefetch, rounds = 48, 8, 5
    await fill(service, n)
    stream = await service.open_stream(prefetch, 60_000)
    got = await taken(stream, prefetch)
    sent: list[str] = []
    for name in ("_fetch", "_fetchval", "_fetchrow", "_execute"):
        method = getattr(store, name)

        async def counted(sql: str, *args: object, _method: Any = method) -> Any:
            sent.append(sql)
            return await _method(sql, *args)

        monkeypatch.setattr(store, name, counted)
    for _ in range(rounds):  # (tasks are left for every round: no claim comes back short)
        outcomes, _ = await service.settle_many(acks(got), ())
        assert outcomes == [None] * len(got)
        got = await taken(stream, prefetch)
    # One statement a round: two before (the settle, then the claim).
    assert len(sent) == rounds, [s.split()[:6] for s in sent]
