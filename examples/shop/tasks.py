"""The shop's tasks: ``wq worker tasks:app`` runs them (from this directory).

Each function is an ordinary function you can call and test; ``@app.task`` adds ``.enqueue()``
(run it on a worker), ``.s()`` (a step of a chain or a chord) and the options the broker keeps
with each call (queue, attempts, time limit).
"""

from __future__ import annotations

import asyncio
from decimal import Decimal

from wqclient import App, Context, Fail, Retry

app = App()  # the broker: $WQ_BROKER, else http://localhost:8080

PRICES = {"mug": Decimal("12.50"), "tee": Decimal("20.00"), "sticker": Decimal("1.25")}
STOCK = {"mug": 40, "tee": 3, "sticker": 500}
DECLINED_CARD = "4000-0000-0000-0002"  # the bank always says no
FLAKY_CARD = "4000-0000-0000-0119"  # the bank times out once, then says yes


@app.task(queue="emails", max_attempts=5, timeout=30)
async def send_receipt(email: str, order_id: str) -> str:
    """An async task: it runs on the worker's event loop."""
    await asyncio.sleep(0.05)  # (talking to the mail service)
    return f"receipt for {order_id} sent to {email}"


@app.task(give_up_on=(KeyError,))
def price(sku: str, qty: int) -> Decimal:
    """A sync task: it runs in the worker's thread pool. An unknown SKU fails at once (no
    retry would make it known): straight to the dead-letter queue."""
    return PRICES[sku] * qty


@app.task
def total(prices: list[Decimal]) -> Decimal:
    """A chord's callback: handed the results of the group before it, in order."""
    return sum(prices, Decimal(0))


@app.task(max_attempts=3)
def charge(amount: Decimal, card: str, ctx: Context) -> str:
    """Retries from code: ``Retry`` tries again (after ``delay`` seconds), ``Fail`` gives up at
    once; any other exception retries with the broker's backoff, up to ``max_attempts``."""
    if card == DECLINED_CARD:
        raise Fail(f"card {card} declined")
    if card == FLAKY_CARD and ctx.attempt == 1:
        raise Retry(delay=0.2, error="the bank timed out")
    return f"ch_{ctx.task_id}_{amount}"


@app.task
def ship(charge_id: str, order_id: str) -> dict[str, str]:
    """The last step of the order's chain: handed the charge's result first."""
    return {"order": order_id, "charge": charge_id, "status": "shipped"}


@app.task
def stock_report() -> dict[str, int]:
    """Fired by the broker's schedule (schedules.toml): the items running low."""
    return {sku: n for sku, n in STOCK.items() if n < 10}
