"""POST /jobs/{id}/release (an extension): the holder hands its task back without counting the
attempt, as a worker that is stopping does. A real broker on port 0, raw HTTP and wqclient."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.helpers import Http, http_broker, http_client, invariant_holds, wait_until
from wqbroker.broker import Broker
from wqbroker.clock import FakeClock
from wqclient import AsyncClient, LeaseLost, NotFound, Unsupported

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=[True, False], ids=["fast-lane", "aiohttp-only"])
async def broker(clock: FakeClock, request: pytest.FixtureRequest) -> AsyncIterator[Broker]:
    async with http_broker(clock=clock, http_fast_lane=request.param) as b:
        yield b


@pytest.fixture
async def http(broker: Broker) -> AsyncIterator[Http]:
    async with http_client(broker.http_url) as h:
        yield h


async def release(http: Http, task_id: str, lease_id: str | None) -> tuple[int, Any]:
    query = "" if lease_id is None else f"?lease_id={lease_id}"
    return await http.request("POST", f"/jobs/{task_id}/release{query}")


async def test_a_released_task_is_ready_at_the_head_with_its_attempt_not_counted(
    http: Http,
) -> None:
    first = await http.enqueue("first", max_attempts=1)
    second = await http.enqueue("second")
    held = await http.claim()
    assert (held["task"]["id"], held["task"]["attempts"]) == (first, 1)
    assert await release(http, first, held["lease_id"]) == (204, None)
    status, view = await http.request("GET", f"/jobs/{first}")
    assert status == 200
    assert (view["state"], view["attempts"]) == ("ready", 0)
    assert view.get("last_error") is None  # (a release records nothing)
    again = await http.claim()
    assert again["task"]["id"] == first  # ahead of the older ready task
    assert again["task"]["attempts"] == 1  # its only attempt, still to run
    assert await http.ack(first, again["lease_id"]) == 204
    assert (await http.claim())["task"]["id"] == second
    stats = await http.stats()
    totals = stats["totals"]
    assert (totals["nacked"], totals["retried"], totals["buried"]) == (0, 0, 0)
    assert totals["delivered"] == 2  # the attempt given back is not counted
    assert invariant_holds(stats)


async def test_a_release_is_refused_as_a_nack_is(http: Http) -> None:
    task_id = await http.enqueue(1)
    status, body = await release(http, task_id, "x")  # ready, held by nobody
    assert status == 404
    assert task_id in body["error"]
    held = await http.claim()
    status, body = await release(http, task_id, "not-" + held["lease_id"])
    assert status == 409
    assert task_id in body["error"]
    status, body = await release(http, "does-not-exist", "x")
    assert status == 404
    status, body = await release(http, task_id, None)
    assert status == 400
    assert "lease_id" in body["error"]
    assert (await http.stats())["handed_out"] == 1  # the holder still has it
    assert await release(http, task_id, held["lease_id"]) == (204, None)
    status, _ = await release(http, task_id, held["lease_id"])  # twice: no longer held
    assert status == 404


async def test_a_released_cancelling_task_is_gone_counted_cancelled(http: Http) -> None:
    task_id = await http.enqueue(1)
    held = await http.claim()
    status, _ = await http.request("DELETE", f"/jobs/{task_id}")
    assert status == 202
    assert await release(http, task_id, held["lease_id"]) == (204, None)
    status, _ = await http.request("GET", f"/jobs/{task_id}")
    assert status == 404
    stats = await http.stats()
    assert stats["totals"]["cancelled"] == 1
    assert invariant_holds(stats)


async def test_a_waiting_consumer_gets_the_released_task(broker: Broker, http: Http) -> None:
    task_id = await http.enqueue(1)
    held = await http.claim()
    waiting = asyncio.ensure_future(http.claim(wait_ms=20_000))
    await wait_until(lambda: broker.service.parked_polls == 1, what="the claim to park")
    assert await release(http, task_id, held["lease_id"]) == (204, None)
    got = await asyncio.wait_for(waiting, 10)
    assert (got["task"]["id"], got["task"]["attempts"]) == (task_id, 1)


async def test_the_client_releases_a_delivery(broker: Broker) -> None:
    async with AsyncClient(broker.http_url) as wq:
        task_id = (await wq.enqueue({"n": 1}, max_attempts=1)).id
        delivery = await wq.claim(wait_ms=0)
        assert delivery is not None
        await wq.release(delivery)
        task = await wq.get_task(task_id)
        assert (task.state, task.attempts) == ("ready", 0)
        with pytest.raises(NotFound):
            await wq.release(delivery)  # no longer held
        again = await wq.claim(wait_ms=0)
        assert again is not None
        with pytest.raises(LeaseLost):
            await wq.release(task_id, delivery.lease_id)  # an earlier hand-out's lease
        await wq.release(task_id, again.lease_id)


async def test_the_client_says_unsupported_for_a_broker_without_the_route(
    broker: Broker, http: Http
) -> None:
    # A broker without release answers 404 "no such endpoint" (or a plain 404, or 405): the
    # client tells that apart from a task nobody holds.
    async with AsyncClient(broker.http_url.rstrip("/") + "/nowhere") as wq:
        with pytest.raises(Unsupported):
            await wq.release("0123456789abcdef", "fedcba9876543210")
