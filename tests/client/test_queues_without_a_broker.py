"""wqclient's queues, priorities and the rest without a broker: named queues, priorities,
idempotency keys, lease extension, nack options, task lookup, queue and DLQ operations, and the
models they return.

The client runs on ``tests/fake_transport.py``; what is checked is what the client sends through
the transport seam and what it makes of the answers (the broker's own behaviour is checked
end to end in tests/client/test_queues_end_to_end.py).
"""

from __future__ import annotations

import asyncio
import json
import pickle
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest

from tests.fake_transport import FakeStreamingTransport, FakeTransport, Nack
from wqclient import (
    AsyncClient,
    Client,
    Delivery,
    Enqueued,
    EnqueueItem,
    InvalidArgument,
    LeaseLost,
    NotFound,
    ProtocolError,
    QueueInfo,
    Stats,
    Task,
    Totals,
    Transport,
)

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def fake() -> FakeTransport:
    return FakeTransport()


@pytest.fixture
async def client(fake: FakeTransport) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(transport=fake) as c:
        yield c


async def claimed(client: AsyncClient, **options: Any) -> Delivery:
    delivery = await client.claim(wait_ms=0, **options)
    assert delivery is not None
    return delivery


# -- enqueue: queues, priorities, keys ------------------------------------------------------------


async def test_enqueue_returns_an_enqueued_that_is_the_id(
    client: AsyncClient, fake: FakeTransport
) -> None:
    task_id = await client.enqueue({"a": 1})
    assert isinstance(task_id, Enqueued)
    assert isinstance(task_id, str)
    assert task_id == "t1"
    assert task_id.id == "t1"
    assert type(task_id.id) is str
    assert not task_id.duplicate
    assert json.dumps({"id": task_id}) == '{"id": "t1"}'  # old code that used the id still works
    assert {"t1": 1}[task_id] == 1
    assert fake.tasks["t1"].queue == "default"
    assert fake.tasks["t1"].priority == 0


def test_enqueued_pickles_and_shows_what_happened() -> None:
    dup = Enqueued("t9", duplicate=True)
    back = pickle.loads(pickle.dumps(dup))
    assert (back, back.duplicate, type(back)) == ("t9", True, Enqueued)
    assert repr(dup) == "Enqueued('t9', duplicate=True)"
    assert str(dup) == "t9"
    assert Enqueued.from_mapping({"id": "t2"}) == "t2"
    assert Enqueued.from_mapping({"id": "t2", "duplicate": True}).duplicate
    with pytest.raises(ProtocolError):
        Enqueued.from_mapping({"id": 5})
    with pytest.raises(ProtocolError):
        Enqueued.from_mapping({})


async def test_enqueue_to_a_queue_with_a_priority(client: AsyncClient, fake: FakeTransport) -> None:
    task_id = await client.enqueue("x", queue="emails", priority=7, max_attempts=2)
    task = fake.tasks[task_id]
    assert (task.queue, task.priority, task.max_attempts) == ("emails", 7, 2)


async def test_an_idempotency_key_makes_a_second_enqueue_a_duplicate_per_queue(
    client: AsyncClient, fake: FakeTransport
) -> None:
    first = await client.enqueue("x", idempotency_key="order-42")
    again = await client.enqueue("y", idempotency_key="order-42")
    elsewhere = await client.enqueue("z", queue="other", idempotency_key="order-42")
    assert (first.duplicate, again.duplicate, elsewhere.duplicate) == (False, True, False)
    assert again == first
    assert elsewhere != first
    assert len(fake.tasks) == 2


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"queue": 5}, "queue"),
        ({"priority": "high"}, "priority"),
        ({"priority": True}, "priority"),
        ({"idempotency_key": b"k"}, "idempotency_key"),
    ],
)
async def test_options_of_the_wrong_type_are_refused_before_any_call(
    client: AsyncClient, fake: FakeTransport, options: dict[str, Any], field: str
) -> None:
    with pytest.raises(InvalidArgument) as e:
        await client.enqueue("x", **options)
    assert field in e.value.message
    assert fake.calls == []


async def test_ranges_are_the_brokers_to_check(client: AsyncClient, fake: FakeTransport) -> None:
    # The client sends what it is given; the broker (here the fake) says what is wrong.
    with pytest.raises(InvalidArgument) as e:
        await client.enqueue("x", priority=10)
    assert "priority" in e.value.message
    with pytest.raises(InvalidArgument):
        await client.enqueue("x", queue="no spaces")
    assert fake.calls_to("enqueue") == [None, None]


