"""The rule of a schedule (wqbroker/schedules.py, docs/design/schedules.md): cron expressions and
their macros, names, steps, ranges and lists; time zones, and the daylight-saving transitions in
two of them, both ways; intervals; the latest fire time after a long downtime (in a few steps);
and what a bad rule is told. Also the checks of a schedule's members (wqbroker/limits.py) and the
reading of -schedule-file (wqbroker/schedulefile.py)."""

from __future__ import annotations

import itertools
import json
import time
from datetime import UTC, datetime, tzinfo
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from wqbroker import limits
from wqbroker.errors import InvalidArgument, PayloadTooLarge
from wqbroker.models import ScheduleTask
from wqbroker.schedulefile import ScheduleFileError, read_schedules
from wqbroker.schedules import MACROS, Rule, five_fields
from wqbroker.service import ScheduleSubmission

BERLIN = ZoneInfo("Europe/Berlin")
NEW_YORK = ZoneInfo("America/New_York")


def at(year: int, month: int, day: int, hour: int = 0, minute: int = 0, tz: tzinfo = UTC) -> float:
    """An epoch time from a wall-clock time in a zone (the first, if it occurs twice)."""
    return datetime(year, month, day, hour, minute, tzinfo=tz).timestamp()


def utc(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M")


def local(t: float, tz: ZoneInfo) -> str:
    return datetime.fromtimestamp(t, tz).strftime("%Y-%m-%d %H:%M %Z")


def fires(rule: Rule, start: float, end: float) -> list[float]:
    """Every fire time of ``rule`` in (start, end], by next_after."""
    out = []
    t = rule.next_after(start)
    while t <= end:
        out.append(t)
        t = rule.next_after(t)
    return out


# -- cron ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("macro", "first"),
    [
        ("@yearly", "2027-01-01 00:00"),
        ("@annually", "2027-01-01 00:00"),
        ("@monthly", "2026-04-01 00:00"),
        ("@weekly", "2026-03-22 00:00"),  # (a Sunday)
        ("@daily", "2026-03-19 00:00"),
        ("@midnight", "2026-03-19 00:00"),
        ("@hourly", "2026-03-18 13:00"),
    ],
)
def test_each_macro_fires_as_its_five_fields(macro: str, first: str) -> None:
    rule = Rule.parse(macro)
    assert rule.cron == macro  # (kept as given)
    assert utc(rule.next_after(at(2026, 3, 18, 12, 30))) == first
    same = Rule.parse(MACROS[macro])
    t = at(2026, 3, 18, 12, 30)
    assert fires(rule, t, t + 400 * 86400) == fires(same, t, t + 400 * 86400)


def test_macros_are_taken_in_any_case_and_with_spaces_around() -> None:
    assert five_fields(" @Hourly ") == "0 * * * *"
    assert Rule.parse("@DAILY").cron == "@DAILY"


def test_next_after_is_strictly_after() -> None:
    rule = Rule.parse("*/15 * * * *")
    t = at(2026, 3, 18, 12, 15)
    assert rule.next_after(t) == t + 900
    assert rule.next_after(t - 0.001) == t
    assert rule.next_after(t + 0.5) == t + 900


def test_names_steps_ranges_and_lists() -> None:
    # Weekdays (by name) at 9:30, in January and July only.
    rule = Rule.parse("30 9 * JAN,JUL MON-FRI")
    got = fires(rule, at(2026, 1, 1), at(2026, 12, 31))
    assert len(got) == 22 + 23  # (the weekdays of January and July 2026)
    assert all(datetime.fromtimestamp(t, UTC).weekday() < 5 for t in got)
    assert {datetime.fromtimestamp(t, UTC).month for t in got} == {1, 7}
    assert utc(got[0]) == "2026-01-01 09:30"
    # Every 20 minutes from minute 5, hours 8 to 10.
    rule = Rule.parse("5/20 8-10 * * *")
    shown = [utc(t) for t in fires(rule, at(2026, 3, 18), at(2026, 3, 18, 23))]
    assert shown == [f"2026-03-18 {h:02d}:{m:02d}" for h in (8, 9, 10) for m in (5, 25, 45)]
    # Lowercase names, and the last Friday of the month.
    assert utc(Rule.parse("0 12 * * fri").next_after(at(2026, 3, 18))) == "2026-03-20 12:00"
    assert utc(Rule.parse("0 0 * * 5L").next_after(at(2026, 3, 1))) == "2026-03-27 00:00"


