"""Limits per queue under load (docs/design/schedules.md), on a running broker, through the public
client: workers (wqclient.Worker) take tasks from a rate-limited queue and from a
concurrency-limited one for a while; how close to its limit each queue runs, and that neither is
ever passed.

    python -m bench.limits run URL SECONDS RATE BURST CONCURRENCY

Sets ``RATE`` a second (a bucket of ``BURST``) on the queue ``lim-rate`` and ``CONCURRENCY`` on
``lim-conc``, fills both, and runs four workers on each (each of 16 handlers, so the workers ask
for far more than the limits allow) for ``SECONDS``. The rate queue's handlers return at once;
the concurrency queue's sleep 5 ms. Prints one JSON line:
``{"rate": {"limit", "burst", "handed", "steady_per_s", "max_window", "window_bound"},
"concurrency": {"limit", "handled", "per_s", "max_held_broker", "max_in_handlers"}}``:
``steady_per_s`` is the rate after the first second (the burst spent), ``max_window`` the most
tasks that reached a handler in any one-second window (the broker hands out at most RATE + BURST
in any second; the handlers see them a delivery's jitter later), ``max_held_broker`` the most
tasks of the queue the broker counted handed out (its ``/queues``, every 10 ms),
``max_in_handlers`` the most handlers running at once over all workers.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import sys
import time
from typing import Any

from wqclient import AsyncClient, Worker
from wqclient.models import RateLimit

RATE_QUEUE = "lim-rate"
CONC_QUEUE = "lim-conc"
WORKERS = 4
HANDLERS = 16
HOLD = 0.005  # seconds a task of the concurrency queue is worked on


async def run(url: str, seconds: float, rate: int, burst: int, concurrency: int) -> dict[str, Any]:
    client = AsyncClient(url)
    try:
        await client.set_limits(RATE_QUEUE, rate=RateLimit(rate, 1000, burst))
        await client.set_limits(CONC_QUEUE, concurrency=concurrency)
        await _fill(client, RATE_QUEUE, int(rate * seconds * 1.5) + burst)
        await _fill(client, CONC_QUEUE, int(concurrency / HOLD * seconds * 1.5))
        handed: list[float] = []  # when each task of the rate queue reached a handler
        running = 0
        most_running = 0

        async def rated(task: Any) -> None:
            handed.append(time.monotonic())

        async def held(task: Any) -> None:
            nonlocal running, most_running
            running += 1
            most_running = max(most_running, running)
            await asyncio.sleep(HOLD)
            running -= 1

        workers = [
            Worker(client, rated, concurrency=HANDLERS, queues=RATE_QUEUE) for _ in range(WORKERS)
        ] + [Worker(client, held, concurrency=HANDLERS, queues=CONC_QUEUE) for _ in range(WORKERS)]
        most_held = 0
        started = time.monotonic()
        runs = [asyncio.ensure_future(w.run()) for w in workers]
        while time.monotonic() < started + seconds:
            for q in await client.queues():
                if q.name == CONC_QUEUE:
                    most_held = max(most_held, q.handed_out)
            await asyncio.sleep(0.01)
        for w in workers:
            w.stop()
        await asyncio.gather(*runs)
        handled = sum(w.succeeded for w in workers[WORKERS:])
    finally:
        await client.close()
    handed.sort()
    steady = [t for t in handed if started + 1.0 <= t < started + seconds]
    window = max(
        (bisect.bisect_right(handed, t + 1.0) - i for i, t in enumerate(handed)), default=0
    )
    return {
        "rate": {
            "limit": rate,
            "burst": burst,
            "handed": len(handed),
            "steady_per_s": len(steady) / (seconds - 1.0),
            "max_window": window,
            "window_bound": rate + burst,
        },
        "concurrency": {
            "limit": concurrency,
            "handled": handled,
            "per_s": handled / seconds,
            "max_held_broker": most_held,
            "max_in_handlers": most_running,
        },
    }


async def _fill(client: AsyncClient, queue: str, n: int) -> None:
    for i in range(0, n, 500):
        await client.enqueue_many([{"n": j} for j in range(i, min(n, i + 500))], queue=queue)


def main() -> None:
    if len(sys.argv) != 7 or sys.argv[1] != "run":
        raise SystemExit(__doc__)
    url, seconds, rate, burst, concurrency = sys.argv[2:]
    result = asyncio.run(run(url, float(seconds), int(rate), int(burst), int(concurrency)))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
