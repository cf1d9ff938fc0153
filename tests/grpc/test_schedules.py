"""Schedules and per-queue limits over gRPC (docs/design/schedules.md), against a real broker on
port 0: PutSchedule, GetSchedule, ListSchedules, DeleteSchedule, PauseSchedule, ResumeSchedule,
SetQueueLimits; ``Task.schedule`` and ``Task.scheduled_for`` on a fired task (GetTask, NextJob, a
stream, ListTasks, ListDead) and on no other; ``QueueInfo.limits`` and ``QueueInfo.tokens``;
INVALID_ARGUMENT naming the member, NOT_FOUND; the same schedule seen over both protocols; the
token rules. A FakeClock drives the fires.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from tests.authkit import ALL_BUT, ONLY, ROOT, metadata, write_token_file
from tests.helpers import Http, http_client, running_broker, wait_until
from wqbroker.broker import Broker
from wqbroker.clock import FakeClock
from wqwire.pb import broker_pb2 as pb
from wqwire.pb import broker_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(60)

Code = grpc.StatusCode


@pytest.fixture
async def http(broker: Broker) -> AsyncIterator[Http]:
    async with http_client(broker.http_url) as h:
        yield h


async def rpc_error(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


def seconds(t: Timestamp) -> float:
    return t.seconds + t.nanos / 1e9


async def get(stub: pb_grpc.BrokerAsyncStub, name: str) -> pb.Schedule:
    return (await stub.GetSchedule(pb.GetScheduleRequest(name=name))).schedule


async def fire(
    broker: Broker, stub: pb_grpc.BrokerAsyncStub, clock: FakeClock, name: str, by: float
) -> pb.Schedule:
    """Move the clock on by ``by`` seconds and sweep: the schedule fires; its message after."""
    before = (await get(stub, name)).fires
    clock.advance(by)
    await broker.service.sweep()
    return await wait_until(
        lambda: get(stub, name), lambda s: s.fires > before, what=f"{name} to fire"
    )


# -- schedules ------------------------------------------------------------------------------------


async def test_a_cron_schedule_is_put_and_read_back(
    stub: pb_grpc.BrokerAsyncStub, clock: FakeClock
) -> None:
    now = clock.now()
    put = await stub.PutSchedule(
        pb.PutScheduleRequest(
            name="reports",
            cron="*/5 * * * *",
            timezone="Europe/Paris",
            payload=b'{"n": 1}',
            queue="mail",
            priority=3,
            max_attempts=2,
            timeout_ms=5000,
        )
    )
    s = put.schedule
    assert (s.name, s.cron, s.timezone, s.HasField("every_ms")) == (
        "reports",
        "*/5 * * * *",
        "Europe/Paris",
        False,
    )
    assert (s.payload, s.queue, s.priority, s.max_attempts) == (b'{"n": 1}', "mail", 3, 2)
    assert s.timeout_ms == 5000
    assert not s.HasField("expires_in_ms")
    assert not s.HasField("result_ttl_ms")
    assert (s.paused, s.fires, s.last_task_id) == (False, 0, "")
    assert seconds(s.created_at) == seconds(s.updated_at) == now
    assert seconds(s.next_fire_at) == now + 300
    assert not s.HasField("last_fire_at")
    assert await get(stub, "reports") == s


async def test_an_interval_schedule_has_no_cron_and_an_empty_timezone(
    stub: pb_grpc.BrokerAsyncStub, clock: FakeClock
) -> None:
    s = (
        await stub.PutSchedule(pb.PutScheduleRequest(name="tick", every_ms=2000, payload=b"null"))
    ).schedule
    assert (s.HasField("cron"), s.timezone, s.every_ms) == (False, "", 2000)
    assert (s.payload, s.queue, s.priority, s.max_attempts) == (b"null", "default", 0, 3)
    assert seconds(s.next_fire_at) == clock.now() + 2


async def test_list_delete_and_not_found(stub: pb_grpc.BrokerAsyncStub) -> None:
    assert list((await stub.ListSchedules(pb.ListSchedulesRequest())).schedules) == []
    for name in ("b", "a", "c"):
        await stub.PutSchedule(pb.PutScheduleRequest(name=name, every_ms=1000, payload=b"1"))
    listed = (await stub.ListSchedules(pb.ListSchedulesRequest())).schedules
    assert [s.name for s in listed] == ["a", "b", "c"]
    assert await stub.DeleteSchedule(pb.DeleteScheduleRequest(name="b")) == (
        pb.DeleteScheduleResponse()
    )
    for call in (
        stub.GetSchedule(pb.GetScheduleRequest(name="b")),
        stub.DeleteSchedule(pb.DeleteScheduleRequest(name="b")),
        stub.PauseSchedule(pb.PauseScheduleRequest(name="b")),
        stub.ResumeSchedule(pb.ResumeScheduleRequest(name="b")),
    ):
        error = await rpc_error(call)
        assert error.code() == Code.NOT_FOUND, error.details()
        assert "b" in (error.details() or "")
    listed = (await stub.ListSchedules(pb.ListSchedulesRequest())).schedules
    assert [s.name for s in listed] == ["a", "c"]


async def test_pause_and_resume(
    broker: Broker, stub: pb_grpc.BrokerAsyncStub, clock: FakeClock
) -> None:
    await stub.PutSchedule(pb.PutScheduleRequest(name="p", every_ms=1000, payload=b"1"))
    paused = (await stub.PauseSchedule(pb.PauseScheduleRequest(name="p"))).schedule
    assert paused.paused
    assert not paused.HasField("next_fire_at")
    clock.advance(3.0)
    await broker.service.sweep()
    assert (await get(stub, "p")).fires == 0
    resumed = (await stub.ResumeSchedule(pb.ResumeScheduleRequest(name="p"))).schedule
    assert not resumed.paused
    assert seconds(resumed.next_fire_at) == clock.now() + 1
    assert (await fire(broker, stub, clock, "p", 1.0)).fires == 1


async def test_put_paused(stub: pb_grpc.BrokerAsyncStub) -> None:
    request = pb.PutScheduleRequest(name="held", every_ms=1000, payload=b"1", paused=True)
    s = (await stub.PutSchedule(request)).schedule
    assert s.paused
    assert not s.HasField("next_fire_at")


BAD = [
    ({"cron": "61 * * * *"}, "cron"),
    ({"cron": ""}, "cron"),
    ({"cron": "* * * * *", "timezone": "Nowhere/Special"}, "timezone"),
    ({"cron": "* * * * *", "every_ms": 1000}, "every_ms"),
    ({}, "every_ms"),
    ({"every_ms": 0}, "every_ms"),
    ({"every_ms": -5}, "every_ms"),
    ({"every_ms": 2**62}, "every_ms"),
    ({"every_ms": 1000, "timezone": "Asia/Tokyo"}, "timezone"),
    ({"every_ms": 1000, "queue": "a b"}, "queue"),
    ({"every_ms": 1000, "priority": 10}, "priority"),
    ({"every_ms": 1000, "max_attempts": 0}, "max_attempts"),
    ({"every_ms": 1000, "expires_in_ms": -1}, "expires_in_ms"),
]


@pytest.mark.parametrize(("fields", "word"), BAD, ids=lambda v: str(v)[:50])
async def test_a_bad_schedule_is_invalid_argument_naming_the_member(
    stub: pb_grpc.BrokerAsyncStub, fields: dict[str, Any], word: str
) -> None:
    request = pb.PutScheduleRequest(name="bad", payload=b"1", **fields)
    error = await rpc_error(stub.PutSchedule(request))
    assert error.code() == Code.INVALID_ARGUMENT
    assert word in (error.details() or "")
    assert (await rpc_error(stub.GetSchedule(pb.GetScheduleRequest(name="bad")))).code() == (
        Code.NOT_FOUND
    )


@pytest.mark.parametrize(
    ("name", "payload", "word"),
    [("", b"1", "name"), ("a b", b"1", "name"), ("ok", b"", "payload"), ("ok", b"{", "payload")],
)
async def test_a_bad_name_or_payload_is_invalid_argument(
    stub: pb_grpc.BrokerAsyncStub, name: str, payload: bytes, word: str
) -> None:
    request = pb.PutScheduleRequest(name=name, every_ms=1000, payload=payload)
    error = await rpc_error(stub.PutSchedule(request))
    assert error.code() == Code.INVALID_ARGUMENT
    assert word in (error.details() or "")


# -- a fired task ---------------------------------------------------------------------------------


async def test_a_fired_task_carries_its_schedule_and_time(
    broker: Broker, stub: pb_grpc.BrokerAsyncStub, http: Http, clock: FakeClock
) -> None:
    plain = (await stub.Enqueue(pb.EnqueueRequest(payload=b"0", queue="fired"))).id
    request = pb.PutScheduleRequest(name="beat", every_ms=1000, payload=b'{"b": 1}', queue="fired")
    await stub.PutSchedule(request)
    fired = await fire(broker, stub, clock, "beat", 1.0)
    assert seconds(fired.last_fire_at) == clock.now()
    found = await stub.GetTask(pb.GetTaskRequest(id=fired.last_task_id))
    task = found.task
    assert (task.schedule, task.HasField("schedule")) == ("beat", True)
    assert task.scheduled_for == fired.last_fire_at
    assert (task.payload, task.queue) == (b'{"b": 1}', "fired")
    other = (await stub.GetTask(pb.GetTaskRequest(id=plain))).task
    assert not other.HasField("schedule")
    assert not other.HasField("scheduled_for")
    listed = await stub.ListTasks(pb.ListTasksRequest(queue="fired"))
    assert {t.task.id: t.task.schedule for t in listed.tasks} == {
        plain: "",
        fired.last_task_id: "beat",
    }
    # Over HTTP, the same task and the same time.
    status, view = await http.request("GET", f"/jobs/{fired.last_task_id}")
    assert status == 200
    assert view["schedule"] == "beat"
    status, schedule = await http.request("GET", "/schedules/beat")
    assert view["scheduled_for"] == schedule["last_fire_at"]
    # NextJob (the plain task first, then the fired one), and the DLQ.
    first = await stub.NextJob(pb.NextJobRequest(wait_ms=0, queues=["fired"]))
    assert not first.delivery.task.HasField("schedule")
    second = (await stub.NextJob(pb.NextJobRequest(wait_ms=0, queues=["fired"]))).delivery
    assert (second.task.id, second.task.schedule) == (fired.last_task_id, "beat")
    assert second.task.scheduled_for == fired.last_fire_at
    await stub.Nack(pb.NackRequest(id=second.task.id, lease_id=second.lease_id, terminal=True))
    dead = (await stub.ListDead(pb.ListDeadRequest(queue="fired"))).tasks
    assert [(t.id, t.schedule) for t in dead] == [(fired.last_task_id, "beat")]


async def test_a_stream_delivers_a_fired_task_with_its_schedule(
    broker: Broker, stub: pb_grpc.BrokerAsyncStub, clock: FakeClock
) -> None:
    call = stub.StreamJobs(None)
    await call.write(pb.StreamJobsRequest(open=pb.StreamOpen(prefetch=1, queues=["streamed"])))
    assert await asyncio.wait_for(call.read(), 5) == pb.StreamJobsResponse()
    request = pb.PutScheduleRequest(name="s", every_ms=1000, payload=b"1", queue="streamed")
    await stub.PutSchedule(request)
    fired = await fire(broker, stub, clock, "s", 1.0)
    response = await asyncio.wait_for(call.read(), 5)
    assert isinstance(response, pb.StreamJobsResponse)
    (delivery,) = response.deliveries
    assert (delivery.task.id, delivery.task.schedule) == (fired.last_task_id, "s")
    assert delivery.task.scheduled_for == fired.last_fire_at
    call.cancel()


async def test_a_schedule_put_over_grpc_is_the_one_http_shows(
    stub: pb_grpc.BrokerAsyncStub, http: Http
) -> None:
    request = pb.PutScheduleRequest(
        name="both", cron="@daily", payload=b'[1, "\xc3\xa9"]', expires_in_ms=60_000
    )
    s = (await stub.PutSchedule(request)).schedule
    status, view = await http.request("GET", "/schedules/both")
    assert status == 200
    assert (view["cron"], view["timezone"], view["every_ms"]) == ("@daily", "UTC", None)
    assert (view["payload"], view["expires_in_ms"]) == ([1, "é"], 60_000)
    status, view = await http.request(
        "PUT", "/schedules/both", json={"every_ms": 5000, "payload": {"k": None}}
    )
    assert status == 200
    again = await get(stub, "both")
    assert (again.HasField("cron"), again.timezone, again.every_ms) == (False, "", 5000)
    assert again.payload == b'{"k": null}'
    assert again.created_at == s.created_at


# -- limits ---------------------------------------------------------------------------------------


async def queue_info(stub: pb_grpc.BrokerAsyncStub, name: str) -> pb.QueueInfo:
    (info,) = [q for q in (await stub.ListQueues(pb.ListQueuesRequest())).queues if q.name == name]
    return info


async def test_limits_are_set_listed_and_cleared(stub: pb_grpc.BrokerAsyncStub) -> None:
    await stub.Enqueue(pb.EnqueueRequest(payload=b"1", queue="slow"))
    info = await queue_info(stub, "slow")
    assert not info.HasField("limits")
    assert not info.HasField("tokens")
    limits = pb.QueueLimits(rate=pb.RateLimit(tasks=10, per_ms=1000, burst=4), concurrency=2)
    answer = await stub.SetQueueLimits(pb.SetQueueLimitsRequest(queue="slow", limits=limits))
    assert answer.limits == limits
    info = await queue_info(stub, "slow")
    assert info.limits == limits
    assert (info.HasField("tokens"), info.tokens) == (True, 4.0)
    # A burst of 0 is its default (tasks); concurrency alone has no tokens.
    answer = await stub.SetQueueLimits(
        pb.SetQueueLimitsRequest(
            queue="slow", limits=pb.QueueLimits(rate=pb.RateLimit(tasks=3, per_ms=60_000))
        )
    )
    assert answer.limits == pb.QueueLimits(rate=pb.RateLimit(tasks=3, per_ms=60_000, burst=3))
    answer = await stub.SetQueueLimits(
        pb.SetQueueLimitsRequest(queue="slow", limits=pb.QueueLimits(concurrency=1))
    )
    assert answer.limits == pb.QueueLimits(concurrency=1)
    info = await queue_info(stub, "slow")
    assert not info.HasField("tokens")
    # Unset limits, or limits with nothing set: none.
    for request in (
        pb.SetQueueLimitsRequest(queue="slow"),
        pb.SetQueueLimitsRequest(queue="slow", limits=pb.QueueLimits()),
    ):
        answer = await stub.SetQueueLimits(request)
        assert not answer.HasField("limits")
        assert not (await queue_info(stub, "slow")).HasField("limits")


async def test_limits_set_over_grpc_show_over_http(
    stub: pb_grpc.BrokerAsyncStub, http: Http
) -> None:
    limits = pb.QueueLimits(rate=pb.RateLimit(tasks=5, per_ms=2000))
    await stub.SetQueueLimits(pb.SetQueueLimitsRequest(queue="new", limits=limits))
    status, rows = await http.request("GET", "/queues")
    assert status == 200
    (row,) = [r for r in rows if r["name"] == "new"]
    assert row["limits"] == {"rate": {"tasks": 5, "per_ms": 2000, "burst": 5}, "concurrency": None}
    assert row["tokens"] == 5


@pytest.mark.parametrize(
    ("queue", "limits", "word"),
    [
        ("", pb.QueueLimits(concurrency=1), "queue"),
        ("a b", pb.QueueLimits(concurrency=1), "queue"),
        ("q", pb.QueueLimits(concurrency=0), "concurrency"),
        ("q", pb.QueueLimits(concurrency=-1), "concurrency"),
        ("q", pb.QueueLimits(concurrency=1_000_001), "concurrency"),
        ("q", pb.QueueLimits(rate=pb.RateLimit(per_ms=1000)), "tasks"),
        ("q", pb.QueueLimits(rate=pb.RateLimit(tasks=1)), "per_ms"),
        ("q", pb.QueueLimits(rate=pb.RateLimit(tasks=1, per_ms=86_400_001)), "per_ms"),
        ("q", pb.QueueLimits(rate=pb.RateLimit(tasks=1, per_ms=1, burst=-1)), "burst"),
    ],
    ids=lambda v: str(v).replace("\n", " ")[:40],
)
async def test_bad_limits_are_invalid_argument_naming_the_member(
    stub: pb_grpc.BrokerAsyncStub, queue: str, limits: pb.QueueLimits, word: str
) -> None:
    error = await rpc_error(
        stub.SetQueueLimits(pb.SetQueueLimitsRequest(queue=queue, limits=limits))
    )
    assert error.code() == Code.INVALID_ARGUMENT
    assert word in (error.details() or "")


# -- tokens ---------------------------------------------------------------------------------------


async def test_changes_need_admin_and_reads_any_token(tmp_path: Path) -> None:
    token_file = write_token_file(tmp_path)
    async with (
        running_broker(token_file=str(token_file)) as broker,
        grpc.aio.insecure_channel(broker.grpc_target) as channel,
    ):
        stub = pb_grpc.BrokerStub(channel)
        put = pb.PutScheduleRequest(name="s", every_ms=1000, payload=b"1")
        changes: list[tuple[str, Any]] = [
            ("PutSchedule", put),
            ("PauseSchedule", pb.PauseScheduleRequest(name="s")),
            ("ResumeSchedule", pb.ResumeScheduleRequest(name="s")),
            ("DeleteSchedule", pb.DeleteScheduleRequest(name="s")),
            (
                "SetQueueLimits",
                pb.SetQueueLimitsRequest(queue="q", limits=pb.QueueLimits(concurrency=1)),
            ),
        ]
        for name, request in changes:
            method = getattr(stub, name)
            for token in (ALL_BUT["admin"], ONLY["produce"]):
                error = await rpc_error(method(request, metadata=metadata(token)))
                assert error.code() == Code.PERMISSION_DENIED, (name, error.details())
                assert "admin" in (error.details() or "")
            error = await rpc_error(method(request))
            assert error.code() == Code.UNAUTHENTICATED
            await method(request, metadata=metadata(ONLY["admin"]))
        await stub.PutSchedule(put, metadata=metadata(ROOT))
        for token in (ONLY["produce"], ONLY["consume"], ONLY["metrics"]):
            md = metadata(token)
            assert (await stub.GetSchedule(pb.GetScheduleRequest(name="s"), metadata=md)).schedule
            listed = await stub.ListSchedules(pb.ListSchedulesRequest(), metadata=md)
            assert [s.name for s in listed.schedules] == ["s"]