async def test_enqueue_many_takes_payloads_and_items_with_options_of_their_own(
    client: AsyncClient, fake: FakeTransport
) -> None:
    ids = await client.enqueue_many(
        [
            {"n": 1},
            EnqueueItem(b'{"n":2}', priority=9),
            EnqueueItem(b'{"n":3}', queue="other", idempotency_key="k3"),
            EnqueueItem(b'{"n":4}', queue="other", idempotency_key="k3"),  # a duplicate
        ],
        queue="batch",
        priority=1,
    )
    assert [(i, i.duplicate) for i in ids] == [
        ("t1", False),
        ("t2", False),
        ("t3", False),
        ("t3", True),
    ]
    assert [(t.queue, t.priority, t.payload) for t in fake.tasks.values()] == [
        ("batch", 1, {"n": 1}),
        ("batch", 9, {"n": 2}),
        ("other", 1, {"n": 3}),
    ]
    assert fake.calls_to("enqueue_many") == [None]  # one call


async def test_enqueue_many_is_all_or_none(client: AsyncClient, fake: FakeTransport) -> None:
    with pytest.raises(InvalidArgument) as e:
        await client.enqueue_many(["a", EnqueueItem(b'"b"', priority=12)])
    assert "tasks[1].priority" in e.value.message
    assert fake.tasks == {}
    assert await client.enqueue_many([]) == []


# -- claim: queues in order, priorities ----------------------------------------------------------


async def test_a_claim_takes_from_the_default_queue_unless_told(
    client: AsyncClient, fake: FakeTransport
) -> None:
    fake.add("elsewhere", queue="other")
    assert await client.claim(wait_ms=0) is None
    mine = fake.add("mine")
    assert (await claimed(client)).id == mine
    assert fake.claim_queues == [["default"], ["default"]]


@pytest.mark.parametrize("queues", ["urgent,normal", ["urgent", "normal"], ("urgent", "normal")])
async def test_a_claim_takes_from_its_queues_in_the_order_listed(
    client: AsyncClient, fake: FakeTransport, queues: str | Sequence[str]
) -> None:
    normal = fake.add("n", queue="normal", priority=9)
    urgent = fake.add("u", queue="urgent", priority=0)
    first = await claimed(client, queues=queues)
    second = await claimed(client, queues=queues)
    assert (first.id, second.id) == (urgent, normal)  # the first queue wins, whatever priority
    assert (first.task.queue, second.task.priority) == ("urgent", 9)
    assert fake.claim_queues == [["urgent", "normal"]] * 2


async def test_within_a_queue_the_highest_priority_comes_first_then_the_oldest(
    client: AsyncClient, fake: FakeTransport
) -> None:
    low = fake.add("low", priority=1)
    high_old = fake.add("high", priority=5)
    high_new = fake.add("high too", priority=5)
    order = [(await claimed(client)).id for _ in range(3)]
    assert order == [high_old, high_new, low]


async def test_queues_of_the_wrong_type_are_refused(client: AsyncClient) -> None:
    with pytest.raises(InvalidArgument):
        await client.claim(queues=[1, 2])  # type: ignore[list-item]


async def test_a_stream_takes_from_its_queues(fake: FakeTransport) -> None:
    streaming = FakeStreamingTransport()
    streaming.add("no", queue="other")
    wanted = streaming.add("yes", queue="jobs")
    async with AsyncClient(transport=streaming) as c:
        stream = await c.stream(prefetch=2, queues="jobs")
        delivery = await asyncio.wait_for(anext(stream), 5)
        assert delivery.id == wanted
        await stream.ack(delivery, confirm=True)
        assert await stream.drain() == 0
        await stream.close()
    assert streaming.claim_queues == [["jobs"]]


# -- pause, resume, stats, queues ---------------------------------------------------------------


async def test_a_paused_queue_accepts_tasks_but_hands_none_out(
    client: AsyncClient, fake: FakeTransport
) -> None:
    await client.pause("jobs")
    task_id = await client.enqueue("x", queue="jobs")
    assert await client.claim(wait_ms=0, queues="jobs") is None
    await client.resume("jobs")
    await client.resume("jobs")  # idempotent
    assert (await claimed(client, queues="jobs")).id == task_id


async def test_queues_lists_every_queue_with_its_gauges(
    client: AsyncClient, fake: FakeTransport
) -> None:
    fake.add("a", queue="b-queue")
    fake.add("b", queue="b-queue")
    await client.pause("a-queue")
    await claimed(client, queues="b-queue")
    assert await client.queues() == [
        QueueInfo("a-queue", paused=True),
        QueueInfo("b-queue", ready=1, handed_out=1),
        QueueInfo("default"),
    ]


async def test_stats_of_one_queue_or_of_all(client: AsyncClient, fake: FakeTransport) -> None:
    fake.add("a", queue="q1")
    fake.add("b", queue="q2")
    fake.add("c", queue="q2")
    assert (await client.stats()).ready == 3
    assert (await client.stats("q2")).ready == 2
    assert (await client.stats(queue="never")).ready == 0


# -- nack options, extend ------------------------------------------------------------------------


