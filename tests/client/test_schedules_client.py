"""Schedules and limits (issue 28) in the client, ``AsyncClient`` and its blocking mirror
``Client``, over the transport seam (tests/fake_transport.py): putting, reading, pausing, resuming
and deleting schedules, a fired task's ``schedule`` and ``scheduled_for``, a queue's limits; and
the ``wq`` commands built on them (schedules, schedule set|get|delete|pause|resume, limits, the
queues table's limit columns), run against the same fake.
"""

from __future__ import annotations

import io
import json
from typing import Any

import pytest

import wqclient
from tests.fake_transport import FakeTransport
from wqclient import (
    AsyncClient,
    Client,
    InvalidArgument,
    Limits,
    NotFound,
    QueueInfo,
    RateLimit,
    Schedule,
)
from wqclient.cli import admin

pytestmark = pytest.mark.timeout(30)


def test_the_new_models_are_exported() -> None:
    for name in ("Schedule", "RateLimit", "Limits"):
        assert name in wqclient.__all__
        assert getattr(wqclient, name) is not None
    assert RateLimit(20) == RateLimit(20, 1000, None)  # (a second, the broker's burst)
    assert RateLimit(100, 60_000).per_second == pytest.approx(100 / 60)
    assert Limits().empty
    assert not Limits(concurrency=1).empty


# -- AsyncClient ----------------------------------------------------------------------------------


async def test_put_get_list_pause_resume_delete() -> None:
    fake = FakeTransport()
    async with AsyncClient(transport=fake) as wq:
        nightly = await wq.put_schedule(
            "nightly",
            cron="0 2 * * *",
            timezone="Europe/Paris",
            payload={"report": "daily"},
            queue="reports",
            priority=5,
            max_attempts=2,
            expires_in_ms=3_600_000,
            timeout_ms=60_000,
            result_ttl_ms=0,
        )
        tick = await wq.put_schedule("tick", every_ms=5_000, payload=1, paused=True)
        assert (nightly.cron, nightly.timezone, nightly.every_ms) == (
            "0 2 * * *",
            "Europe/Paris",
            None,
        )
        assert nightly.payload == {"report": "daily"}
        assert (nightly.queue, nightly.priority, nightly.max_attempts) == ("reports", 5, 2)
        assert (nightly.expires_in_ms, nightly.timeout_ms, nightly.result_ttl_ms) == (
            3_600_000,
            60_000,
            0,
        )
        assert nightly.next_fire_at is not None
        assert (tick.paused, tick.next_fire_at, tick.every_ms) == (True, None, 5_000)
        assert await wq.get_schedule("nightly") == nightly
        assert [s.name for s in await wq.list_schedules()] == ["nightly", "tick"]

        resumed = await wq.resume_schedule("tick")
        assert (resumed.paused, resumed.next_fire_at is not None) == (False, True)
        paused = await wq.pause_schedule("nightly")
        assert (paused.paused, paused.next_fire_at) == (True, None)
        await wq.delete_schedule("tick")
        assert [s.name for s in await wq.list_schedules()] == ["nightly"]
        for call in (wq.get_schedule, wq.delete_schedule, wq.pause_schedule, wq.resume_schedule):
            with pytest.raises(NotFound):
                await call("tick")


async def test_a_put_replaces_and_keeps_the_fires() -> None:
    fake = FakeTransport()
    async with AsyncClient(transport=fake) as wq:
        first = await wq.put_schedule("s", every_ms=60_000, payload={"v": 1})
        fake.fire("s")
        again = await wq.put_schedule("s", cron="@hourly", payload={"v": 2})
    assert again.created_at == first.created_at
    assert (again.fires, again.last_task_id) == (1, "t1")
    assert (again.cron, again.every_ms, again.payload) == ("@hourly", None, {"v": 2})


async def test_the_rule_is_one_of_cron_and_every() -> None:
    fake = FakeTransport()
    async with AsyncClient(transport=fake) as wq:
        with pytest.raises(InvalidArgument, match="exactly one"):
            await wq.put_schedule("s", payload=1)
        with pytest.raises(InvalidArgument, match="exactly one"):
            await wq.put_schedule("s", cron="@daily", every_ms=1000, payload=1)
        with pytest.raises(InvalidArgument, match="every_ms"):
            await wq.put_schedule("s", every_ms=999, payload=1)
        with pytest.raises(InvalidArgument, match="every_ms must be an integer"):
            await wq.put_schedule("s", every_ms=1.5, payload=1)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="name must be a string"):
            await wq.get_schedule(7)  # type: ignore[arg-type]
        assert await wq.list_schedules() == []


