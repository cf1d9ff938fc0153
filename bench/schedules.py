"""Schedules under load (docs/design/schedules.md): how late each fire is, on a running broker.

    python -m bench.schedules file PATH N     # a -schedule-file of N schedules, every_ms=1000
    python -m bench.schedules delays URL      # every fired task's delay, as one JSON line

``file`` writes N schedules (``s0`` ... ``sN-1``, every second, all to the queue ``sched``) for a
broker started with ``-schedule-file PATH``. ``delays`` reads every ready task of that queue (the
HTTP listing, page after page) and measures each one's delay: from its scheduled time
(``scheduled_for``) to its enqueue (``created_at``, the moment the fire's transaction made it):
``{"fires", "once", "p50_ms", "p99_ms", "max_ms", "per_s", "warm_p99_ms", "warm_max_ms"}``
(``once``: no (schedule, scheduled time) has two tasks; ``per_s``: fires per second over the span
of the scheduled times; ``warm_*``: without the fires of the first second, whose transactions are
the first of the broker's connections: on PostgreSQL, each compiles its functions then).
"""

from __future__ import annotations

import json
import statistics
import sys
import urllib.request
from collections import Counter
from datetime import datetime
from typing import Any

QUEUE = "sched"


def write_file(path: str, n: int) -> None:
    schedules = {f"s{i}": {"every_ms": 1000, "queue": QUEUE, "payload": {"n": i}} for i in range(n)}
    with open(path, "w") as f:
        json.dump({"schedules": schedules}, f)


def _epoch(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=60) as answer:
        return json.loads(answer.read())


def delays(url: str) -> dict[str, Any]:
    tasks: list[dict[str, Any]] = []
    cursor = ""
    while True:
        page = _get(f"{url}/jobs?queue={QUEUE}&state=ready&limit=1000&cursor={cursor}")
        tasks += page["tasks"]
        cursor = page["next_cursor"]
        if not cursor:
            break
    fired = [t for t in tasks if t.get("scheduled_for")]
    if not fired:
        return {"fires": 0, "once": True, "per_s": 0.0} | dict.fromkeys(_FIGURES, 0.0)
    times = [_epoch(t["scheduled_for"]) for t in fired]
    late = [(_epoch(t["created_at"]) - at) * 1000 for t, at in zip(fired, times, strict=True)]
    first = min(times)
    warm = sorted(ms for ms, at in zip(late, times, strict=True) if at >= first + 1.0) or [0.0]
    late.sort()
    seen = Counter((t["schedule"], t["scheduled_for"]) for t in fired)
    span = max(times) - first
    return {
        "fires": len(fired),
        "once": max(seen.values()) == 1,
        "p50_ms": statistics.median(late),
        "p99_ms": _p99(late),
        "max_ms": late[-1],
        "warm_p99_ms": _p99(warm),
        "warm_max_ms": warm[-1],
        "per_s": len(fired) / span if span > 0 else float(len(fired)),
    }


_FIGURES = ("p50_ms", "p99_ms", "max_ms", "warm_p99_ms", "warm_max_ms")


def _p99(ordered: list[float]) -> float:
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def main() -> None:
    what = sys.argv[1]
    if what == "file":
        write_file(sys.argv[2], int(sys.argv[3]))
        print(json.dumps({"written": int(sys.argv[3])}))
    elif what == "delays":
        print(json.dumps(delays(sys.argv[2])))
    else:
        raise SystemExit(f"unknown command {what!r}")


if __name__ == "__main__":
    main()