async def test_nack_with_a_delay_or_terminal(client: AsyncClient, fake: FakeTransport) -> None:
    a = fake.add("a", max_attempts=5)
    b = fake.add("b", max_attempts=5)
    await client.nack(await claimed(client), error="later", delay_ms=60_000)
    await client.nack(await claimed(client), error="never", terminal=True)
    assert fake.nacks == [Nack(a, "later", 60_000, False), Nack(b, "never", None, True)]
    assert fake.dead == [b]  # buried with four attempts left
    assert list(fake.ready) == [a]


async def test_nack_option_types_are_checked_and_combinations_left_to_the_broker(
    client: AsyncClient, fake: FakeTransport
) -> None:
    fake.add("a")
    delivery = await claimed(client)
    with pytest.raises(InvalidArgument):
        await client.nack(delivery, terminal="yes")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        await client.nack(delivery, delay_ms=1.5)  # type: ignore[arg-type]
    assert fake.calls_to("nack") == []
    with pytest.raises(InvalidArgument):  # the broker's rule: not both
        await client.nack(delivery, delay_ms=5, terminal=True)
    await client.nack(delivery.id, delivery.lease_id, error="plain")  # the old spelling
    assert fake.nacks == [Nack(delivery.id, "plain")]


async def test_extend_returns_the_new_deadline_and_a_lost_lease_raises(
    client: AsyncClient, fake: FakeTransport
) -> None:
    fake.add("a")
    delivery = await claimed(client, lease_ms=1_000)
    before = datetime.now(UTC)
    deadline = await client.extend(delivery, 120_000)
    assert before + timedelta(seconds=119) < deadline <= datetime.now(UTC) + timedelta(seconds=120)
    await client.extend(delivery.id, lease_id=delivery.lease_id)  # the broker's default lease
    assert fake.extends == [(delivery.id, 120_000), (delivery.id, None)]
    fake.take_away(delivery.id)
    with pytest.raises(LeaseLost):
        await client.extend(delivery, 1_000)
    with pytest.raises(NotFound):
        await client.extend("t404", 1_000, lease_id="x")
    with pytest.raises(InvalidArgument):
        await client.extend(delivery.id, 1_000)  # no lease id


# -- lookup, DLQ ---------------------------------------------------------------------------------


async def test_get_task_shows_its_state_until_acked(
    client: AsyncClient, fake: FakeTransport
) -> None:
    task_id = await client.enqueue({"x": 1}, queue="q", priority=3)
    task = await client.get_task(task_id)
    assert (task.id, task.state, task.queue, task.priority, task.payload) == (
        task_id,
        "ready",
        "q",
        3,
        {"x": 1},
    )
    delivery = await claimed(client, queues="q")
    assert (await client.get_task(task_id)).state == "handed_out"
    await client.ack(delivery)
    with pytest.raises(NotFound):
        await client.get_task(task_id)


async def test_dlq_by_queue_requeue_all_and_purge(client: AsyncClient, fake: FakeTransport) -> None:
    ids: dict[str, list[str]] = {}
    for name in ("q1", "q1", "q2"):
        task_id = fake.add(name, queue=name, max_attempts=1)
        ids.setdefault(name, []).append(task_id)
        await client.nack(await claimed(client, queues=name), error="boom")
    assert [t.id for t in await client.dead_letters()] == ids["q1"] + ids["q2"]
    assert [t.id for t in await client.dead_letters(queue="q2")] == ids["q2"]
    assert [t.id for t in await client.dead_letters(1, queue="q1")] == ids["q1"][:1]
    assert (await client.get_task(ids["q2"][0])).state == "dead"
    await client.purge(ids["q2"][0])
    with pytest.raises(NotFound):
        await client.purge(ids["q2"][0])
    with pytest.raises(NotFound):
        await client.get_task(ids["q2"][0])
    assert await client.requeue_all("q2") == 0
    assert await client.requeue_all(queue="q1") == 2
    assert await client.requeue_all() == 0
    stats = await client.stats()
    assert (stats.dead, stats.ready, stats.totals.purged, stats.totals.requeued) == (0, 2, 1, 2)


# -- a transport written before queues ------------------------------------------------------------


class OldTransport:
    """The seam as it was: no queues, priorities, keys or nack options."""

    def __init__(self) -> None:
        self.fake = FakeTransport()
        self.calls: list[tuple[Any, ...]] = []

    async def enqueue(
        self, payload_json: bytes, max_attempts: int | None, delay_ms: int | None
    ) -> str:
        self.calls.append(("enqueue", payload_json, max_attempts, delay_ms))
        return "t1"

    async def claim(self, wait_ms: int | None, lease_ms: int | None) -> Delivery | None:
        self.calls.append(("claim", wait_ms, lease_ms))
        return None

    async def nack(self, task_id: str, lease_id: str, error: str | None) -> None:
        self.calls.append(("nack", task_id, lease_id, error))

    async def stats(self) -> Stats:
        self.calls.append(("stats",))
        return Stats()

    async def dead_letters(self, limit: int | None) -> list[Task]:
        self.calls.append(("dead_letters", limit))
        return []

    async def close(self) -> None:
        pass