async def test_a_fired_task_names_its_schedule_and_time() -> None:
    fake = FakeTransport()
    async with AsyncClient(transport=fake) as wq:
        schedule = await wq.put_schedule(
            "tick", every_ms=1000, payload={"tick": True}, queue="ticks", priority=3
        )
        task_id = fake.fire("tick")
        task = await wq.get_task(task_id)
        assert (task.schedule, task.scheduled_for) == ("tick", schedule.next_fire_at)
        assert (task.queue, task.priority, task.payload) == ("ticks", 3, {"tick": True})
        delivery = await wq.claim(queues="ticks", wait_ms=0)
        assert delivery is not None
        assert delivery.task.schedule == "tick"
        after = await wq.get_schedule("tick")
        assert (after.fires, after.last_task_id, after.last_fire_at) == (
            1,
            task_id,
            schedule.next_fire_at,
        )
        plain = await wq.get_task(await wq.enqueue(1))
        assert (plain.schedule, plain.scheduled_for) == (None, None)


async def test_limits_set_shown_and_cleared() -> None:
    fake = FakeTransport()
    async with AsyncClient(transport=fake) as wq:
        found = await wq.set_limits("mail", rate=RateLimit(20, 1000), concurrency=4)
        assert found == Limits(RateLimit(20, 1000, 20), 4)
        assert await wq.set_limits("other", concurrency=2) == Limits(None, 2)
        by_name = {q.name: q for q in await wq.queues()}
        assert (by_name["mail"].limits, by_name["mail"].tokens) == (found, 20.0)
        assert (by_name["other"].limits, by_name["other"].tokens) == (Limits(None, 2), None)
        assert (by_name["default"].limits, by_name["default"].tokens) == (None, None)
        with pytest.raises(InvalidArgument, match="concurrency"):
            await wq.set_limits("mail", concurrency=0)
        await wq.clear_limits("mail")
        assert await wq.set_limits("other") is None
        assert all(q.limits is None for q in await wq.queues())


def test_the_blocking_client_mirrors_every_call() -> None:
    fake = FakeTransport()
    with Client(transport=fake) as wq:
        put = wq.put_schedule("s", cron="*/5 * * * *", payload=[1], timezone="UTC")
        assert isinstance(put, Schedule)
        assert wq.get_schedule("s") == put
        assert wq.list_schedules() == [put]
        assert wq.pause_schedule("s").paused
        assert not wq.resume_schedule("s").paused
        wq.delete_schedule("s")
        with pytest.raises(NotFound):
            wq.get_schedule("s")
        assert wq.set_limits("q", rate=RateLimit(1, 500, 3)) == Limits(RateLimit(1, 500, 3))
        wq.clear_limits("q")
        assert [q.limits for q in wq.queues()] == [None, None]


# -- wq -------------------------------------------------------------------------------------------


