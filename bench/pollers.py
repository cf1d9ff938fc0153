"""Parked long-pollers: the broker's memory per parked HTTP poller, and the enqueue-to-delivery
latency a worker sees with them parked.

    python -m bench.pollers URL BROKER_PID POLLERS SAMPLES GAP_MS

Opens POLLERS connections, each long-polling GET /jobs/next?wait_ms=30000 (and polling again
after a 204). Reads the broker's RSS before and after. Then enqueues SAMPLES tasks one at a time,
each carrying the time it was sent: whichever poller the broker hands it to (the one parked
longest) notes how late it arrived, acks it, and parks again. Prints one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import aiohttp


def rss_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


async def run(url: str, pid: int, pollers: int, samples: int, gap_ms: float) -> dict[str, Any]:
    latencies: list[float] = []
    got = asyncio.Event()
    stop = asyncio.Event()
    parked = 0
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def poll() -> None:
            nonlocal parked
            while not stop.is_set():
                parked += 1
                try:
                    async with session.get(url + "/jobs/next?wait_ms=30000") as resp:
                        raw = await resp.read()
                        status = resp.status
                finally:
                    parked -= 1
                if status != 200:
                    continue
                now = time.time()
                body = json.loads(raw)
                latencies.append(now - body["task"]["payload"]["sent"])
                got.set()
                ack = f"{url}/jobs/{body['task']['id']}/ack?lease_id={body['lease_id']}"
                async with session.post(ack) as r:
                    await r.read()

        gc_rss = rss_of(pid)
        tasks = []
        for i in range(pollers):
            tasks.append(asyncio.ensure_future(poll()))
            if i % 500 == 499:
                await asyncio.sleep(0.05)  # do not overrun the listen backlog
        # Give every request time to arrive and park, and the broker's memory to settle.
        await asyncio.sleep(2.0 + pollers / 4000)
        rss = rss_of(pid)
        per_poller = (rss - gc_rss) / pollers
        async with aiohttp.ClientSession() as producer:
            for _ in range(samples):
                got.clear()
                body = {"payload": {"sent": time.time()}}
                async with producer.post(url + "/jobs", json=body) as resp:
                    await resp.read()
                await asyncio.wait_for(got.wait(), 10)
                await asyncio.sleep(gap_ms / 1000)
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    latencies.sort()
    return {
        "pollers": pollers,
        "broker_rss_mb": rss / 2**20,
        "bytes_per_poller": per_poller,
        "p50_ms": latencies[len(latencies) // 2] * 1000,
        "p99_ms": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1000,
    }


def main(argv: list[str]) -> None:
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:  # pragma: no cover
        pass
    url, pid, pollers, samples, gap = (
        argv[0],
        int(argv[1]),
        int(argv[2]),
        int(argv[3]),
        float(argv[4]),
    )
    print(json.dumps(asyncio.run(run(url, pid, pollers, samples, gap))), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