def test_a_timezone_moves_the_wall_clock_time() -> None:
    rule = Rule.parse("0 9 * * *", "America/New_York")
    t = rule.next_after(at(2026, 1, 10))
    assert local(t, NEW_YORK) == "2026-01-10 09:00 EST"
    assert utc(t) == "2026-01-10 14:00"
    summer = rule.next_after(at(2026, 7, 10))
    assert local(summer, NEW_YORK) == "2026-07-10 09:00 EDT"
    assert utc(summer) == "2026-07-10 13:00"


# Daylight saving: a time in a skipped hour fires once, just after it (at the end of the gap); a
# time in a repeated hour fires once (its first occurrence). In two zones, both ways.
@pytest.mark.parametrize(
    ("zone", "day", "expected"),
    [
        # Europe/Berlin skips 02:00-03:00 on 2026-03-29.
        ("Europe/Berlin", (2026, 3, 29), "2026-03-29 03:00 CEST"),
        # America/New_York skips 02:00-03:00 on 2026-03-08.
        ("America/New_York", (2026, 3, 8), "2026-03-08 03:00 EDT"),
    ],
)
def test_a_time_in_a_skipped_hour_fires_once_just_after_it(
    zone: str, day: tuple[int, int, int], expected: str
) -> None:
    tz = ZoneInfo(zone)
    rule = Rule.parse("30 2 * * *", zone)
    start = at(*day, tz=tz) - 86400  # the day before, midnight
    got = fires(rule, start, start + 3 * 86400)
    shown = [local(t, tz) for t in got]
    assert shown[1] == expected
    assert len(got) == 3  # once a day: the day before, the day of the change, the day after
    assert shown[0].endswith("02:30 " + ("CET" if zone == "Europe/Berlin" else "EST"))
    assert shown[2].endswith("02:30 " + ("CEST" if zone == "Europe/Berlin" else "EDT"))


@pytest.mark.parametrize(
    ("zone", "day", "first"),
    [
        # Europe/Berlin repeats 02:00-03:00 on 2026-10-25 (CEST, then CET).
        ("Europe/Berlin", (2026, 10, 25), "2026-10-25 02:30 CEST"),
        # America/New_York repeats 01:00-02:00 on 2026-11-01 (EDT, then EST).
        ("America/New_York", (2026, 11, 1), "2026-11-01 01:30 EDT"),
    ],
)
def test_a_time_in_a_repeated_hour_fires_once(
    zone: str, day: tuple[int, int, int], first: str
) -> None:
    tz = ZoneInfo(zone)
    hour = 2 if zone == "Europe/Berlin" else 1
    rule = Rule.parse(f"30 {hour} * * *", zone)
    start = at(*day, tz=tz)
    got = fires(rule, start, start + 2 * 86400)
    assert [local(t, tz) for t in got[:1]] == [first]
    assert len(got) == 2  # that day once, the next day once
    assert got[1] - got[0] == 25 * 3600  # (the repeated hour: a day of 25 hours)
    # From a moment inside the second occurrence of the hour, the next fire is the next day's
    # (the first occurrence has fired; it is not fired again).
    second = got[0] + 3600  # the same wall-clock time, an hour later
    assert rule.next_after(second) == got[1]


def test_an_hourly_rule_fires_every_real_hour_across_the_transitions() -> None:
    rule = Rule.parse("0 * * * *", "Europe/Berlin")
    spring = fires(rule, at(2026, 3, 28, 22), at(2026, 3, 29, 6))
    autumn = fires(rule, at(2026, 10, 24, 22), at(2026, 10, 25, 6))
    assert all(b - a == 3600 for a, b in itertools.pairwise(spring))
    assert all(b - a == 3600 for a, b in itertools.pairwise(autumn))
    assert (len(spring), len(autumn)) == (8, 8)


