"""wqclient's HTTP transport against a real broker (HTTP on port 0): every Transport method (queues,
keys, lookup and the rest too), what it sends and what it makes of the answers, and the errors it
maps.

(The models and the seam are wqclient's; the AsyncClient over either transport is tested in
client/test_client.py.)
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from datetime import datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import examples, json_values, running_broker, settle
from wqbroker.broker import Broker
from wqbroker.clock import FakeClock
from wqclient import _http
from wqclient._http import HttpTransport
from wqclient.errors import InvalidArgument, LeaseLost, NotFound, ProtocolError
from wqclient.models import Delivery, EnqueueItem
from wqclient.transport import Transport
from wqwire.scan import skip

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def broker(clock: FakeClock) -> AsyncIterator[Broker]:
    async with running_broker(clock=clock, grpc_addr="off") as b:
        yield b


@pytest.fixture
async def wq(broker: Broker) -> AsyncIterator[HttpTransport]:
    transport = HttpTransport(broker.http_url)
    yield transport
    await transport.close()


async def held(wq: HttpTransport, queues: list[str] | None = None) -> Delivery:
    delivery = await wq.claim(0, None, queues)
    assert delivery is not None
    return delivery


async def dead(wq: HttpTransport, queue: str | None = None) -> str:
    task_id = await wq.enqueue(b"1", 1, None, queue=queue)
    delivery = await held(wq, [queue] if queue else None)
    await wq.nack(delivery.id, delivery.lease_id, "bad")
    return str(task_id)


def test_the_http_transport_is_a_transport(broker: Broker) -> None:
    transport: Transport = HttpTransport(broker.http_url)  # checked by mypy
    assert transport is not None


async def test_enqueue_sends_queue_priority_and_key(wq: HttpTransport) -> None:
    first = await wq.enqueue(b'{"n":1}', 2, None, queue="mail", priority=7, idempotency_key="k1")
    assert isinstance(first, str)
    assert first.duplicate is False
    again = await wq.enqueue(b'{"n":2}', None, None, queue="mail", idempotency_key="k1")
    assert (again, again.duplicate) == (first, True)
    delivery = await held(wq, ["mail"])
    task = delivery.task
    assert (task.id, task.queue, task.priority, task.max_attempts) == (first, "mail", 7, 2)
    assert task.payload == {"n": 1}
    assert task.state is None  # set only by a lookup


async def test_enqueue_defaults_reproduce_the_spec(wq: HttpTransport) -> None:
    task_id = await wq.enqueue(b"1", None, None)
    assert task_id.duplicate is False
    task = (await held(wq)).task
    assert (task.id, task.queue, task.priority, task.max_attempts) == (task_id, "default", 0, 3)


async def test_enqueue_many_reports_duplicates_per_item(wq: HttpTransport) -> None:
    existing = await wq.enqueue(b"0", None, None, idempotency_key="seen")
    got = await wq.enqueue_many(
        [
            EnqueueItem(b"1", queue="a", priority=3),
            EnqueueItem(b"2", idempotency_key="seen"),
            EnqueueItem(b"3", idempotency_key="new"),
            EnqueueItem(b"4", idempotency_key="new"),
        ]
    )
    assert [e.duplicate for e in got] == [False, True, False, True]
    assert got[1] == existing
    assert got[3] == got[2]
    assert len({got[0], got[1], got[2]}) == 3
    stats = await wq.stats()
    assert stats.totals.enqueued == 3


async def test_claim_takes_from_the_queues_in_order(wq: HttpTransport) -> None:
    b = await wq.enqueue(b"1", None, None, queue="b")
    a = await wq.enqueue(b"2", None, None, queue="a")
    assert await wq.claim(0, None) is None  # default only
    assert (await held(wq, ["a", "b"])).id == a
    assert (await held(wq, ["a", "b"])).id == b


async def test_nack_options(wq: HttpTransport, clock: FakeClock) -> None:
    await wq.enqueue(b"1", 5, None)
    first = await held(wq)
    await wq.nack(first.id, first.lease_id, None, delay_ms=2000)
    assert (await wq.get_task(first.id)).state == "delayed"
    clock.advance(2.01)
    await settle()
    second = await held(wq)
    assert (second.id, second.task.attempts) == (first.id, 2)
    await wq.nack(second.id, second.lease_id, "poison", terminal=True)
    [buried] = await wq.dead_letters(None)
    assert (buried.id, buried.attempts, buried.last_error) == (first.id, 2, "poison")
    stats = await wq.stats()
    assert (stats.totals.retried, stats.totals.buried) == (1, 1)


async def test_a_bad_nack_option_is_invalid_argument(wq: HttpTransport) -> None:
    await wq.enqueue(b"1", None, None)
    delivery = await held(wq)
    with pytest.raises(InvalidArgument, match="delay_ms"):
        await wq.nack(delivery.id, delivery.lease_id, None, delay_ms=-1)
    with pytest.raises(InvalidArgument):
        await wq.nack(delivery.id, delivery.lease_id, None, delay_ms=5, terminal=True)
    await wq.ack(delivery.id, delivery.lease_id)


async def test_extend_returns_the_new_deadline(wq: HttpTransport, clock: FakeClock) -> None:
    await wq.enqueue(b"1", None, None)
    delivery = await held(wq)
    deadline = await wq.extend(delivery.id, delivery.lease_id, 120_000)
    assert isinstance(deadline, datetime)
    assert deadline.utcoffset() is not None
    assert deadline.timestamp() == pytest.approx(clock.now() + 120, abs=1e-5)
    default = await wq.extend(delivery.id, delivery.lease_id, None)
    assert default.timestamp() == pytest.approx(clock.now() + 30, abs=1e-5)
    with pytest.raises(LeaseLost):
        await wq.extend(delivery.id, "not-the-lease", None)
    with pytest.raises(NotFound):
        await wq.extend("nosuchtask", delivery.lease_id, None)
    with pytest.raises(InvalidArgument, match="lease_ms"):
        await wq.extend(delivery.id, delivery.lease_id, 0)


async def test_get_task_has_the_state(wq: HttpTransport) -> None:
    task_id = await wq.enqueue(b'{"a":1}', None, None, queue="q", priority=2)
    task = await wq.get_task(task_id)
    assert (task.id, task.state, task.queue, task.priority) == (task_id, "ready", "q", 2)
    assert task.payload_json == b'{"a":1}'
    delivery = await held(wq, ["q"])
    assert (await wq.get_task(task_id)).state == "handed_out"
    await wq.ack(delivery.id, delivery.lease_id)
    with pytest.raises(NotFound):
        await wq.get_task(task_id)


async def test_get_task_next_never_claims(wq: HttpTransport) -> None:
    await wq.enqueue(b"1", None, None)
    with pytest.raises(NotFound):
        await wq.get_task("next")
    stats = await wq.stats()
    assert (stats.ready, stats.handed_out) == (1, 0)


async def test_stats_queues_and_the_dlq_by_queue(wq: HttpTransport) -> None:
    a = await dead(wq, "a")
    b = await dead(wq, "b")
    await wq.enqueue(b"1", None, None, queue="b")
    assert (await wq.stats("a")).dead == 1
    stats_b = await wq.stats("b")
    assert (stats_b.ready, stats_b.dead, stats_b.totals.enqueued) == (1, 1, 2)
    assert (await wq.stats()).dead == 2
    infos = {q.name: q for q in await wq.queues()}
    assert (infos["a"].dead, infos["b"].ready, infos["b"].dead) == (1, 1, 1)
    assert not infos["b"].paused
    assert [t.id for t in await wq.dead_letters(None, "b")] == [b]
    assert [t.id for t in await wq.dead_letters(1)] == [a]
    assert [t.queue for t in await wq.dead_letters(None)] == ["a", "b"]


async def test_requeue_all_and_purge(wq: HttpTransport) -> None:
    a = await dead(wq, "a")
    await dead(wq, "b")
    await dead(wq, "b")
    assert await wq.requeue_all("b") == 2
    assert await wq.requeue_all("b") == 0
    await wq.purge(a)
    with pytest.raises(NotFound):
        await wq.purge(a)
    assert await wq.requeue_all() == 0
    stats = await wq.stats()
    t = stats.totals
    assert (stats.ready, stats.dead, t.purged, t.requeued) == (2, 0, 1, 2)
    gauges = stats.ready + stats.handed_out + stats.delayed + stats.dead
    assert gauges == t.enqueued - t.acked - t.purged


async def test_pause_and_resume(wq: HttpTransport) -> None:
    await wq.pause("jobs")
    await wq.enqueue(b"1", None, None, queue="jobs")
    assert await wq.claim(0, None, ["jobs"]) is None
    assert {q.name: q.paused for q in await wq.queues()}["jobs"] is True
    await wq.resume("jobs")
    assert await wq.claim(0, None, ["jobs"]) is not None


@pytest.mark.parametrize("name", ["a/b", "a b", "", "x" * 65, "é"])
async def test_a_bad_queue_name_is_invalid_argument_not_a_wrong_path(
    wq: HttpTransport, name: str
) -> None:
    with pytest.raises(InvalidArgument):
        await wq.enqueue(b"1", None, None, queue=name)
    with pytest.raises(InvalidArgument):
        await wq.stats(name)
    with pytest.raises(InvalidArgument):
        await wq.dead_letters(None, name)
    with pytest.raises(InvalidArgument):
        await wq.requeue_all(name)
    if name:  # an empty one cannot be a path segment
        with pytest.raises(InvalidArgument):
            await wq.pause(name)


async def test_a_bad_priority_or_key_is_invalid_argument(wq: HttpTransport) -> None:
    with pytest.raises(InvalidArgument, match="priority"):
        await wq.enqueue(b"1", None, None, priority=10)
    with pytest.raises(InvalidArgument):
        await wq.enqueue(b"1", None, None, idempotency_key="k" * 257)
    assert (await wq.stats()).totals.enqueued == 0


# -- reading answers: the quick way and the general one agree ------------------------------------

_json_values = json_values


def _general(data: bytes) -> object:
    """The member-by-member parser alone (what every answer went through before the quick way)."""
    text = data.decode()
    value, _ = _http._value(text, skip(text, 0))
    return value


@settings(max_examples=examples(300), deadline=None)
@given(
    payload=_json_values,
    payload_text=st.sampled_from(["", " 1.10", '"\\u00e9"', "1e400", ' { "a" : [ 1 , 2 ] } ']),
    task_id=st.text(max_size=8),
    wrapped=st.booleans(),
    extra=st.dictionaries(
        st.sampled_from(["attempts", "payload", "x", "task", "id"]), _json_values
    ),
    outer=st.dictionaries(st.sampled_from(["lease_id", "payload", "task"]), _json_values),
)
def test_answers_read_quickly_are_read_as_the_general_parser_reads_them(
    payload: object,
    payload_text: str,
    task_id: str,
    wrapped: bool,
    extra: dict[str, object],
    outer: dict[str, object],
) -> None:
    # Deliveries and tasks as the broker writes them, and others besides: odd ids, payloads
    # whose text json.dumps would not give back, "payload" (or "task") given twice, nested.
    raw = payload_text or json.dumps(payload)
    task = '{"id":' + json.dumps(task_id) + ',"payload":' + raw
    task += "".join(f",{json.dumps(k)}:{json.dumps(v)}" for k, v in extra.items()) + "}"
    members = "".join(f",{json.dumps(k)}:{json.dumps(v)}" for k, v in outer.items())
    text = ('{"task":' + task + members + "}" if wrapped else task).encode()
    got = _http._loads(text)
    assert got == _general(text)
    inner = got["task"] if wrapped else got
    if not {"payload", "task"} & {*extra, *(outer if wrapped else ())}:
        assert inner["payload"] == raw.strip().encode()  # the payload's own text, as sent


def test_answers_that_are_not_json_are_protocol_errors_either_way() -> None:
    for bad in (
        b'{"task":{"id":"a","payload":{"x":}}}',
        b'{"task":{"id":"a","payload":1}',
        b'{"id":"a","payload":1} x',
        b'{"id":"a","payload":',
    ):
        with pytest.raises(ProtocolError):
            _http._loads(bad)


@settings(max_examples=examples(300), deadline=None)
@given(
    payloads=st.lists(
        st.sampled_from(['{"n":1}', " 1.10", '"\\u00e9"', "1e400", ' { "a" : [ 1 , 2 ] } ']),
        max_size=4,
    ),
    extra=st.dictionaries(st.sampled_from(["attempts", "payload", "x", "task"]), _json_values),
    tail=st.sampled_from(["]}", "]} ", '],"x":1}', "]", ",]}"]),
)
def test_batch_claims_read_quickly_are_read_as_the_general_parser_reads_them(
    payloads: list[str], extra: dict[str, object], tail: str
) -> None:
    # GET /jobs/next/batch's answer as the broker writes it, and others besides.
    members = "".join(f",{json.dumps(k)}:{json.dumps(v)}" for k, v in extra.items())
    deliveries = [
        f'{{"task":{{"id":"a{i}","payload":{p}{members}}},"lease_id":"l","deadline":"t"}}'
        for i, p in enumerate(payloads)
    ]
    text = ('{"deliveries":[' + ",".join(deliveries) + tail).encode()
    try:
        expected = _general(text)
        skip(text.decode(), 0)
    except (ValueError, StopIteration):
        expected = None
    if expected is None or _general_leaves_extra(text):
        with pytest.raises(ProtocolError):
            _http._loads(text)
        return
    got = _http._loads(text)
    assert got == expected
    if not {"payload", "task"} & set(extra) and tail == "]}":
        assert [d["task"]["payload"] for d in got["deliveries"]] == [
            p.strip().encode() for p in payloads
        ]


def _general_leaves_extra(data: bytes) -> bool:
    text = data.decode()
    _, end = _http._value(text, skip(text, 0))
    return skip(text, end) != len(text)
