"""The service's side of results and workflows (docs/design/results.md), on a fake clock and
every store: what it checks before the store is asked (each refusal naming the field), result
waits (answered at once, woken by every way a task ends, timed out on the clock, shared by many
waiters, bounded by -max-waiters, answered when the broker closes), children released to waiting
consumers, and the extended invariant."""

from __future__ import annotations

import asyncio

import pytest

from tests.helpers import settle, wait_until
from wqbroker.clock import FakeClock
from wqbroker.errors import InvalidArgument, NotFound, Overloaded, PayloadTooLarge
from wqbroker.models import Outcome, Stats
from wqbroker.service import Service, Submission
from wqbroker.store import Store

PAYLOAD = b'{"job": 1}'


def gauges_add_up(stats: Stats) -> bool:
    t = stats.totals
    held = stats.ready + stats.handed_out + stats.delayed + stats.dead + stats.waiting
    return held == t.enqueued - t.acked - t.purged - t.cancelled - t.expired


# -- what is checked ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"after": "0123456789abcdef"}, "after"),
        ({"after": []}, "after"),
        ({"after": [7]}, "after[0]"),  # an index outside a batch
        ({"after": [None]}, "after[0]"),
        ({"after": [True]}, "after[0]"),
        ({"after": ["a", "a"]}, "after[1]"),
        ({"after": [""]}, "after[0]"),
        ({"after": ["x"] * 10_001}, "after"),
        ({"result_ttl_ms": -1}, "result_ttl_ms"),
        ({"result_ttl_ms": 31_536_000_001}, "result_ttl_ms"),
        ({"result_ttl_ms": "60"}, "result_ttl_ms"),
        ({"result_ttl_ms": 1.5}, "result_ttl_ms"),
    ],
)
async def test_enqueue_options_are_checked(
    service: Service, options: dict[str, object], named: str
) -> None:
    with pytest.raises(InvalidArgument) as e:
        await service.enqueue(PAYLOAD, **options)
    assert named in e.value.message
    assert (await service.stats()).totals.enqueued == 0


@pytest.mark.parametrize(("index", "refs"), [(0, [0]), (1, [1]), (1, [2]), (2, [-1]), (2, [0, 0])])
async def test_a_batch_item_names_only_earlier_items(
    service: Service, index: int, refs: list[int]
) -> None:
    items = [Submission(PAYLOAD) for _ in range(3)]
    items[index] = Submission(PAYLOAD, after=refs)
    with pytest.raises(InvalidArgument) as e:
        await service.enqueue_many(items)
    assert e.value.message.startswith(f"tasks[{index}].after[")
    assert (await service.stats()).totals.enqueued == 0  # all or nothing


async def test_an_unknown_parent_refuses_the_whole_batch_naming_it(service: Service) -> None:
    parent = await service.enqueue(PAYLOAD)
    with pytest.raises(InvalidArgument) as e:
        await service.enqueue(PAYLOAD, after=[parent.id, "ffffffffffffffff"])
    assert e.value.message.startswith("after[1]: task ffffffffffffffff does not exist")
    items = [
        Submission(PAYLOAD),
        Submission(PAYLOAD, after=[0, parent.id]),
        Submission(PAYLOAD, after=[1, "0000000000000001"]),
    ]
    with pytest.raises(InvalidArgument) as e:
        await service.enqueue_many(items)
    assert e.value.message.startswith("tasks[2].after[1]: task 0000000000000001")
    stats = await service.stats()
    assert (stats.totals.enqueued, stats.ready, stats.waiting) == (1, 1, 0)


@pytest.mark.parametrize("result", [b"", b"{", b"NaN", b"\xff", b'{"a": 1} 2'])
async def test_a_result_must_be_one_json_value(service: Service, result: bytes) -> None:
    await service.enqueue(PAYLOAD)
    d = await service.claim(wait_ms=0)
    assert d is not None
    with pytest.raises(InvalidArgument) as e:
        await service.ack(d.task.id, d.lease_id, result=result)
    assert "result" in e.value.message
    assert (await service.lookup(d.task.id)).state == "handed_out"  # not acked
    await service.ack(d.task.id, d.lease_id, result=b"null")  # null is a result
    found = await service.lookup(d.task.id)
    assert (found.state, found.task.result) == ("succeeded", b"null")


async def test_a_result_over_the_body_limit_is_refused(store: Store, clock: FakeClock) -> None:
    service = Service(store, clock, max_payload=64)
    await service.enqueue(PAYLOAD)
    d = await service.claim(wait_ms=0)
    assert d is not None
    with pytest.raises(PayloadTooLarge):
        await service.ack(d.task.id, d.lease_id, result=b'"' + b"x" * 100 + b'"')
    await service.close()


