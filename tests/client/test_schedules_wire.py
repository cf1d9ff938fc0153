"""Schedules and limits (issue 28) on the wire, both transports, against scripted brokers: what
the client sends for each schedule call and for a queue's limits, and what it makes of the answers
docs/design/schedules.md specifies (a schedule's view, the limits and tokens of /queues, a fired
task's ``schedule`` and ``scheduled_for``, the refusals).

The brokers here answer exactly what the design says a broker answers, so these tests pin the
client to the contract whatever state the broker's side is in; the same calls against real
brokers are in client/test_schedules_end_to_end.py.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import grpc
import pytest
from aiohttp import web

from tests.client.test_control_wire import (
    CREATED,
    EXPIRES,
    GrpcScript,
    HttpScript,
    answer,
    grpc_broker,
    pb_delivery,
    pb_task,
    refuse,
    ts,
    view,
)
from wqclient import (
    AsyncClient,
    InvalidArgument,
    Limits,
    NotFound,
    PermissionDenied,
    ProtocolError,
    RateLimit,
    Schedule,
)
from wqwire.pb import broker_pb2 as pb

pytestmark = pytest.mark.timeout(30)

NEXT = "2026-12-01T11:00:00.000000Z"
LAST = "2026-12-01T10:55:00.000000Z"


def schedule_view(name: str = "nightly", **members: Any) -> dict[str, Any]:
    """A schedule's view as the HTTP API writes it (docs/design/schedules.md)."""
    return {
        "name": name,
        "cron": "0 2 * * *",
        "timezone": "Europe/Paris",
        "every_ms": None,
        "queue": "reports",
        "payload": {"report": 1},
        "priority": 5,
        "max_attempts": 2,
        "expires_in_ms": 3_600_000,
        "timeout_ms": None,
        "result_ttl_ms": None,
        "paused": False,
        "created_at": CREATED,
        "updated_at": CREATED,
        "next_fire_at": NEXT,
        "last_fire_at": LAST,
        "last_task_id": "t7",
        "fires": 3,
        **members,
    }


@pytest.fixture
async def http() -> AsyncIterator[tuple[HttpScript, AsyncClient]]:
    script = HttpScript()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", script.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        async with AsyncClient(f"http://127.0.0.1:{runner.addresses[0][1]}") as client:
            yield script, client
    finally:
        await runner.cleanup()


def at(text: str) -> datetime:
    return datetime.fromisoformat(text).astimezone(UTC)


# -- HTTP: schedules ------------------------------------------------------------------------------


async def test_http_put_schedule_sends_the_members_given(
    http: tuple[HttpScript, AsyncClient],
) -> None:
    script, client = http
    script.on("PUT", "/schedules/nightly", 200, schedule_view())
    schedule = await client.put_schedule(
        "nightly",
        cron="0 2 * * *",
        timezone="Europe/Paris",
        payload={"report": 1},
        queue="reports",
        priority=5,
        max_attempts=2,
        expires_in_ms=3_600_000,
    )
    [seen] = script.seen
    assert json.loads(seen.body) == {
        "payload": {"report": 1},
        "cron": "0 2 * * *",
        "timezone": "Europe/Paris",
        "queue": "reports",
        "priority": 5,
        "max_attempts": 2,
        "expires_in_ms": 3600000,
    }
    assert seen.headers["Content-Type"] == "application/json"
    assert schedule == Schedule(
        "nightly",
        b'{"report": 1}',
        cron="0 2 * * *",
        timezone="Europe/Paris",
        queue="reports",
        priority=5,
        max_attempts=2,
        expires_in_ms=3_600_000,
        created_at=at(CREATED),
        updated_at=at(CREATED),
        next_fire_at=at(NEXT),
        last_fire_at=at(LAST),
        last_task_id="t7",
        fires=3,
    )
    assert schedule.payload == {"report": 1}
    assert schedule.rule == "0 2 * * * (Europe/Paris)"


