"""``wq`` (``python -m wqclient.cli.admin``): the admin command, for people at a terminal.

``wq stats``, ``wq queues``, ``wq dlq [list|requeue|purge]``, ``wq task ID``, ``wq tasks QUEUE``
(a queue's tasks in one state, a page at a time), ``wq cancel ID``, ``wq result ID`` (how a task
ended, waiting for it with ``-wait``: docs/design/results.md), ``wq enqueue JSON`` (``-after``:
tasks it waits for), ``wq pause QUEUE``, ``wq resume QUEUE``, ``wq queue empty|delete NAME``,
``wq schedules`` and ``wq schedule set|get|delete|pause|resume NAME`` (cron and interval
schedules), ``wq limits QUEUE`` (a queue's rate and concurrency limits: docs/design/schedules.md)
and ``wq watch`` (a live view of the gauges and rates).
Each prints a table for people (the ``rich`` library: colours only when standard output is a
terminal) or, with ``-json``, one JSON document with the HTTP API's member names (``wq watch
-json``: one document a line, a line per refresh).

The flags follow the other commands (:mod:`wqwire.flags`): one dash or two, the value after a
space or ``=``, and the common ones (``-broker``, ``-token``, ``-ca-file``, ``-timeout``,
``-json``) before or after the command. An error is one line on standard error, ``wq: message``,
and an exit status that says what kind (:data:`EXIT_CODES`); never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, fields
from datetime import UTC, datetime
from typing import Any, Final, NoReturn, TextIO

from rich import box
from rich.columns import Columns
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.measure import Measurement
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from wqclient.cli import SettingError, add_connection_flags, connection, quiet_grpc
from wqclient.client import AsyncClient
from wqclient.errors import (
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
    WqError,
)
from wqclient.models import (
    CANCELLED,
    CANCELLING,
    LIST_STATES,
    Limits,
    QueueInfo,
    RateLimit,
    Schedule,
    Stats,
    Task,
    TaskResult,
    Totals,
)
from wqwire.flags import (
    FlagParser,
    add_switch,
    non_negative_int,
    positive_int,
    priority,
    spell_switches,
    switch_spellings,
)

PROG: Final = "wq"

# -- exit codes ---------------------------------------------------------------------------------

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1  # the broker refused the call for another reason (a queue not empty ...)
EXIT_USAGE: Final = 2  # a bad command line: flags, a payload that is not JSON, a bad queue name
EXIT_NOT_FOUND: Final = 3  # no such task (or not in the dead-letter queue), queue or schedule
EXIT_UNAVAILABLE: Final = 4  # the broker cannot be reached, is shutting down, or is at a limit
EXIT_REFUSED: Final = 5  # the broker refused the token (missing, unknown, or lacking a scope)
EXIT_PENDING: Final = 6  # `wq result`: the task was still pending when -wait ran out
EXIT_INTERRUPTED: Final = 130  # Ctrl-C (except in `wq watch`, which it ends normally)

EXIT_CODES: Final = {
    EXIT_OK: "success",
    EXIT_FAILED: "the broker refused the call (for a reason not below: a queue to delete that "
    "still\n       holds tasks ...)",
    EXIT_USAGE: "usage: a bad flag or argument, a payload that is not JSON, a value the "
    "broker\n       rejects (a bad queue name ...)",
    EXIT_NOT_FOUND: "not found: no such task (or not in the dead-letter queue), no such queue "
    "or schedule",
    EXIT_UNAVAILABLE: "the broker cannot be reached (its TLS certificate failing verification "
    "included), is shutting down, or is at a limit (429)",
    EXIT_REFUSED: "the broker refused the token (none, unknown, or without the scope needed)",
    EXIT_PENDING: "wq result: the task was still pending when -wait ran out (and 1: it did not "
    "succeed)",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
}


class _Usage(Exception):
    """A bad command line found after parsing (exit status 2)."""


def exit_code(error: WqError) -> int:
    """The exit status for an error the client raised."""
    if isinstance(error, NotFound):
        return EXIT_NOT_FOUND
    if isinstance(error, (Unauthenticated, PermissionDenied)):
        return EXIT_REFUSED
    if isinstance(error, Unavailable):
        return EXIT_UNAVAILABLE
    if isinstance(error, InvalidArgument):
        return EXIT_USAGE
    return EXIT_FAILED


# -- JSON: the HTTP API's shapes ------------------------------------------------------------------


def rfc3339(when: datetime) -> str:
    """A timestamp as the HTTP API writes it: ``2026-11-29T23:07:38.123456Z``."""
    when = when.astimezone(UTC) if when.tzinfo is not None else when
    return when.isoformat(timespec="microseconds").replace("+00:00", "") + "Z"


def task_json(task: Task) -> dict[str, Any]:
    """A task as the HTTP API shows it (``GET /dlq``; with ``state``, as ``GET /jobs/{id}``)."""
    view: dict[str, Any] = {
        "id": task.id,
        "payload": json.loads(task.payload_json),
        "attempts": task.attempts,
        "max_attempts": task.max_attempts,
        "created_at": rfc3339(task.created_at),
        "available_at": rfc3339(task.available_at),
        "last_error": task.last_error,
        "queue": task.queue,
        "priority": task.priority,
    }
    if task.state is not None:
        view["state"] = task.state
    # The members of task control (docs/design/control.md), only when set, as the API's.
    if task.expires_at is not None:
        view["expires_at"] = rfc3339(task.expires_at)
    if task.timeout_ms is not None:
        view["timeout_ms"] = task.timeout_ms
    if task.progress_json is not None:
        view["progress"] = json.loads(task.progress_json)
    if task.cancelling:
        view["cancelling"] = True
    if task.result_json is not None or task.finished_at is not None or task.after is not None:
        _results_json(view, task)
    elif task.result_ttl_ms is not None or task.children is not None or task.children_count:
        _results_json(view, task)
    _fired_or_buried_json(view, task)
    return view


def _fired_or_buried_json(view: dict[str, Any], task: Task) -> None:
    """The schedule that fired a task (docs/design/schedules.md), and when a dead one was
    buried, only when set, as the API's."""
    if task.schedule is not None:
        view["schedule"] = task.schedule
        if task.scheduled_for is not None:
            view["scheduled_for"] = rfc3339(task.scheduled_for)
    if task.buried_at is not None:
        view["buried_at"] = rfc3339(task.buried_at)


def _results_json(view: dict[str, Any], task: Task) -> None:
    """The members of results and workflows (docs/design/results.md), only when set, as the
    API's."""
    if task.result_json is not None:
        view["result"] = json.loads(task.result_json)
    if task.finished_at is not None:
        view["finished_at"] = rfc3339(task.finished_at)
    if task.result_ttl_ms is not None:
        view["result_ttl_ms"] = task.result_ttl_ms
    if task.after is not None:
        view["after"] = list(task.after)
    if task.waiting_for:
        view["waiting_for"] = task.waiting_for
    if task.children is not None or task.children_count:
        view["children"] = list(task.children or ())
        view["children_count"] = task.children_count


def result_json(task_id: str, answer: TaskResult | None) -> dict[str, Any]:
    """A result wait's answer as GET /jobs/{id}/result gives it (its 204, still pending, as
    ``{"id": ..., "state": "pending"}``)."""
    if answer is None:
        return {"id": task_id, "state": "pending"}
    view: dict[str, Any] = {"id": answer.id, "state": answer.state}
    if answer.result_json is not None:
        view["result"] = json.loads(answer.result_json)
    if answer.finished_at is not None:
        view["finished_at"] = rfc3339(answer.finished_at)
    if answer.state == "dead":
        view["last_error"] = answer.last_error
        view["attempts"] = answer.attempts
    return view


def stats_json(stats: Stats) -> dict[str, Any]:
    """Stats as ``GET /stats`` shows them (the gauges, then ``totals``)."""
    view = asdict(stats)
    view["totals"] = view.pop("totals")
    return view


def queue_json(queue: QueueInfo) -> dict[str, Any]:
    """A queue as ``GET /queues`` shows it."""
    view = asdict(queue)
    oldest = queue.oldest_ready_at
    view["oldest_ready_at"] = None if oldest is None else rfc3339(oldest)
    return view