@pytest.fixture
def on_fake(monkeypatch: pytest.MonkeyPatch) -> FakeTransport:
    """``wq`` talks to a fake broker (each run opens and closes a client on it)."""
    fake = FakeTransport()

    def client(*args: Any, **kwargs: Any) -> AsyncClient:
        fake.closed = False
        return AsyncClient(transport=fake)

    monkeypatch.setattr(admin, "AsyncClient", client)
    monkeypatch.setenv("COLUMNS", "120")
    for name in ("FORCE_COLOR", "NO_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "LINES"):
        monkeypatch.delenv(name, raising=False)
    return fake


def wq(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = admin.main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def value(table: str, label: str) -> str:
    """The value a field table shows for ``label`` (the rest of its line)."""
    for line in table.splitlines():
        if line.startswith(f" {label}  "):
            return " ".join(line[len(label) + 1 :].split())
    raise AssertionError(f"no field {label!r} in:\n{table}")


def wq_errors(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``wq argv``, its errors where they are written: those of the flags' parser on the
    process's standard error, the others on ``err``."""
    capsys.readouterr()
    code, out, err = wq(*argv)
    return code, out, err + capsys.readouterr().err


def wq_json(*argv: str) -> Any:
    code, out, err = wq(*argv, "-json")
    assert (code, err) == (0, ""), err
    return json.loads(out)


def row(table: str, first: str) -> list[str]:
    for line in table.splitlines():
        cells = line.split()
        if cells and cells[0] == first:
            return cells
    raise AssertionError(f"no row {first!r} in:\n{table}")


def test_wq_schedule_set_with_cron_or_every(on_fake: FakeTransport) -> None:
    fake = on_fake
    code, out, err = wq(
        "schedule",
        "set",
        "nightly",
        "-cron",
        "0 2 * * *",
        "-timezone",
        "Europe/Paris",
        "--payload",
        '{"report": 1}',
        "-queue",
        "reports",
        "-priority",
        "5",
        "-max-attempts",
        "2",
        "-expires-in-ms",
        "60000",
        "-timeout-ms",
        "30000",
        "-result-ttl-ms=0",
    )
    assert (code, err) == (0, "")
    assert out.startswith("schedule nightly set (0 2 * * * in Europe/Paris): next fire 20")
    nightly = fake.schedules["nightly"]
    assert (nightly.cron, nightly.timezone, nightly.queue, nightly.priority) == (
        "0 2 * * *",
        "Europe/Paris",
        "reports",
        5,
    )
    assert (nightly.max_attempts, nightly.expires_in_ms, nightly.timeout_ms) == (2, 60_000, 30_000)
    assert (nightly.result_ttl_ms, nightly.payload_json) == (0, b'{"report": 1}')

    view = wq_json("schedule", "set", "tick", "-every", "1m30s", "-payload", "1", "-paused")
    assert view == admin.schedule_json(fake.schedules["tick"])
    assert (view["every_ms"], view["cron"], view["timezone"], view["paused"]) == (
        90_000,
        None,
        None,
        True,
    )
    assert view["next_fire_at"] is None
    assert wq("schedule", "set", "tick", "-every", "5s", "-payload", "2")[:2] == (
        0,
        "schedule tick set (every 5s): next fire "
        + admin.rfc3339(fake.schedules["tick"].next_fire_at)  # type: ignore[arg-type]
        + "\n",
    )
    code, out, _ = wq("schedule", "set", "p", "-every", "1h", "-payload", "3", "-paused=true")
    assert (code, out) == (0, "schedule p set (every 1h), paused: no fires until resumed\n")


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["-payload", "1"], "give -cron EXPR or -every DURATION"),
        (["-cron", "@daily", "-every", "5m", "-payload", "1"], "give -cron EXPR or -every"),
        (["-every", "5m", "-timezone", "UTC", "-payload", "1"], "-timezone goes with -cron"),
        (["-every", "5", "-payload", "1"], "'5' is not a duration"),
        (["-every", "soon", "-payload", "1"], "is not a duration"),
        (["-every", "0s", "-payload", "1"], "longer than 0"),
        (["-every", "5m"], "the following arguments are required: -payload"),
        (["-every", "5m", "-payload", "{nope"], "the payload is not valid JSON"),
        (["-every", "5m", "-payload", "1", "-priority", "10"], "must be from 0 to 9"),
        (["-every", "5m", "-payload", "1", "-paused=maybe"], "not a boolean"),
        (["-cron", "0 2 * * *", "-payload", "1", "-nope"], "flag provided but not defined"),
    ],
)
def test_wq_schedule_set_usage_errors(
    on_fake: FakeTransport, capsys: pytest.CaptureFixture[str], argv: list[str], problem: str
) -> None:
    code, out, err = wq_errors(capsys, "schedule", "set", "s", *argv)
    assert (code, out) == (2, "")
    assert problem in err
    assert len(err.splitlines()) == 1
    assert on_fake.schedules == {}