async def test_http_put_schedule_keeps_the_payload_s_text_and_sends_only_what_is_set(
    http: tuple[HttpScript, AsyncClient],
) -> None:
    script, client = http
    every = schedule_view(
        "tick", cron=None, timezone=None, every_ms=5000, paused=True, next_fire_at=None
    )
    text = json.dumps(every).replace('{"report": 1}', '{"n": 1.10}')
    script.on("PUT", "/schedules/tick", 200, text)
    schedule = await client.put_schedule("tick", every_ms=5000, payload=b'{"n": 1.10}', paused=True)
    assert script.seen[0].body == b'{"payload":{"n": 1.10},"every_ms":5000,"paused":true}'
    assert (schedule.every_ms, schedule.cron, schedule.timezone) == (5000, None, None)
    assert schedule.payload_json == b'{"n": 1.10}'  # (byte for byte, as enqueued payloads)
    assert (schedule.paused, schedule.next_fire_at) == (True, None)
    assert schedule.rule == "every 5000 ms"


async def test_http_schedule_names_are_percent_encoded(
    http: tuple[HttpScript, AsyncClient],
) -> None:
    script, client = http
    paths: list[str] = []

    async def raw(request: web.Request) -> web.Response:
        paths.append(request.raw_path)
        return web.json_response({"error": "name 'a b/c?' is not a schedule name"}, status=400)

    script.custom = raw
    with pytest.raises(InvalidArgument, match="is not a schedule name"):
        await client.get_schedule("a b/c?")
    with pytest.raises(InvalidArgument):
        await client.pause_schedule("a b/c?")
    with pytest.raises(InvalidArgument):
        await client.set_limits("q 1", concurrency=1)
    assert paths == [
        "/schedules/a%20b%2Fc%3F",
        "/schedules/a%20b%2Fc%3F/pause",
        "/queues/q%201/limits",
    ]


async def test_http_get_list_delete_pause_resume(http: tuple[HttpScript, AsyncClient]) -> None:
    script, client = http
    script.on("GET", "/schedules/nightly", 200, schedule_view())
    script.on(
        "GET",
        "/schedules",
        200,
        {"schedules": [schedule_view("a"), schedule_view("b", cron=None, every_ms=60_000)]},
    )
    script.on("DELETE", "/schedules/nightly", 204)
    script.on(
        "POST", "/schedules/nightly/pause", 200, schedule_view(paused=True, next_fire_at=None)
    )
    script.on("POST", "/schedules/nightly/resume", 200, schedule_view())
    assert (await client.get_schedule("nightly")).fires == 3
    listed = await client.list_schedules()
    assert [(s.name, s.every_ms) for s in listed] == [("a", None), ("b", 60_000)]
    paused = await client.pause_schedule("nightly")
    assert (paused.paused, paused.next_fire_at) == (True, None)
    resumed = await client.resume_schedule("nightly")
    assert (resumed.paused, resumed.next_fire_at) == (False, at(NEXT))
    await client.delete_schedule("nightly")
    assert script.requests() == [
        ("GET", "/schedules/nightly"),
        ("GET", "/schedules"),
        ("POST", "/schedules/nightly/pause"),
        ("POST", "/schedules/nightly/resume"),
        ("DELETE", "/schedules/nightly"),
    ]


async def test_http_schedule_refusals_map_as_everywhere(
    http: tuple[HttpScript, AsyncClient],
) -> None:
    script, client = http
    script.on("GET", "/schedules/never", 404, {"error": "schedule never not found"})
    script.on("PUT", "/schedules/bad", 400, {"error": "cron: '61 * * * *' is not a cron rule"})
    script.on(
        "POST",
        "/schedules/x/pause",
        403,
        {"error": "POST /schedules/{name}/pause needs a token with the admin scope"},
    )
    with pytest.raises(NotFound, match="schedule never not found"):
        await client.get_schedule("never")
    with pytest.raises(InvalidArgument) as refused:
        await client.put_schedule("bad", cron="61 * * * *", payload=1)
    assert refused.value.message == "cron: '61 * * * *' is not a cron rule"
    with pytest.raises(PermissionDenied, match="admin"):
        await client.pause_schedule("x")
    with pytest.raises(InvalidArgument):
        await client.get_schedule("")  # (a path cannot carry it: refused without a request)
    assert ("GET", "/schedules/") not in script.requests()