def schedule_json(schedule: Schedule) -> dict[str, Any]:
    """A schedule as ``GET /schedules/{name}`` shows it (docs/design/schedules.md)."""

    def when(value: datetime | None) -> str | None:
        return None if value is None else rfc3339(value)

    return {
        "name": schedule.name,
        "cron": schedule.cron,
        "timezone": schedule.timezone,
        "every_ms": schedule.every_ms,
        "queue": schedule.queue,
        "payload": json.loads(schedule.payload_json),
        "priority": schedule.priority,
        "max_attempts": schedule.max_attempts,
        "expires_in_ms": schedule.expires_in_ms,
        "timeout_ms": schedule.timeout_ms,
        "result_ttl_ms": schedule.result_ttl_ms,
        "paused": schedule.paused,
        "created_at": when(schedule.created_at),
        "updated_at": when(schedule.updated_at),
        "next_fire_at": when(schedule.next_fire_at),
        "last_fire_at": when(schedule.last_fire_at),
        "last_task_id": schedule.last_task_id,
        "fires": schedule.fires,
    }


def limits_json(limits: Limits | None) -> dict[str, Any] | None:
    """A queue's limits as ``PUT /queues/{name}/limits`` and ``GET /queues`` show them."""
    return None if limits is None else asdict(limits)


def _dump(document: Any) -> str:
    return json.dumps(document, ensure_ascii=False)


# -- output ---------------------------------------------------------------------------------------


class Output:
    """Where a command writes: ``-json`` documents, or rich renderables for people."""

    def __init__(self, out: TextIO, as_json: bool, err: TextIO | None = None) -> None:
        self.as_json = as_json
        self.file = out
        self.err = err or sys.stderr
        # highlight=False: rich would colour numbers and words by guessing; the tables say
        # what they colour. Colours (and Live's redrawing) only when `out` is a terminal.
        self.console = Console(file=out, highlight=False, soft_wrap=False)

    def fit(self, table: Table) -> RenderableType:
        """``table``, or, if it is wider than the terminal, the same rows as cards (a table of
        columns that never wrap would otherwise cut every cell to a letter or two)."""
        unbounded = self.console.options.update(width=1_000_000)
        wanted = Measurement.get(self.console, unbounded, table).maximum
        return table if wanted <= self.console.width else as_cards(table)

    def json(self, document: Any) -> None:
        self.file.write(_dump(document) + "\n")
        self.file.flush()

    def show(self, *renderables: RenderableType | str) -> None:
        for r in renderables:
            if isinstance(r, str) and not self.console.is_terminal:
                # A message into a file or a pipe: one line as it is, never wrapped at the width.
                self.file.write(r + "\n")
                self.file.flush()
                continue
            if self.console.is_terminal:
                self.console.print(r, markup=False)
                continue
            # Into a file or a pipe: no colours, and no spaces that pad a line out to the width.
            with self.console.capture() as captured:
                self.console.print(r, markup=False)
            lines = captured.get().splitlines()
            self.file.write("".join(line.rstrip() + "\n" for line in lines))
            self.file.flush()


def _n(value: int) -> str:
    return f"{value:,}"


_GAUGES: Final = ("ready", "handed_out", "delayed", "dead")
# The gauges of results and workflows: tasks waiting for their parents, results held.
_RESULT_GAUGES: Final = ("waiting", "succeeded")
_GAUGE_STYLE: Final = {
    "ready": "green",
    "handed_out": "cyan",
    "delayed": "yellow",
    "dead": "red",
    "waiting": "magenta",
    "succeeded": "blue",
}
_TOTALS: Final = tuple(f.name for f in fields(Totals))


def _label(name: str) -> str:
    return name.replace("_", " ")


def stats_table(stats: Stats, queue: str | None) -> RenderableType:
    """The gauges beside the totals."""
    gauges = _table()
    gauges.add_column("gauge", no_wrap=True)
    gauges.add_column("now", justify="right", no_wrap=True)
    for name in (*_GAUGES, *_RESULT_GAUGES):
        value = getattr(stats, name)
        gauges.add_row(_label(name), Text(_n(value), style=_GAUGE_STYLE[name] if value else "dim"))
    totals = _table()
    totals.add_column("total", no_wrap=True)
    totals.add_column("since start", justify="right", no_wrap=True)
    for name in _TOTALS:
        totals.add_row(_label(name), _n(getattr(stats.totals, name)))
    both = Table.grid(padding=(0, 4))
    both.add_row(gauges, totals)
    title = f"queue {queue}" if queue is not None else "all queues"
    return Group(Text(title, style="bold"), both)


def _cell_text(cell: RenderableType) -> Text:
    if isinstance(cell, Text):
        return cell.copy()
    return Text(cell if isinstance(cell, str) else str(cell))


def as_cards(table: Table) -> Group:
    """A table's rows for a narrow terminal: per row, its first cell, then each other column's
    header and value beneath, as many to a line as fit."""
    parts: list[RenderableType] = []
    if table.title is not None:
        parts.append(Text(str(table.title), style="bold"))
    first, *others = table.columns
    for row in range(table.row_count):
        head = _cell_text(first._cells[row])
        head.stylize("bold")
        fields = []
        for column in others:
            field = Text(f"{column.header}: ", style="dim")
            field.append_text(_cell_text(column._cells[row]))
            fields.append(field)
        # (each field whole on a line: the line breaks fall between them)
        parts += [head, Padding(Columns(fields, padding=(0, 3)), (0, 0, 0, 2))]
    return Group(*parts)


def _table(title: str | None = None) -> Table:
    """The tables' look: a heavy rule under the header, no frame."""
    return Table(title=title, title_justify="left", box=box.SIMPLE_HEAVY, show_edge=False)


def _shown_gauges(queues: Sequence[QueueInfo]) -> tuple[str, ...]:
    """The gauges a table of queues shows: the four, and those of results and workflows once
    some queue has any (a broker whose clients use none of them shows the table it always
    did)."""
    if any(q.waiting or q.succeeded for q in queues):
        return (*_GAUGES, *_RESULT_GAUGES)
    return _GAUGES


def queues_table(queues: Sequence[QueueInfo]) -> Table:
    """The queues: their gauges, and their limits (rate, tokens, concurrency in use of the
    limit) once some queue has any (a broker whose queues have none shows the table it always
    did)."""
    table = _table(f"queues: {len(queues)}")
    table.add_column("queue", no_wrap=True)
    shown = _shown_gauges(queues)
    for name in shown:
        table.add_column(_label(name), justify="right", no_wrap=True)
    limited = any(q.limits is not None for q in queues)
    if limited:
        table.add_column("rate", justify="right", no_wrap=True)
        table.add_column("tokens", justify="right", no_wrap=True)
        table.add_column("concurrency", justify="right", no_wrap=True)
    table.add_column("state", no_wrap=True)
    for q in queues:
        state = Text("paused", style="bold yellow") if q.paused else Text("active", style="green")
        gauges = [
            Text(_n(getattr(q, g)), style=_GAUGE_STYLE[g] if getattr(q, g) else "dim")
            for g in shown
        ]
        if limited:
            gauges.extend(_limit_cells(q))
        table.add_row(q.name, *gauges, state)
    return table


def _limit_cells(q: QueueInfo) -> list[Text]:
    """A queue's rate, its tokens now, and its concurrency (in use / limit); "-" for none."""
    none = Text("-", style="dim")
    limits = q.limits or Limits()
    rate = none if limits.rate is None else Text(format_rate(limits.rate))
    tokens = none if q.tokens is None else Text(_tokens(q.tokens))
    if limits.concurrency is None:
        concurrency = none
    else:
        full = q.handed_out >= limits.concurrency
        concurrency = Text(
            f"{_n(q.handed_out)}/{_n(limits.concurrency)}", style="bold yellow" if full else ""
        )
    return [rate, tokens, concurrency]


def _tokens(value: float) -> str:
    """Rate tokens as a person reads them: whole when they are, else to one decimal (down: a
    token not all there cannot be taken)."""
    whole = int(value)
    return _n(whole) if value == whole else f"{int(value * 10) / 10:,.1f}"


# -- durations and rates: -every 5m, -rate 20/s -------------------------------------------------

_UNITS_MS: Final = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_DURATION_PART: Final = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")


def parse_duration_ms(text: str) -> int:
    """A duration as the commands take it, in milliseconds: numbers with units, ``ms``, ``s``,
    ``m``, ``h``, ``d`` (``30s``, ``5m``, ``1h30m``, ``1500ms``, ``1.5h``). Raises ValueError,
    saying why, for anything else (a bare number too: its unit would be a guess)."""
    spelled = text.strip().lower()
    parts = list(_DURATION_PART.finditer(spelled))
    if not parts or "".join(p.group(0) for p in parts) != spelled:
        raise ValueError(f"{text!r} is not a duration (a number and a unit: 30s, 5m, 1h30m, 500ms)")
    total = sum(float(p.group(1)) * _UNITS_MS[p.group(2)] for p in parts)
    if total != int(total):
        raise ValueError(f"{text!r} is not a whole number of milliseconds")
    return int(total)


