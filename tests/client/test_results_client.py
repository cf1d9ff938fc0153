"""Results and workflows (issue 27) in the client, without a broker: ``AsyncClient`` and its
blocking mirror over the transport seam (tests/fake_transport.py), the Worker returning values, the
long result wait in slices on a fake clock, and the wire formats both transports read (HTTP's JSON
with results kept byte for byte, gRPC's messages).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

import pytest
from google.protobuf.timestamp_pb2 import Timestamp

import wqclient
from tests.fake_clock import FakeClock
from tests.fake_transport import FakeStreamingTransport, FakeTransport
from wqclient import (
    AsyncClient,
    Client,
    Delivery,
    EnqueueItem,
    InvalidArgument,
    NotFound,
    ParentResult,
    ResultTimeout,
    Task,
    TaskNotSucceeded,
    TaskResult,
    WqError,
)
from wqclient._grpc import _delivery
from wqclient._http import _loads
from wqclient.models import plain_task
from wqclient.worker import Worker
from wqwire.pb import broker_pb2 as pb

pytestmark = pytest.mark.timeout(30)

WORKER_LOG = "wqclient.worker"


def test_the_new_names_are_exported_and_placed_in_the_tree() -> None:
    for name in (
        "TaskResult",
        "ParentResult",
        "TaskNotSucceeded",
        "ResultTimeout",
        "chain",
        "group",
        "chord",
        "signature",
        "Signature",
    ):
        assert name in wqclient.__all__
        assert getattr(wqclient, name) is not None
    assert issubclass(TaskNotSucceeded, WqError)
    assert issubclass(ResultTimeout, WqError)
    assert issubclass(ResultTimeout, TimeoutError)  # (caught as any time-out is)


# -- enqueue: after and result_ttl_ms ------------------------------------------------------------


async def test_after_takes_ids_and_anything_with_an_id() -> None:
    fake = FakeTransport()
    async with AsyncClient(transport=fake) as wq:
        first = await wq.enqueue("first")
        second = await wq.enqueue("second")
        task = await wq.get_task(second)
        # An Enqueued, a plain str, a Task: each names its task; one may be given alone.
        child = await wq.enqueue("child", after=[first, str(second)], result_ttl_ms=5_000)
        only = await wq.enqueue("only", after=task)
        view = await wq.get_task(child)
    assert (view.state, view.after, view.waiting_for) == ("waiting", (first, second), 2)
    assert fake.options[child].result_ttl_ms == 5_000
    assert fake.tasks[only].after == (second,)


async def test_an_empty_after_is_no_parents_and_nothing_new_is_sent() -> None:
    fake = FakeTransport()
    async with AsyncClient(transport=fake) as wq:
        task_id = await wq.enqueue("alone", after=[])
        assert (await wq.get_task(task_id)).state == "ready"
    assert fake.options[task_id].after is None
    assert fake.options[task_id].result_ttl_ms is None


@pytest.mark.parametrize(
    ("after", "message"),
    [
        ([0], "after[0] must be a task id (an index names an earlier item of a batch"),
        ([3.5], "after[0] must be a task id, got float"),
        (["a", None], "after[1] must be a task id, got NoneType"),
        (7, "after must be a list of task ids (or handles), got int"),
        (b"abc", "after must be a list of task ids (or handles), got bytes"),
    ],
)
async def test_a_bad_after_is_refused_before_anything_is_sent(after: Any, message: str) -> None:
    fake = FakeTransport()
    async with AsyncClient(transport=fake) as wq:
        with pytest.raises(InvalidArgument) as refused:
            await wq.enqueue("x", after=after)
    assert refused.value.message.startswith(message)
    assert fake.calls_to("enqueue") == []


async def test_a_batch_names_earlier_items_by_index_all_or_none() -> None:
    fake = FakeTransport()
    async with AsyncClient(transport=fake) as wq:
        outside = await wq.enqueue("outside")
        ids = await wq.enqueue_many(
            [
                "root",
                EnqueueItem(b'"left"', after=[0]),
                EnqueueItem(b'"right"', after=[0, outside]),
                EnqueueItem(b'"join"', after=[1, 2], result_ttl_ms=0),
            ],
            result_ttl_ms=60_000,
        )
        assert fake.tasks[ids[1]].after == (ids[0],)
        assert fake.tasks[ids[2]].after == (ids[0], outside)
        assert fake.tasks[ids[3]].after == (ids[1], ids[2])
        # The call's result_ttl_ms for the items that set none; an item's own wins.
        assert [fake.options[i].result_ttl_ms for i in ids] == [60_000, 60_000, 60_000, 0]
        with pytest.raises(InvalidArgument) as refused:
            await wq.enqueue_many(["a", EnqueueItem(b'"b"', after=[-1])])
        assert refused.value.message.startswith("tasks[1].after[0] must name an earlier item")
        with pytest.raises(InvalidArgument) as refused:  # (the broker's check: not earlier)
            await wq.enqueue_many(["a", EnqueueItem(b'"b"', after=[1])])
        assert "tasks[1].after[0]" in refused.value.message
        with pytest.raises(InvalidArgument):
            await wq.enqueue_many([EnqueueItem(b'"b"', after=["nonesuch"])])
    assert len(fake.tasks) == 5  # nothing of the refused batches


async def test_a_transport_written_before_results_still_serves_calls_without_them() -> None:
    class Older(FakeTransport):
        """Its enqueue and ack know nothing of after, result_ttl_ms or result."""

        async def enqueue(  # type: ignore[override]
            self, payload_json: bytes, max_attempts: int | None, delay_ms: int | None
        ) -> wqclient.Enqueued:
            return await super().enqueue(payload_json, max_attempts, delay_ms)

        async def ack(self, task_id: str, lease_id: str) -> None:  # type: ignore[override]
            await super().ack(task_id, lease_id)

    fake = Older()
    async with AsyncClient(transport=fake) as wq:  # type: ignore[arg-type]
        await wq.enqueue("plain")
        delivery = await wq.claim(wait_ms=0)
        assert delivery is not None
        await wq.ack(delivery)
    assert len(fake.acked) == 1


# -- ack with a result, and the lookups ---------------------------------------------------------


async def test_an_ack_carries_any_json_value_as_its_result() -> None:
    fake = FakeTransport()
    async with AsyncClient(transport=fake) as wq:
        for _ in range(4):
            await wq.enqueue("work")
        for result in ({"rows": [1, 2], "ok": True}, None, b'{"exact": 1.10}'):
            delivery = await wq.claim(wait_ms=0)
            assert delivery is not None
            await wq.ack(delivery, result=result)
        plain = await wq.claim(wait_ms=0)
        assert plain is not None
        await wq.ack(plain)
        with pytest.raises(NotFound):
            await wq.get_task(plain.id)  # no result: forgotten, as always
        kept = await wq.get_task(fake.acked[0])
    assert [text for _, text in fake.results] == [
        b'{"rows":[1,2],"ok":true}',
        b"null",  # None is a result: JSON null
        b'{"exact": 1.10}',  # bytes: JSON text, sent as they are
    ]
    assert (kept.state, kept.result, kept.result_json) == (
        "succeeded",
        {"rows": [1, 2], "ok": True},
        b'{"rows":[1,2],"ok":true}',
    )
    assert kept.finished_at is not None


async def test_a_result_json_cannot_encode_is_refused_and_the_task_not_acked() -> None:
    fake = FakeTransport()
    async with AsyncClient(transport=fake) as wq:
        await wq.enqueue("work")
        delivery = await wq.claim(wait_ms=0)
        assert delivery is not None
        for bad in ({1, 2}, float("nan"), object()):
            with pytest.raises(InvalidArgument) as refused:
                await wq.ack(delivery, result=bad)
            assert refused.value.message.startswith("result cannot be encoded as JSON")
        assert (await wq.get_task(delivery.id)).state == "handed_out"
    assert fake.calls_to("ack") == []


async def test_a_lookup_shows_parents_children_and_the_waiting_count() -> None:
    fake = FakeTransport()
    async with AsyncClient(transport=fake) as wq:
        a, b = await wq.enqueue_many(["a", "b"])
        kids = await wq.enqueue_many(
            [EnqueueItem(b"1", after=[a, b]), EnqueueItem(b"2", after=[a])]
        )
        delivery = await wq.claim(wait_ms=0)
        assert delivery is not None
        assert delivery.id == a
        await wq.ack(delivery, result=41)
        parent = await wq.get_task(a)
        first = await wq.get_task(kids[0])
        second = await wq.get_task(kids[1])
        stats = await wq.stats()
        queues = await wq.queues()
        waiting = await wq.list_tasks(state="waiting")
        succeeded = await wq.list_tasks(state="succeeded")
    assert (parent.state, parent.result, parent.children, parent.children_count) == (
        "succeeded",
        41,
        tuple(kids),
        2,
    )
    assert (first.state, first.waiting_for, first.after) == ("waiting", 1, (a, b))
    assert (second.state, second.waiting_for) == ("ready", 0)
    assert (stats.waiting, stats.succeeded, stats.ready) == (1, 1, 2)
    assert (queues[0].waiting, queues[0].succeeded) == (1, 1)
    assert [t.id for t in waiting] == [kids[0]]
    assert [(t.id, t.state) for t in succeeded] == [(a, "succeeded")]


async def test_a_delivery_and_its_task_carry_the_parents_results_in_order() -> None:
    fake = FakeTransport()
    async with AsyncClient(transport=fake) as wq:
        ids = await wq.enqueue_many(
            ["x", "y", "z", EnqueueItem(b'"join"', after=[2, 0, 1])], result_ttl_ms=60_000
        )
        for result in ("X", None, b"[1e400]"):
            delivery = await wq.claim(wait_ms=0)
            assert delivery is not None
            if result is None:
                await wq.ack(delivery)  # (no result: the child still runs, the parent has none)
            else:
                await wq.ack(delivery, result=result)
        child = await wq.claim(wait_ms=0)
    assert child is not None
    assert child.id == ids[3]
    assert child.parents == child.task.parents
    assert child.parents == (
        ParentResult(ids[2], b"[1e400]"),
        ParentResult(ids[0], b'"X"'),
        ParentResult(ids[1], None),
    )
    assert [p.result for p in child.parents] == [[math.inf], "X", None]


async def test_a_parent_that_dies_buries_its_waiting_children_naming_it() -> None:
    fake = FakeTransport()
    async with AsyncClient(transport=fake) as wq:
        root, child, grandchild = await wq.enqueue_many(
            [
                EnqueueItem(b'"root"', max_attempts=1),
                EnqueueItem(b'"child"', after=[0]),
                EnqueueItem(b'"grandchild"', after=[1]),
            ]
        )
        delivery = await wq.claim(wait_ms=0)
        assert delivery is not None
        await wq.nack(delivery, error="disk full")
        dead = {t.id: t.last_error for t in await wq.dead_letters()}
    assert dead == {
        root: "disk full",
        child: f"parent {root} is dead: disk full",
        grandchild: f"parent {child} is dead: parent {root} is dead: disk full",
    }


# -- wait_result ---------------------------------------------------------------------------------


@asynccontextmanager
async def on_a_fake_clock() -> AsyncIterator[tuple[AsyncClient, FakeTransport, FakeClock]]:
    clock = FakeClock()
    fake = FakeTransport(clock)
    async with AsyncClient(transport=fake, clock=clock) as wq:
        yield wq, fake, clock


async def test_a_wait_longer_than_the_brokers_cap_is_asked_in_slices() -> None:
    async with on_a_fake_clock() as (wq, fake, clock):
        task_id = await wq.enqueue("slow")
        start = clock.now
        waiting = asyncio.ensure_future(wq.wait_result(task_id, timeout=75))
        for _ in range(3):
            await clock.sleeping()
            await clock.advance(30)
        assert await waiting is None  # still pending when the 75 s ran out
        assert clock.now - start == pytest.approx(90)  # (the fake moved 30 s at a time)
    assert fake.result_waits == [(task_id, 30_000), (task_id, 30_000), (task_id, 15_000)]


async def test_a_wait_ends_when_the_task_ends_in_a_later_slice() -> None:
    async with on_a_fake_clock() as (wq, fake, clock):
        task_id = await wq.enqueue("slow")
        waiting = asyncio.ensure_future(wq.wait_result(task_id, timeout=600))
        await clock.sleeping()
        await clock.advance(30)  # the first slice ends: pending, asked again
        await clock.sleeping()
        delivery = await wq.claim(wait_ms=0)
        assert delivery is not None
        await wq.ack(delivery, result={"done": True})
        answer = await asyncio.wait_for(waiting, 5)
    assert isinstance(answer, TaskResult)
    assert (answer.id, answer.state, answer.succeeded, answer.result) == (
        task_id,
        "succeeded",
        True,
        {"done": True},
    )
    assert [wait_ms for _, wait_ms in fake.result_waits] == [30_000, 30_000]


@pytest.mark.parametrize("timeout", [None, math.inf])
async def test_a_wait_with_no_timeout_goes_on_until_the_task_ends(timeout: float | None) -> None:
    async with on_a_fake_clock() as (wq, fake, clock):
        task_id = await wq.enqueue("slow", max_attempts=1)
        waiting = asyncio.ensure_future(wq.wait_result(task_id, timeout=timeout))
        for _ in range(5):
            await clock.sleeping()
            await clock.advance(30)
        assert not waiting.done()
        delivery = await wq.claim(wait_ms=0)
        assert delivery is not None
        await wq.nack(delivery, error="no luck")
        answer = await asyncio.wait_for(waiting, 5)
    assert answer == TaskResult(task_id, "dead", last_error="no luck", attempts=1)
    assert not answer.succeeded
    assert {wait_ms for _, wait_ms in fake.result_waits} == {30_000}


async def test_a_wait_of_zero_asks_once_and_a_negative_one_is_refused() -> None:
    async with on_a_fake_clock() as (wq, fake, _):
        task_id = await wq.enqueue("x")
        assert await wq.wait_result(task_id, timeout=0) is None
        for bad in (-1, math.nan):
            with pytest.raises(InvalidArgument):
                await wq.wait_result(task_id, timeout=bad)
        with pytest.raises(NotFound):
            await wq.wait_result("nonesuch", timeout=10)
    assert fake.result_waits == [(task_id, 0), ("nonesuch", 10_000)]


async def test_a_broker_that_answers_a_wait_early_is_not_asked_in_a_tight_loop() -> None:
    class Impatient(FakeTransport):
        async def wait_result(self, task_id: str, wait_ms: int | None) -> TaskResult | None:
            self.result_waits.append((task_id, wait_ms))
            return None  # at once, whatever it was asked

    clock = FakeClock()
    fake = Impatient()
    async with AsyncClient(transport=fake, clock=clock) as wq:
        waiting = asyncio.ensure_future(wq.wait_result("t1", timeout=3))
        for _ in range(3):
            await clock.sleeping()
            await clock.advance(1)
        assert await waiting is None
    assert len(fake.result_waits) == 4  # once a second (a pause between), not thousands
    assert clock.sleeps == [1.0, 1.0, 1.0]


async def test_a_waiter_sees_a_task_acked_without_a_result_and_one_cancelled() -> None:
    async with on_a_fake_clock() as (wq, _, clock):
        plain, doomed = await wq.enqueue("plain"), await wq.enqueue("doomed")
        waits = [asyncio.ensure_future(wq.wait_result(i, timeout=10)) for i in (plain, doomed)]
        await clock.sleeping(2)
        delivery = await wq.claim(wait_ms=0)
        assert delivery is not None
        assert delivery.id == plain
        await wq.ack(delivery)
        await wq.cancel(doomed)
        acked, cancelled = await asyncio.gather(*waits)
        assert acked is not None
        assert cancelled is not None
        assert (acked.state, acked.result_json, acked.result) == ("succeeded", None, None)
        assert cancelled.state == "cancelled"
        for gone in (plain, doomed):  # afterwards: gone
            with pytest.raises(NotFound):
                await wq.wait_result(gone, timeout=0)


def test_the_blocking_client_acks_with_results_and_waits() -> None:
    fake = FakeStreamingTransport()
    with Client(transport=fake) as wq:
        first = wq.enqueue({"n": 1})
        second = wq.enqueue({"n": 2}, after=[first], result_ttl_ms=1000)
        delivery = wq.claim(wait_ms=0)
        assert delivery is not None
        wq.ack(delivery, result=[delivery.payload["n"]])
        stream = wq.stream(prefetch=1)
        streamed = next(iter(stream))
        assert streamed.id == second
        assert streamed.parents == (ParentResult(first, b"[1]"),)
        stream.ack(streamed, result=None, confirm=True)
        stream.close()
        answers = [wq.wait_result(i, timeout=0) for i in (first, second)]
    assert [(a.state, a.result_json) for a in answers if a is not None] == [
        ("succeeded", b"[1]"),
        ("succeeded", b"null"),
    ]


# -- the Worker: a handler's return value is the task's result -----------------------------------


@pytest.fixture(params=["unary", "stream"])
def fake(request: pytest.FixtureRequest) -> FakeTransport:
    return FakeStreamingTransport() if request.param == "stream" else FakeTransport()


@asynccontextmanager
async def running(
    fake: FakeTransport, handler: Callable[[Task], Any], **options: Any
) -> AsyncIterator[Worker]:
    async with AsyncClient(transport=fake) as client:
        worker = Worker(client, handler, concurrency=2, clock=FakeClock(), **options)
        run = asyncio.ensure_future(worker.run())
        try:
            yield worker
        finally:
            worker.stop()
            await asyncio.wait_for(run, 10)


class Unencodable:
    def __repr__(self) -> str:
        return "<unencodable>"


def returns(payload: Any) -> Any:
    """What the handlers below return for a task's payload."""
    kind = payload["kind"]
    if kind == "number":
        return payload["n"] * 2
    if kind == "nothing":
        return None
    if kind == "text":
        return b'{"as": "sent", "n": 1.10}'
    if kind == "set":
        return {1, 2}
    if kind == "nan":
        return float("nan")
    if kind == "bad bytes":
        return b"{not json"
    return Unencodable()