async def test_http_answers_that_are_not_schedules_are_protocol_errors(
    http: tuple[HttpScript, AsyncClient],
) -> None:
    script, client = http
    script.on("GET", "/schedules", 200, [schedule_view()])  # not {"schedules": [...]}
    script.on("GET", "/schedules/x", 200, {"name": "x"})  # no payload
    with pytest.raises(ProtocolError):
        await client.list_schedules()
    with pytest.raises(ProtocolError, match="schedule"):
        await client.get_schedule("x")


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        ({"every_ms": "5s"}, "every_ms must be an integer"),
        ({"every_ms": True}, "every_ms must be an integer"),
        ({"cron": 5}, "cron must be a string"),
        ({"cron": "@daily", "paused": "yes"}, "paused must be true or false"),
        ({"cron": "@daily", "queue": ["a"]}, "queue must be a string"),
    ],
)
async def test_options_of_the_wrong_kind_are_refused_before_sending(
    http: tuple[HttpScript, AsyncClient], options: dict[str, Any], problem: str
) -> None:
    script, client = http
    with pytest.raises(InvalidArgument, match=problem):
        await client.put_schedule("x", payload=1, **options)
    with pytest.raises(InvalidArgument, match="payload cannot be encoded"):
        await client.put_schedule("x", every_ms=1000, payload={1, 2})
    assert script.seen == []


# -- HTTP: limits ---------------------------------------------------------------------------------


async def test_http_set_and_clear_limits(http: tuple[HttpScript, AsyncClient]) -> None:
    script, client = http
    limits = {"rate": {"tasks": 20, "per_ms": 1000, "burst": 20}, "concurrency": 4}
    script.on("PUT", "/queues/mail/limits", 200, {"queue": "mail", "limits": limits})
    script.on("DELETE", "/queues/mail/limits", 204)
    found = await client.set_limits("mail", rate=RateLimit(20, 1000), concurrency=4)
    assert found == Limits(RateLimit(20, 1000, 20), 4)
    assert found.rate is not None
    assert found.rate.per_second == 20.0
    assert json.loads(script.seen[0].body) == {
        "rate": {"tasks": 20, "per_ms": 1000},
        "concurrency": 4,
    }
    script.on(
        "PUT",
        "/queues/mail/limits",
        200,
        {"queue": "mail", "limits": {"rate": None, "concurrency": 2}},
    )
    assert await client.set_limits("mail", concurrency=2) == Limits(None, 2)
    assert json.loads(script.seen[1].body) == {"rate": None, "concurrency": 2}
    await client.set_limits("mail", rate=RateLimit(5, 60_000, burst=1))
    assert json.loads(script.seen[2].body) == {
        "rate": {"tasks": 5, "per_ms": 60000, "burst": 1},
        "concurrency": None,
    }
    await client.clear_limits("mail")
    assert await client.set_limits("mail") is None  # (neither: no limits, a DELETE)
    assert script.requests()[-2:] == [
        ("DELETE", "/queues/mail/limits"),
        ("DELETE", "/queues/mail/limits"),
    ]


async def test_http_limit_refusals(http: tuple[HttpScript, AsyncClient]) -> None:
    script, client = http
    script.on(
        "PUT",
        "/queues/mail/limits",
        400,
        {"error": "rate.tasks must be from 1 to 1000000, got 0"},
    )
    with pytest.raises(InvalidArgument, match=r"rate\.tasks must be from 1 to 1000000, got 0"):
        await client.set_limits("mail", rate=RateLimit(0, 1000))
    with pytest.raises(InvalidArgument, match="rate must be a RateLimit"):
        await client.set_limits("mail", rate=(20, 1000))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="concurrency must be an integer"):
        await client.set_limits("mail", concurrency=2.5)  # type: ignore[arg-type]
    assert len(script.seen) == 1