def format_duration_ms(ms: int) -> str:
    """Milliseconds as :func:`parse_duration_ms` reads them: in the largest unit that divides
    them (``5m``, ``90s``, ``1500ms``)."""
    for unit in ("d", "h", "m", "s"):
        size = _UNITS_MS[unit]
        if ms >= size and ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"


def parse_rate(text: str) -> tuple[int, int]:
    """``N/PERIOD``: N tasks per PERIOD, a duration or a unit alone (``20/s``, ``100/1m``,
    ``5/500ms``, ``1000/h``). Returns (tasks, per_ms); raises ValueError saying why."""
    count, slash, period = text.strip().partition("/")
    if not slash or not count.strip().isdigit():
        raise ValueError(f"{text!r} is not a rate (N/PERIOD: 20/s, 100/1m, 5/500ms)")
    period = period.strip().lower()
    per_ms = parse_duration_ms(period if period[:1].isdigit() else f"1{period}")
    return int(count), per_ms


def format_rate(rate: RateLimit) -> str:
    """A rate limit as :func:`parse_rate` reads it (``20/s``, ``100/5m``), with its burst when
    it is not the default (``20/s burst 50``)."""
    period = format_duration_ms(rate.per_ms)
    if period.startswith("1") and period[1:] in ("s", "m", "h", "d"):
        period = period[1:]
    text = f"{_n(rate.tasks)}/{period}"
    if rate.burst is not None and rate.burst != rate.tasks:
        text += f" burst {_n(rate.burst)}"
    return text


def _short(text: str, width: int = 48) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


# Below this width the dead letters are shown one card each, not as a table (at 80 columns a
# table left the last error two characters, a couple of letters a line).
DEAD_TABLE_WIDTH: Final = 120


def _dead_title(tasks: Sequence[Task], limit: int | None) -> str:
    more = " (the first, --limit)" if limit is not None and len(tasks) >= limit else ""
    return f"dead letters: {len(tasks)}{more}"


def dead_cards(tasks: Sequence[Task], limit: int | None) -> Group:
    """The dead letters for a narrow terminal: per task, a line of its id, queue, priority and
    attempts, then its burial time, its whole last error and its payload, wrapped beneath."""
    parts: list[RenderableType] = [Text(_dead_title(tasks, limit), style="bold")]
    for t in tasks:
        buried = "unknown" if t.buried_at is None else rfc3339(t.buried_at)
        head = Text(t.id, style="bold")
        head.append(f"  queue {t.queue}  prio {t.priority}  attempts {t.attempts}/{t.max_attempts}")
        body = Table.grid(padding=(0, 1))
        body.add_column(no_wrap=True)
        body.add_column(overflow="fold")
        body.add_row("  buried", buried)
        body.add_row("  error", Text(t.last_error or "-", style="red"))
        payload = json.dumps(json.loads(t.payload_json), ensure_ascii=False)
        body.add_row("  payload", _short(payload, 240))
        parts += [Text(""), head, body]
    return Group(*parts)


def dead_table(tasks: Sequence[Task], limit: int | None) -> Table:
    table = _table(_dead_title(tasks, limit))
    table.add_column("id", no_wrap=True)
    table.add_column("queue", no_wrap=True)
    table.add_column("prio", justify="right", no_wrap=True)
    table.add_column("attempts", justify="right", no_wrap=True)
    table.add_column("buried at", no_wrap=True)
    table.add_column("last error", style="red", overflow="fold", ratio=3, min_width=12)
    table.add_column("payload", overflow="fold", ratio=2, min_width=10)
    for t in tasks:
        table.add_row(
            t.id,
            t.queue,
            str(t.priority),
            f"{t.attempts}/{t.max_attempts}",
            "unknown" if t.buried_at is None else rfc3339(t.buried_at),
            _short(t.last_error or "-", 120),
            _short(json.dumps(json.loads(t.payload_json), ensure_ascii=False), 80),
        )
    return table


_STATE_STYLE: Final = _GAUGE_STYLE


def task_table(task: Task) -> Table:
    table = _table(f"task {task.id}")
    table.add_column("field", no_wrap=True)
    table.add_column("value", overflow="fold")
    state = task.state or "-"
    table.add_row("state", Text(_label(state), style=_STATE_STYLE.get(state, "")))
    table.add_row("queue", task.queue)
    table.add_row("priority", str(task.priority))
    table.add_row("attempts", f"{task.attempts} of {task.max_attempts}")
    table.add_row("created at", rfc3339(task.created_at))
    if task.state == "dead":
        buried = "unknown" if task.buried_at is None else rfc3339(task.buried_at)
        table.add_row("buried at", buried)
    else:
        table.add_row("available at", rfc3339(task.available_at))
    table.add_row(
        "last error", Text(task.last_error or "-", style="red" if task.last_error else "")
    )
    if task.cancelling:
        table.add_row("cancelling", Text("yes: it will not be retried", style="bold yellow"))
    if task.expires_at is not None:
        table.add_row("expires at", rfc3339(task.expires_at))
    if task.timeout_ms is not None:
        table.add_row("time limit", f"{_n(task.timeout_ms)} ms")
    if task.progress_json is not None:
        table.add_row("progress", _json_text(task.progress_json))
    _results_rows(table, task)
    if task.schedule is not None:  # (fired by a schedule: docs/design/schedules.md)
        table.add_row("schedule", task.schedule)
        if task.scheduled_for is not None:
            table.add_row("scheduled for", rfc3339(task.scheduled_for))
    payload = json.dumps(json.loads(task.payload_json), indent=2, ensure_ascii=False)
    table.add_row("payload", payload)
    return table


def _results_rows(table: Table, task: Task) -> None:
    """A task's rows of results and workflows: its parents (and how many it still waits for),
    its children, when it finished and its result."""
    if task.after is not None:
        waiting = f" (waiting for {_n(task.waiting_for)})" if task.waiting_for else ""
        table.add_row("parents", "\n".join(task.after) + waiting)
    if task.children is not None or task.children_count:
        shown = list(task.children or ())
        more = task.children_count - len(shown)
        lines = shown + ([f"… and {_n(more)} more"] if more > 0 else [])
        table.add_row(f"children ({_n(task.children_count)})", "\n".join(lines))
    if task.result_ttl_ms is not None:
        table.add_row("result kept", f"{_n(task.result_ttl_ms)} ms")
    if task.finished_at is not None:
        table.add_row("finished at", rfc3339(task.finished_at))
    if task.result_json is not None:
        table.add_row("result", _pretty(task.result_json))


def _pretty(data: bytes) -> str:
    return json.dumps(json.loads(data), indent=2, ensure_ascii=False)


def _json_text(data: bytes, width: int = 80) -> str:
    return _short(json.dumps(json.loads(data), ensure_ascii=False), width)


def tasks_table(tasks: Sequence[Task], queue: str, state: str, more: str | None) -> Table:
    """A page of a queue's tasks in one state (``more``: the cursor of the next page)."""
    title = f"{_label(state)} tasks of queue {queue}: {len(tasks)}"
    if more is not None:
        title += f" (more: --cursor {more})"
    table = _table(title)
    table.add_column("id", no_wrap=True)
    table.add_column("prio", justify="right", no_wrap=True)
    table.add_column("attempts", justify="right", no_wrap=True)
    table.add_column("available at", no_wrap=True)
    notes = state in ("handed_out", "dead") or any(t.expires_at or t.timeout_ms for t in tasks)
    if notes:
        table.add_column("notes", overflow="fold", ratio=3, min_width=12)
    table.add_column("payload", overflow="fold", ratio=2, min_width=10)
    for t in tasks:
        cells: list[RenderableType] = [
            t.id,
            str(t.priority),
            f"{t.attempts}/{t.max_attempts}",
            rfc3339(t.available_at),
        ]
        if notes:
            cells.append(_notes(t))
        cells.append(_json_text(t.payload_json))
        table.add_row(*cells)
    return table


def _notes(task: Task) -> Text:
    """What a listing says of a task beside its numbers: cancelling, progress, its limits, its
    last error."""
    text = Text()
    parts: list[tuple[str, str]] = []
    if task.cancelling:
        parts.append(("cancelling", "bold yellow"))
    if task.progress_json is not None:
        parts.append((f"progress {_json_text(task.progress_json, 40)}", "cyan"))
    if task.timeout_ms is not None:
        parts.append((f"limit {_n(task.timeout_ms)} ms", ""))
    if task.expires_at is not None:
        parts.append((f"expires {rfc3339(task.expires_at)}", ""))
    if task.last_error:
        parts.append((_short(task.last_error, 120), "red"))
    for i, (words, style) in enumerate(parts):
        if i:
            text.append("; ")
        text.append(words, style=style)
    return text if parts else Text("-", style="dim")


