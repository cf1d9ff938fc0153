"""``-schedule-file FILE`` (docs/design/schedules.md): the schedules a broker puts at start-up.

TOML (a file named ``*.toml``) or JSON (any other name)::

    [schedules.nightly-report]          {"schedules": {"nightly-report": {
    cron = "0 3 * * *"                      "cron": "0 3 * * *",
    timezone = "Europe/Berlin"              "timezone": "Europe/Berlin",
    queue = "reports"                       "queue": "reports",
    payload = { kind = "nightly" }          "payload": {"kind": "nightly"}}}}

Each schedule has the members of ``PUT /schedules/{name}`` (``payload`` is the task's JSON value,
any TOML value that JSON has too). At start-up each is put as that call puts it: replacing the
schedule of that name, or (the same rule, task and paused flag as stored) leaving it as it
stands, its next fire time kept. Schedules not in the file are left alone.
:func:`read_schedules` checks the file's shape (before the store is opened); :func:`put_all` puts
each schedule through the service, whose checks name the member. Either raises
:class:`ScheduleFileError`: one line naming the file, the schedule and the member.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Sequence
from typing import Any, Final

from wqbroker.errors import InvalidArgument, PayloadTooLarge
from wqbroker.service import ScheduleSubmission, Service

#: The members a schedule may have (those of PUT /schedules/{name}).
MEMBERS: Final = (
    "cron",
    "timezone",
    "every_ms",
    "payload",
    "queue",
    "priority",
    "max_attempts",
    "expires_in_ms",
    "timeout_ms",
    "result_ttl_ms",
    "paused",
)


class ScheduleFileError(Exception):
    """The file cannot be used: one line, naming the file (and the schedule and the member)."""


def read_schedules(path: str) -> list[tuple[str, ScheduleSubmission]]:
    """The schedules of the file, by name in the file's order, their members as given."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ScheduleFileError(f"cannot read {path}: {e.strerror or e}") from None
    top = _parse(path, data)
    if not isinstance(top, dict):
        raise ScheduleFileError(f"{path}: must hold an object with a schedules member")
    unknown = [k for k in top if k != "schedules"]
    if unknown:
        raise ScheduleFileError(
            f"{path}: unknown member {unknown[0]!r} (the one it has: schedules)"
        )
    table = top.get("schedules")
    if table is None:
        raise ScheduleFileError(f"{path}: has no schedules member")
    if not isinstance(table, dict):
        raise ScheduleFileError(f"{path}: schedules must be a table of schedules by name")
    return [(str(name), _submission(path, str(name), spec)) for name, spec in table.items()]


def _parse(path: str, data: bytes) -> Any:
    if path.endswith(".toml"):
        try:
            return tomllib.loads(data.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ScheduleFileError(f"{path} is not UTF-8 text: {e.reason}") from None
        except tomllib.TOMLDecodeError as e:
            raise ScheduleFileError(f"{path} is not valid TOML: {e}") from None
    try:
        return json.loads(data)
    except UnicodeDecodeError as e:
        raise ScheduleFileError(f"{path} is not UTF-8 text: {e.reason}") from None
    except json.JSONDecodeError as e:
        raise ScheduleFileError(
            f"{path} is not valid JSON (a file not named .toml is read as JSON): {e}"
        ) from None


def _submission(path: str, name: str, spec: object) -> ScheduleSubmission:
    where = f"{path}: schedule {name!r}"
    if not isinstance(spec, dict):
        raise ScheduleFileError(f"{where} must be a table of its members")
    unknown = [k for k in spec if k not in MEMBERS]
    if unknown:
        raise ScheduleFileError(
            f"{where}: unknown member {unknown[0]!r} (the members: {', '.join(MEMBERS)})"
        )
    payload = None
    if "payload" in spec:
        try:
            text = json.dumps(spec["payload"], ensure_ascii=False, separators=(",", ":"))
        except (TypeError, ValueError):
            raise ScheduleFileError(
                f"{where}: payload holds a value JSON has none for (a TOML date or time)"
            ) from None
        payload = text.encode("utf-8")
    members = {k: v for k, v in spec.items() if k != "payload"}
    return ScheduleSubmission(payload, **members)


async def put_all(
    service: Service, path: str, schedules: Sequence[tuple[str, ScheduleSubmission]]
) -> None:
    """Put each schedule of the file (see the module's docstring)."""
    for name, sub in schedules:
        try:
            await service.put_schedule(name, sub)
        except (InvalidArgument, PayloadTooLarge) as e:
            raise ScheduleFileError(f"{path}: schedule {name!r}: {e.message}") from None