async def test_http_queues_show_limits_and_tokens(http: tuple[HttpScript, AsyncClient]) -> None:
    script, client = http
    limited = {"rate": {"tasks": 100, "per_ms": 60000, "burst": 10}, "concurrency": None}
    script.on(
        "GET",
        "/queues",
        200,
        [
            {"name": "a", "ready": 1, "limits": limited, "tokens": 7.25},
            {"name": "b", "ready": 2, "limits": None, "tokens": None},
            {"name": "old", "ready": 3},  # (a broker before limits)
        ],
    )
    a, b, old = await client.queues()
    assert a.limits == Limits(RateLimit(100, 60_000, 10))
    assert a.tokens == 7.25
    assert (b.limits, b.tokens, old.limits, old.tokens) == (None, None, None, None)


async def test_http_a_fired_task_names_its_schedule(http: tuple[HttpScript, AsyncClient]) -> None:
    script, client = http
    script.on(
        "GET", "/jobs/t1", 200, view(state="ready", schedule="nightly", scheduled_for=EXPIRES)
    )
    script.on("GET", "/jobs/t2", 200, view(state="ready"))
    script.on(
        "GET",
        "/jobs/next",
        200,
        {
            "task": view("t3", schedule="tick", scheduled_for=CREATED),
            "lease_id": "L",
            "deadline": EXPIRES,
        },
    )
    fired = await client.get_task("t1")
    assert (fired.schedule, fired.scheduled_for) == ("nightly", at(EXPIRES))
    plain = await client.get_task("t2")
    assert (plain.schedule, plain.scheduled_for) == (None, None)
    delivery = await client.claim(wait_ms=0)
    assert delivery is not None
    assert (delivery.task.schedule, delivery.task.scheduled_for) == ("tick", at(CREATED))


# -- gRPC -----------------------------------------------------------------------------------------


def pb_schedule(name: str = "nightly", **fields: Any) -> pb.Schedule:
    defaults: dict[str, Any] = {
        "cron": "0 2 * * *",
        "timezone": "Europe/Paris",
        "payload": b'{"report": 1}',
        "queue": "reports",
        "priority": 5,
        "max_attempts": 2,
        "expires_in_ms": 3_600_000,
        "created_at": ts(CREATED),
        "updated_at": ts(CREATED),
        "next_fire_at": ts(NEXT),
        "last_fire_at": ts(LAST),
        "last_task_id": "t7",
        "fires": 3,
    }
    defaults.update(fields)
    return pb.Schedule(name=name, **defaults)


async def test_grpc_put_schedule_sends_the_fields_set_and_reads_the_schedule() -> None:
    script = GrpcScript()
    script.on(
        "PutSchedule",
        pb.PutScheduleRequest,
        answer(pb.PutScheduleResponse(schedule=pb_schedule())),
    )
    async with grpc_broker(script) as transport:
        client = AsyncClient(transport=transport)
        schedule = await client.put_schedule(
            "nightly",
            cron="0 2 * * *",
            timezone="Europe/Paris",
            payload={"report": 1},
            queue="reports",
            priority=5,
            max_attempts=2,
            expires_in_ms=3_600_000,
        )
        await client.put_schedule("tick", every_ms=5000, payload=b"1", paused=True)
    first, second = script.seen
    assert first == pb.PutScheduleRequest(
        name="nightly",
        cron="0 2 * * *",
        timezone="Europe/Paris",
        payload=b'{"report":1}',
        queue="reports",
        priority=5,
        max_attempts=2,
        expires_in_ms=3_600_000,
    )
    assert not first.HasField("every_ms")
    assert not first.HasField("paused")
    assert second == pb.PutScheduleRequest(name="tick", every_ms=5000, payload=b"1", paused=True)
    assert not second.HasField("cron")
    assert not second.HasField("priority")
    assert schedule == Schedule(
        "nightly",
        b'{"report": 1}',
        cron="0 2 * * *",
        timezone="Europe/Paris",
        queue="reports",
        priority=5,
        max_attempts=2,
        expires_in_ms=3_600_000,
        created_at=at(CREATED),
        updated_at=at(CREATED),
        next_fire_at=at(NEXT),
        last_fire_at=at(LAST),
        last_task_id="t7",
        fires=3,
    )


