"""Sends the shop's work to the workers and prints what comes back: ``python producer.py``."""

from __future__ import annotations

import asyncio
from decimal import Decimal

from tasks import DECLINED_CARD, FLAKY_CARD, app, charge, price, send_receipt, ship, total

from wqclient import TaskNotSucceeded, chain, chord, signature


async def main() -> None:
    async with app:  # (closes its connection at the end)
        await send_the_work()


async def send_the_work() -> None:
    # One call, one task: enqueue() returns a handle at once; result() waits for the worker.
    receipt = await send_receipt.enqueue("ann@example.com", order_id="o-1001")
    print("receipt:", await receipt.result(timeout=30))
    mugs = await price.enqueue("mug", 2)
    print("2 mugs:", await mugs.result(timeout=30))

    # A chain: each step runs once the one before has succeeded, and is handed its result
    # (.s(); .si() would not be). The handle's result is the last step's.
    order = chain(
        price.s("tee", 1),
        charge.s(card="4242-4242-4242-4242"),
        ship.s(order_id="o-1002"),
    )
    print("order o-1002:", await (await app.submit(order)).result(timeout=30))

    # A chord: the prices side by side, then their total once all of them are in.
    basket = chord([price.s("mug", 2), price.s("tee", 1), price.s("sticker", 4)], total.s())
    print("basket:", await (await app.submit(basket)).result(timeout=30))

    # Retries: the flaky card is charged on the second attempt; the declined one fails at once
    # and is kept in the dead-letter queue with its error (GET /dlq, `wq dlq`).
    flaky = await charge.enqueue(Decimal("9.99"), card=FLAKY_CARD)
    charged = await flaky.result(timeout=30)
    print(f"flaky card: {charged} (attempt {(await flaky.status()).attempts})")
    declined = await charge.enqueue(Decimal("9.99"), card=DECLINED_CARD)
    try:
        await declined.result(timeout=30)
    except TaskNotSucceeded as e:
        print("declined card:", e)

    # A task for a worker in another language (archive_order.sh): the payload convention
    # written out, in the queue that worker takes from.
    payload = {"task": "archive_order", "kwargs": {"order_id": "o-1002"}}
    archive = signature(payload, queue="archive")
    print("archived:", await (await app.submit(archive)).result(timeout=30))


if __name__ == "__main__":
    asyncio.run(main())
