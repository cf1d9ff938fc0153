"""The service's side of control over tasks (docs/design/control.md), on a fake clock and every
store: what it checks before the store is asked (each refusal an InvalidArgument naming the
field), listing cursors (opaque, refused when foreign or for another state), a cancel reaching the
stream that holds the task, expiry and time limits driven by the sweeper, and the invariant."""

from __future__ import annotations

import pytest

from tests.helpers import invariant_holds, settle, wait_until
from wqbroker.clock import FakeClock
from wqbroker.errors import Cancelled, InvalidArgument, NotFound, TimeLimitReached
from wqbroker.models import CANCELLED, CANCELLING, DEFAULT_QUEUE, PURGED
from wqbroker.service import Service, Submission, decode_cursor, encode_cursor

PAYLOAD = b'{"job": 1}'


# -- what is checked ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"expires_in_ms": 0}, "expires_in_ms"),
        ({"expires_in_ms": -5}, "expires_in_ms"),
        ({"expires_in_ms": 31_536_000_001}, "expires_in_ms"),
        ({"expires_in_ms": "10"}, "expires_in_ms"),
        ({"expires_in_ms": 1.5}, "expires_in_ms"),
        ({"expires_in_ms": True}, "expires_in_ms"),
        ({"timeout_ms": 0}, "timeout_ms"),
        ({"timeout_ms": 2**70}, "timeout_ms"),
        ({"timeout_ms": None, "unique": True}, "unique"),  # without a key
        ({"unique": "yes", "key": "k"}, "unique"),
        ({"unique": 1, "key": "k"}, "unique"),
    ],
)
async def test_enqueue_options_are_checked(
    service: Service, options: dict[str, object], named: str
) -> None:
    with pytest.raises(InvalidArgument) as e:
        await service.enqueue(PAYLOAD, **options)
    assert named in e.value.message
    with pytest.raises(InvalidArgument) as e:
        await service.enqueue_many([Submission(PAYLOAD), Submission(PAYLOAD, **options)])
    assert e.value.message.startswith("tasks[1].")
    assert (await service.stats()).totals.enqueued == 0  # all or nothing


async def test_the_options_land_on_the_task(service: Service, clock: FakeClock) -> None:
    done = await service.enqueue(PAYLOAD, expires_in_ms=60_000, timeout_ms=5_000)
    assert done.task is not None
    assert done.task.expires_at == pytest.approx(clock.now() + 60)
    assert done.task.timeout == pytest.approx(5.0)
    found = await service.lookup(done.id)
    assert (found.task.expires_at, found.task.timeout) == (done.task.expires_at, 5.0)


@pytest.mark.parametrize(
    "progress", [b"", b"{", b'{"a": 1} x', b"NaN", b"\xff", b'"' + b"x" * 4095 + b'"']
)
async def test_progress_must_be_one_json_value_of_4096_bytes_at_most(
    service: Service, progress: bytes
) -> None:
    await service.enqueue(PAYLOAD)
    d = await service.claim(wait_ms=0)
    assert d is not None
    with pytest.raises(InvalidArgument) as e:
        await service.extend(d.task.id, d.lease_id, progress=progress)
    assert "progress" in e.value.message
    found = await service.lookup(d.task.id)
    assert found.task.progress is None  # nothing recorded by a refused call
    await service.extend(d.task.id, d.lease_id, progress=b'"' + b"x" * 4094 + b'"')  # 4096


@pytest.mark.parametrize(
    ("call", "named"),
    [
        ({"state": "running"}, "state"),
        ({"state": 3}, "state"),
        ({"limit": 0}, "limit"),
        ({"limit": 1001}, "limit"),
        ({"limit": "5"}, "limit"),
        ({"queue": "no spaces"}, "queue"),
        ({"cursor": "garbage!"}, "cursor"),
        ({"cursor": 12}, "cursor"),
    ],
)
async def test_a_listing_s_values_are_checked(
    service: Service, call: dict[str, object], named: str
) -> None:
    with pytest.raises(InvalidArgument) as e:
        await service.list_tasks(**call)
    assert named in e.value.message