async def test_grpc_an_interval_schedule_never_fired_reads_its_unset_fields_as_none() -> None:
    script = GrpcScript()
    fresh = pb.Schedule(
        name="tick",
        every_ms=60_000,
        payload=b"1",
        queue="default",
        max_attempts=3,
        paused=True,
        created_at=ts(CREATED),
        updated_at=ts(CREATED),
    )
    script.on("GetSchedule", pb.GetScheduleRequest, answer(pb.GetScheduleResponse(schedule=fresh)))
    async with grpc_broker(script) as transport:
        schedule = await transport.get_schedule("tick")
    assert (schedule.cron, schedule.timezone, schedule.every_ms) == (None, None, 60_000)
    assert (schedule.next_fire_at, schedule.last_fire_at, schedule.last_task_id) == (
        None,
        None,
        None,
    )
    assert (schedule.expires_in_ms, schedule.timeout_ms, schedule.result_ttl_ms) == (
        None,
        None,
        None,
    )
    assert (schedule.paused, schedule.fires, schedule.priority) == (True, 0, 0)


async def test_grpc_get_list_delete_pause_resume() -> None:
    script = GrpcScript()
    script.on(
        "GetSchedule", pb.GetScheduleRequest, answer(pb.GetScheduleResponse(schedule=pb_schedule()))
    )
    script.on(
        "ListSchedules",
        pb.ListSchedulesRequest,
        answer(pb.ListSchedulesResponse(schedules=[pb_schedule("a"), pb_schedule("b")])),
    )
    script.on("DeleteSchedule", pb.DeleteScheduleRequest, answer(pb.DeleteScheduleResponse()))
    script.on(
        "PauseSchedule",
        pb.PauseScheduleRequest,
        answer(pb.PauseScheduleResponse(schedule=pb_schedule(paused=True, next_fire_at=None))),
    )
    script.on(
        "ResumeSchedule",
        pb.ResumeScheduleRequest,
        answer(pb.ResumeScheduleResponse(schedule=pb_schedule())),
    )
    async with grpc_broker(script) as transport:
        client = AsyncClient(transport=transport)
        assert (await client.get_schedule("nightly")).last_task_id == "t7"
        assert [s.name for s in await client.list_schedules()] == ["a", "b"]
        paused = await client.pause_schedule("nightly")
        assert (paused.paused, paused.next_fire_at) == (True, None)
        assert (await client.resume_schedule("nightly")).next_fire_at == at(NEXT)
        await client.delete_schedule("nightly")
    assert script.seen == [
        pb.GetScheduleRequest(name="nightly"),
        pb.ListSchedulesRequest(),
        pb.PauseScheduleRequest(name="nightly"),
        pb.ResumeScheduleRequest(name="nightly"),
        pb.DeleteScheduleRequest(name="nightly"),
    ]


