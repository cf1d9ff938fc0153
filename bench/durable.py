"""The SQLite store's footprint: resident memory per ready task, and a restart.

    python -m bench.durable fill PATH N SIZE   # N ready tasks of SIZE-byte payloads
    python -m bench.durable build PATH N SIZE  # the same, in batches of 10,000 (a larger file)
    python -m bench.durable open PATH          # a restart on that file

Each prints one JSON line; run each in a fresh process (the benchmark does). ``fill`` goes through
the store's ``enqueue_many`` (batches of 1,000, as EnqueueBatch would) with synchronous=NORMAL;
``open`` times the open (the index rebuilt from the file) and reads the memory it leaves.
"""

from __future__ import annotations

import asyncio
import gc
import json
import random
import sys
import time
from typing import Any

from bench.inproc import rss_bytes
from wqbroker.models import NewTask
from wqbroker.retry import Backoff
from wqbroker.store.sqlite import SqliteStore

BATCH = 1000
NOW = 1_800_000_000.0


def payload(i: int, size: int) -> bytes:
    head = b'{"n":%d,"pad":"' % i
    return head + b"x" * max(0, size - len(head) - 2) + b'"}'


async def _open(path: str) -> SqliteStore:
    rng = random.Random(1)
    return await SqliteStore.open(path, Backoff(1.0, 30.0, rng), rng, sync="normal")


async def fill(path: str, n: int, size: int, batch: int = BATCH) -> dict[str, Any]:
    store = await _open(path)
    await store.enqueue_many([NewTask(payload(0, size), 3, 0.0)], now=NOW)  # warm up
    gc.collect()
    before = rss_bytes()
    t0 = time.perf_counter()
    half = 0
    for start in range(1, n + 1, batch):
        items = [NewTask(payload(i, size), 3, 0.0) for i in range(start, min(n + 1, start + batch))]
        await store.enqueue_many(items, now=NOW)
        if not half and start + batch > n // 2:
            gc.collect()
            half, half_n = rss_bytes(), start + len(items) - 1
    elapsed = time.perf_counter() - t0
    gc.collect()
    after = rss_bytes()
    marginal = (after - half) / (n - half_n)
    stats = await store.stats()
    assert stats.ready == n + 1, stats
    await store.close()
    return {
        "n": n,
        "payload_bytes": size,
        "fill_s": elapsed,
        "rss_mb": after / 2**20,
        "bytes_per_task": (after - before) / n,
        # what each further task costs, and so the resident memory at 10M tasks of this size
        "marginal_bytes_per_task": marginal,
        "projected_10m_gib": (after + marginal * (10_000_000 - n)) / 2**30,
    }


async def reopen(path: str) -> dict[str, Any]:
    gc.collect()
    before = rss_bytes()
    t0 = time.perf_counter()
    store = await _open(path)
    elapsed = time.perf_counter() - t0
    gc.collect()
    after = rss_bytes()
    stats = await store.stats()
    delivery = await store.claim(lease=30.0, now=NOW)
    assert delivery is not None
    assert delivery.task.payload.startswith(b'{"n":0,'), delivery
    await store.release(delivery.task.id, delivery.lease_id, now=NOW)  # leave the file as it was
    await store.close()
    return {
        "ready": stats.ready,
        "open_s": elapsed,
        "rss_mb": after / 2**20,
        "bytes_per_task": (after - before) / max(1, stats.ready),
    }


def main(argv: list[str]) -> None:
    what = argv[0]
    if what == "fill":
        result = asyncio.run(fill(argv[1], int(argv[2]), int(argv[3])))
    elif what == "build":
        result = asyncio.run(fill(argv[1], int(argv[2]), int(argv[3]), batch=10_000))
    elif what == "open":
        result = asyncio.run(reopen(argv[1]))
    else:
        raise SystemExit(f"unknown measurement {what}")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