@pytest.mark.parametrize(
    "cursor",
    [
        encode_cursor("ready", ()),  # no key
        encode_cursor("ready", (1, 2, 3, 4)),  # too long
        "WyJyZWFkeSIsIm5vIl0",  # ["ready","no"]: not numbers
        "WyJyZWFkeSIsdHJ1ZV0",  # ["ready",true]
        "e30",  # {}
        "x" * 300,
        "é",
        "WyJyZWFkeSIsMWU5OTlc",  # cut short
    ],
)
def test_only_a_cursor_the_broker_made_is_taken(cursor: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        decode_cursor(cursor, "ready")
    assert "cursor" in e.value.message


def test_a_cursor_goes_with_its_state() -> None:
    cursor = encode_cursor("delayed", (1_000_000.25, 7))
    assert decode_cursor(cursor, "delayed") == (1_000_000.25, 7)
    assert cursor.isascii()
    assert not set(cursor) & set("=/+")  # (URL-safe as it is)
    with pytest.raises(InvalidArgument) as e:
        decode_cursor(cursor, "ready")
    assert "delayed" in e.value.message


async def test_paging_through_the_service_sees_every_task_once(service: Service) -> None:
    ids = [(await service.enqueue(b"%d" % n, priority=n % 3)).id for n in range(25)]
    seen: list[str] = []
    cursor = None
    pages = 0
    while True:
        tasks, cursor = await service.list_tasks(DEFAULT_QUEUE, "ready", 4, cursor)
        pages += 1
        seen += [t.task.id for t in tasks]
        if cursor is None:
            break
    assert sorted(seen) == sorted(ids)
    assert len(seen) == len(set(seen))
    assert pages == 7


# -- cancel ---------------------------------------------------------------------------------------


async def test_cancel_answers_what_it_did(service: Service) -> None:
    ready = (await service.enqueue(PAYLOAD)).id
    dead = (await service.enqueue(PAYLOAD, max_attempts=1, queue="d")).id
    d = await service.claim(wait_ms=0, queues="d")
    assert d is not None
    await service.nack(d.task.id, d.lease_id, "x")
    held = (await service.enqueue(PAYLOAD, queue="h")).id
    h = await service.claim(wait_ms=0, queues="h")
    assert h is not None
    assert (await service.cancel(ready)).state == CANCELLED
    assert (await service.cancel(dead)).state == PURGED
    result = await service.cancel(held)
    assert (result.state, result.lease_id) == (CANCELLING, h.lease_id)
    with pytest.raises(NotFound):
        await service.cancel(ready)
    with pytest.raises(InvalidArgument):
        await service.cancel("")
    with pytest.raises(Cancelled):
        await service.extend(held, h.lease_id)
    await service.nack(held, h.lease_id, "stopped")  # no retry: gone
    stats = await service.stats()
    assert (stats.totals.cancelled, stats.totals.purged, stats.ready, stats.delayed) == (2, 1, 0, 0)
    assert invariant_holds(stats)


async def test_a_cancel_reaches_the_stream_holding_the_task(service: Service) -> None:
    first = (await service.enqueue(PAYLOAD)).id
    second = (await service.enqueue(PAYLOAD)).id
    stream = await service.open_stream(prefetch=2)
    d1 = await stream.next()
    d2 = await stream.next()
    assert d1 is not None
    assert d2 is not None
    assert {d1.task.id, d2.task.id} == {first, second}
    assert stream.take_cancels() == []
    await service.cancel(first)
    lease = d1.lease_id if d1.task.id == first else d2.lease_id
    assert stream.take_cancels() == [(first, lease)]
    await service.cancel(first)  # told once
    assert stream.take_cancels() == []
    await stream.close()


async def test_a_cancel_of_a_task_queued_for_a_stream_comes_after_its_delivery(
    service: Service,
) -> None:
    task_id = (await service.enqueue(PAYLOAD)).id
    stream = await service.open_stream(prefetch=1)
    await wait_until(lambda: stream.pending == 1, what="the delivery queued for the stream")
    await service.cancel(task_id)
    assert stream.take_cancels() == []  # not before the worker has the task
    (delivery,) = stream.take_ready()
    assert stream.take_cancels() == [(task_id, delivery.lease_id)]
    await stream.close()


async def test_a_cancelled_task_s_stream_slot_frees_once_it_is_nacked(service: Service) -> None:
    ids = [(await service.enqueue(b"%d" % n)).id for n in range(3)]
    stream = await service.open_stream(prefetch=1)
    d = await stream.next()
    assert d is not None
    assert d.task.id == ids[0]
    await service.cancel(d.task.id)
    await service.settle_many([], [(d.task.id, d.lease_id, "cancelled")])
    nxt = await stream.next()
    assert nxt is not None
    assert nxt.task.id == ids[1]
    await stream.close()
    assert (await service.stats()).totals.cancelled == 1


# -- the sweeper ----------------------------------------------------------------------------------


async def test_the_sweeper_drops_an_expired_task_on_time(
    service: Service, clock: FakeClock
) -> None:
    done = await service.enqueue(PAYLOAD, expires_in_ms=2_000)
    clock.advance(1.5)
    await settle()
    assert (await service.stats()).ready == 1
    clock.advance(1.0)

    async def expired() -> int:
        return (await service.stats()).totals.expired

    await wait_until(expired, lambda n: n == 1, what="the task to expire")
    with pytest.raises(NotFound):
        await service.lookup(done.id)
    assert await service.claim(wait_ms=0) is None


async def test_a_parked_worker_never_gets_an_expired_task(
    service: Service, clock: FakeClock
) -> None:
    await service.enqueue(PAYLOAD, delay_ms=5_000, expires_in_ms=3_000)
    clock.advance(10)
    await settle()
    assert await service.claim(wait_ms=0) is None
    stats = await service.stats()
    assert (stats.totals.expired, stats.delayed) == (1, 0)


async def test_a_hung_worker_cannot_hold_a_task_past_its_time_limit(
    service: Service, clock: FakeClock
) -> None:
    done = await service.enqueue(PAYLOAD, timeout_ms=10_000, max_attempts=2)
    d = await service.claim(wait_ms=0, lease_ms=4_000)
    assert d is not None
    for _ in range(2):  # it keeps extending: up to the limit
        clock.advance(3)
        await service.extend(done.id, d.lease_id, 4_000)
    clock.advance(3)
    with pytest.raises(TimeLimitReached) as e:
        await service.extend(done.id, d.lease_id, 4_000)
    assert "10000 ms" in e.value.message
    clock.advance(2)

    async def reclaimed() -> int:
        return (await service.stats()).totals.reclaimed

    await wait_until(reclaimed, lambda n: n == 1, what="the hung task reclaimed")
    stats = await service.stats()
    assert stats.delayed + stats.ready == 1  # retried