def _at(when: datetime | None) -> str:
    """A time in a table of schedules: to the second, in UTC ("-" for none)."""
    if when is None:
        return "-"
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _rule(schedule: Schedule) -> str:
    """A schedule's rule as the commands take it: the cron text, or ``every 5m``."""
    if schedule.cron is not None:
        return schedule.cron
    return f"every {format_duration_ms(schedule.every_ms or 0)}"


def _schedule_state(schedule: Schedule) -> Text:
    return Text("paused", style="bold yellow") if schedule.paused else Text("active", style="green")


def schedules_table(schedules: Sequence[Schedule]) -> Table:
    """Every schedule: its rule, where its tasks go, its next and last fires."""
    table = _table(f"schedules: {len(schedules)}")
    table.add_column("name", no_wrap=True)
    table.add_column("rule", no_wrap=True)
    table.add_column("timezone", no_wrap=True)
    table.add_column("queue", no_wrap=True)
    table.add_column("next fire", no_wrap=True)
    table.add_column("last fire", no_wrap=True)
    table.add_column("fires", justify="right", no_wrap=True)
    table.add_column("state", no_wrap=True)
    for sc in schedules:
        table.add_row(
            sc.name,
            _rule(sc),
            sc.timezone or "-",
            sc.queue,
            Text(_at(sc.next_fire_at), style="dim" if sc.next_fire_at is None else ""),
            Text(_at(sc.last_fire_at), style="dim" if sc.last_fire_at is None else ""),
            _n(sc.fires),
            _schedule_state(sc),
        )
    return table


def schedule_table(schedule: Schedule) -> Table:
    """One schedule, field by field."""
    table = _table(f"schedule {schedule.name}")
    table.add_column("field", no_wrap=True)
    table.add_column("value", overflow="fold")
    table.add_row("rule", _rule(schedule))
    if schedule.cron is not None:
        table.add_row("timezone", schedule.timezone or "UTC")
    table.add_row("state", _schedule_state(schedule))
    next_fire = _full(schedule.next_fire_at)
    table.add_row("next fire", next_fire if not schedule.paused else "- (paused)")
    table.add_row("last fire", _full(schedule.last_fire_at))
    table.add_row("last task", schedule.last_task_id or "-")
    table.add_row("fires", _n(schedule.fires))
    table.add_row("queue", schedule.queue)
    table.add_row("priority", str(schedule.priority))
    table.add_row("max attempts", str(schedule.max_attempts))
    if schedule.expires_in_ms is not None:
        table.add_row("expires in", f"{_n(schedule.expires_in_ms)} ms")
    if schedule.timeout_ms is not None:
        table.add_row("time limit", f"{_n(schedule.timeout_ms)} ms")
    if schedule.result_ttl_ms is not None:
        table.add_row("result kept", f"{_n(schedule.result_ttl_ms)} ms")
    table.add_row("created at", _full(schedule.created_at))
    table.add_row("updated at", _full(schedule.updated_at))
    table.add_row("payload", _pretty(schedule.payload_json))
    return table


def _full(when: datetime | None) -> str:
    return "-" if when is None else rfc3339(when)


def limits_text(queue: str, limits: Limits | None) -> str:
    """A queue's limits in a line: ``queue mail: rate 20/s, concurrency 4``."""
    if limits is None or limits.empty:
        return f"queue {queue}: no limits"
    parts = []
    if limits.rate is not None:
        parts.append(f"rate {format_rate(limits.rate)}")
    if limits.concurrency is not None:
        parts.append(f"concurrency {_n(limits.concurrency)}")
    return f"queue {queue}: " + ", ".join(parts)


# -- the commands ---------------------------------------------------------------------------------


async def cmd_stats(client: AsyncClient, args: argparse.Namespace, out: Output) -> int:
    stats = await client.stats(args.queue)
    if out.as_json:
        out.json(stats_json(stats))
    else:
        out.show(stats_table(stats, args.queue))
    return EXIT_OK


async def cmd_queues(client: AsyncClient, args: argparse.Namespace, out: Output) -> int:
    queues = await client.queues()
    if out.as_json:
        out.json([queue_json(q) for q in queues])
    elif not queues:
        out.show("no queues yet (a queue exists once a task was sent to it)")
    else:
        out.show(out.fit(queues_table(queues)))
    return EXIT_OK


async def cmd_dlq_list(client: AsyncClient, args: argparse.Namespace, out: Output) -> int:
    tasks = await client.dead_letters(args.limit, queue=args.queue)
    if out.as_json:
        out.json([task_json(t) for t in tasks])
    elif not tasks:
        where = f" of queue {args.queue}" if args.queue else ""
        out.show(f"the dead-letter queue{where} is empty")
    elif out.console.width < DEAD_TABLE_WIDTH:
        out.show(dead_cards(tasks, args.limit))
    else:
        out.show(dead_table(tasks, args.limit))
    return EXIT_OK


async def cmd_dlq_requeue(client: AsyncClient, args: argparse.Namespace, out: Output) -> int:
    if args.all == (args.id is not None):
        raise _Usage("give a task id, or -all (with -queue for one queue's)")
    if args.queue is not None and not args.all:
        raise _Usage("-queue goes with -all")
    if args.id is not None:
        await client.requeue(args.id)
        if out.as_json:
            out.json({"requeued": 1, "id": args.id})
        else:
            out.show(f"requeued {args.id}")
        return EXIT_OK
    count = await client.requeue_all(args.queue)
    if out.as_json:
        out.json({"requeued": count, "queue": args.queue})
    else:
        where = f" of queue {args.queue}" if args.queue else ""
        out.show(f"requeued {count} dead task{'' if count == 1 else 's'}{where}")
    return EXIT_OK


async def cmd_dlq_purge(client: AsyncClient, args: argparse.Namespace, out: Output) -> int:
    await client.purge(args.id)
    if out.as_json:
        out.json({"purged": 1, "id": args.id})
    else:
        out.show(f"purged {args.id}")
    return EXIT_OK


async def cmd_task(client: AsyncClient, args: argparse.Namespace, out: Output) -> int:
    task = await client.get_task(args.id)
    if out.as_json:
        out.json(task_json(task))
    else:
        out.show(task_table(task))
    return EXIT_OK


async def cmd_result(client: AsyncClient, args: argparse.Namespace, out: Output) -> int:
    """How a task ended (docs/design/results.md), waiting up to -wait for it to."""
    answer = await client.wait_result(args.id, timeout=args.wait / 1000)
    if out.as_json:
        out.json(result_json(args.id, answer))
    elif answer is None:
        waited = f" after {_n(args.wait)} ms" if args.wait else ""
        out.show(f"task {args.id} is still pending{waited}")
    elif answer.succeeded:
        if answer.result_json is None:
            out.show(f"task {args.id} succeeded (acked without a result)")
        else:  # (the result's text as the broker keeps it: for a pipe, or jq)
            out.file.write(answer.result_json.decode() + "\n")
            out.file.flush()
    elif answer.state == "dead":
        out.show(f"task {args.id} is dead (attempts {answer.attempts}): {answer.last_error or '-'}")
    else:
        out.show(f"task {args.id} {'was cancelled' if answer.state == 'cancelled' else 'expired'}")
    if answer is None:
        return EXIT_PENDING
    return EXIT_OK if answer.succeeded else EXIT_FAILED


async def cmd_tasks(client: AsyncClient, args: argparse.Namespace, out: Output) -> int:
    queue, state = args.queue_name, args.state
    if args.all:
        tasks = [
            t async for t in client.iter_tasks(queue, state, limit=args.limit, cursor=args.cursor)
        ]
        more = None
    else:
        page = await client.list_tasks(queue, state, limit=args.limit, cursor=args.cursor)
        tasks, more = page.tasks, page.next_cursor
    if out.as_json:
        out.json({"tasks": [task_json(t) for t in tasks], "next_cursor": more})
    elif not tasks:
        out.show(f"no {_label(state)} tasks in queue {queue}")
    else:
        out.show(tasks_table(tasks, queue, state, more))
    return EXIT_OK