KINDS = ["number", "nothing", "text", "set", "nan", "bad bytes", "object"]


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
async def test_a_handlers_return_value_is_the_tasks_result(
    fake: FakeTransport, sync: bool, caplog: pytest.LogCaptureFixture
) -> None:
    async def async_handler(task: Task) -> Any:
        return returns(task.payload)

    def sync_handler(task: Task) -> Any:
        return returns(task.payload)

    # (three attempts each: a result JSON cannot encode buries the task at once, not retried)
    ids = {kind: fake.add({"kind": kind, "n": 21}, max_attempts=3) for kind in KINDS}
    caplog.set_level(logging.WARNING, logger=WORKER_LOG)
    async with running(fake, sync_handler if sync else async_handler) as worker:
        await fake.wait_until(lambda: len(fake.acked) + len(fake.dead) == len(KINDS))
    results = dict(fake.results)
    assert results == {ids["number"]: b"42", ids["text"]: b'{"as": "sent", "n": 1.10}'}
    assert ids["nothing"] in fake.acked  # None: acked as always, no result
    assert set(fake.acked) == {ids["number"], ids["nothing"], ids["text"]}
    errors = {fake.tasks[i].last_error for i in fake.dead}
    assert all(e is not None and e.startswith("result is not JSON: ") for e in errors)
    assert len(fake.dead) == 4  # (a clear terminal nack, not a crash: the worker went on)
    assert all(fake.tasks[i].attempts == 1 for i in fake.dead)
    assert (worker.succeeded, worker.failed) == (3, 4)
    logged = [r.getMessage() for r in caplog.records if "result is not JSON" in r.getMessage()]
    assert len(logged) == 4


