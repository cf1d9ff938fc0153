"""In-process measurements of the store and the service (no network): memory per queued task, the
cost of operations at 1k versus 1M tasks, and the sweeper's tick with 1M idle leases.

    python -m bench.inproc memory N
    python -m bench.inproc scale SMALL LARGE OPS
    python -m bench.inproc sweep N
    python -m bench.inproc queues QUEUES PRIORITIES TASKS OPS

Each prints one JSON line. Run each in a fresh process (the benchmark does) so that memory readings
are not polluted by earlier work.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import statistics
import sys
import time
from typing import Any

from wqbroker.clock import FakeClock
from wqbroker.retry import Backoff
from wqbroker.service import Service
from wqbroker.store.memory import MemoryStore

PAYLOAD_SIZE = 100


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def payload(i: int) -> bytes:
    # A distinct 100-byte JSON payload per task, as each would arrive in its own request.
    head = b'{"n":%d,"pad":"' % i
    return head + b"x" * (PAYLOAD_SIZE - len(head) - 2) + b'"}'


def make_service() -> tuple[Service, MemoryStore, FakeClock]:
    rng = random.Random(1)
    store = MemoryStore(Backoff(1.0, 30.0, rng), rng)
    clock = FakeClock()
    return Service(store, clock), store, clock


async def memory(n: int) -> dict[str, Any]:
    """RSS growth per ready task, less its 100 payload bytes (the payload's bytes-object header
    counts as overhead)."""
    service, _, _ = make_service()
    await service.enqueue(payload(0))  # warm up: first-use allocations are not per task
    gc.collect()
    before = rss_bytes()
    for i in range(1, n + 1):
        await service.enqueue(payload(i))
    gc.collect()
    after = rss_bytes()
    stats = await service.stats()
    assert stats.ready == n + 1
    per_task = (after - before) / n - PAYLOAD_SIZE
    return {"n": n, "rss_mb": after / 2**20, "bytes_per_task_beyond_payload": per_task}


async def populate(service: Service, clock: FakeClock, n: int) -> None:
    """n ready, n delayed, n handed out."""
    for i in range(n):
        await service.enqueue(payload(i))
    for _ in range(n):
        await service.claim(0, 300_000)
    for i in range(n):
        await service.enqueue(payload(i), None, 3_600_000)
    for i in range(n):
        await service.enqueue(payload(i))


async def timed_ops(service: Service, ops: int) -> dict[str, float]:
    """Seconds per enqueue, claim and ack (each measured over ``ops`` operations)."""
    p = payload(0)
    t0 = time.perf_counter()
    for _ in range(ops):
        await service.enqueue(p)
    t1 = time.perf_counter()
    deliveries = [await service.claim(0, 300_000) for _ in range(ops)]
    t2 = time.perf_counter()
    for d in deliveries:
        assert d is not None
        await service.ack(d.task.id, d.lease_id)
    t3 = time.perf_counter()
    return {"enqueue": (t1 - t0) / ops, "claim": (t2 - t1) / ops, "ack": (t3 - t2) / ops}


async def scale(small: int, large: int, ops: int) -> dict[str, Any]:
    """Both populations are built first, then timed in turns (five rounds, best of each), so
    that a machine speeding up or slowing down does not tilt the ratio."""
    services = {}
    for n in (small, large):
        service, _, clock = make_service()
        await populate(service, clock, n)
        services[n] = service
    gc.collect()
    gc.freeze()  # the populations are long-lived: keep the collector from rescanning them
    best: dict[int, dict[str, float]] = {small: {}, large: {}}
    for _ in range(5):
        for n, service in services.items():
            for op, t in (await timed_ops(service, ops)).items():
                best[n][op] = min(best[n].get(op, t), t)
    gc.unfreeze()
    ratios = {op: best[large][op] / best[small][op] for op in best[small]}
    return {
        "small": small,
        "large": large,
        "us_small": {k: v * 1e6 for k, v in best[small].items()},
        "us_large": {k: v * 1e6 for k, v in best[large].items()},
        "ratio": ratios,
    }


async def sweep(n: int) -> dict[str, Any]:
    service, _, clock = make_service()
    for i in range(n):
        await service.enqueue(payload(i))
    for _ in range(n):
        await service.claim(0, 300_000)
    gc.collect()
    gc.freeze()
    samples = []
    for _ in range(200):
        clock.advance(0.25)
        t0 = time.perf_counter()
        await service.sweep()
        samples.append(time.perf_counter() - t0)
    stats = await service.stats()
    assert stats.handed_out == n
    return {
        "leases": n,
        "tick_median_us": statistics.median(samples) * 1e6,
        "tick_max_us": max(samples) * 1e6,
    }


async def _queue_ops(
    service: Service, names: list[str], priorities: int, ops: int
) -> dict[str, float]:
    """Seconds per enqueue, claim and ack, spread over ``names`` and ``priorities``."""
    p = payload(0)
    k = len(names)
    t0 = time.perf_counter()
    for i in range(ops):
        await service.enqueue(p, queue=names[i % k], priority=(i // k) % priorities)
    t1 = time.perf_counter()
    deliveries = [await service.claim(0, 300_000, queues=names[i % k]) for i in range(ops)]
    t2 = time.perf_counter()
    for d in deliveries:
        assert d is not None
        await service.ack(d.task.id, d.lease_id)
    t3 = time.perf_counter()
    return {"enqueue": (t1 - t0) / ops, "claim": (t2 - t1) / ops, "ack": (t3 - t2) / ops}


async def queues(n_queues: int, priorities: int, tasks: int, ops: int) -> dict[str, Any]:
    """The cost of enqueue, claim and ack with ``tasks`` ready tasks spread over ``n_queues``
    queues and ``priorities`` priorities, against the same number in one queue at one priority
    (each claim names one queue, as a worker of that queue does). Timed in turns, best of five."""
    # Both name their queues (the default queue skips the name's check, a constant cost).
    setups = {"one": (["jobs"], 1), "many": ([f"q{i}" for i in range(n_queues)], priorities)}
    services = {}
    for label, (names, prios) in setups.items():
        service, _, _ = make_service()
        k = len(names)
        for i in range(tasks):
            await service.enqueue(payload(i), queue=names[i % k], priority=(i // k) % prios)
        services[label] = service
    gc.collect()
    gc.freeze()
    best: dict[str, dict[str, float]] = {"one": {}, "many": {}}
    for _ in range(5):
        for label, service in services.items():
            names, prios = setups[label]
            for op, t in (await _queue_ops(service, names, prios, ops)).items():
                best[label][op] = min(best[label].get(op, t), t)
    gc.unfreeze()
    return {
        "queues": n_queues,
        "priorities": priorities,
        "tasks": tasks,
        "us_one": {k: v * 1e6 for k, v in best["one"].items()},
        "us_many": {k: v * 1e6 for k, v in best["many"].items()},
        "ratio": {op: best["many"][op] / best["one"][op] for op in best["one"]},
    }


def main(argv: list[str]) -> None:
    what = argv[0]
    if what == "memory":
        result = asyncio.run(memory(int(argv[1])))
    elif what == "scale":
        result = asyncio.run(scale(int(argv[1]), int(argv[2]), int(argv[3])))
    elif what == "sweep":
        result = asyncio.run(sweep(int(argv[1])))
    elif what == "queues":
        result = asyncio.run(queues(*(int(a) for a in argv[1:5])))
    else:
        raise SystemExit(f"unknown measurement {what}")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