async def cmd_cancel(client: AsyncClient, args: argparse.Namespace, out: Output) -> int:
    state = await client.cancel(args.id)
    if out.as_json:
        out.json({"id": args.id, "state": state})
    elif state == CANCELLED:
        out.show(f"cancelled {args.id}")
    elif state == CANCELLING:
        out.show(
            f"{args.id} is cancelling: it is handed out, its worker is told to stop, and it "
            "will not be retried"
        )
    else:
        out.show(f"purged {args.id} (it was in the dead-letter queue)")
    return EXIT_OK


async def cmd_queue_empty(client: AsyncClient, args: argparse.Namespace, out: Output) -> int:
    count = await client.empty_queue(args.queue_name)
    if out.as_json:
        out.json({"queue": args.queue_name, "cancelled": count})
    else:
        what = f"{count} ready or delayed task{'' if count == 1 else 's'} cancelled"
        out.show(f"emptied queue {args.queue_name}: {what}")
    return EXIT_OK


async def cmd_queue_delete(client: AsyncClient, args: argparse.Namespace, out: Output) -> int:
    await client.delete_queue(args.queue_name)
    if out.as_json:
        out.json({"queue": args.queue_name, "deleted": True})
    else:
        out.show(f"deleted queue {args.queue_name}")
    return EXIT_OK


async def cmd_schedules(client: AsyncClient, args: argparse.Namespace, out: Output) -> int:
    schedules = await client.list_schedules()
    if out.as_json:
        out.json({"schedules": [schedule_json(sc) for sc in schedules]})
    elif not schedules:
        out.show("no schedules (wq schedule set NAME -cron EXPR | -every DURATION -payload JSON)")
    else:
        out.show(out.fit(schedules_table(schedules)))
    return EXIT_OK


async def cmd_schedule_set(client: AsyncClient, args: argparse.Namespace, out: Output) -> int:
    if (args.cron is None) == (args.every is None):
        raise _Usage("give -cron EXPR or -every DURATION (one of them)")
    if args.timezone is not None and args.cron is None:
        raise _Usage("-timezone goes with -cron")
    schedule = await client.put_schedule(
        args.name,
        payload=parse_payload(args.payload),
        cron=args.cron,
        every_ms=args.every,
        timezone=args.timezone,
        queue=args.queue,
        priority=args.priority,
        max_attempts=args.max_attempts,
        expires_in_ms=args.expires_in_ms,
        timeout_ms=args.timeout_ms,
        result_ttl_ms=args.result_ttl_ms,
        paused=args.paused,
    )
    if out.as_json:
        out.json(schedule_json(schedule))
        return EXIT_OK
    rule = _rule(schedule)
    if schedule.cron is not None and schedule.timezone not in (None, "UTC"):
        rule += f" in {schedule.timezone}"  # (the next fire is in UTC: say whose clock the rule is)
    if schedule.paused:
        out.show(f"schedule {schedule.name} set ({rule}), paused: no fires until resumed")
    else:
        when = _full(schedule.next_fire_at)
        out.show(f"schedule {schedule.name} set ({rule}): next fire {when}")
    return EXIT_OK


async def cmd_schedule_get(client: AsyncClient, args: argparse.Namespace, out: Output) -> int:
    schedule = await client.get_schedule(args.name)
    if out.as_json:
        out.json(schedule_json(schedule))
    else:
        out.show(schedule_table(schedule))
    return EXIT_OK


async def cmd_schedule_delete(client: AsyncClient, args: argparse.Namespace, out: Output) -> int:
    await client.delete_schedule(args.name)
    if out.as_json:
        out.json({"schedule": args.name, "deleted": True})
    else:
        out.show(f"deleted schedule {args.name} (the tasks it fired stay)")
    return EXIT_OK


async def cmd_schedule_pause(client: AsyncClient, args: argparse.Namespace, out: Output) -> int:
    schedule = await client.pause_schedule(args.name)
    if out.as_json:
        out.json(schedule_json(schedule))
    else:
        out.show(f"paused schedule {schedule.name}: no fires until it is resumed")
    return EXIT_OK


async def cmd_schedule_resume(client: AsyncClient, args: argparse.Namespace, out: Output) -> int:
    schedule = await client.resume_schedule(args.name)
    if out.as_json:
        out.json(schedule_json(schedule))
    else:
        out.show(f"resumed schedule {schedule.name}: next fire {_full(schedule.next_fire_at)}")
    return EXIT_OK


async def cmd_limits(client: AsyncClient, args: argparse.Namespace, out: Output) -> int:
    """Show a queue's limits (no flags), set them (-rate, -burst, -concurrency: those given
    replace the queue's), or take them away (-clear)."""
    queue = args.queue_name
    setting = args.rate is not None or args.concurrency is not None
    if args.burst is not None and args.rate is None:
        raise _Usage("-burst goes with -rate")
    if args.clear and setting:
        raise _Usage("-clear takes the limits away: give it alone, without -rate or -concurrency")
    if args.clear:
        await client.clear_limits(queue)
        if out.as_json:
            out.json({"queue": queue, "limits": None})
        else:
            out.show(f"queue {queue}: limits cleared")
        return EXIT_OK
    if setting:
        rate = None
        if args.rate is not None:
            rate = RateLimit(args.rate[0], args.rate[1], args.burst)
        limits = await client.set_limits(queue, rate=rate, concurrency=args.concurrency)
        if out.as_json:
            out.json({"queue": queue, "limits": limits_json(limits)})
        else:
            out.show(limits_text(queue, limits))
        return EXIT_OK
    return await _show_limits(client, queue, out)


async def _show_limits(client: AsyncClient, queue: str, out: Output) -> int:
    """``wq limits QUEUE``: its limits, from /queues (with its tokens and the concurrency in
    use)."""
    found = next((q for q in await client.queues() if q.name == queue), None)
    if found is None:
        raise NotFound(f"queue {queue} not found")
    if out.as_json:
        out.json(
            {
                "queue": queue,
                "limits": limits_json(found.limits),
                "tokens": found.tokens,
                "handed_out": found.handed_out,
            }
        )
        return EXIT_OK
    out.show(limits_text(queue, found.limits))
    if found.limits is not None:
        out.show(out.fit(queues_table([found])))
    return EXIT_OK


def parse_payload(text: str) -> bytes:
    """The payload argument of ``wq enqueue``: JSON text, checked here (NaN and Infinity are
    not JSON) and sent as given."""

    def constant(name: str) -> NoReturn:
        raise ValueError(f"{name} is not JSON")

    try:
        json.loads(text, parse_constant=constant)
    except RecursionError:
        raise _Usage("the payload is nested too deeply") from None
    except ValueError as e:
        raise _Usage(f"the payload is not valid JSON: {e}") from None
    return text.strip().encode()


async def cmd_enqueue(client: AsyncClient, args: argparse.Namespace, out: Output) -> int:
    payload = parse_payload(args.payload)
    enqueued = await client.enqueue(
        payload,
        max_attempts=args.max_attempts,
        delay_ms=args.delay_ms,
        queue=args.queue,
        priority=args.priority,
        idempotency_key=args.key,
        after=args.after,
        result_ttl_ms=args.result_ttl_ms,
    )
    duplicate = getattr(enqueued, "duplicate", False) is True
    if out.as_json:
        out.json({"id": str(enqueued), "duplicate": duplicate})
    elif duplicate:
        out.show(f"{enqueued} (a duplicate: the key was used within the window; nothing new)")
    else:
        out.show(f"{enqueued}")
    return EXIT_OK


async def cmd_pause(client: AsyncClient, args: argparse.Namespace, out: Output) -> int:
    await client.pause(args.queue_name)
    if out.as_json:
        out.json({"queue": args.queue_name, "paused": True})
    else:
        out.show(f"paused queue {args.queue_name}")
    return EXIT_OK


async def cmd_resume(client: AsyncClient, args: argparse.Namespace, out: Output) -> int:
    await client.resume(args.queue_name)
    if out.as_json:
        out.json({"queue": args.queue_name, "paused": False})
    else:
        out.show(f"resumed queue {args.queue_name}")
    return EXIT_OK


# -- wq watch -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What one refresh of ``wq watch`` read, and when (monotonic seconds, and wall clock)."""

    at: float
    wall: datetime
    stats: Stats
    queues: list[QueueInfo]


def rates(now: Snapshot, before: Snapshot | None) -> dict[str, float | None]:
    """Each total's change per second since the previous refresh (None on the first)."""
    span = now.at - before.at if before is not None else 0.0
    out: dict[str, float | None] = {}
    for name in _TOTALS:
        if before is None or span <= 0:
            out[name] = None
        else:
            delta = getattr(now.stats.totals, name) - getattr(before.stats.totals, name)
            out[name] = round(delta / span, 3)
    return out