async def test_grpc_schedule_refusals_map_as_everywhere() -> None:
    script = GrpcScript()
    script.on(
        "GetSchedule", pb.GetScheduleRequest, refuse(grpc.StatusCode.NOT_FOUND, "no schedule x")
    )
    script.on(
        "PutSchedule",
        pb.PutScheduleRequest,
        refuse(grpc.StatusCode.INVALID_ARGUMENT, "timezone: 'Mars/Olympus' is not a timezone"),
    )
    script.on("PauseSchedule", pb.PauseScheduleRequest, answer(pb.PauseScheduleResponse()))
    async with grpc_broker(script) as transport:
        client = AsyncClient(transport=transport)
        with pytest.raises(NotFound, match="no schedule x"):
            await client.get_schedule("x")
        with pytest.raises(InvalidArgument) as refused:
            await client.put_schedule("x", cron="@daily", timezone="Mars/Olympus", payload=1)
        assert refused.value.message == "timezone: 'Mars/Olympus' is not a timezone"
        with pytest.raises(ProtocolError, match="no schedule"):
            await client.pause_schedule("x")  # (an answer without its schedule)


async def test_grpc_set_and_clear_limits() -> None:
    script = GrpcScript()

    async def set_limits(request: pb.SetQueueLimitsRequest, context: Any) -> Any:
        if not request.HasField("limits"):
            return pb.SetQueueLimitsResponse()
        limits = pb.QueueLimits()
        limits.CopyFrom(request.limits)
        if limits.HasField("rate") and not limits.rate.burst:
            limits.rate.burst = limits.rate.tasks  # (the broker's default)
        return pb.SetQueueLimitsResponse(limits=limits)

    script.on("SetQueueLimits", pb.SetQueueLimitsRequest, set_limits)
    async with grpc_broker(script) as transport:
        client = AsyncClient(transport=transport)
        found = await client.set_limits("mail", rate=RateLimit(20, 1000), concurrency=4)
        assert found == Limits(RateLimit(20, 1000, 20), 4)
        assert await client.set_limits("mail", concurrency=1) == Limits(None, 1)
        await client.clear_limits("mail")
        assert await client.set_limits("mail") is None
    first, second, cleared, neither = script.seen
    assert first == pb.SetQueueLimitsRequest(
        queue="mail",
        limits=pb.QueueLimits(rate=pb.RateLimit(tasks=20, per_ms=1000), concurrency=4),
    )
    assert not second.limits.HasField("rate")
    assert second.limits.concurrency == 1
    assert cleared == neither == pb.SetQueueLimitsRequest(queue="mail")
    assert not cleared.HasField("limits")


async def test_grpc_queues_show_limits_and_tokens() -> None:
    script = GrpcScript()
    queues = [
        pb.QueueInfo(
            name="a",
            handed_out=2,
            limits=pb.QueueLimits(rate=pb.RateLimit(tasks=5, per_ms=500, burst=5), concurrency=2),
            tokens=0.5,
        ),
        pb.QueueInfo(name="b", ready=1),
    ]
    script.on("ListQueues", pb.ListQueuesRequest, answer(pb.ListQueuesResponse(queues=queues)))
    async with grpc_broker(script) as transport:
        a, b = await transport.queues()
    assert (a.limits, a.tokens, a.handed_out) == (Limits(RateLimit(5, 500, 5), 2), 0.5, 2)
    assert (b.limits, b.tokens) == (None, None)


async def test_grpc_a_fired_task_names_its_schedule() -> None:
    script = GrpcScript()
    fired = pb_task("t1", schedule="nightly", scheduled_for=ts(EXPIRES))
    script.on(
        "GetTask",
        pb.GetTaskRequest,
        answer(pb.GetTaskResponse(task=fired, state="ready")),
    )
    script.on(
        "NextJob",
        pb.NextJobRequest,
        answer(
            pb.NextJobResponse(
                delivery=pb_delivery("t2", "L", schedule="tick", scheduled_for=ts(CREATED))
            )
        ),
    )
    async with grpc_broker(script) as transport:
        task = await transport.get_task("t1")
        delivery = await transport.claim(0, None)
    assert (task.schedule, task.scheduled_for, task.state) == ("nightly", at(EXPIRES), "ready")
    assert delivery is not None
    assert (delivery.task.schedule, delivery.task.scheduled_for) == ("tick", at(CREATED))
    assert delivery.task.payload == {"n": 1}