@pytest.mark.parametrize("zone", ["Europe/Berlin", "America/New_York"])
@pytest.mark.parametrize("cron", ["30 2 * * *", "15 1-3 * * *", "0 2,3 * * SUN", "*/10 * * * *"])
def test_the_latest_fire_is_the_forward_walks_around_transitions(zone: str, cron: str) -> None:
    """latest_at_or_before (which may walk backward) agrees with the forward walk at every
    moment of the days around both transitions."""
    rule = Rule.parse(cron, zone)
    for start in (at(2026, 3, 7), at(2026, 3, 28), at(2026, 10, 24), at(2026, 10, 31)):
        end = start + 3 * 86400
        chain = fires(rule, start, end)
        for t in range(int(chain[0]), int(end), 599):
            expected = max(x for x in chain if x <= t)
            assert rule.latest_at_or_before(t, start) == expected, local(t, ZoneInfo(zone))
            scheduled, following = rule.due(chain[0], t)
            assert scheduled == expected
            assert following == min(x for x in [*chain, rule.next_after(end)] if x > t)


def test_the_latest_fire_after_a_year_of_downtime_is_found_in_a_few_steps() -> None:
    rule = Rule.parse("* * * * *")
    since = at(2026, 1, 1)
    started = time.perf_counter()
    latest = rule.latest_at_or_before(since + 365 * 86400 + 30.5, since)
    assert time.perf_counter() - started < 0.5  # (half a million steps forward would not be)
    assert latest == at(2027, 1, 1)
    scheduled, following = rule.due(since + 60, since + 365 * 86400 + 30.5)
    assert (scheduled, following) == (at(2027, 1, 1), at(2027, 1, 1, 0, 1))
    # A rule at set times in a zone with daylight saving walks forward from near the end.
    rule = Rule.parse("0-59 0-23 * * *", "Europe/Berlin")
    started = time.perf_counter()
    assert rule.latest_at_or_before(since + 365 * 86400 + 30.5, since) == at(2027, 1, 1)
    assert time.perf_counter() - started < 0.5


def test_the_latest_fire_in_an_empty_range_is_none() -> None:
    rule = Rule.parse("0 12 * * *")
    assert rule.latest_at_or_before(at(2026, 3, 18, 11), at(2026, 3, 18, 10)) is None
    assert rule.latest_at_or_before(at(2026, 3, 18, 12), at(2026, 3, 18, 10)) == at(2026, 3, 18, 12)
    # (since, t]: a fire at ``since`` itself is not in it.
    assert rule.latest_at_or_before(at(2026, 3, 18, 13), at(2026, 3, 18, 12)) is None


# -- every --------------------------------------------------------------------------------------


def test_every_counts_from_the_previous_scheduled_time() -> None:
    rule = Rule.parse(None, None, 60.0)
    assert (rule.cron, rule.every, rule.timezone) == (None, 60.0, "UTC")
    t = 1_800_000_000.25
    assert rule.next_after(t) == t + 60
    # Due at t + 60, looked at 10 s late: that time, the next 60 s after it (not after now).
    assert rule.due(t + 60, t + 70) == (t + 60, t + 120)
    # After an hour and a half away: once, for the most recent time of the chain.
    assert rule.due(t + 60, t + 5400 + 5) == (t + 5400, t + 5460)
    assert rule.due(t + 60, t + 60) == (t + 60, t + 120)
    assert rule.latest_at_or_before(t + 5405, t) == t + 5400
    assert rule.latest_at_or_before(t + 59, t) is None


def test_every_after_a_long_gap_is_arithmetic() -> None:
    rule = Rule.parse(None, None, 1.0)
    t = 1_800_000_000.0
    started = time.perf_counter()
    assert rule.due(t + 1, t + 10 * 365 * 86400 + 0.5) == (
        t + 10 * 365 * 86400,
        t + 10 * 365 * 86400 + 1,
    )
    assert time.perf_counter() - started < 0.01