async def test_a_result_the_broker_refuses_buries_the_task(
    fake: FakeTransport, caplog: pytest.LogCaptureFixture
) -> None:
    async def handler(task: Task) -> Any:
        return "x" * 100

    fake.fail("ack", InvalidArgument("result is 100 bytes, over the limit of 64"))
    task_id = fake.add("big", max_attempts=3)
    caplog.set_level(logging.WARNING, logger=WORKER_LOG)
    async with running(fake, handler) as worker:
        await fake.wait_until(lambda: task_id in fake.dead)
    assert fake.tasks[task_id].last_error == (
        "result refused by the broker: result is 100 bytes, over the limit of 64"
    )
    assert (worker.succeeded, worker.failed) == (0, 1)
    assert fake.tasks[task_id].attempts == 1  # buried, not retried
    assert any("refused its handler's result" in r.getMessage() for r in caplog.records)


async def test_a_handler_finds_its_parents_results_and_passes_its_own_on(
    fake: FakeTransport,
) -> None:
    seen: dict[str, Any] = {}

    async def handler(task: Task) -> Any:
        inputs = [p.result for p in task.parents or ()]
        seen[task.payload] = (inputs, task.parents is None)
        return sum(inputs) + 1

    ids = await fake.enqueue_many(
        [
            EnqueueItem(b'"a"'),
            EnqueueItem(b'"b"'),
            EnqueueItem(b'"sum"', after=(0, 1)),
            EnqueueItem(b'"last"', after=(2,)),
        ]
    )
    async with running(fake, handler):
        await fake.wait_until(lambda: len(fake.acked) == 4)
    assert seen == {"a": ([], True), "b": ([], True), "sum": ([1, 1], False), "last": ([3], False)}
    assert dict(fake.results)[ids[3]] == b"4"


