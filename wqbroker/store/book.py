"""The schedules of a store that keeps its state in this process (docs/design/schedules.md): the
memory store's (lost at exit, as its tasks are) and the SQLite store's (which writes each change
to its file in the same commit as the tasks', and loads them back at open).

A :class:`Book` holds every schedule by name, and those that will fire (not paused) sorted by
their next fire time, so that the due ones are found at a cost in what is due (and a logarithm),
never in how many schedules there are. Nothing here suspends: each call is one atomic step of the
event loop, so a fire's compare-and-set and the enqueue of its task (by the store, in the same
step) are one change, and one commit.

The book hands out copies: a schedule it returns is the caller's to keep.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from sortedcontainers import SortedList

from wqbroker.models import Enqueued, NewTask, Schedule
from wqbroker.store.index import Index, Record


def same_rule(a: Schedule, b: Schedule) -> bool:
    """Whether two schedules fire by the same rule (as written)."""
    return a.cron == b.cron and a.timezone == b.timezone and a.every == b.every


def unchanged(stored: Schedule, new: Schedule) -> bool:
    """Whether a put of ``new`` would change nothing of ``stored`` (the same rule, task and
    paused flag): it is left as it stands."""
    return same_rule(stored, new) and stored.task == new.task and stored.paused == new.paused


class Book:
    """Every schedule by name; the firing ones by next fire time."""

    __slots__ = ("_by_name", "_due", "_revision")

    def __init__(self) -> None:
        self._by_name: dict[str, Schedule] = {}
        self._due: SortedList[tuple[float, str]] = SortedList()  # (next_fire_at, name)
        self._revision = 0  # the last revision drawn

    def __len__(self) -> int:
        return len(self._by_name)

    def get(self, name: str) -> Schedule | None:
        found = self._by_name.get(name)
        return None if found is None else replace(found)

    def all(self) -> list[Schedule]:
        """Every schedule, by name."""
        return [replace(self._by_name[name]) for name in sorted(self._by_name)]

    def put(self, schedule: Schedule, now: float) -> tuple[Schedule, bool]:
        """Insert or replace (see the store contract's put_schedule): the schedule as stored,
        and whether anything changed."""
        old = self._by_name.get(schedule.name)
        if old is not None and unchanged(old, schedule):
            return replace(old), False
        new = replace(schedule, updated_at=now, revision=self._draw())
        if old is None:
            new.created_at, new.fires, new.last_fire_at, new.last_task_id = now, 0, None, None
        else:
            new.created_at, new.fires = old.created_at, old.fires
            new.last_fire_at, new.last_task_id = old.last_fire_at, old.last_task_id
            if not old.paused and not new.paused and same_rule(old, new):
                new.next_fire_at = old.next_fire_at
        if new.paused:
            new.next_fire_at = None
        self._set(new)
        return replace(new), True

    def delete(self, name: str) -> bool:
        old = self._by_name.pop(name, None)
        if old is None:
            return False
        self._undue(old)
        return True

    def set_paused(
        self, name: str, paused: bool, next_fire_at: float | None, now: float
    ) -> tuple[Schedule | None, bool]:
        """Pause or resume (see the store contract): the schedule as it stands (None: there is
        none), and whether it changed."""
        old = self._by_name.get(name)
        if old is None:
            return None, False
        if old.paused == paused:
            return replace(old), False
        new = replace(
            old,
            paused=paused,
            next_fire_at=None if paused else next_fire_at,
            updated_at=now,
            revision=self._draw(),
        )
        self._set(new)
        return replace(new), True

    def due(self, now: float) -> tuple[list[Schedule], float | None]:
        """The firing schedules whose next fire time is at or before ``now`` (earliest first),
        and the earliest next fire time of the others (None: none)."""
        out: list[Schedule] = []
        later = None
        for at, name in self._due:
            if at > now:
                later = at
                break
            out.append(replace(self._by_name[name]))
        return out, later

    def fire(
        self,
        name: str,
        expected: float,
        revision: int,
        scheduled_for: float,
        next_fire_at: float,
        task_id: str | None,
    ) -> Schedule | None:
        """The compare-and-set of a fire (``task_id``: the task it enqueued; None: a fire the
        broker refused, which only moves ``next_fire_at``): the schedule as it then stands, or
        None if it is not as expected (gone, changed, paused, fired)."""
        if not self.firable(name, expected, revision):
            return None
        old = self._by_name[name]
        new = replace(old, next_fire_at=next_fire_at)
        if task_id is not None:
            new.last_fire_at, new.last_task_id, new.fires = scheduled_for, task_id, old.fires + 1
        self._set(new)
        return replace(new)

    def firable(self, name: str, expected: float, revision: int) -> bool:
        """Whether a fire's compare-and-set would succeed now."""
        old = self._by_name.get(name)
        return (
            old is not None
            and not old.paused
            and old.next_fire_at == expected
            and old.revision == revision
        )

    def load(self, schedules: Iterable[Schedule]) -> None:
        """The schedules of a file, at open (their revisions go on from the highest)."""
        for schedule in schedules:
            self._set(schedule)
            self._revision = max(self._revision, schedule.revision)

    def _draw(self) -> int:
        self._revision += 1
        return self._revision

    def _set(self, schedule: Schedule) -> None:
        old = self._by_name.get(schedule.name)
        if old is not None:
            self._undue(old)
        self._by_name[schedule.name] = schedule
        if not schedule.paused and schedule.next_fire_at is not None:
            self._due.add((schedule.next_fire_at, schedule.name))

    def _undue(self, schedule: Schedule) -> None:
        if not schedule.paused and schedule.next_fire_at is not None:
            self._due.discard((schedule.next_fire_at, schedule.name))


def enqueue_fired(index: Index, task: NewTask, now: float) -> tuple[Record, Enqueued]:
    """A schedule's task enqueued in an index, as any task (its queue, gauges, counters), and
    marked with its schedule and scheduled time (its record's control part: only such a task,
    or one with other options, carries one); its record and the answer."""
    record = index.enqueue(task, now)
    ctl = record.control()
    ctl.schedule, ctl.scheduled_for = task.schedule, task.scheduled_for
    view = record.view()
    view.payload, view.created_at = task.payload, now  # (a store may keep them in its file)
    return record, Enqueued(view.id, False, view)
