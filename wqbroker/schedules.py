"""The rule of a schedule (docs/design/schedules.md): when it fires.

:class:`Rule` is the one home of it: ``Rule.parse(cron, timezone, every)`` checks a rule (a
five-field cron expression or a macro, in an IANA time zone; or an interval in seconds), and
answers when it fires: :meth:`Rule.next_after` (the first fire time strictly after a moment),
:meth:`Rule.latest_at_or_before` (the most recent fire time in ``(since, t]``), and
:meth:`Rule.due` (what a fire due since a time does: its scheduled time and the next one).

Cron expressions are parsed and walked by **cronsim** (what healthchecks.io runs its cron checks
on), which handles daylight-saving transitions as cron does: a time that falls in a skipped hour
fires once, just after it; a time in a repeated hour fires once (the first time). Its forward walk
is the rule here. Its backward walk, used to find the latest fire time before a moment without
walking forward from a time long past (a ``* * * * *`` rule a year behind would be half a million
steps), agrees with it except around a transition for a rule at set times in a zone with daylight
saving; for such a rule the answer is the forward walk from a little before the backward walk's.

Times are epoch seconds (floats), as everywhere in the broker.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import UTC, datetime, tzinfo
from typing import Final
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from wqbroker.errors import InvalidArgument

#: The macros, as the five fields they stand for.
MACROS: Final = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
DEFAULT_TIMEZONE: Final = "UTC"
MAX_CRON_CHARS: Final = 256
MAX_TIMEZONE_CHARS: Final = 64
_FIELDS: Final = "minute hour day-of-month month day-of-week"
# How far before a moment the forward walk starts, for a rule whose backward walk may disagree
# with it (see the module's docstring): more than any daylight-saving shift (an hour; Lord Howe's
# is half of one).
_DST_MARGIN: Final = 2 * 3600.0


def _zone(name: str) -> tzinfo:
    """The zone of this IANA name (UTC itself as datetime's, which cronsim walks fastest);
    InvalidArgument naming ``timezone`` if there is none."""
    if name == DEFAULT_TIMEZONE:
        return UTC
    if len(name) > MAX_TIMEZONE_CHARS:
        raise InvalidArgument(
            f"timezone must be at most {MAX_TIMEZONE_CHARS} characters, got {len(name)}"
        )
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        shown = name if name.isprintable() else repr(name)
        raise InvalidArgument(
            f"timezone {shown!r} is not a known IANA time zone (such as UTC, Europe/Berlin or "
            "America/New_York)"
        ) from None


def five_fields(cron: str) -> str:
    """The five fields a cron expression stands for (a macro's, or its own, spaced once);
    InvalidArgument naming ``cron`` if it is neither."""
    text = cron.strip()
    if text.startswith("@"):
        fields = MACROS.get(text.lower())
        if fields is None:
            raise InvalidArgument(
                f"cron {cron!r} is not a macro this broker knows (the macros: {', '.join(MACROS)})"
            )
        return fields
    parts = text.split()
    if len(parts) != 5:
        raise InvalidArgument(
            f"cron {cron!r} has {len(parts)} fields: it must have five ({_FIELDS}), or be a "
            "macro such as @hourly"
        )
    return " ".join(parts)


@dataclass(frozen=True, slots=True, eq=False)
class Rule:
    """When a schedule fires: ``cron`` (as given) in ``timezone``, or ``every`` seconds. Make
    one with :meth:`parse`."""

    cron: str | None
    timezone: str
    every: float | None
    _expr: str = field(default="", repr=False)  # the five fields (cron)
    _zone: tzinfo = field(default=UTC, repr=False)
    # Whether cronsim walks it with its daylight-saving fix-ups (a rule at set times in a zone
    # not UTC): then its backward walk may disagree with its forward one.
    _fixup: bool = field(default=False, repr=False)

    @classmethod
    def parse(
        cls, cron: str | None, timezone: str | None = None, every: float | None = None
    ) -> Rule:
        """A rule: exactly one of ``cron`` (five fields or a macro; ``timezone``: an IANA name,
        UTC when None) and ``every`` (seconds, above 0). InvalidArgument naming the member
        otherwise."""
        if (cron is None) == (every is None):
            raise InvalidArgument("exactly one of cron and every_ms must be given")
        if every is not None:
            if timezone is not None and timezone != DEFAULT_TIMEZONE:
                raise InvalidArgument("timezone goes only with cron (every_ms counts seconds)")
            if not every > 0 or not math.isfinite(every):
                raise InvalidArgument(f"every_ms must be above 0, got {every * 1000:g}")
            return cls(None, DEFAULT_TIMEZONE, float(every))
        assert cron is not None
        if len(cron) > MAX_CRON_CHARS:
            raise InvalidArgument(
                f"cron must be at most {MAX_CRON_CHARS} characters, got {len(cron)}"
            )
        name = DEFAULT_TIMEZONE if timezone is None else timezone
        zone = _zone(name)
        expr = five_fields(cron)
        start = datetime.now(zone)
        try:
            sim = CronSim(expr, start)
            next(sim)
        except CronSimError as e:
            reason = str(e)[:1].lower() + str(e)[1:]
            raise InvalidArgument(
                f"cron {cron!r} is not a valid cron expression: {reason}"
            ) from None
        except StopIteration:
            raise InvalidArgument(f"cron {cron!r} never fires (not once in 50 years)") from None
        return cls(cron, name, None, expr, zone, sim.fixup_tz is not None)

    def next_after(self, t: float) -> float:
        """The first fire time strictly after ``t``."""
        if self.every is not None:
            return t + self.every
        # (Walked on until past ``t``: from a moment in a repeated hour, cronsim's fix-up may
        # first give the earlier of its two times, which is before it.)
        for at in CronSim(self._expr, datetime.fromtimestamp(t, self._zone)):
            x = at.timestamp()
            if x > t:
                return x
        raise AssertionError("unreachable")  # (StopIteration: a rule parse() let through)

    def latest_at_or_before(self, t: float, since: float) -> float | None:
        """The most recent fire time in ``(since, t]``: the last time at or before ``t`` of the
        rule's times after ``since`` (``next_after(since)``, then each next one); None if
        there is none."""
        first = self.next_after(since)
        if first > t:
            return None
        return self.due(first, t)[0]

    def due(self, first: float, t: float) -> tuple[float, float]:
        """A fire at ``t`` of a schedule whose next fire time is ``first`` (one of the rule's
        times, at or before ``t``): its scheduled time, the most recent of the rule's times
        from ``first`` on that is at or before ``t`` (after a downtime, the times in between
        are skipped); and the next one, the first strictly after ``t``. For ``every``, the
        times are ``first`` and every interval after it."""
        every = self.every
        if every is not None:
            k = max(0, math.floor((t - first) / every))
            at = first + k * every
            while at > t and k > 0:  # (rounding)
                k -= 1
                at = first + k * every
            following = first + (k + 1) * every
            while following <= t:
                k += 1
                at, following = following, first + (k + 1) * every
            return at, following
        latest = self._latest(t)
        return max(latest, first), self.next_after(t)

    def _latest(self, t: float) -> float:
        """The latest of the rule's times at or before ``t`` (cron), in a few steps whatever
        the distance to the one before."""
        if not self._fixup:
            return self._backward(t)
        while True:
            start = self._backward(t - _DST_MARGIN) - 1.0
            best = None
            at = start
            while True:
                at = self.next_after(at)
                if at > t:
                    break
                best = at
            if best is not None:
                return best
            t = start  # (none in (start, t]: the latest is at or before start)

    def _backward(self, t: float) -> float:
        """cronsim's backward walk: its latest time at or before ``t`` (times are whole
        seconds: at or before ``t`` is before the next whole second)."""
        start = datetime.fromtimestamp(math.floor(t) + 1, self._zone)
        return next(CronSim(self._expr, start, reverse=True)).timestamp()

    def same(self, other: Rule) -> bool:
        """The same rule as written (a replace with it keeps the schedule's next fire time)."""
        return (self.cron, self.timezone, self.every) == (other.cron, other.timezone, other.every)