def watch_json(now: Snapshot, before: Snapshot | None) -> dict[str, Any]:
    return {
        "time": rfc3339(now.wall),
        "stats": stats_json(now.stats),
        "rates": rates(now, before),
        "queues": [queue_json(q) for q in now.queues],
    }


# The totals a person watches (-json has them all): work in, out, done, failed, given up on,
# and reclaimed from workers that went silent.
_RATES_SHOWN: Final = ("enqueued", "delivered", "acked", "nacked", "buried", "reclaimed")


def _rate(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}/s" if value >= 100 else f"{value:,.1f}/s"


def watch_frame(
    now: Snapshot, before: Snapshot | None, broker: str, queue: str | None
) -> RenderableType:
    """One refresh: the gauges, the rates since the last one (and the totals), the queues."""
    where = f" (queue {queue})" if queue else ""
    heading = Text.assemble(
        ("wq watch ", "bold"),
        f"{broker}{where}  ",
        (now.wall.astimezone().strftime("%H:%M:%S"), "dim"),
        ("  Ctrl-C to stop", "dim"),
    )
    gauges = _table("gauges")
    shown: tuple[str, ...] = _GAUGES
    if now.stats.waiting or now.stats.succeeded:
        shown = (*_GAUGES, *_RESULT_GAUGES)
    for name in shown:
        gauges.add_column(_label(name), justify="right", no_wrap=True)
    gauges.add_row(
        *(Text(_n(getattr(now.stats, g)), style=_GAUGE_STYLE[g]) for g in shown),
    )
    per_second = rates(now, before)
    flow = _table("per second (totals)")
    flow.add_column("", no_wrap=True, style="dim")
    for name in _RATES_SHOWN:
        flow.add_column(name, justify="right", no_wrap=True)
    flow.add_row("rate", *(_rate(per_second[n]) for n in _RATES_SHOWN))
    flow.add_row("total", *(_n(getattr(now.stats.totals, n)) for n in _RATES_SHOWN))
    parts: list[RenderableType] = [heading, gauges, flow]
    queues = [q for q in now.queues if queue is None or q.name == queue]
    if queues:
        parts.append(queues_table(queues))
    return Group(*parts)


async def _snapshot(client: AsyncClient, queue: str | None) -> Snapshot:
    stats, queues = await asyncio.gather(client.stats(queue), client.queues())
    return Snapshot(time.monotonic(), datetime.now(UTC), stats, queues)


async def cmd_watch(client: AsyncClient, args: argparse.Namespace, out: Output) -> int:
    """Refresh every ``-interval`` until Ctrl-C (or ``-count`` refreshes). The first read must
    work (else the usual error and exit status); after that a broker that cannot be reached is
    reported, and tried again at the next refresh."""
    before: Snapshot | None = None
    shown = 0
    live: Live | None = None
    if not out.as_json and out.console.is_terminal:
        live = Live(console=out.console, auto_refresh=False, transient=False)
        live.start()
    try:
        while True:
            started = time.monotonic()
            try:
                now = await _snapshot(client, args.queue)
            except Unavailable as e:
                if before is None:
                    raise
                _watch_trouble(e, live, before, client, args, out)
            else:
                _watch_show(now, before, live, client, args, out)
                before = now
            shown += 1
            if args.count and shown >= args.count:
                return EXIT_OK
            await asyncio.sleep(max(0.0, args.interval - (time.monotonic() - started)))
    finally:
        if live is not None:
            live.stop()


def _watch_show(
    now: Snapshot,
    before: Snapshot | None,
    live: Live | None,
    client: AsyncClient,
    args: argparse.Namespace,
    out: Output,
) -> None:
    if out.as_json:
        out.json(watch_json(now, before))
        return
    frame = watch_frame(now, before, client.url or "", args.queue)
    if live is not None:
        live.update(frame, refresh=True)
    else:
        out.show(frame)


def _watch_trouble(
    error: Unavailable,
    live: Live | None,
    before: Snapshot,
    client: AsyncClient,
    args: argparse.Namespace,
    out: Output,
) -> None:
    message = f"{error.message} (trying again)"
    if live is None:
        print(f"{PROG}: {message}", file=out.err, flush=True)
        return
    frame = watch_frame(before, None, client.url or "", args.queue)
    live.update(Group(frame, Text(message, style="bold red")), refresh=True)


# -- the command line -----------------------------------------------------------------------------

# Flags given with no value that mean true (-json is -json=true): a switch never takes the next
# argument as its value (``wq task -json ID``).

_NUMBER = re.compile(r"^-\d+(\.\d*)?$")


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _switch(p: argparse.ArgumentParser, name: str, help: str) -> None:
    add_switch(p, name, help)


def add_common_flags(p: argparse.ArgumentParser) -> None:
    """The flags every ``wq`` command takes."""
    add_connection_flags(p)
    p.add_argument(
        "-timeout",
        "--timeout",
        type=_positive_seconds,
        default=10.0,
        metavar="SECONDS",
        help="how long to wait for the broker to connect and answer (default 10)",
    )
    _switch(p, "json", "print one JSON document (the HTTP API's member names) instead of tables")