def test_wq_schedule_set_refused_by_the_broker_is_a_usage_error(on_fake: FakeTransport) -> None:
    code, out, err = wq("schedule", "set", "s", "-every", "500ms", "-payload", "1")
    assert (code, out) == (2, "")
    assert err == "wq: every_ms must be from 1000 to 31536000000, got 500\n"
    code, _, err = wq("schedule", "set", "bad name", "-every", "5s", "-payload", "1")
    assert code == 2
    assert "name" in err


def test_wq_schedules_in_both_modes(on_fake: FakeTransport) -> None:
    fake = on_fake
    assert wq("schedules") == (
        0,
        "no schedules (wq schedule set NAME -cron EXPR | -every DURATION -payload JSON)\n",
        "",
    )
    assert wq_json("schedules") == {"schedules": []}
    wq(
        "schedule",
        "set",
        "nightly",
        "-cron",
        "0 2 * * *",
        "-timezone",
        "Asia/Tokyo",
        "-payload",
        "1",
    )
    wq("schedule", "set", "tick", "-every", "30s", "-payload", "2", "-queue", "ticks", "-paused")
    task_id = fake.fire("nightly")
    listed = wq_json("schedules")
    assert listed == {"schedules": [admin.schedule_json(s) for s in fake.schedules.values()]}
    assert [s["name"] for s in listed["schedules"]] == ["nightly", "tick"]
    code, table, err = wq("schedules")
    assert (code, err) == (0, "")
    lines = table.splitlines()
    assert lines[0] == "schedules: 2"
    assert lines[1].split() == [
        "name",
        "rule",
        "timezone",
        "queue",
        "next",
        "fire",
        "last",
        "fire",
        "fires",
        "state",
    ]
    nightly = row(table, "nightly")
    assert nightly[1:7] == ["0", "2", "*", "*", "*", "Asia/Tokyo"]
    assert nightly[7] == "default"
    assert nightly[-2:] == ["1", "active"]
    last = fake.schedules["nightly"].last_fire_at
    assert last is not None
    assert admin._at(last) in nightly
    assert row(table, "tick")[1:] == ["every", "30s", "-", "ticks", "-", "-", "0", "paused"]
    assert fake.tasks[task_id].schedule == "nightly"


def test_wq_schedule_get_pause_resume_delete(on_fake: FakeTransport) -> None:
    fake = on_fake
    wq("schedule", "set", "s", "-every", "2m", "-payload", '{"a": [1, 2]}', "-timeout-ms", "9000")
    task_id = fake.fire("s")
    code, table, err = wq("schedule", "get", "s")
    assert (code, err) == (0, "")
    assert table.splitlines()[0] == "schedule s"
    assert value(table, "rule") == "every 2m"
    assert value(table, "state") == "active"
    assert value(table, "last task") == task_id
    last = fake.schedules["s"].last_fire_at
    assert last is not None
    assert value(table, "last fire") == admin.rfc3339(last)
    assert value(table, "fires") == "1"
    assert value(table, "time limit") == "9,000 ms"
    assert '"a": [' in table
    assert wq_json("schedule", "get", "s") == admin.schedule_json(fake.schedules["s"])

    assert wq("schedule", "pause", "s") == (
        0,
        "paused schedule s: no fires until it is resumed\n",
        "",
    )
    assert value(wq("schedule", "get", "s")[1], "next fire") == "- (paused)"
    view = wq_json("schedule", "resume", "s")
    assert (view["paused"], view["name"]) == (False, "s")
    code, out, _ = wq("schedule", "resume", "s")
    assert (code, out) == (0, f"resumed schedule s: next fire {view['next_fire_at']}\n")
    assert wq_json("schedule", "pause", "s")["paused"] is True
    assert wq("schedule", "delete", "s") == (
        0,
        "deleted schedule s (the tasks it fired stay)\n",
        "",
    )
    assert task_id in fake.tasks
    for action in ("get", "delete", "pause", "resume"):
        assert wq("schedule", action, "s") == (3, "", "wq: schedule s not found\n"), action
    assert wq_json("schedule", "set", "s", "-every", "1s", "-payload", "1")["name"] == "s"
    assert wq_json("schedule", "delete", "s") == {"schedule": "s", "deleted": True}


