"""Results and workflows (docs/design/results.md) over gRPC, against a real broker on port 0:
``AckRequest.result`` (Ack, NextJob's acks, a stream's acks), ``WaitResult``,
``EnqueueRequest.after`` (TaskRef: an id, or an index in a batch) and ``result_ttl_ms`` (Enqueue,
EnqueueBatch, Produce), ``Delivery.parents``, the Task fields 14-18, GetTask's children, the
gauges ``waiting`` and ``succeeded``; hostile input; what a client that sends none of it sees.

Then across the protocols, on every store (memory, SQLite, PostgreSQL): a result byte for byte
whichever protocol acked it and whichever reads it, a chain and a fan-in released over both, a
waiter woken by an ack of the other protocol; and across two brokers on one PostgreSQL database,
a waiter on one woken by an ack on the other.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, TypeAlias

import grpc
import pytest

from tests import pg
from tests.grpc.test_api import Worker, ack_of
from tests.helpers import Http, http_client, make_store, running_broker, wait_until
from wqbroker.broker import Broker
from wqbroker.clock import FakeClock
from wqbroker.limits import MAX_PARENTS, MAX_RESULT_TTL_MS
from wqbroker.retry import Backoff
from wqbroker.store import Store
from wqbroker.store.postgres import PostgresStore
from wqwire.pb import broker_pb2 as pb
from wqwire.pb import broker_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(60)

Code = grpc.StatusCode
Stub: TypeAlias = "pb_grpc.BrokerAsyncStub"
EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]  # not in grpc-stubs
MAX_BODY = 64 * 1024


@pytest.fixture
async def broker(clock: FakeClock) -> AsyncIterator[Broker]:
    async with running_broker(clock=clock, rng=random.Random(7), max_body=MAX_BODY) as b:
        yield b


@pytest.fixture
async def stub(broker: Broker) -> AsyncIterator[Stub]:
    async with grpc.aio.insecure_channel(broker.grpc_target) as channel:
        yield pb_grpc.BrokerStub(channel)


async def rpc_error(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


async def refused(call: Any, code: grpc.StatusCode, field: str) -> grpc.aio.AioRpcError:
    error = await rpc_error(call)
    assert error.code() == code, error.details()
    assert field in (error.details() or ""), error.details()
    return error


async def enqueue(stub: Stub, payload: bytes = b"1", **fields: Any) -> str:
    return (await stub.Enqueue(pb.EnqueueRequest(payload=payload, **fields))).id


async def claim(stub: Stub, queue: str = "") -> pb.Delivery:
    response = await stub.NextJob(pb.NextJobRequest(wait_ms=0, queues=[queue] if queue else []))
    assert response.HasField("delivery")
    return response.delivery


async def held(stub: Stub, **fields: Any) -> pb.Delivery:
    task_id = await enqueue(stub, **fields)
    d = await claim(stub, fields.get("queue", ""))
    assert d.task.id == task_id
    return d


async def succeeded(stub: Stub, result: bytes, **fields: Any) -> str:
    d = await held(stub, **fields)
    await stub.Ack(pb.AckRequest(id=d.task.id, lease_id=d.lease_id, result=result))
    return d.task.id


async def get(stub: Stub, task_id: str) -> pb.GetTaskResponse:
    return await stub.GetTask(pb.GetTaskRequest(id=task_id))


def wait(stub: Stub, task_id: str, wait_ms: int | None = 30_000) -> Any:
    return stub.WaitResult(pb.WaitResultRequest(id=task_id, wait_ms=wait_ms))


def after(*refs: str | int) -> list[pb.TaskRef]:
    return [pb.TaskRef(index=r) if isinstance(r, int) else pb.TaskRef(id=r) for r in refs]


async def parked(broker: Broker, n: int = 1) -> None:
    await wait_until(lambda: broker.service.result_waiters == n, what=f"{n} result waits to park")


def fields_set(message: Any) -> set[str]:
    return {f.name for f, _ in message.ListFields()}


# The fields a task has set when none of the new options was given (attempts is 0 until it is
# handed out, which protobuf does not send).
PLAIN_FIELDS = {"id", "payload", "max_attempts", "created_at", "available_at", "queue"}

RESULTS = [
    b"null",
    b"1.10",
    b"1e400",
    b' {"z": [1, 2.50], "a": "caf\xc3\xa9 \\u00e9"} ',
    b"12345678901234567890123456789012345678901234567890",
    b"[]",
]


# -- Ack's result ---------------------------------------------------------------------------------


@pytest.mark.parametrize("result", RESULTS)
async def test_an_ack_s_result_is_kept_as_sent(stub: Stub, clock: FakeClock, result: bytes) -> None:
    d = await held(stub)
    await stub.Ack(pb.AckRequest(id=d.task.id, lease_id=d.lease_id, result=result))
    found = await get(stub, d.task.id)
    assert found.state == "succeeded"
    assert found.task.HasField("result")
    assert found.task.result == result
    assert found.task.finished_at.ToDatetime().timestamp() == pytest.approx(clock.now(), abs=1e-3)
    assert fields_set(found.task) == PLAIN_FIELDS | {"attempts", "result", "finished_at"}
    answer = await wait(stub, d.task.id, None)
    assert (answer.id, answer.state, answer.result) == (d.task.id, "succeeded", result)
    assert answer.finished_at == found.task.finished_at
    assert not answer.HasField("last_error")
    assert answer.attempts == 0


async def test_an_ack_without_a_result_forgets_the_task(stub: Stub) -> None:
    d = await held(stub)
    await stub.Ack(pb.AckRequest(id=d.task.id, lease_id=d.lease_id))
    await refused(get(stub, d.task.id), Code.NOT_FOUND, d.task.id)
    await refused(wait(stub, d.task.id), Code.NOT_FOUND, d.task.id)
    stats = await stub.Stats(pb.StatsRequest())
    assert (stats.succeeded, stats.totals.acked) == (0, 1)


@pytest.mark.parametrize(
    ("result", "code", "field"),
    [
        (b"{not json", Code.INVALID_ARGUMENT, "result is not valid JSON"),
        (b"NaN", Code.INVALID_ARGUMENT, "result is not valid JSON"),
        (b"1 2", Code.INVALID_ARGUMENT, "result is not valid JSON"),
        (b'"\xff"', Code.INVALID_ARGUMENT, "result is not valid UTF-8"),
        (b"", Code.INVALID_ARGUMENT, "result"),
        (b"  ", Code.INVALID_ARGUMENT, "result"),
        (b'"' + b"x" * MAX_BODY + b'"', Code.RESOURCE_EXHAUSTED, "result"),
    ],
)
async def test_a_bad_result_is_refused_and_the_task_stays_held(
    stub: Stub, result: bytes, code: grpc.StatusCode, field: str
) -> None:
    d = await held(stub)
    ack = pb.AckRequest(id=d.task.id, lease_id=d.lease_id, result=result)
    await refused(stub.Ack(ack), code, field)
    assert (await get(stub, d.task.id)).state == "handed_out"
    await stub.Ack(ack_of(d))  # still held: acked now


async def test_next_job_s_acks_take_results(stub: Stub) -> None:
    first, second, bad = await held(stub), await held(stub), await held(stub)
    await enqueue(stub, b'"next"')
    response = await stub.NextJob(
        pb.NextJobRequest(
            wait_ms=0,
            acks=[
                pb.AckRequest(id=first.task.id, lease_id=first.lease_id, result=b"[1.10]"),
                ack_of(second),
                pb.AckRequest(id=bad.task.id, lease_id=bad.lease_id, result=b"{"),
            ],
        )
    )
    assert [s.code for s in response.settled] == [0, 0, Code.INVALID_ARGUMENT.value[0]]
    assert "result" in response.settled[2].message
    assert response.delivery.task.payload == b'"next"'
    assert (await wait(stub, first.task.id, None)).result == b"[1.10]"
    await refused(get(stub, second.task.id), Code.NOT_FOUND, second.task.id)
    assert (await get(stub, bad.task.id)).state == "handed_out"


async def test_a_stream_s_acks_take_results(stub: Stub) -> None:
    ids = [await enqueue(stub, b"%d" % i) for i in range(3)]
    worker = await Worker(stub).open(prefetch=3)
    d0, d1, d2 = await worker.receive(3)
    await worker.send(
        acks=[
            pb.AckRequest(id=d0.task.id, lease_id=d0.lease_id, result=b'{"n": 0}'),
            pb.AckRequest(id=d1.task.id, lease_id=d1.lease_id, result=b"\xc3("),
            ack_of(d2),
        ]
    )
    outcomes = await worker.outcomes(3)
    assert [o.code for o in outcomes] == [0, Code.INVALID_ARGUMENT.value[0], 0]
    assert "result" in outcomes[1].message
    assert (await wait(stub, ids[0], None)).result == b'{"n": 0}'
    assert (await get(stub, ids[1])).state == "handed_out"
    await refused(get(stub, ids[2]), Code.NOT_FOUND, ids[2])
    await worker.send(acks=[pb.AckRequest(id=d1.task.id, lease_id=d1.lease_id, result=b"1")])
    assert [o.code for o in await worker.outcomes(1)] == [0]
    await worker.finish()


# -- WaitResult -----------------------------------------------------------------------------------


async def test_a_pending_task_answers_an_empty_state(
    stub: Stub, broker: Broker, clock: FakeClock
) -> None:
    task_id = await enqueue(stub)
    answer = await wait(stub, task_id, None)  # the default wait: none
    assert (answer.id, answer.state) == (task_id, "")
    assert fields_set(answer) == {"id"}
    call = wait(stub, task_id, 5_000)
    await parked(broker)
    clock.advance(4.9)
    await asyncio.sleep(0.05)
    assert not call.done()
    clock.advance(0.2)
    assert (await call).state == ""
    big = wait(stub, task_id, 2**62)  # clamped to 30 s
    await parked(broker)
    clock.advance(29.9)
    await asyncio.sleep(0.05)
    assert not big.done()
    clock.advance(0.2)
    assert (await big).state == ""


async def test_bad_waits_are_refused(stub: Stub) -> None:
    task_id = await enqueue(stub)
    await refused(wait(stub, task_id, -1), Code.INVALID_ARGUMENT, "wait_ms")
    await refused(wait(stub, "", 10), Code.INVALID_ARGUMENT, "id")
    await refused(wait(stub, "ffffffffffffffff", 30_000), Code.NOT_FOUND, "ffffffffffffffff")


async def test_many_waiters_are_woken_by_one_ack(stub: Stub, broker: Broker) -> None:
    d = await held(stub)
    calls = [wait(stub, d.task.id) for _ in range(20)]
    await parked(broker, 20)
    await stub.Ack(pb.AckRequest(id=d.task.id, lease_id=d.lease_id, result=b"[1.50]"))
    answers = await asyncio.wait_for(asyncio.gather(*calls), 10)
    assert {(a.state, a.result) for a in answers} == {("succeeded", b"[1.50]")}
    assert broker.service.result_waiters == 0


async def test_a_waiter_hears_how_a_task_ended(
    stub: Stub, broker: Broker, clock: FakeClock
) -> None:
    acked, buried = await held(stub), await held(stub, max_attempts=1)
    cancelled = await enqueue(stub)
    expired = await enqueue(stub, delay_ms=60_000, expires_in_ms=10_000)
    calls = [wait(stub, t) for t in (acked.task.id, buried.task.id, cancelled, expired)]
    await parked(broker, 4)
    await stub.Ack(ack_of(acked))
    await stub.Nack(pb.NackRequest(id=buried.task.id, lease_id=buried.lease_id, error="boom"))
    await stub.CancelTask(pb.CancelTaskRequest(id=cancelled))
    clock.advance(11)
    answers = await asyncio.wait_for(asyncio.gather(*calls), 10)
    assert [a.state for a in answers] == ["succeeded", "dead", "cancelled", "expired"]
    assert not answers[0].HasField("result")  # acked without one
    assert answers[0].HasField("finished_at")
    assert (answers[1].last_error, answers[1].attempts) == ("boom", 1)
    assert fields_set(answers[2]) == {"id", "state"}
    again = await wait(stub, buried.task.id)  # a dead task stays: at once
    assert again.state == "dead"
    for gone in (acked.task.id, cancelled, expired):
        await refused(wait(stub, gone), Code.NOT_FOUND, gone)


async def test_a_waiter_at_a_broker_that_closes_hears_pending(clock: FakeClock) -> None:
    async with (
        running_broker(clock=clock) as b,
        grpc.aio.insecure_channel(b.grpc_target) as channel,
    ):
        stub = pb_grpc.BrokerStub(channel)
        task_id = await enqueue(stub)
        calls = [wait(stub, task_id) for _ in range(3)]
        await parked(b, 3)
        await b.stop()
        answers = await asyncio.wait_for(asyncio.gather(*calls), 10)
        assert [a.state for a in answers] == ["", "", ""]


async def test_a_waiter_that_goes_away_waits_no_more(stub: Stub, broker: Broker) -> None:
    task_id = await enqueue(stub)
    call = wait(stub, task_id)
    await parked(broker)
    call.cancel()
    await wait_until(lambda: broker.service.result_waiters == 0, what="the wait to end")
    assert (await wait(stub, task_id, 0)).state == ""


async def test_result_waits_count_toward_max_waiters(clock: FakeClock) -> None:
    async with (
        running_broker(clock=clock, max_waiters=1) as b,
        grpc.aio.insecure_channel(b.grpc_target) as channel,
    ):
        stub = pb_grpc.BrokerStub(channel)
        task_id, other = await enqueue(stub), await enqueue(stub)
        call = wait(stub, task_id)
        await parked(b)
        error = await refused(wait(stub, other, 1000), Code.RESOURCE_EXHAUSTED, "waiters")
        metadata: Any = error.trailing_metadata()
        assert dict(metadata)["retry-after-ms"] == "1000"
        assert (await wait(stub, other, 0)).state == ""
        claim_call = stub.NextJob(pb.NextJobRequest(wait_ms=1000, queues=["other"]))
        await refused(claim_call, Code.RESOURCE_EXHAUSTED, "waiting")
        clock.advance(31)
        assert (await call).state == ""


# -- Enqueue's after and result_ttl_ms ------------------------------------------------------------


async def test_result_ttl_ms_is_taken_and_shown_only_when_given(stub: Stub) -> None:
    plain = await enqueue(stub)
    assert not (await get(stub, plain)).task.HasField("result_ttl_ms")
    for ttl in (0, 5_000, MAX_RESULT_TTL_MS):
        task_id = await enqueue(stub, result_ttl_ms=ttl)
        task = (await get(stub, task_id)).task
        assert (task.HasField("result_ttl_ms"), task.result_ttl_ms) == (True, ttl)
    for bad in (-1, MAX_RESULT_TTL_MS + 1):
        await refused(enqueue(stub, result_ttl_ms=bad), Code.INVALID_ARGUMENT, "result_ttl_ms")
        batch = pb.EnqueueBatchRequest(
            tasks=[
                pb.EnqueueRequest(payload=b"1"),
                pb.EnqueueRequest(payload=b"1", result_ttl_ms=bad),
            ]
        )
        await refused(stub.EnqueueBatch(batch), Code.INVALID_ARGUMENT, "tasks[1].result_ttl_ms")


async def test_a_result_ttl_of_zero_keeps_nothing_and_a_short_one_is_pruned(
    stub: Stub, clock: FakeClock
) -> None:
    none_kept = await succeeded(stub, b"1", result_ttl_ms=0)
    await refused(get(stub, none_kept), Code.NOT_FOUND, none_kept)
    short = await succeeded(stub, b"2", result_ttl_ms=1_000)
    assert (await wait(stub, short, 0)).result == b"2"
    clock.advance(1.5)

    async def gone() -> bool:
        try:
            await wait(stub, short, 0)
        except grpc.aio.AioRpcError as e:
            return e.code() == Code.NOT_FOUND
        return False

    await wait_until(gone, what="the result to be pruned")
    assert (await stub.Stats(pb.StatsRequest())).succeeded == 0


@pytest.mark.parametrize(
    ("refs", "field"),
    [
        ([pb.TaskRef()], "after[0]"),  # neither an id nor an index
        ([pb.TaskRef(id="")], "after[0]"),
        ([pb.TaskRef(id="ffffffffffffffff")], "after[0]"),  # unknown
        (after("a", "b", "a"), "after[2]"),  # twice
        (after(*["a"] * (MAX_PARENTS + 1)), f"after names at most {MAX_PARENTS}"),
    ],
)
async def test_a_bad_after_is_invalid_naming_it(
    stub: Stub, refs: list[pb.TaskRef], field: str
) -> None:
    await refused(enqueue(stub, after=refs), Code.INVALID_ARGUMENT, field)
    batch = pb.EnqueueBatchRequest(
        tasks=[pb.EnqueueRequest(payload=b"0"), pb.EnqueueRequest(payload=b"1", after=refs)]
    )
    await refused(stub.EnqueueBatch(batch), Code.INVALID_ARGUMENT, f"tasks[1].{field}")
    assert (await stub.Stats(pb.StatsRequest())).totals.enqueued == 0


async def test_an_index_names_an_item_of_a_batch_only(stub: Stub) -> None:
    error = await refused(enqueue(stub, after=after(0)), Code.INVALID_ARGUMENT, "after[0]")
    assert "earlier item of a batch" in (error.details() or "")


@pytest.mark.parametrize(
    ("index", "refs", "field"),
    [
        (0, after(0), "tasks[0].after[0]"),
        (1, after(1), "tasks[1].after[0]"),
        (1, after(2), "tasks[1].after[0]"),
        (2, after(0, 7), "tasks[2].after[1]"),
        (2, after(1, 1), "tasks[2].after[1]"),
        (2, after(0, "ffffffffffffffff"), "tasks[2].after[1]"),
    ],
)
async def test_a_batch_item_names_only_earlier_items(
    stub: Stub, index: int, refs: list[pb.TaskRef], field: str
) -> None:
    tasks = [pb.EnqueueRequest(payload=b"%d" % i) for i in range(3)]
    tasks[index].after.extend(refs)
    await refused(
        stub.EnqueueBatch(pb.EnqueueBatchRequest(tasks=tasks)), Code.INVALID_ARGUMENT, field
    )
    assert (await stub.Stats(pb.StatsRequest())).totals.enqueued == 0


async def test_a_chain_in_one_batch_carries_its_parents_results(stub: Stub) -> None:
    batch = pb.EnqueueBatchRequest(
        tasks=[
            pb.EnqueueRequest(payload=b'"a"'),
            pb.EnqueueRequest(payload=b'"b"', after=after(0)),
            pb.EnqueueRequest(payload=b'"c"', after=after(1), result_ttl_ms=0),
        ]
    )
    a, b, c = (await stub.EnqueueBatch(batch)).ids
    found = await get(stub, b)
    assert (found.state, list(found.task.after), found.task.waiting_for) == ("waiting", [a], 1)
    assert (list(found.children), found.children_count) == ([c], 1)
    stats = await stub.Stats(pb.StatsRequest())
    assert (stats.ready, stats.waiting) == (1, 2)
    first = await claim(stub)
    assert (first.task.id, len(first.parents)) == (a, 0)
    await stub.Ack(pb.AckRequest(id=a, lease_id=first.lease_id, result=b' {"n": 1.10} '))
    second = await claim(stub)
    assert second.task.id == b
    assert [(p.id, p.HasField("result"), p.result) for p in second.parents] == [
        (a, True, b' {"n": 1.10} ')
    ]
    assert (list(second.task.after), second.task.waiting_for) == ([a], 0)
    await stub.Ack(ack_of(second))
    third = await claim(stub)
    assert third.task.id == c
    assert [(p.id, p.HasField("result")) for p in third.parents] == [(b, False)]
    queues = (await stub.ListQueues(pb.ListQueuesRequest())).queues
    assert [(q.name, q.waiting, q.succeeded) for q in queues] == [("default", 0, 1)]


async def test_produce_takes_after_and_result_ttl_ms(stub: Stub) -> None:
    parent = await enqueue(stub)
    call: Any = stub.Produce(None)
    await call.write(
        pb.EnqueueBatchRequest(
            tasks=[
                pb.EnqueueRequest(payload=b"1", after=after(parent), result_ttl_ms=7),
                pb.EnqueueRequest(payload=b"2", after=after(0, parent)),
            ]
        )
    )
    done = await asyncio.wait_for(call.read(), 5)
    assert done.code == 0
    await call.write(
        pb.EnqueueBatchRequest(tasks=[pb.EnqueueRequest(payload=b"3", after=after(1))])
    )
    refused_batch = await asyncio.wait_for(call.read(), 5)
    assert refused_batch.code == Code.INVALID_ARGUMENT.value[0]
    assert "tasks[0].after[0]" in refused_batch.message
    await call.done_writing()
    assert await asyncio.wait_for(call.read(), 5) is EOF
    first, second = (await get(stub, done.ids[0])).task, (await get(stub, done.ids[1])).task
    assert (list(first.after), first.result_ttl_ms, first.waiting_for) == ([parent], 7, 1)
    assert (list(second.after), second.waiting_for) == ([done.ids[0], parent], 2)
    found = await get(stub, parent)
    assert (list(found.children), found.children_count) == (list(done.ids), 2)


async def test_a_failed_parent_buries_its_children(stub: Stub) -> None:
    d = await held(stub, max_attempts=1)
    child = await enqueue(stub, after=after(d.task.id))
    await stub.Nack(pb.NackRequest(id=d.task.id, lease_id=d.lease_id, error="boom"))
    found = await get(stub, child)
    assert (found.state, found.task.last_error) == ("dead", f"parent {d.task.id} is dead: boom")
    stats = await stub.Stats(pb.StatsRequest())
    assert (stats.dead, stats.waiting) == (2, 0)


async def test_a_client_that_sends_none_of_it_sees_nothing_new(stub: Stub) -> None:
    task_id = await enqueue(stub)
    found = await get(stub, task_id)
    assert fields_set(found.task) == PLAIN_FIELDS
    assert fields_set(found) == {"task", "state"}  # no children
    d = await claim(stub)
    assert fields_set(d) == {"task", "lease_id", "deadline"}  # no parents
    await stub.Ack(ack_of(d))
    await refused(get(stub, task_id), Code.NOT_FOUND, task_id)
    stats = await stub.Stats(pb.StatsRequest())
    assert (stats.waiting, stats.succeeded) == (0, 0)


# -- across the protocols, on every store ---------------------------------------------------------


@pytest.fixture(params=["memory", "sqlite", "postgres"])
async def store(
    request: pytest.FixtureRequest, rng: random.Random, tmp_path: Path
) -> AsyncIterator[Store]:
    s = await make_store(str(request.param), Backoff(1.0, 30.0, rng), rng, tmp_path)
    yield s
    await s.close()


class Both:
    """One broker (the real clock) reached over both protocols."""

    def __init__(self, broker: Broker, stub: Stub, http: Http) -> None:
        self.broker = broker
        self.stub = stub
        self.http = http

    async def raw(self, method: str, path: str, data: bytes | None = None) -> tuple[int, bytes]:
        async with self.http.session.request(method, self.http.base + path, data=data) as resp:
            return resp.status, await resp.read()

    async def http_claim(self) -> dict[str, Any]:
        status, body = await self.http.request("GET", "/jobs/next?wait_ms=0")
        assert status == 200, body
        assert isinstance(body, dict)
        return body

    async def http_ack(self, task_id: str, lease_id: str, body: bytes | None = None) -> None:
        status, answer = await self.raw("POST", f"/jobs/{task_id}/ack?lease_id={lease_id}", body)
        assert status == 204, answer


@pytest.fixture
async def both(store: Store) -> AsyncIterator[Both]:
    async with (
        running_broker(store=store) as broker,
        grpc.aio.insecure_channel(broker.grpc_target) as channel,
        http_client(broker.http_url) as http,
    ):
        yield Both(broker, pb_grpc.BrokerStub(channel), http)


async def test_a_result_survives_byte_for_byte_across_protocols(both: Both) -> None:
    for result in RESULTS:
        # Acked over gRPC, read over HTTP (the result wait, the view, and a child's delivery).
        d = await held(both.stub)
        child = await enqueue(both.stub, b"0", after=after(d.task.id))
        await both.stub.Ack(pb.AckRequest(id=d.task.id, lease_id=d.lease_id, result=result))
        text = result.strip(b" ")
        status, answer = await both.raw("GET", f"/jobs/{d.task.id}/result")
        assert status == 200
        assert b'"result":' + result + b',"finished_at"' in answer
        status, view = await both.raw("GET", f"/jobs/{d.task.id}")
        assert b'"result":' + result + b',"finished_at"' in view
        status, delivered = await both.raw("GET", "/jobs/next?wait_ms=0")
        assert status == 200
        assert delivered.endswith(
            f'"parents":[{{"id":"{d.task.id}","result":'.encode() + result + b"}]}"
        )
        await both.http_ack(child, json.loads(delivered)["lease_id"])
        # Acked over HTTP, read over gRPC (the result wait, GetTask, a child's delivery).
        task_id = await both.http.enqueue(1)
        child = await both.http.enqueue(2, after=[task_id])
        lease = (await both.http_claim())["lease_id"]
        await both.http_ack(task_id, lease, b'{"result":' + result + b"}")
        assert (await wait(both.stub, task_id, 0)).result == text
        assert (await get(both.stub, task_id)).task.result == text
        delivery = await claim(both.stub)
        assert [(p.id, p.result) for p in delivery.parents] == [(task_id, text)]
        await both.stub.Ack(ack_of(delivery))


async def test_nothing_new_for_a_client_that_sends_none_of_it_on_every_store(both: Both) -> None:
    task_id = await both.http.enqueue({"n": 1})
    status, view = await both.http.request("GET", f"/jobs/{task_id}")
    assert status == 200
    assert set(view) == {
        "id",
        "payload",
        "attempts",
        "max_attempts",
        "created_at",
        "available_at",
        "last_error",
        "queue",
        "priority",
        "state",
    }
    found = await get(both.stub, task_id)
    assert (fields_set(found), fields_set(found.task)) == ({"task", "state"}, PLAIN_FIELDS)
    status, delivery = await both.raw("GET", "/jobs/next?wait_ms=0")
    assert set(json.loads(delivery)) == {"task", "lease_id", "deadline"}
    await both.http_ack(task_id, json.loads(delivery)["lease_id"])
    await refused(get(both.stub, task_id), Code.NOT_FOUND, task_id)
    d = await held(both.stub)
    assert fields_set(d) == {"task", "lease_id", "deadline"}
    assert fields_set(d.task) == PLAIN_FIELDS | {"attempts"}


async def test_batched_settles_keep_results_on_every_store(both: Both) -> None:
    """POST /jobs/settle's acks and NextJob's acks with results (one transaction each)."""
    ids = [await both.http.enqueue(i) for i in range(4)]
    status, claimed = await both.http.request("GET", "/jobs/next/batch?wait_ms=0&max=2")
    assert status == 200, claimed
    first, second = claimed["deliveries"]
    body = (
        b'{"acks": ['
        + f'{{"id": "{first["task"]["id"]}", "lease_id": "{first["lease_id"]}", '.encode()
        + b'"result": {"b": 1.10}},'
        + f'{{"id": "{second["task"]["id"]}", "lease_id": "{second["lease_id"]}"}}]}}'.encode()
    )
    status, answer = await both.raw("POST", "/jobs/settle", body)
    assert (status, json.loads(answer)) == (200, {"acks": [None, None], "nacks": []})
    third, fourth = await claim(both.stub), await claim(both.stub)
    acks = [
        pb.AckRequest(id=third.task.id, lease_id=third.lease_id, result=b"[3]"),
        ack_of(fourth),
    ]
    assert [
        s.code for s in (await both.stub.NextJob(pb.NextJobRequest(wait_ms=0, acks=acks))).settled
    ] == [
        0,
        0,
    ]
    assert (await wait(both.stub, ids[0], 0)).result == b'{"b": 1.10}'
    assert (await wait(both.stub, ids[2], 0)).result == b"[3]"
    for gone in (ids[1], ids[3]):
        await refused(wait(both.stub, gone, 0), Code.NOT_FOUND, gone)
    stats = await both.stub.Stats(pb.StatsRequest())
    assert (stats.succeeded, stats.totals.acked) == (2, 4)


async def test_a_chain_and_a_fan_in_are_released_over_both_protocols(both: Both) -> None:
    # A chain enqueued over HTTP, run alternately by a gRPC stream and HTTP claims.
    status, body = await both.http.request(
        "POST",
        "/jobs/batch",
        json={"tasks": [{"payload": 0}, *({"payload": n, "after": [n - 1]} for n in range(1, 4))]},
    )
    assert status == 201, body
    chain = body["ids"]
    # The first acked on NextJob, whose claim in the same call takes the child it released.
    first = await claim(both.stub)
    assert first.task.id == chain[0]
    ack = pb.AckRequest(id=first.task.id, lease_id=first.lease_id, result=b"0")
    answer = await both.stub.NextJob(pb.NextJobRequest(wait_ms=5000, acks=[ack]))
    assert [s.code for s in answer.settled] == [0]
    second = answer.delivery
    assert second.task.id == chain[1]
    assert [(p.id, p.result) for p in second.parents] == [(chain[0], b"0")]
    # The second acked over HTTP; the third and fourth go to a stream as each is released.
    await both.http_ack(chain[1], second.lease_id, b'{"result": 1}')
    worker = await Worker(both.stub).open(prefetch=1)
    (third,) = await worker.receive(1)
    assert third.task.id == chain[2]
    assert [(p.id, p.result) for p in third.parents] == [(chain[1], b"1")]
    await worker.send(acks=[pb.AckRequest(id=chain[2], lease_id=third.lease_id, result=b"2")])
    (fourth,) = await worker.receive(1)
    assert fourth.task.id == chain[3]
    assert [(p.id, p.result) for p in fourth.parents] == [(chain[2], b"2")]
    await worker.send(acks=[ack_of(fourth)], drain=True)
    await worker.until(lambda w: w.ended)
    status, done = await both.http.request("GET", f"/jobs/{chain[2]}/result")
    assert (status, done["result"]) == (200, 2)
    # A fan-in: parents enqueued over gRPC, the child over HTTP, the parents acked over both.
    parents = [await enqueue(both.stub, b"%d" % i) for i in range(6)]
    child = await both.http.enqueue("child", after=parents)
    for n in range(6):
        if n % 2:
            d = await claim(both.stub)
            await both.stub.Ack(pb.AckRequest(id=d.task.id, lease_id=d.lease_id, result=b"%d" % n))
        else:
            got = await both.http_claim()
            await both.http_ack(got["task"]["id"], got["lease_id"], f'{{"result": {n}}}'.encode())
        found = await get(both.stub, child)
        assert found.state == ("waiting" if n < 5 else "ready")
    delivery = await claim(both.stub)
    assert delivery.task.id == child
    assert [(p.id, p.result) for p in delivery.parents] == [
        (p, b"%d" % n) for n, p in enumerate(parents)
    ]
    stats = await both.stub.Stats(pb.StatsRequest())
    assert (stats.waiting, stats.handed_out, stats.succeeded) == (0, 1, 9)


async def test_a_waiter_is_woken_by_an_ack_of_the_other_protocol(both: Both) -> None:
    # Waiting over HTTP, acked over gRPC.
    d = await held(both.stub)
    http_wait = asyncio.ensure_future(
        both.http.request("GET", f"/jobs/{d.task.id}/result?wait_ms=30000")
    )
    await parked(both.broker)
    await both.stub.Ack(pb.AckRequest(id=d.task.id, lease_id=d.lease_id, result=b'{"x": 1}'))
    status, body = await asyncio.wait_for(http_wait, 10)
    assert (status, body["state"], body["result"]) == (200, "succeeded", {"x": 1})
    # Waiting over gRPC, acked over HTTP.
    task_id = await both.http.enqueue(1)
    grpc_wait = wait(both.stub, task_id)
    await parked(both.broker)
    lease = (await both.http_claim())["lease_id"]
    await both.http_ack(task_id, lease, b'{"result": [2]}')
    answer = await asyncio.wait_for(grpc_wait, 10)
    assert (answer.state, answer.result) == ("succeeded", b"[2]")


# -- two brokers, one PostgreSQL database ---------------------------------------------------------


@pytest.mark.pg
async def test_a_waiter_on_one_broker_is_woken_by_an_ack_on_another(
    rng: random.Random, tmp_path: Path
) -> None:
    backoff = Backoff(1.0, 30.0, rng)
    first = await make_store("postgres", backoff, rng, tmp_path)  # (the database emptied)
    second = await PostgresStore.open(await pg.database(), backoff, rng, pool_size=4)
    try:
        async with (
            running_broker(store=first) as a,
            running_broker(store=second) as b,
            grpc.aio.insecure_channel(a.grpc_target) as channel,
            http_client(b.http_url) as http_b,
        ):
            stub_a = pb_grpc.BrokerStub(channel)
            d = await held(stub_a)
            child = await enqueue(stub_a, b'"child"', after=after(d.task.id))
            waits = [
                asyncio.ensure_future(http_b.request("GET", f"/jobs/{t}/result?wait_ms=30000"))
                for t in (d.task.id, d.task.id, child)
            ]
            await parked(b, 3)
            await stub_a.Ack(pb.AckRequest(id=d.task.id, lease_id=d.lease_id, result=b"[1.10]"))
            for status, body in await asyncio.wait_for(asyncio.gather(*waits[:2]), 20):
                assert (status, body["state"], body["result"]) == (200, "succeeded", [1.1])
            # The child, released by A's ack, is claimed on B with its parent's result.
            status, delivery = await http_b.request("GET", "/jobs/next?wait_ms=5000")
            assert status == 200, delivery
            assert delivery["parents"] == [{"id": d.task.id, "result": [1.1]}]
            lease = delivery["lease_id"]
            status, _ = await http_b.request(
                "POST", f"/jobs/{child}/ack?lease_id={lease}", data=b'{"result": "done"}'
            )
            assert status == 204
            status, body = await asyncio.wait_for(waits[2], 20)
            assert (status, body["result"]) == (200, "done")
    finally:
        await first.close()
        await second.close()