# -- bad rules ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cron", "words"),
    [
        ("0 0 * * * *", "has 6 fields: it must have five"),
        ("0 0 0 * * * *", "has 7 fields"),
        ("* * * *", "has 4 fields"),
        ("", "has 0 fields"),
        ("61 * * * *", "is not a valid cron expression: bad minute"),
        ("* 24 * * *", "bad hour"),
        ("0 0 30 2 *", "bad day-of-month"),
        ("0 0 * 13 *", "bad month"),
        ("0 0 * * FUNDAY", "bad day-of-week"),
        ("*/0 * * * *", "bad minute"),
        ("@reboot", "is not a macro this broker knows"),
        ("@every 5m", "is not a macro"),
    ],
)
def test_a_bad_cron_is_refused_naming_cron_and_why(cron: str, words: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        Rule.parse(cron)
    assert e.value.message.startswith(f"cron {cron!r} ")
    assert words in e.value.message


@pytest.mark.parametrize("zone", ["Mars/Olympus", "utc", "Europe", "../etc/passwd", "/etc/x", ""])
def test_an_unknown_timezone_is_refused_naming_timezone(zone: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        Rule.parse("0 * * * *", zone)
    assert e.value.message.startswith("timezone ")
    assert "is not a known IANA time zone" in e.value.message


def test_exactly_one_of_cron_and_every() -> None:
    with pytest.raises(InvalidArgument, match="exactly one of cron and every_ms"):
        Rule.parse(None, None, None)
    with pytest.raises(InvalidArgument, match="exactly one of cron and every_ms"):
        Rule.parse("* * * * *", None, 60.0)
    with pytest.raises(InvalidArgument, match="timezone goes only with cron"):
        Rule.parse(None, "Europe/Berlin", 60.0)


# -- the members of a schedule (limits.schedule_value) -------------------------------------------


def sub(**members: object) -> ScheduleSubmission:
    payload = members.pop("payload", b'{"job": 1}')
    assert payload is None or isinstance(payload, bytes)
    return ScheduleSubmission(payload, **members)


def test_a_schedules_members_are_checked_into_a_schedule() -> None:
    checked = limits.schedule_value(
        "nightly",
        sub(
            cron="0 3 * * *",
            timezone="Europe/Berlin",
            queue="reports",
            priority=7,
            max_attempts=5,
            expires_in_ms=60_000,
            timeout_ms=30_000,
            result_ttl_ms=0,
            paused=True,
        ),
        1000,
    )
    assert (checked.name, checked.cron, checked.timezone, checked.every) == (
        "nightly",
        "0 3 * * *",
        "Europe/Berlin",
        None,
    )
    assert checked.task == ScheduleTask(b'{"job": 1}', "reports", 7, 5, 60.0, 30.0, 0.0)
    assert checked.paused is True
    defaults = limits.schedule_value("tick", sub(every_ms=1000), 1000)
    assert (defaults.every, defaults.timezone, defaults.paused) == (1.0, "UTC", False)
    assert defaults.task == ScheduleTask(b'{"job": 1}', "default", 0, 3, None, None, None)


@pytest.mark.parametrize(
    ("members", "message"),
    [
        ({}, "cron or every_ms is required (exactly one of them)"),
        ({"cron": "* * * * *", "every_ms": 1000}, "cron and every_ms cannot both be given"),
        ({"every_ms": 1000, "timezone": "UTC"}, "timezone goes only with cron"),
        (
            {"every_ms": 999},
            "every_ms must be from 1000 (a second) to 31536000000 (a year), got 999",
        ),
        ({"every_ms": 31536000001}, "every_ms must be from 1000"),
        ({"every_ms": 1.5}, "every_ms must be an integer, got the number 1.5"),
        ({"every_ms": True}, "every_ms must be an integer, got a boolean"),
        ({"cron": 5}, "cron must be a string, got int"),
        ({"cron": "* * * * *", "timezone": 1}, "timezone must be a string, got int"),
        ({"every_ms": 1000, "queue": "a b"}, "queue 'a b' is not a queue name"),
        ({"every_ms": 1000, "priority": 10}, "priority must be from 0 to 9, got 10"),
        ({"every_ms": 1000, "max_attempts": 0}, "max_attempts must be at least 1, got 0"),
        ({"every_ms": 1000, "expires_in_ms": 0}, "expires_in_ms must be from 1 to"),
        ({"every_ms": 1000, "timeout_ms": -1}, "timeout_ms must be from 1 to"),
        ({"every_ms": 1000, "result_ttl_ms": -1}, "result_ttl_ms must be from 0 to"),
        ({"every_ms": 1000, "paused": "yes"}, "paused must be a boolean, got a string"),
        ({"every_ms": 1000, "payload": None}, "payload is required"),
        ({"every_ms": 1000, "payload": b"{nope"}, "payload"),
    ],
)
def test_a_bad_member_is_refused_naming_it(members: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        limits.schedule_value("s", sub(**members), 1000)
    assert message in e.value.message


def test_a_payload_over_the_limit_is_too_large() -> None:
    with pytest.raises(PayloadTooLarge, match="payload is larger than the limit of 10 bytes"):
        limits.schedule_value("s", sub(every_ms=1000, payload=b'"0123456789"'), 10)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        (None, "name is required"),
        ("", "name is required"),
        (5, "name must be a string, got int"),
        ("a b", "name 'a b' is not a schedule name (1-64 characters of A-Z a-z 0-9 _ . -)"),
        ("x" * 65, "is not a schedule name"),
    ],
)
def test_a_bad_schedule_name_is_refused_naming_name(name: object, message: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        limits.schedule_name_value(name)
    assert message in e.value.message


def test_a_good_schedule_name_is_taken() -> None:
    assert limits.schedule_name_value("nightly-report_2.v1") == "nightly-report_2.v1"


# -- -schedule-file -----------------------------------------------------------------------------


def test_a_toml_file_is_read_with_its_payloads_as_json(tmp_path: Path) -> None:
    path = tmp_path / "s.toml"
    path.write_text(
        "[schedules.nightly]\n"
        'cron = "0 3 * * *"\n'
        'timezone = "Europe/Berlin"\n'
        'payload = { kind = "nightly", n = [1, 2.5, true] }\n'
        "[schedules.tick]\n"
        "every_ms = 1000\n"
        'queue = "ticks"\n'
        'payload = "tick"\n'
        "paused = true\n"
    )
    got = read_schedules(str(path))
    assert [name for name, _ in got] == ["nightly", "tick"]
    nightly, tick = got[0][1], got[1][1]
    assert json.loads(nightly.payload or b"") == {"kind": "nightly", "n": [1, 2.5, True]}
    assert (nightly.cron, nightly.timezone, nightly.every_ms) == (
        "0 3 * * *",
        "Europe/Berlin",
        None,
    )
    assert (tick.payload, tick.every_ms, tick.queue, tick.paused) == (
        b'"tick"',
        1000,
        "ticks",
        True,
    )


def test_a_json_file_is_read(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"schedules": {"a": {"every_ms": 5000, "payload": {"x": "é"}}}}))
    ((name, spec),) = read_schedules(str(path))
    assert (name, spec.every_ms, spec.payload) == ("a", 5000, '{"x":"é"}'.encode())


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("s.toml", "[schedules.a\n", "s.toml is not valid TOML"),
        ("s.json", "{", "s.json is not valid JSON"),
        ("s.json", "[]", "must hold an object with a schedules member"),
        ("s.json", '{"jobs": {}}', "unknown member 'jobs'"),
        ("s.json", "{}", "has no schedules member"),
        ("s.json", '{"schedules": []}', "schedules must be a table of schedules by name"),
        ("s.json", '{"schedules": {"a": 5}}', "schedule 'a' must be a table of its members"),
        (
            "s.toml",
            '[schedules.a]\nevery_ms = 1000\ncorn = "* * * * *"\n',
            "schedule 'a': unknown member 'corn'",
        ),
        (
            "s.toml",
            "[schedules.a]\nevery_ms = 1000\npayload = 1979-05-27\n",
            "schedule 'a': payload holds a value JSON has none for",
        ),
    ],
)
def test_a_bad_file_is_told_naming_the_schedule_and_the_member(
    tmp_path: Path, name: str, text: str, message: str
) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ScheduleFileError) as e:
        read_schedules(str(path))
    assert str(e.value).startswith(str(path))
    assert message in str(e.value)


def test_a_missing_file_is_told(tmp_path: Path) -> None:
    with pytest.raises(ScheduleFileError, match=r"cannot read .*nope\.toml"):
        read_schedules(str(tmp_path / "nope.toml"))