async def test_a_bad_result_in_a_batch_refuses_only_its_ack(service: Service) -> None:
    for _ in range(3):
        await service.enqueue(PAYLOAD)
    ds = [await service.claim(wait_ms=0) for _ in range(3)]
    assert all(d is not None for d in ds)
    acks = [(d.task.id, d.lease_id, r) for d, r in zip(ds, [b"1", b"{", None], strict=True) if d]
    outcomes, _ = await service.settle_many(acks, ())
    assert outcomes[0] is None
    assert outcomes[2] is None
    assert isinstance(outcomes[1], InvalidArgument)
    assert "result" in outcomes[1].message
    assert ds[0]
    assert ds[1]
    assert ds[2]
    assert (await service.lookup(ds[0].task.id)).task.result == b"1"
    assert (await service.lookup(ds[1].task.id)).state == "handed_out"
    with pytest.raises(NotFound):
        await service.lookup(ds[2].task.id)  # acked without a result: gone
    with pytest.raises(InvalidArgument) as e:
        await service.settle_many(acks, (), strict=True)
    assert e.value.message.startswith("acks[1].result")


# -- results and their waits ----------------------------------------------------------------------


async def test_a_kept_result_is_there_at_once_then_pruned(
    service: Service, clock: FakeClock
) -> None:
    done = await service.enqueue(PAYLOAD, result_ttl_ms=60_000)
    d = await service.claim(wait_ms=0)
    assert d is not None
    await service.ack(d.task.id, d.lease_id, result=b'{"sum": 3}')
    outcome = await service.wait_result(done.id)
    assert outcome is not None
    assert (outcome.state, outcome.result) == ("succeeded", b'{"sum": 3}')
    assert outcome.finished_at == pytest.approx(clock.now())
    stats = await service.stats()
    assert (stats.succeeded, stats.totals.acked) == (1, 1)
    assert gauges_add_up(stats)
    clock.advance(61)
    await service.sweep()
    with pytest.raises(NotFound):
        await service.wait_result(done.id)
    assert (await service.stats()).succeeded == 0


async def test_a_result_ttl_of_zero_keeps_nothing(service: Service) -> None:
    done = await service.enqueue(PAYLOAD, result_ttl_ms=0)
    d = await service.claim(wait_ms=0)
    assert d is not None
    await service.ack(d.task.id, d.lease_id, result=b"1")
    with pytest.raises(NotFound):
        await service.wait_result(done.id)


async def test_a_pending_task_answers_none_when_the_wait_ends(
    service: Service, clock: FakeClock
) -> None:
    done = await service.enqueue(PAYLOAD)
    assert await service.wait_result(done.id) is None  # no wait: at once
    waiting = asyncio.ensure_future(service.wait_result(done.id, wait_ms=5_000))
    await wait_until(lambda: service.result_waiters == 1, what="the wait to start")
    clock.advance(4.9)
    await settle()
    assert not waiting.done()
    clock.advance(0.2)
    assert await asyncio.wait_for(waiting, 5) is None


async def test_unknown_tasks_are_not_found(service: Service) -> None:
    with pytest.raises(NotFound):
        await service.wait_result("ffffffffffffffff", wait_ms=1000)
    with pytest.raises(InvalidArgument):
        await service.wait_result("", wait_ms=1000)
    with pytest.raises(InvalidArgument):
        await service.wait_result("ffffffffffffffff", wait_ms=-1)


async def _waiting_for(
    service: Service, task_id: str, n: int = 1
) -> list[asyncio.Task[Outcome | None]]:
    waits = [asyncio.ensure_future(service.wait_result(task_id, wait_ms=30_000)) for _ in range(n)]
    before = service.result_waiters
    await wait_until(lambda: service.result_waiters == before + n, what="the waits to start")
    assert not any(w.done() for w in waits)
    return waits


async def test_many_waiters_are_woken_by_an_ack_with_a_result(service: Service) -> None:
    done = await service.enqueue(PAYLOAD)
    waits = await _waiting_for(service, done.id, 50)
    d = await service.claim(wait_ms=0)
    assert d is not None
    await service.ack(d.task.id, d.lease_id, result=b"[1, 2]")
    outcomes = await asyncio.wait_for(asyncio.gather(*waits), 10)
    assert {(o.state, o.result) for o in outcomes if o is not None} == {("succeeded", b"[1, 2]")}
    assert all(o is not None for o in outcomes)


async def test_a_waiter_hears_of_an_ack_without_a_result(service: Service) -> None:
    done = await service.enqueue(PAYLOAD)
    (wait,) = await _waiting_for(service, done.id)
    d = await service.claim(wait_ms=0)
    assert d is not None
    await service.ack(d.task.id, d.lease_id)
    outcome = await asyncio.wait_for(wait, 10)
    assert outcome is not None
    assert (outcome.state, outcome.result) == ("succeeded", None)
    with pytest.raises(NotFound):  # gone, as the spec says, for whoever comes later
        await service.wait_result(done.id)