# -- the wire: what each transport reads -----------------------------------------------------------


def test_http_keeps_results_byte_for_byte_in_views_deliveries_and_waits() -> None:
    view = (
        b'{"id":"a1","payload":{"p":1.10},"attempts":1,"max_attempts":3,'
        b'"created_at":"2026-01-02T03:04:05.000006Z","available_at":"2026-01-02T03:04:05.000006Z",'
        b'"last_error":null,"queue":"default","priority":0,"state":"succeeded",'
        b'"result":{"r":1e400, "s":"\\u00e9"},"finished_at":"2026-01-02T03:04:06Z",'
        b'"result_ttl_ms":0,"after":["p1","p2"],"children":["c1"],"children_count":3}'
    )
    task = Task.from_mapping(_loads(view))
    assert task.result_json == b'{"r":1e400, "s":"\\u00e9"}'  # not re-encoded
    assert task.payload_json == b'{"p":1.10}'
    assert (task.state, task.after, task.children, task.children_count) == (
        "succeeded",
        ("p1", "p2"),
        ("c1",),
        3,
    )
    assert (task.result_ttl_ms, task.finished_at) == (0, datetime(2026, 1, 2, 3, 4, 6, tzinfo=UTC))
    delivery_task = (
        b'{"id":"c1","payload":[1],"attempts":1,"max_attempts":3,'
        b'"created_at":"2026-01-02T03:04:05Z","available_at":"2026-01-02T03:04:05Z",'
        b'"last_error":null,"queue":"default","priority":0,"after":["p1","p2"]}'
    )
    delivery = (
        b'{"task":' + delivery_task + b',"lease_id":"l1","deadline":"2026-01-02T03:05:05Z",'
        b'"parents":[{"id":"p1","result":[1.0,2.50]},{"id":"p2"}]}'
    )
    expected = (ParentResult("p1", b"[1.0,2.50]"), ParentResult("p2", None))
    one = Delivery.from_mapping(_loads(delivery))
    batch = _loads(b'{"deliveries":[' + delivery + b"," + delivery + b"]}")
    many = [Delivery.from_mapping(row) for row in batch["deliveries"]]
    for d in (one, *many):
        assert d.parents == expected
        assert d.task.payload_json == b"[1]"
        assert d.task.after == ("p1", "p2")
    answer = _loads(
        b'{"id":"a1","state":"succeeded","result":0.10,"finished_at":"2026-01-02T03:04:06Z"}'
    )
    assert TaskResult.from_mapping(answer).result_json == b"0.10"
    dead = TaskResult.from_mapping(
        _loads(b'{"id":"a1","state":"dead","last_error":"boom","attempts":3}')
    )
    assert (dead.state, dead.last_error, dead.attempts, dead.result) == ("dead", "boom", 3, None)


