"""Schedules and limits (issue 28) end to end: wqclient against a real in-process broker, over HTTP
and over gRPC, with the same meanings on both. Schedules put, read, listed, paused, resumed and
deleted; their fires (exactly one task a scheduled time, naming its schedule and time); the
refusals; a queue's rate and concurrency limits set, shown by ``queues()``, applied to claims and
cleared; and the blocking client.

The broker runs on a :class:`wqbroker.clock.FakeClock`: a schedule fires when the test moves the
clock past its ``next_fire_at``, so nothing here sleeps to let time pass.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from tests.helpers import running_broker, settle, wait_until
from wqbroker.broker import Broker
from wqbroker.clock import FakeClock
from wqclient import (
    AsyncClient,
    Client,
    InvalidArgument,
    Limits,
    NotFound,
    RateLimit,
    Schedule,
)

pytestmark = pytest.mark.timeout(60)

TRANSPORTS = ["http", "grpc"]


def url_for(broker: Broker, transport: str) -> str:
    return broker.http_url if transport == "http" else "grpc://" + broker.grpc_target


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def broker(clock: FakeClock) -> AsyncIterator[Broker]:
    async with running_broker(clock=clock, backoff_base=0.01) as b:
        yield b


@pytest.fixture
async def client(broker: Broker, transport: str) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(url_for(broker, transport)) as c:
        yield c


def now(clock: FakeClock) -> datetime:
    return datetime.fromtimestamp(clock.now(), UTC)


async def fired(client: AsyncClient, name: str, fires: int) -> Schedule:
    """The schedule once it has fired ``fires`` times (the sweeper runs on the broker's loop)."""
    return await wait_until(
        lambda: client.get_schedule(name),
        lambda s: s.fires >= fires,
        what=f"{name} to fire {fires} time(s)",
    )


# -- schedules ------------------------------------------------------------------------------------


async def test_put_get_list_pause_resume_delete(client: AsyncClient, clock: FakeClock) -> None:
    put = await client.put_schedule(
        "nightly",
        cron="0 2 * * *",
        timezone="Europe/Paris",
        payload={"report": "daily"},
        queue="reports",
        priority=5,
        max_attempts=2,
        expires_in_ms=3_600_000,
        timeout_ms=60_000,
        result_ttl_ms=600_000,
    )
    assert (put.name, put.cron, put.timezone, put.every_ms) == (
        "nightly",
        "0 2 * * *",
        "Europe/Paris",
        None,
    )
    assert put.payload == {"report": "daily"}
    assert (put.queue, put.priority, put.max_attempts) == ("reports", 5, 2)
    assert (put.expires_in_ms, put.timeout_ms, put.result_ttl_ms) == (3_600_000, 60_000, 600_000)
    assert (put.paused, put.fires, put.last_fire_at, put.last_task_id) == (False, 0, None, None)
    assert put.created_at == put.updated_at == now(clock)
    assert put.next_fire_at is not None
    assert put.next_fire_at > now(clock)
    local = put.next_fire_at.astimezone(ZoneInfo("Europe/Paris"))
    assert (local.hour, local.minute, local.second) == (2, 0, 0)  # 02:00 in Paris

    tick = await client.put_schedule("tick", every_ms=5_000, payload=1)
    assert (tick.cron, tick.timezone, tick.every_ms, tick.queue) == (None, None, 5_000, "default")
    assert (tick.priority, tick.max_attempts) == (0, 3)
    assert (tick.expires_in_ms, tick.timeout_ms, tick.result_ttl_ms) == (None, None, None)
    assert tick.next_fire_at == now(clock) + timedelta(seconds=5)

    assert await client.get_schedule("nightly") == put
    assert [s.name for s in await client.list_schedules()] == ["nightly", "tick"]

    paused = await client.pause_schedule("tick")
    assert (paused.paused, paused.next_fire_at) == (True, None)
    clock.advance(60)
    resumed = await client.resume_schedule("tick")
    assert resumed.paused is False
    assert resumed.next_fire_at == now(clock) + timedelta(seconds=5)

    await client.delete_schedule("tick")
    assert [s.name for s in await client.list_schedules()] == ["nightly"]
    for call in (
        client.get_schedule,
        client.delete_schedule,
        client.pause_schedule,
        client.resume_schedule,
    ):
        with pytest.raises(NotFound):
            await call("tick")


async def test_a_put_of_the_same_name_replaces_and_keeps_its_history(
    client: AsyncClient, clock: FakeClock
) -> None:
    first = await client.put_schedule("s", every_ms=1_000, payload={"v": 1})
    clock.advance(1)
    done = await fired(client, "s", 1)
    again = await client.put_schedule("s", cron="@hourly", payload={"v": 2}, queue="other")
    assert again.created_at == first.created_at
    assert again.updated_at == now(clock) > first.created_at  # type: ignore[operator]
    assert (again.fires, again.last_fire_at, again.last_task_id) == (
        1,
        done.last_fire_at,
        done.last_task_id,
    )
    assert (again.cron, again.every_ms, again.payload, again.queue) == (
        "@hourly",
        None,
        {"v": 2},
        "other",
    )


async def test_a_fire_enqueues_one_task_naming_its_schedule(
    client: AsyncClient, clock: FakeClock
) -> None:
    put = await client.put_schedule(
        "tick", every_ms=1_000, payload={"tick": True}, queue="ticks", priority=7
    )
    assert put.next_fire_at is not None
    clock.advance(1)
    schedule = await fired(client, "tick", 1)
    assert schedule.last_fire_at == put.next_fire_at
    assert schedule.next_fire_at == put.next_fire_at + timedelta(seconds=1)
    assert schedule.last_task_id is not None
    task = await client.get_task(schedule.last_task_id)
    assert (task.schedule, task.scheduled_for) == ("tick", put.next_fire_at)
    assert (task.queue, task.priority, task.payload, task.state) == (
        "ticks",
        7,
        {"tick": True},
        "ready",
    )
    delivery = await client.claim(queues="ticks", wait_ms=0)
    assert delivery is not None
    assert delivery.id == schedule.last_task_id
    assert (delivery.task.schedule, delivery.task.scheduled_for) == ("tick", put.next_fire_at)
    await client.ack(delivery)
    # A task enqueued by hand has neither.
    plain = await client.get_task(await client.enqueue(1, queue="ticks"))
    assert (plain.schedule, plain.scheduled_for) == (None, None)


async def test_after_downtime_a_schedule_fires_once(client: AsyncClient, clock: FakeClock) -> None:
    put = await client.put_schedule("tick", every_ms=1_000, payload=1, queue="once")
    assert put.next_fire_at is not None
    clock.advance(10.5)  # ten scheduled times went by
    schedule = await fired(client, "tick", 1)
    await settle()
    schedule = await client.get_schedule("tick")
    assert schedule.fires == 1
    assert schedule.last_fire_at == put.next_fire_at + timedelta(seconds=9)  # the latest missed
    assert (await client.stats("once")).ready == 1


async def test_a_paused_schedule_does_not_fire(client: AsyncClient, clock: FakeClock) -> None:
    await client.put_schedule("quiet", every_ms=1_000, payload=1, queue="quiet", paused=True)
    clock.advance(5)
    await settle()
    schedule = await client.get_schedule("quiet")
    assert (schedule.fires, schedule.paused, schedule.next_fire_at) == (0, True, None)
    assert (await client.stats("quiet")).ready == 0
    resumed = await client.resume_schedule("quiet")
    assert resumed.next_fire_at == now(clock) + timedelta(seconds=1)
    clock.advance(1)
    await fired(client, "quiet", 1)


@pytest.mark.parametrize(
    ("options", "member"),
    [
        ({}, "cron"),  # neither rule
        ({"cron": "@daily", "every_ms": 60_000}, "cron"),  # both
        ({"cron": "61 * * * *"}, "cron"),
        ({"cron": "not a rule"}, "cron"),
        ({"cron": "@daily", "timezone": "Mars/Olympus_Mons"}, "timezone"),
        ({"every_ms": 999}, "every_ms"),
        ({"every_ms": 31_536_000_001}, "every_ms"),
        ({"every_ms": 60_000, "timezone": "UTC"}, "timezone"),
        ({"every_ms": 60_000, "queue": "has space"}, "queue"),
        ({"every_ms": 60_000, "priority": 10}, "priority"),
    ],
)
async def test_a_bad_schedule_is_refused_naming_the_member(
    client: AsyncClient, options: dict[str, object], member: str
) -> None:
    with pytest.raises(InvalidArgument) as refused:
        await client.put_schedule("bad", payload=1, **options)  # type: ignore[arg-type]
    assert member in refused.value.message
    assert await client.list_schedules() == []


async def test_bad_names_are_refused(client: AsyncClient) -> None:
    with pytest.raises(InvalidArgument):
        await client.put_schedule("has space", every_ms=60_000, payload=1)
    with pytest.raises(InvalidArgument):
        await client.put_schedule("x" * 65, every_ms=60_000, payload=1)
    with pytest.raises((InvalidArgument, NotFound)):
        await client.get_schedule("")


# -- limits ---------------------------------------------------------------------------------------


async def test_limits_set_shown_and_cleared(client: AsyncClient) -> None:
    await client.enqueue(1, queue="mail")
    await client.enqueue(1, queue="free")
    found = await client.set_limits("mail", rate=RateLimit(20, 1000), concurrency=4)
    assert found == Limits(RateLimit(20, 1000, 20), 4)  # (burst: tasks, by default)
    by_name = {q.name: q for q in await client.queues()}
    assert by_name["mail"].limits == found
    assert by_name["mail"].tokens == pytest.approx(20.0)
    assert (by_name["free"].limits, by_name["free"].tokens) == (None, None)
    assert await client.set_limits("mail", concurrency=2) == Limits(None, 2)
    mail = {q.name: q for q in await client.queues()}["mail"]
    assert (mail.limits, mail.tokens) == (Limits(None, 2), None)
    await client.clear_limits("mail")
    mail = {q.name: q for q in await client.queues()}["mail"]
    assert (mail.limits, mail.tokens) == (None, None)
    assert await client.set_limits("mail") is None  # (neither: no limits)
    # A queue not known yet is made by its limits.
    await client.set_limits("fresh", rate=RateLimit(5, 60_000, burst=2))
    fresh = {q.name: q for q in await client.queues()}["fresh"]
    assert fresh.limits == Limits(RateLimit(5, 60_000, 2))
    assert fresh.tokens == pytest.approx(2.0)


@pytest.mark.parametrize(
    ("rate", "concurrency", "member"),
    [
        (RateLimit(0, 1000), None, "tasks"),
        (RateLimit(1_000_001, 1000), None, "tasks"),
        (RateLimit(1, 0), None, "per_ms"),
        (RateLimit(1, 86_400_001), None, "per_ms"),
        (RateLimit(1, 1000, burst=1_000_001), None, "burst"),
        (None, 0, "concurrency"),
    ],
)
async def test_bad_limits_are_refused_naming_the_member(
    client: AsyncClient, rate: RateLimit | None, concurrency: int | None, member: str
) -> None:
    with pytest.raises(InvalidArgument) as refused:
        await client.set_limits("mail", rate=rate, concurrency=concurrency)
    assert member in refused.value.message


async def test_a_concurrency_limit_holds_claims_back(client: AsyncClient) -> None:
    for n in range(3):
        await client.enqueue(n, queue="one-at-a-time")
    await client.set_limits("one-at-a-time", concurrency=1)
    first = await client.claim(queues="one-at-a-time", wait_ms=0)
    assert first is not None
    assert await client.claim(queues="one-at-a-time", wait_ms=0) is None
    queue = {q.name: q for q in await client.queues()}["one-at-a-time"]
    assert (queue.handed_out, queue.ready) == (1, 2)
    await client.ack(first)
    second = await client.claim(queues="one-at-a-time", wait_ms=0)
    assert second is not None
    await client.ack(second)


async def test_a_rate_limit_spends_tokens_and_refills_them(
    client: AsyncClient, clock: FakeClock
) -> None:
    for n in range(5):
        await client.enqueue(n, queue="paced")
    await client.set_limits("paced", rate=RateLimit(2, 1000))
    for _ in range(2):
        delivery = await client.claim(queues="paced", wait_ms=0)
        assert delivery is not None
        await client.ack(delivery)
    assert await client.claim(queues="paced", wait_ms=0) is None
    paced = {q.name: q for q in await client.queues()}["paced"]
    assert paced.tokens == pytest.approx(0.0, abs=0.01)
    clock.advance(0.5)  # one token back
    paced = {q.name: q for q in await client.queues()}["paced"]
    assert paced.tokens == pytest.approx(1.0, abs=0.01)
    delivery = await client.claim(queues="paced", wait_ms=0)
    assert delivery is not None
    assert await client.claim(queues="paced", wait_ms=0) is None


# -- the blocking client --------------------------------------------------------------------------


async def test_the_blocking_client_end_to_end(
    broker: Broker, transport: str, clock: FakeClock
) -> None:
    def scene() -> None:
        with Client(url_for(broker, transport)) as wq:
            put = wq.put_schedule("sync", every_ms=2_000, payload=[1], queue="sync")
            assert wq.get_schedule("sync") == put
            assert [s.name for s in wq.list_schedules()] == ["sync"]
            assert wq.pause_schedule("sync").paused
            assert not wq.resume_schedule("sync").paused
            assert wq.set_limits("sync", concurrency=3) == Limits(None, 3)
            assert {q.name: q.limits for q in wq.queues()}["sync"] == Limits(None, 3)
            wq.clear_limits("sync")
            wq.delete_schedule("sync")
            with pytest.raises(NotFound):
                wq.get_schedule("sync")

    await asyncio.to_thread(scene)
    await settle()