async def test_calls_that_leave_the_new_options_unset_still_work_on_an_old_transport() -> None:
    old = OldTransport()
    async with AsyncClient(transport=cast(Transport, old)) as c:
        assert await c.enqueue("x", max_attempts=2) == "t1"
        assert await c.claim(wait_ms=0) is None
        await c.nack("t1", "L1", error="e")
        assert await c.stats() == Stats()
        assert await c.dead_letters(limit=3) == []
    assert old.calls == [
        ("enqueue", b'"x"', 2, None),
        ("claim", 0, None),
        ("nack", "t1", "L1", "e"),
        ("stats",),
        ("dead_letters", 3),
    ]


# -- the blocking Client -------------------------------------------------------------------------


async def test_the_blocking_client_has_every_new_method(fake: FakeTransport) -> None:
    def scenario() -> None:
        with Client(transport=fake) as c:
            first = c.enqueue("a", queue="q", priority=2, idempotency_key="k")
            assert c.enqueue("b", queue="q", idempotency_key="k").duplicate
            assert c.enqueue_many(["c"], queue="q", priority=1) == ["t2"]
            assert c.get_task(first).state == "ready"
            delivery = c.claim(wait_ms=0, queues=["q"])
            assert delivery is not None
            assert delivery.id == first
            assert c.extend(delivery, 5_000) > datetime.now(UTC)
            c.nack(delivery, error="x", terminal=True)
            assert [t.id for t in c.dead_letters(queue="q")] == [first]
            c.purge(first)
            c.pause("q")
            assert c.claim(wait_ms=0, queues="q") is None
            assert [q.name for q in c.queues() if q.paused] == ["q"]
            c.resume("q")
            assert c.stats("q").ready == 1
            assert c.requeue_all() == 0

    await asyncio.to_thread(scenario)
    assert fake.counters.purged == 1


async def test_the_blocking_stream_extends_nacks_with_options_and_drains() -> None:
    streaming = FakeStreamingTransport()
    a = streaming.add("a", max_attempts=5)
    b = streaming.add("b", max_attempts=5)

    def scenario() -> None:
        with Client(transport=streaming) as c:
            stream = c.stream(prefetch=2)
            first, second = next(stream), next(stream)
            assert stream.extend(first, 60_000) > datetime.now(UTC)
            stream.nack(first, "later", delay_ms=1_000, confirm=True)
            assert stream.drain() == 1  # the second is still unsettled
            stream.nack(second, "never", terminal=True, confirm=True)
            stream.close()

    await asyncio.to_thread(scenario)
    assert streaming.nacks == [Nack(a, "later", 1_000, False), Nack(b, "never", None, True)]
    assert streaming.extends == [(a, 60_000)]


# -- models --------------------------------------------------------------------------------------

TASK = {
    "id": "t1",
    "payload": b"{}",
    "attempts": 1,
    "max_attempts": 3,
    "created_at": "2026-01-01T00:00:00Z",
    "available_at": "2026-01-01T00:00:00Z",
}


def test_a_task_reads_queue_priority_and_state_and_defaults_them() -> None:
    old = Task.from_mapping(TASK)
    assert (old.queue, old.priority, old.state) == ("default", 0, None)
    new = Task.from_mapping({**TASK, "queue": "q", "priority": 4, "state": "dead"})
    assert (new.queue, new.priority, new.state) == ("q", 4, "dead")
    # A protobuf message leaves unset fields empty: they mean the defaults too.
    unset = Task.from_mapping({**TASK, "queue": "", "priority": 0, "state": ""})
    assert (unset.queue, unset.priority, unset.state) == ("default", 0, None)
    with pytest.raises(ProtocolError):
        Task.from_mapping({**TASK, "priority": "high"})


def test_queue_info_and_totals_read_the_new_fields() -> None:
    info = QueueInfo.from_mapping(
        {"name": "q", "ready": 1, "handed_out": 2, "delayed": 3, "dead": 4, "paused": True}
    )
    assert info == QueueInfo("q", 1, 2, 3, 4, True)
    assert QueueInfo.from_mapping({"name": "q"}) == QueueInfo("q")
    with pytest.raises(ProtocolError):
        QueueInfo.from_mapping({"ready": 1})
    with pytest.raises(ProtocolError):
        QueueInfo.from_mapping({"name": "q", "ready": "many"})
    assert Totals.from_mapping({"purged": 2}).purged == 2
    assert Totals.from_mapping({}).purged == 0