def test_a_plain_delivered_task_reads_the_new_fields_as_their_defaults() -> None:
    now = datetime.now(UTC)
    task = plain_task("t1", b"1", 1, 3, now, now, None, "default", 0)
    assert (task.result_json, task.result, task.after, task.waiting_for, task.parents) == (
        None,
        None,
        None,
        0,
        None,
    )
    assert (task.children, task.children_count, task.finished_at, task.result_ttl_ms) == (
        None,
        0,
        None,
        None,
    )
    assert task == Task("t1", b"1", 1, 3, now, now)
    with pytest.raises(AttributeError):
        task.no_such_field  # type: ignore[attr-defined]  # noqa: B018


def test_grpc_deliveries_carry_their_parents() -> None:
    stamp = Timestamp(seconds=1_700_000_000)
    message = pb.Delivery(
        task=pb.Task(
            id="c1",
            payload=b'{"n":1}',
            attempts=1,
            max_attempts=3,
            created_at=stamp,
            available_at=stamp,
            after=["p1", "p2"],
        ),
        lease_id="l1",
        deadline=stamp,
        parents=[pb.ParentResult(id="p1", result=b"1.10"), pb.ParentResult(id="p2")],
    )
    delivery = _delivery(message)
    assert delivery.parents == (ParentResult("p1", b"1.10"), ParentResult("p2", None))
    assert delivery.task.after == ("p1", "p2")  # (as HTTP's delivery shows it)
    without = pb.Delivery(task=message.task, lease_id="l2", deadline=stamp)
    without.task.ClearField("after")
    assert _delivery(without).parents is None


async def test_the_fakes_wait_parks_on_its_clock_not_on_real_time() -> None:
    # (A guard for the tests above: they would pass vacuously if the fake's waits ended at once.)
    clock = FakeClock()
    fake = FakeTransport(clock)
    task_id = fake.add("x")
    waiting = asyncio.ensure_future(fake.wait_result(task_id, 30_000))
    await clock.sleeping()
    await asyncio.sleep(0.05)
    assert not waiting.done()
    await clock.advance(30)
    assert await waiting is None


def test_result_values_decode_json_text() -> None:
    assert TaskResult("t", "succeeded", b'{"a":[1,2]}').result == {"a": [1, 2]}
    assert ParentResult("p", b"null").result is None
    assert json.loads(ParentResult("p", b"[0.5]").result_json or b"") == [0.5]