def _queue_flag(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("-queue", "--queue", default=None, metavar="NAME", help=help)


Handler = Callable[[AsyncClient, argparse.Namespace, Output], Awaitable[int]]


@dataclass(frozen=True, slots=True)
class Command:
    name: str  # "stats", or "dlq requeue"
    summary: str
    handler: Handler
    flags: Callable[[argparse.ArgumentParser], None]

    def parser(self) -> FlagParser:
        p = FlagParser(prog=f"{PROG} {self.name}", description=self.summary)
        self.flags(p)
        add_common_flags(p)
        return p


def _stats_flags(p: argparse.ArgumentParser) -> None:
    _queue_flag(p, "one queue's gauges and totals (default: the whole broker)")


def _no_flags(p: argparse.ArgumentParser) -> None:
    pass


def _dlq_list_flags(p: argparse.ArgumentParser) -> None:
    _queue_flag(p, "only this queue's dead tasks (default: every queue's)")
    p.add_argument(
        "-limit",
        "--limit",
        type=positive_int,
        default=None,
        metavar="N",
        help="only the first N (oldest burial first; default: all)",
    )


def _dlq_requeue_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("id", nargs="?", metavar="ID", help="the dead task to requeue")
    _switch(p, "all", "requeue every dead task (of -queue, if given)")
    _queue_flag(p, "with -all: only this queue's dead tasks")


def _id_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("id", metavar="ID", help="the task's id")


def _enqueue_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("payload", metavar="JSON", help="the payload: any JSON value ('{\"n\": 1}')")
    _queue_flag(p, 'the queue to enqueue to (default "default")')
    p.add_argument(
        "-priority",
        "--priority",
        type=priority,
        default=None,
        help="0 to 9, higher served first (default 0)",
    )
    p.add_argument(
        "-delay-ms",
        "--delay-ms",
        type=non_negative_int,
        default=None,
        metavar="MS",
        help="hold the task back this long before it can be claimed (default 0)",
    )
    p.add_argument(
        "-max-attempts",
        "--max-attempts",
        type=positive_int,
        default=None,
        metavar="N",
        help="attempts before the task is buried in the dead-letter queue (default 3)",
    )
    p.add_argument(
        "-key",
        "--key",
        "-idempotency-key",
        "--idempotency-key",
        dest="key",
        default=None,
        metavar="KEY",
        help="an idempotency key: an enqueue to the same queue with a key the broker saw within "
        "its window creates nothing and answers the first task's id",
    )
    p.add_argument(
        "-after",
        "--after",
        type=_task_ids,
        default=None,
        metavar="ID[,ID]",
        help="the tasks it waits for: it is waiting until every one has succeeded, then ready "
        "(and handed out with their results); a parent that fails for good buries it",
    )
    p.add_argument(
        "-result-ttl-ms",
        "--result-ttl-ms",
        type=non_negative_int,
        default=None,
        metavar="MS",
        help="how long its result is kept once it is acked with one (0: none is kept; default "
        "the broker's -result-ttl-ms, an hour)",
    )


def _task_ids(text: str) -> list[str]:
    """``-after``'s value: task ids separated by commas."""
    ids = [part.strip() for part in text.split(",")]
    if not all(ids):
        raise argparse.ArgumentTypeError(f"expected task ids separated by commas, got {text!r}")
    return ids


def _result_flags(p: argparse.ArgumentParser) -> None:
    _id_flags(p)
    p.add_argument(
        "-wait",
        "--wait",
        type=non_negative_int,
        default=0,
        metavar="MS",
        help="wait up to MS milliseconds for the task to end (default 0: answer at once; "
        "longer than the broker's 30 s, asked again in turn)",
    )
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = (
        "prints the result's JSON as the broker keeps it (-json: the HTTP API's answer to\n"
        'GET /jobs/{id}/result, {"state": "pending"} for its 204).\n\n'
        "exit codes:\n"
        f"  {EXIT_OK:<5}the task succeeded (with a result, or acked without one while waiting)\n"
        f"  {EXIT_FAILED:<5}it did not: it is dead (its last error), or was cancelled, or expired\n"
        f"  {EXIT_USAGE:<5}usage: a bad flag or argument\n"
        f"  {EXIT_NOT_FOUND:<5}no such task: never known, acked without a result, gone, or its "
        "result's time is up\n"
        f"  {EXIT_UNAVAILABLE:<5}the broker cannot be reached\n"
        f"  {EXIT_REFUSED:<5}the broker refused the token\n"
        f"  {EXIT_PENDING:<5}still pending (waiting, ready, delayed or handed out) when -wait ran "
        "out"
    )


def _queue_name_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("queue_name", metavar="QUEUE", help="the queue's name")


def _schedule_name_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", metavar="NAME", help="the schedule's name")


def _duration_ms(text: str) -> int:
    try:
        value = parse_duration_ms(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be longer than 0, got {text}")
    return value


def _rate_flag(text: str) -> tuple[int, int]:
    try:
        return parse_rate(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _schedule_set_flags(p: argparse.ArgumentParser) -> None:
    _schedule_name_flags(p)
    p.add_argument(
        "-cron",
        "--cron",
        default=None,
        metavar="EXPR",
        help="a cron rule: five fields, minute hour day-of-month month day-of-week ('*/5 * * * "
        "*', '0 9 * * MON-FRI'), or @hourly, @daily, @weekly, @monthly, @yearly",
    )
    p.add_argument(
        "-timezone",
        "--timezone",
        default=None,
        metavar="TZ",
        help="with -cron: the IANA timezone its times are in (Europe/Paris; default UTC)",
    )
    p.add_argument(
        "-every",
        "--every",
        type=_duration_ms,
        default=None,
        metavar="DURATION",
        help="instead of -cron: a fixed interval, 1s to a year (30s, 5m, 1h30m, 1d); the first "
        "fire comes that long after the schedule is set",
    )
    p.add_argument(
        "-payload",
        "--payload",
        required=True,
        metavar="JSON",
        help="the payload of the task each fire enqueues: any JSON value ('{\"report\": 1}')",
    )
    _queue_flag(p, 'the queue its tasks go to (default "default")')
    p.add_argument(
        "-priority",
        "--priority",
        type=priority,
        default=None,
        help="its tasks' priority, 0 to 9, higher served first (default 0)",
    )
    p.add_argument(
        "-max-attempts",
        "--max-attempts",
        type=positive_int,
        default=None,
        metavar="N",
        help="attempts before a task is buried in the dead-letter queue (default 3)",
    )
    p.add_argument(
        "-expires-in-ms",
        "--expires-in-ms",
        type=positive_int,
        default=None,
        metavar="MS",
        help="a task not handed out this long after its fire is dropped (default: never)",
    )
    p.add_argument(
        "-timeout-ms",
        "--timeout-ms",
        type=positive_int,
        default=None,
        metavar="MS",
        help="the most one attempt of a task may run (default: no limit)",
    )
    p.add_argument(
        "-result-ttl-ms",
        "--result-ttl-ms",
        type=non_negative_int,
        default=None,
        metavar="MS",
        help="how long a task's result is kept once it is acked with one (default the broker's)",
    )
    _switch(p, "paused", "set it paused: it fires once resumed (wq schedule resume NAME)")
    p.epilog = (
        "a schedule of that name is replaced (its fires so far and last fire kept); each "
        "scheduled time enqueues exactly one task, on any number of brokers"
    )


def _limits_flags(p: argparse.ArgumentParser) -> None:
    _queue_name_flags(p)
    p.add_argument(
        "-rate",
        "--rate",
        type=_rate_flag,
        default=None,
        metavar="N/PERIOD",
        help="hand out at most N tasks per PERIOD (20/s, 100/1m, 5/500ms, 1000/h), from a bucket "
        "of -burst tokens",
    )
    p.add_argument(
        "-burst",
        "--burst",
        type=positive_int,
        default=None,
        metavar="N",
        help="with -rate: how many tasks may go at once after a quiet spell (default N)",
    )
    p.add_argument(
        "-concurrency",
        "--concurrency",
        type=positive_int,
        default=None,
        metavar="N",
        help="at most N of its tasks handed out at once",
    )
    _switch(p, "clear", "take the queue's limits away")
    p.epilog = (
        "without flags: the queue's limits, its rate tokens now and the concurrency in use. "
        "-rate and -concurrency replace the queue's limits (a kind not given: no limit of it); "
        "they hold over every worker and broker"
    )


def _tasks_flags(p: argparse.ArgumentParser) -> None:
    _queue_name_flags(p)
    p.add_argument(
        "-state",
        "--state",
        choices=LIST_STATES,
        default="ready",
        help="the tasks in this state: ready (in the order they would be claimed), delayed (by "
        "due time), handed_out (by lease deadline), dead (by burial), waiting (for their "
        "parents, by enqueue) or succeeded (with a result kept, by finish); default ready",
    )
    p.add_argument(
        "-limit",
        "--limit",
        type=positive_int,
        default=100,
        metavar="N",
        help="tasks per page, 1 to 1000 (default 100)",
    )
    p.add_argument(
        "-cursor",
        "--cursor",
        default=None,
        metavar="C",
        help="start where the page before ended (the cursor it printed)",
    )
    _switch(p, "all", "every page, one after the other (-limit tasks per request)")


def _watch_flags(p: argparse.ArgumentParser) -> None:
    _queue_flag(p, "one queue's gauges and rates (default: the whole broker)")
    p.add_argument(
        "-interval",
        "--interval",
        type=_positive_seconds,
        default=1.0,
        metavar="SECONDS",
        help="seconds between refreshes (default 1)",
    )
    p.add_argument(
        "-count",
        "--count",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="stop after N refreshes (default 0: until Ctrl-C)",
    )


COMMANDS: Final = {
    c.name: c
    for c in (
        Command("stats", "The gauges and lifetime totals.", cmd_stats, _stats_flags),
        Command(
            "queues", "Every queue: its gauges, and whether it is paused.", cmd_queues, _no_flags
        ),
        Command(
            "dlq list",
            "The dead-letter queue, oldest burial first, with each task's last error.",
            cmd_dlq_list,
            _dlq_list_flags,
        ),
        Command(
            "dlq requeue",
            "Give a dead task (or every one, with -all) a clean start: attempts 0, ready again.",
            cmd_dlq_requeue,
            _dlq_requeue_flags,
        ),
        Command("dlq purge", "Drop a dead task for good.", cmd_dlq_purge, _id_flags),
        Command(
            "task",
            "Look a task up: its state, attempts, last error, payload; parents, children, result.",
            cmd_task,
            _id_flags,
        ),
        Command(
            "result",
            "How a task ended: its result, or why it has none (-wait: for it to end).",
            cmd_result,
            _result_flags,
        ),
        Command(
            "tasks",
            "A queue's tasks in one state (-state), a page at a time (-cursor, or -all).",
            cmd_tasks,
            _tasks_flags,
        ),
        Command(
            "cancel",
            "Cancel a task: dropped if waiting, stopped if running (no retry), purged if dead.",
            cmd_cancel,
            _id_flags,
        ),
        Command("enqueue", "Enqueue a task; prints its id.", cmd_enqueue, _enqueue_flags),
        Command(
            "pause",
            "Stop handing out a queue's tasks (it still takes new ones).",
            cmd_pause,
            _queue_name_flags,
        ),
        Command("resume", "Hand a paused queue's tasks out again.", cmd_resume, _queue_name_flags),
        Command(
            "queue empty",
            "Cancel every ready and delayed task of a queue (running ones run their course).",
            cmd_queue_empty,
            _queue_name_flags,
        ),
        Command(
            "queue delete",
            "Forget a queue that holds no task (refused, exit 1, while it holds any).",
            cmd_queue_delete,
            _queue_name_flags,
        ),
        Command(
            "limits",
            "A queue's rate and concurrency limits: shown, set (-rate, -concurrency) or -clear.",
            cmd_limits,
            _limits_flags,
        ),
        Command(
            "schedules",
            "Every schedule: its rule, queue, next and last fires, fires so far.",
            cmd_schedules,
            _no_flags,
        ),
        Command(
            "schedule set",
            "Create or replace a schedule: -cron EXPR or -every DURATION, and -payload JSON.",
            cmd_schedule_set,
            _schedule_set_flags,
        ),
        Command(
            "schedule get",
            "One schedule: its rule, next and last fires, last task, the task it enqueues.",
            cmd_schedule_get,
            _schedule_name_flags,
        ),
        Command(
            "schedule delete",
            "Delete a schedule (the tasks it fired stay).",
            cmd_schedule_delete,
            _schedule_name_flags,
        ),
        Command(
            "schedule pause",
            "Stop a schedule's fires until it is resumed.",
            cmd_schedule_pause,
            _schedule_name_flags,
        ),
        Command(
            "schedule resume",
            "Fire a paused schedule again, from its next time after now.",
            cmd_schedule_resume,
            _schedule_name_flags,
        ),
        Command(
            "watch",
            "A live view of the gauges and rates, refreshed every -interval, until Ctrl-C.",
            cmd_watch,
            _watch_flags,
        ),
    )
}

_DLQ_ACTIONS: Final = ("list", "requeue", "purge")
_QUEUE_ACTIONS: Final = ("empty", "delete")
_SCHEDULE_ACTIONS: Final = ("set", "get", "delete", "pause", "resume")
# The commands of two words: the first word, and the second's default (None: one is needed).
_TWO_WORDS: Final = {
    "dlq": ("list", _DLQ_ACTIONS),
    "queue": (None, _QUEUE_ACTIONS),
    "schedule": (None, _SCHEDULE_ACTIONS),
}


def top_parser() -> FlagParser:
    """``wq -h``: the commands, the common flags and the exit codes."""
    width = max(len(name) for name in COMMANDS) + 2
    commands = "\n".join(f"  {name:<{width}}{c.summary}" for name, c in COMMANDS.items())
    commands += f"\n  {'worker':<{width}}{WORKER_SUMMARY}"
    commands += f"\n  {'completion':<{width}}{COMPLETION_SUMMARY}"
    codes = "\n".join(f"  {code:<5}{meaning}" for code, meaning in EXIT_CODES.items())
    p = FlagParser(
        prog=PROG,
        description="Look at and run a wq broker from a terminal. The flags below go with\n"
        f"every command, before or after it ({PROG} COMMAND -h for a command's own).\n\n"
        f"commands:\n{commands}",
    )
    p.usage = f"{PROG} COMMAND [ARGS] [FLAGS]"
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = f"exit codes:\n{codes}"
    add_common_flags(p)
    return p


def _value_flags() -> tuple[set[str], set[str]]:
    """Every spelling of every flag that takes a value, and of every switch, of every
    command."""
    values: set[str] = set()
    switches: set[str] = set()
    for parser in (top_parser(), *(c.parser() for c in COMMANDS.values())):
        switches |= switch_spellings(parser)
        for action in parser._actions:
            if action.nargs is None and action.option_strings:
                values.update(action.option_strings)
    return values, switches


def split_command(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """The command's words (``["dlq", "requeue"]``) and the rest of ``argv`` (flags and
    arguments) in order: flags may come before or after the command."""
    takes_value, switches = _value_flags()
    words: list[str] = []
    rest: list[str] = []
    args = spell_switches(argv, switches)  # -json true: the switch's value, not a command word
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            rest.extend(args[i:])
            break
        if arg.startswith("-") and len(arg) > 1 and not _NUMBER.match(arg):
            rest.append(arg)
            if arg in takes_value and i + 1 < len(args):
                rest.append(args[i + 1])
                i += 1
        elif not words:
            words.append(arg)
        elif len(words) == 1 and words[0] in _TWO_WORDS:
            words.append(arg)  # its action: dlq list, requeue or purge; queue empty ...
        else:
            rest.append(arg)
        i += 1
    return words, rest


def _fail(message: str, code: int = EXIT_USAGE, err: TextIO | None = None) -> int:
    print(f"{PROG}: {' '.join(message.split())}", file=err or sys.stderr)
    return code


def resolve(words: list[str]) -> Command:
    """The command the words name; raises _Usage for a word that names none."""
    if not words:
        raise _Usage(f"no command given: one of {', '.join(_command_words())} ({PROG} -h for help)")
    if words[0] in _TWO_WORDS:
        default, actions = _TWO_WORDS[words[0]]
        action = words[1] if len(words) > 1 else default
        if action is None:
            raise _Usage(f"{words[0]} needs an action: one of {', '.join(actions)}")
        if action not in actions:
            raise _Usage(f"unknown {words[0]} action {action!r}: one of {', '.join(actions)}")
        return COMMANDS[f"{words[0]} {action}"]
    command = COMMANDS.get(words[0])
    if command is None:
        raise _Usage(f"unknown command {words[0]!r}: one of {', '.join(_command_words())}")
    return command


def _command_words() -> list[str]:
    return [*dict.fromkeys(name.split()[0] for name in COMMANDS), "worker", "completion"]


# `wq worker` is a command of its own (wqclient.cli.run): its flags are its own.
WORKER_SUMMARY: Final = (
    "Run an App's tasks (MODULE:APP) or a program per task (-exec, or after --)."
)


# `wq completion SHELL` (wqclient.cli.completion): a script generated from COMMANDS.
COMPLETION_SUMMARY: Final = "Print a shell completion script for wq: bash, zsh or fish."


def _worker_argv(argv: Sequence[str], command: str = "worker") -> list[str] | None:
    """The arguments of ``wq worker ...`` (all but its first ``worker``), or None if the
    command is another."""
    words, _ = split_command(argv)
    if not words or words[0] != command:
        return None
    args = list(argv)
    del args[args.index(command)]
    return args


async def _run(command: Command, args: argparse.Namespace, out: Output) -> int:
    try:
        client = AsyncClient(
            args.broker, token=args.token, ca_file=args.ca_file, timeout=args.timeout
        )
    except WqError as e:  # a URL of another kind, a CA file that cannot be read ...
        raise _Usage(e.message) from None
    try:
        return await command.handler(client, args, out)
    finally:
        await client.close()


def parse(argv: Sequence[str], err: TextIO) -> tuple[Command, argparse.Namespace] | int:
    """The command and its arguments, or the exit status when there is nothing to run (the
    help was printed, or a one-line error)."""
    words, rest = split_command(argv)
    if not words:
        try:
            top_parser().parse_args(rest)  # -h prints the help; a bad flag is an error
        except SystemExit as e:
            return e.code if isinstance(e.code, int) else EXIT_USAGE
    try:
        command = resolve(words)
    except _Usage as e:
        return _fail(str(e), err=err)
    try:
        args = command.parser().parse_args(rest)
    except SystemExit as e:  # -h (0), or a bad flag: one line on stderr already (2)
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    try:
        conn = connection(args)
    except SettingError as e:
        return _fail(str(e), err=err)
    args.broker, args.token, args.ca_file = conn.broker, conn.token, conn.ca_file
    return command, args


def main(
    argv: Sequence[str] | None = None, *, out: TextIO | None = None, err: TextIO | None = None
) -> int:
    """Run ``wq`` with ``argv`` (default: the command line); returns the exit status.
    ``out``, ``err``: where to write (default: standard output and error)."""
    stderr = err or sys.stderr
    given = list(sys.argv[1:] if argv is None else argv)
    worker_argv = _worker_argv(given)
    if worker_argv is not None:
        from wqclient.cli import run

        return run.main(worker_argv)
    completion_argv = _worker_argv(given, "completion")
    if completion_argv is not None:
        from wqclient.cli import completion

        return completion.main(completion_argv, out=out, err=err)
    parsed = parse(given, stderr)
    if isinstance(parsed, int):
        return parsed
    command, args = parsed
    try:
        return asyncio.run(_run(command, args, Output(out or sys.stdout, args.json, stderr)))
    except _Usage as e:
        return _fail(str(e), err=stderr)
    except WqError as e:
        return _fail(e.message, exit_code(e), err=stderr)
    except KeyboardInterrupt:
        return EXIT_OK if command.name == "watch" else EXIT_INTERRUPTED
    except BrokenPipeError:  # `wq dlq list | head`: the reader has what it wanted
        if out is None:  # and Python would complain when it flushes stdout at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except Exception as e:  # a bug: still one line, not a traceback
        return _fail(f"unexpected error: {type(e).__name__}: {e}", EXIT_FAILED, err=stderr)


if __name__ == "__main__":
    quiet_grpc()
    sys.exit(main())