def test_wq_schedule_needs_an_action_and_a_name(
    on_fake: FakeTransport, capsys: pytest.CaptureFixture[str]
) -> None:
    assert wq("schedule") == (
        2,
        "",
        "wq: schedule needs an action: one of set, get, delete, pause, resume\n",
    )
    assert wq("schedule", "fire", "s")[0] == 2
    for action in ("get", "delete", "pause", "resume", "set"):
        code, out, err = wq_errors(capsys, "schedule", action)
        assert (code, out) == (2, ""), action
        assert len(err.splitlines()) == 1


def test_wq_task_shows_the_schedule_that_fired_it(on_fake: FakeTransport) -> None:
    fake = on_fake
    wq("schedule", "set", "tick", "-every", "10s", "-payload", "7")
    task_id = fake.fire("tick")
    fired_for = fake.tasks[task_id].scheduled_for
    assert fired_for is not None
    code, table, _ = wq("task", task_id)
    assert code == 0
    assert value(table, "schedule") == "tick"
    assert value(table, "scheduled for") == admin.rfc3339(fired_for)
    view = wq_json("task", task_id)
    assert (view["schedule"], view["scheduled_for"]) == ("tick", admin.rfc3339(fired_for))
    plain = wq_json("task", fake.add(1))
    assert "schedule" not in plain
    assert "scheduled_for" not in plain


def test_wq_limits_set_show_clear(on_fake: FakeTransport) -> None:
    fake = on_fake
    fake.add(1, queue="mail")
    assert wq("limits", "mail") == (0, "queue mail: no limits\n", "")
    assert wq_json("limits", "mail") == {
        "queue": "mail",
        "limits": None,
        "tokens": None,
        "handed_out": 0,
    }
    assert wq("limits", "mail", "-rate", "20/s", "-concurrency", "4") == (
        0,
        "queue mail: rate 20/s, concurrency 4\n",
        "",
    )
    assert fake.limits["mail"] == Limits(RateLimit(20, 1000, 20), 4)
    fake.hand_out(None, ["mail"])
    code, out, err = wq("limits", "mail")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == "queue mail: rate 20/s, concurrency 4"
    assert row(out, "mail")[5:9] == ["20/s", "20", "1/4", "active"]
    assert wq_json("limits", "mail") == {
        "queue": "mail",
        "limits": {"rate": {"tasks": 20, "per_ms": 1000, "burst": 20}, "concurrency": 4},
        "tokens": 20.0,
        "handed_out": 1,
    }
    # The flags given replace the limits: a kind not given is no limit.
    assert wq_json("limits", "mail", "--rate=100/1m", "-burst", "5") == {
        "queue": "mail",
        "limits": {"rate": {"tasks": 100, "per_ms": 60000, "burst": 5}, "concurrency": None},
    }
    assert wq("limits", "mail", "-rate", "5/500ms")[1] == "queue mail: rate 5/500ms\n"
    assert wq("limits", "mail", "-concurrency", "2")[1] == "queue mail: concurrency 2\n"
    assert wq("limits", "mail", "-clear") == (0, "queue mail: limits cleared\n", "")
    assert "mail" not in fake.limits
    assert wq_json("limits", "mail", "-clear") == {"queue": "mail", "limits": None}
    assert wq_json("limits", "new", "-concurrency", "1")["limits"] == {
        "rate": None,
        "concurrency": 1,
    }
    assert "new" in fake.known_queues  # (setting limits on an unknown queue makes it)


@pytest.mark.parametrize(
    ("argv", "code", "problem"),
    [
        (["nope"], 3, "wq: queue nope not found"),
        (["mail", "-burst", "5"], 2, "-burst goes with -rate"),
        (["mail", "-clear", "-rate", "1/s"], 2, "-clear takes the limits away"),
        (["mail", "-rate", "20"], 2, "'20' is not a rate"),
        (["mail", "-rate", "x/s"], 2, "is not a rate"),
        (["mail", "-rate", "20/fortnight"], 2, "is not a duration"),
        (["mail", "-rate", "20/s", "-concurrency", "0"], 2, "must be at least 1"),
        (["mail", "-rate", "0/s"], 2, "rate.tasks must be from 1 to 1000000, got 0"),
        ([], 2, "the following arguments are required: QUEUE"),
    ],
)
def test_wq_limits_usage_errors(
    on_fake: FakeTransport,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    code: int,
    problem: str,
) -> None:
    on_fake.add(1, queue="mail")
    got, out, err = wq_errors(capsys, "limits", *argv)
    assert (got, out) == (code, "")
    assert problem in err
    assert len(err.splitlines()) == 1
    assert on_fake.limits == {}