async def test_a_waiter_hears_of_a_burial(service: Service) -> None:
    done = await service.enqueue(PAYLOAD, max_attempts=1)
    (wait,) = await _waiting_for(service, done.id)
    d = await service.claim(wait_ms=0)
    assert d is not None
    await service.nack(d.task.id, d.lease_id, "boom")
    outcome = await asyncio.wait_for(wait, 10)
    assert outcome is not None
    assert (outcome.state, outcome.last_error, outcome.attempts) == ("dead", "boom", 1)
    again = await service.wait_result(done.id)  # a dead task stays: answered at once
    assert again is not None
    assert again.state == "dead"


async def test_a_waiter_hears_of_a_cancel_and_of_an_expiry(
    service: Service, clock: FakeClock
) -> None:
    first = await service.enqueue(PAYLOAD)
    second = await service.enqueue(PAYLOAD, delay_ms=60_000, expires_in_ms=10_000)
    (cancelled,) = await _waiting_for(service, first.id)
    (expired,) = await _waiting_for(service, second.id)
    await service.cancel(first.id)
    outcome = await asyncio.wait_for(cancelled, 10)
    assert outcome is not None
    assert outcome.state == "cancelled"
    clock.advance(11)
    await service.sweep()
    outcome = await asyncio.wait_for(expired, 10)
    assert outcome is not None
    assert outcome.state == "expired"


async def test_result_waiters_count_toward_max_waiters(store: Store, clock: FakeClock) -> None:
    service = Service(store, clock, max_waiters=2)
    await service.start()
    done = await service.enqueue(PAYLOAD)
    other = await service.enqueue(PAYLOAD)
    waits = await _waiting_for(service, done.id, 2)
    with pytest.raises(Overloaded):
        await service.wait_result(other.id, wait_ms=1000)
    assert await service.wait_result(other.id) is None  # an answer at once waits for nothing
    await service.close()
    assert await asyncio.wait_for(asyncio.gather(*waits), 10) == [None, None]


async def test_closing_answers_every_waiter(service: Service) -> None:
    done = await service.enqueue(PAYLOAD)
    waits = await _waiting_for(service, done.id, 3)
    await service.close()
    assert await asyncio.wait_for(asyncio.gather(*waits), 10) == [None, None, None]


# -- workflows ------------------------------------------------------------------------------------


async def test_a_released_child_goes_to_a_waiting_consumer(service: Service) -> None:
    parent = await service.enqueue(PAYLOAD)
    d = await service.claim(wait_ms=0)
    assert d is not None
    child = await service.enqueue(b'"child"', after=[parent.id])
    assert child.task is not None
    assert child.task.waiting_for == 1
    claim = asyncio.ensure_future(service.claim(wait_ms=30_000))
    await wait_until(lambda: service.parked_polls == 1, what="the claim to park")
    await service.ack(d.task.id, d.lease_id, result=b'"made"')
    got = await asyncio.wait_for(claim, 10)
    assert got is not None
    assert got.task.id == child.id
    assert got.parents is not None
    assert [(p.id, p.result) for p in got.parents] == [(parent.id, b'"made"')]
    assert gauges_add_up(await service.stats())


async def test_a_chain_in_one_batch_runs_in_order(service: Service) -> None:
    done = await service.enqueue_many(
        [Submission(b"0"), Submission(b"1", after=[0]), Submission(b"2", after=[1])]
    )
    stats = await service.stats()
    assert (stats.ready, stats.waiting) == (1, 2)
    order = []
    for step in range(3):
        d = await service.claim(wait_ms=0)
        assert d is not None
        assert await service.claim(wait_ms=0) is None
        order.append(d.task.id)
        expected_parents = None if step == 0 else [order[step - 1]]
        assert (None if d.parents is None else [p.id for p in d.parents]) == expected_parents
        await service.ack(d.task.id, d.lease_id, result=str(step).encode())
    assert order == [e.id for e in done]
    stats = await service.stats()
    assert (stats.ready, stats.waiting, stats.succeeded) == (0, 0, 3)
    assert gauges_add_up(stats)


async def test_a_failed_parent_buries_its_waiting_children(service: Service) -> None:
    parent, child, grandchild = await service.enqueue_many(
        [
            Submission(PAYLOAD, max_attempts=1),
            Submission(PAYLOAD, after=[0]),
            Submission(PAYLOAD, after=[1]),
        ]
    )
    (wait,) = await _waiting_for(service, grandchild.id)
    d = await service.claim(wait_ms=0)
    assert d is not None
    await service.nack(d.task.id, d.lease_id, "boom")
    outcome = await asyncio.wait_for(wait, 10)
    assert outcome is not None
    assert outcome.state == "dead"
    assert outcome.last_error == f"parent {child.id} is dead: parent {parent.id} is dead: boom"
    stats = await service.stats()
    assert (stats.dead, stats.waiting, stats.totals.buried) == (3, 0, 1)
    assert gauges_add_up(stats)
    assert (
        stats.totals.nacked + stats.totals.reclaimed == stats.totals.retried + stats.totals.buried
    )
