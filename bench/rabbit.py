"""The same end-to-end workload through RabbitMQ, for comparison: aio-pika, publisher confirms,
manual acks, a durable-less queue of its own.

    python -m bench.rabbit produce AMQP_URL QUEUE N CONCURRENCY
    python -m bench.rabbit consume AMQP_URL QUEUE N PREFETCH
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

from bench.load import PAYLOAD


async def produce(url: str, queue: str, n: int, concurrency: int) -> dict[str, Any]:
    import aio_pika

    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        await channel.declare_queue(queue, auto_delete=False)
        counter = iter(range(n))
        first = time.time()

        async def publish() -> None:
            for _ in counter:
                await channel.default_exchange.publish(
                    aio_pika.Message(body=PAYLOAD), routing_key=queue
                )

        await asyncio.gather(*(publish() for _ in range(concurrency)))
        last = time.time()
    return {"first": first, "last": last, "n": n}


async def consume(url: str, queue: str, n: int, prefetch: int) -> dict[str, Any]:
    import aio_pika

    connection = await aio_pika.connect(url)
    done = 0
    finished = asyncio.Event()
    async with connection:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=prefetch)
        q = await channel.declare_queue(queue, auto_delete=False)

        async def on_message(message: Any) -> None:
            nonlocal done
            await message.ack()
            done += 1
            if done >= n:
                finished.set()

        tag = await q.consume(on_message)
        await finished.wait()
        last = time.time()
        await q.cancel(tag)
        await q.delete(if_unused=False, if_empty=False)
    return {"last": last, "n": done}


def main(argv: list[str]) -> None:
    role, url, queue, n, k = argv[0], argv[1], argv[2], int(argv[3]), int(argv[4])
    if role == "produce":
        result = asyncio.run(produce(url, queue, n, k))
    else:
        result = asyncio.run(consume(url, queue, n, k))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