def test_wq_queues_shows_limit_columns_once_a_queue_has_limits(on_fake: FakeTransport) -> None:
    fake = on_fake
    fake.add(1, queue="mail")
    code, table, _ = wq("queues")
    assert code == 0
    assert "rate" not in table.splitlines()[1]  # (the table it always was)
    assert wq_json("queues")[0]["limits"] is None
    wq("limits", "mail", "-rate", "100/1m", "-burst", "10", "-concurrency", "3")
    code, table, _ = wq("queues")
    assert table.splitlines()[1].split() == [
        "queue",
        "ready",
        "handed",
        "out",
        "delayed",
        "dead",
        "rate",
        "tokens",
        "concurrency",
        "state",
    ]
    assert row(table, "mail")[5:] == ["100/m", "burst", "10", "10", "0/3", "active"]
    assert row(table, "default")[5:] == ["-", "-", "-", "active"]
    [default, mail] = wq_json("queues")
    assert mail["limits"] == {
        "rate": {"tasks": 100, "per_ms": 60000, "burst": 10},
        "concurrency": 3,
    }
    assert (mail["tokens"], default["limits"], default["tokens"]) == (10.0, None, None)


def test_wq_help_lists_the_new_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert admin.main(["-h"]) == 0
    help_text = capsys.readouterr().out
    for command in (
        "limits",
        "schedules",
        "schedule set",
        "schedule get",
        "schedule delete",
        "schedule pause",
        "schedule resume",
    ):
        assert f"\n  {command} " in help_text, command
    assert admin.main(["schedule", "set", "-h"]) == 0
    help_text = capsys.readouterr().out
    for flag in ("-cron", "-timezone", "-every", "-payload", "-paused", "-timeout-ms"):
        assert flag in help_text
    assert admin.main(["limits", "-h"]) == 0
    assert "N/PERIOD" in capsys.readouterr().out


# -- durations and rates --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "ms"),
    [
        ("30s", 30_000),
        ("5m", 300_000),
        ("1h30m", 5_400_000),
        ("1500ms", 1_500),
        ("1.5h", 5_400_000),
        ("2d", 172_800_000),
        (" 10S ", 10_000),
    ],
)
def test_durations(text: str, ms: int) -> None:
    assert admin.parse_duration_ms(text) == ms


@pytest.mark.parametrize("text", ["", "5", "5 m", "m", "1.2345s", "5w", "-5s", "5s3"])
def test_what_is_not_a_duration(text: str) -> None:
    with pytest.raises(ValueError, match=r"duration|milliseconds"):
        admin.parse_duration_ms(text)


@pytest.mark.parametrize(
    ("text", "rate", "shown"),
    [
        ("20/s", (20, 1000), "20/s"),
        ("20/1s", (20, 1000), "20/s"),
        ("100/1m", (100, 60_000), "100/m"),
        ("5/500ms", (5, 500), "5/500ms"),
        ("1000/h", (1000, 3_600_000), "1,000/h"),
        ("7/90s", (7, 90_000), "7/90s"),
        ("3/2d", (3, 172_800_000), "3/2d"),
    ],
)
def test_rates(text: str, rate: tuple[int, int], shown: str) -> None:
    assert admin.parse_rate(text) == rate
    assert admin.format_rate(RateLimit(*rate)) == shown
    assert admin.format_rate(RateLimit(*rate, burst=rate[0])) == shown
    assert admin.format_rate(RateLimit(*rate, burst=99)) == f"{shown} burst 99"


def test_a_queue_s_limits_in_its_table_row() -> None:
    limited = QueueInfo("q", handed_out=4, limits=Limits(RateLimit(3, 1000, 3), 4), tokens=1.96)
    cells = [c.plain for c in admin._limit_cells(limited)]
    assert cells == ["3/s", "1.9", "4/4"]  # (tokens down: a token not all there is none)
    assert [c.plain for c in admin._limit_cells(QueueInfo("free"))] == ["-", "-", "-"]
