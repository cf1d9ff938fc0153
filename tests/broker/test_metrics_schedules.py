"""GET /metrics for schedules and per-queue limits (docs/design/schedules.md), on a real broker
(over every store) with a FakeClock, the scrape parsed with the Prometheus parser: each
schedule's next and last fire times and its fires (from the store), the fire delay histogram and
the refused fires (this broker's), each queue's rate tokens, rate and concurrency limit."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import Http, http_client, make_store, running_broker, wait_until
from wqbroker.broker import Broker
from wqbroker.clock import FakeClock
from wqbroker.retry import Backoff

pytestmark = pytest.mark.timeout(60)

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

NEW_FAMILIES = {
    "wq_schedule_next_fire_timestamp_seconds": "gauge",
    "wq_schedule_last_fire_timestamp_seconds": "gauge",
    "wq_schedule_fires": "counter",
    "wq_schedule_fire_delay_seconds": "histogram",
    "wq_schedule_fire_errors": "counter",
    "wq_queue_rate_limit_tokens": "gauge",
    "wq_queue_rate_limit_tasks_per_second": "gauge",
    "wq_queue_concurrency_limit": "gauge",
}


@pytest.fixture
async def broker(backend: str, clock: FakeClock, tmp_path: Path) -> AsyncIterator[Broker]:
    rng = random.Random(7)
    store = await make_store(backend, Backoff(1.0, 30.0, rng), rng, tmp_path)
    async with running_broker(clock=clock, rng=rng, store=store) as b:
        yield b


@pytest.fixture
async def http(broker: Broker) -> AsyncIterator[Http]:
    async with http_client(broker.http_url) as h:
        yield h


async def exposition(http: Http) -> str:
    async with http.session.get(http.base + "/metrics") as resp:
        assert resp.status == 200, await resp.text()
        return await resp.text()


async def scrape(http: Http) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(await exposition(http)):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def series(samples: Samples, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: v for (n, labels), v in samples.items() if n == name}


def ts(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


async def ok(http: Http, method: str, path: str, want: int = 200, **kw: Any) -> Any:
    status, body = await http.request(method, path, **kw)
    assert status == want, body
    return body


async def fire(broker: Broker, http: Http, clock: FakeClock, name: str, by: float) -> Any:
    before = (await ok(http, "GET", f"/schedules/{name}"))["next_fire_at"]
    clock.advance(by)
    await broker.service.sweep()
    return await wait_until(
        lambda: ok(http, "GET", f"/schedules/{name}"),
        lambda v: v["next_fire_at"] != before,
        what=f"{name} to fire",
    )


async def test_schedules_and_limits_are_scraped(
    broker: Broker, http: Http, clock: FakeClock
) -> None:
    await ok(http, "PUT", "/schedules/beat", json={"every_ms": 1000, "payload": 1})
    await ok(http, "PUT", "/schedules/held", json={"cron": "@daily", "payload": 1, "paused": True})
    samples = await scrape(http)
    put = await ok(http, "GET", "/schedules/beat")
    assert value(samples, "wq_schedule_fires_total", schedule="beat") == 0
    assert value(samples, "wq_schedule_fires_total", schedule="held") == 0
    assert series(samples, "wq_schedule_next_fire_timestamp_seconds") == {
        (("schedule", "beat"),): ts(put["next_fire_at"])  # (none for the paused one)
    }
    assert series(samples, "wq_schedule_last_fire_timestamp_seconds") == {}
    assert value(samples, "wq_schedule_fire_delay_seconds_count") == 0
    assert value(samples, "wq_schedule_fire_errors_total") == 0

    fired = await fire(broker, http, clock, "beat", 1.0)
    body = {"rate": {"tasks": 20, "per_ms": 2000, "burst": 5}, "concurrency": 4}
    await ok(http, "PUT", "/queues/limited/limits", json=body)
    await ok(http, "PUT", "/queues/only-slots/limits", json={"concurrency": 1})
    await http.enqueue(1, queue="plain")
    samples = await scrape(http)
    assert value(samples, "wq_schedule_fires_total", schedule="beat") == 1
    assert value(samples, "wq_schedule_last_fire_timestamp_seconds", schedule="beat") == ts(
        fired["last_fire_at"]
    )
    assert value(samples, "wq_schedule_next_fire_timestamp_seconds", schedule="beat") == ts(
        fired["next_fire_at"]
    )
    # The fire was on time (a fake clock: the sweep ran at the scheduled time).
    assert value(samples, "wq_schedule_fire_delay_seconds_count") == 1
    assert value(samples, "wq_schedule_fire_delay_seconds_sum") == pytest.approx(0.0, abs=0.3)
    assert value(samples, "wq_schedule_fire_errors_total") == 0
    assert series(samples, "wq_queue_rate_limit_tokens") == {(("queue", "limited"),): 5.0}
    assert series(samples, "wq_queue_rate_limit_tasks_per_second") == {
        (("queue", "limited"),): 10.0
    }
    assert series(samples, "wq_queue_concurrency_limit") == {
        (("queue", "limited"),): 4.0,
        (("queue", "only-slots"),): 1.0,
    }
    # A hand-out takes a token.
    await http.enqueue(2, queue="limited")
    await ok(http, "GET", "/jobs/next?wait_ms=0&queue=limited")
    samples = await scrape(http)
    assert value(samples, "wq_queue_rate_limit_tokens", queue="limited") == pytest.approx(4.0)
    assert value(samples, "wq_queue_handed_out", queue="limited") == 1
    # Deleted: gone from the scrape; limits cleared likewise.
    await ok(http, "DELETE", "/schedules/beat", 204)
    await ok(http, "DELETE", "/queues/limited/limits", 204)
    samples = await scrape(http)
    assert set(series(samples, "wq_schedule_fires_total")) == {(("schedule", "held"),)}
    assert series(samples, "wq_queue_rate_limit_tokens") == {}
    assert set(series(samples, "wq_queue_concurrency_limit")) == {(("queue", "only-slots"),)}


async def test_every_new_family_has_its_type_and_help(broker: Broker, http: Http) -> None:
    await ok(http, "PUT", "/schedules/s", json={"every_ms": 1000, "payload": 1})
    await ok(http, "PUT", "/queues/q/limits", json={"rate": {"tasks": 1, "per_ms": 1}})
    await ok(http, "PUT", "/queues/c/limits", json={"concurrency": 1})
    text = await exposition(http)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, kind in NEW_FAMILIES.items():
        assert name in families, name
        assert families[name].type == kind, name
        assert families[name].documentation.strip(), name
        assert f"# HELP {name}" in text
    for line in text.splitlines():  # (promtool's rules: no NaN or negative timestamps here)
        if line.startswith(("wq_schedule", "wq_queue_rate", "wq_queue_concurrency")):
            assert "NaN" not in line, line


async def test_a_refused_fire_is_counted(clock: FakeClock) -> None:
    async with (
        running_broker(clock=clock, max_tasks=1) as broker,
        http_client(broker.http_url) as http,
    ):
        await http.enqueue(1)  # the broker is full
        await ok(http, "PUT", "/schedules/full", json={"every_ms": 1000, "payload": 1})
        await fire(broker, http, clock, "full", 1.0)
        samples = await scrape(http)
        assert value(samples, "wq_schedule_fire_errors_total") == 1
        assert value(samples, "wq_schedule_fire_delay_seconds_count") == 1
        assert (await http.stats())["totals"]["enqueued"] == 1
