"""A worker in another language: the Node.js client (tests/node/client.mjs, built only from the
.proto with @grpc/grpc-js) against a real in-process broker.

These tests fail, rather than skip, when Node.js or its npm packages are missing: run
``make node-deps``.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import Http, http_client, invariant_holds, running_broker
from wqbroker.broker import Broker
from wqbroker.clock import FakeClock

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parent.parent.parent
NODE_MODULES = REPO / "tests" / "node" / "node_modules"
PACKAGES = ("@grpc/grpc-js", "@grpc/proto-loader")


def require_node() -> None:
    if shutil.which("node") is None:
        pytest.fail("node is not installed: install Node.js, then run `make node-deps`")
    for package in PACKAGES:
        if not (NODE_MODULES / package / "package.json").is_file():
            pytest.fail(f"the npm package {package} is missing: run `make node-deps`")


async def run_node(target: str, *args: str) -> dict[str, Any]:
    """Run the Node.js client from the repo root and return the JSON line it prints."""
    require_node()
    proc = await asyncio.create_subprocess_exec(
        "node",
        "tests/node/client.mjs",
        target,
        *args,
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 30)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise AssertionError("the Node.js client did not finish within 30 s") from None
    assert proc.returncode == 0, err.decode(errors="replace")
    lines = out.decode().strip().splitlines()
    assert lines, "the Node.js client printed nothing"
    result: dict[str, Any] = json.loads(lines[-1])
    return result


@pytest.fixture
async def broker(clock: FakeClock) -> AsyncIterator[Broker]:
    # On the FakeClock no lease runs out and no backoff elapses while node runs.
    async with running_broker(clock=clock, rng=random.Random(3)) as b:
        yield b


@pytest.fixture
async def http(broker: Broker) -> AsyncIterator[Http]:
    async with http_client(broker.http_url) as h:
        yield h


async def test_node_worker_streams_and_acks_tasks_from_both_languages(
    broker: Broker, http: Http, clock: FakeClock
) -> None:
    http_ids = [await http.enqueue({"from": "http", "i": i}) for i in range(5)]
    prefetch = 3
    result = await run_node(
        broker.grpc_target, "--enqueue", "7", "--consume", "12", "--prefetch", str(prefetch)
    )

    assert result["invalid_code"] == 3  # INVALID_ARGUMENT for a payload that is not JSON
    node_ids = result["enqueued"]
    assert len(node_ids) == 7
    assert len(set(node_ids + http_ids)) == 12

    received = result["received"]
    # Every task exactly once, oldest first, with its payload intact across languages.
    assert [r["id"] for r in received] == http_ids + node_ids
    assert [r["payload"] for r in received] == [{"from": "http", "i": i} for i in range(5)] + [
        {"from": "node", "i": i} for i in range(7)
    ]
    assert all(r["attempts"] == 1 for r in received)
    assert all(r["deadline_s"] == int(clock.now()) + 60 for r in received)  # lease_ms 60000

    settled = result["settled"]
    assert sorted(s["id"] for s in settled) == sorted(http_ids + node_ids)
    assert all(s["code"] == 0 and not s["nack"] for s in settled)
    assert 1 <= result["max_unfinished"] <= prefetch

    stats = await http.stats()
    assert (stats["ready"], stats["handed_out"], stats["delayed"], stats["dead"]) == (0, 0, 0, 0)
    totals = stats["totals"]
    assert (totals["enqueued"], totals["delivered"], totals["acked"]) == (12, 12, 12)
    assert totals["reclaimed"] == 0
    assert invariant_holds(stats)
    # Node's own Stats call, made after its stream ended, agrees.
    assert result["stats"]["totals"]["acked"] == 12
    assert result["stats"]["handed_out"] == 0
    assert broker.service.waiting == 0  # the stream is gone


async def test_node_worker_nack_is_counted(broker: Broker, http: Http) -> None:
    ids = [await http.enqueue({"n": i}) for i in range(3)]
    result = await run_node(broker.grpc_target, "--consume", "3", "--prefetch", "1", "--fail-first")

    assert [r["id"] for r in result["received"]] == ids
    settled = [(s["id"], s["code"], s["nack"]) for s in result["settled"]]
    assert settled == [(ids[0], 0, True), (ids[1], 0, False), (ids[2], 0, False)]
    assert result["max_unfinished"] == 1

    stats = await http.stats()
    totals = stats["totals"]
    assert (totals["nacked"], totals["retried"], totals["acked"]) == (1, 1, 2)
    # The nacked task waits out its backoff (the FakeClock does not move).
    assert (stats["ready"], stats["handed_out"], stats["delayed"], stats["dead"]) == (0, 0, 1, 0)
    assert invariant_holds(stats)
    assert result["stats"]["totals"]["nacked"] == 1
    status, body = await http.request("GET", "/jobs/next?wait_ms=0")
    assert status == 204, body


async def test_node_client_uses_named_queues_extend_list_queues_and_drained(
    broker: Broker, http: Http, clock: FakeClock
) -> None:
    result = await run_node(broker.grpc_target, "--queues")
    q = result["queues"]
    low, high = q["enqueued"]
    # The idempotency key matched: the first task's id, nothing created.
    assert q["duplicate"] == {"id": high, "duplicate": True, "first": False}
    assert q["default_idle"] is True
    # Priority 7 is served before priority 1, from the queue the claim named.
    assert q["claimed"] == {"id": high, "queue": "node-q", "priority": 7}
    assert q["extended_deadline_s"] == int(clock.now()) + 120
    assert {"name": "node-q", "ready": 1, "paused": False} in q["queues"]

    stream = q["stream"]
    assert stream["received"] == [{"id": low, "queue": "node-q"}]
    extend, ack = stream["settled"]
    assert extend == {"id": low, "code": 0, "extend": True, "deadline_s": int(clock.now()) + 90}
    assert (ack["id"], ack["code"], ack["extend"]) == (low, 0, False)
    # Drain after the last ack: nothing unsettled, and the broker ended the call (OK).
    assert stream["drained"] == {"unsettled": 0}
    assert stream["status"] == 0

    stats = await http.stats()
    assert (stats["totals"]["enqueued"], stats["totals"]["acked"]) == (2, 2)
    assert broker.service.waiting == 0


async def test_node_client_produces_batches_on_one_stream_answered_in_order(
    broker: Broker, http: Http
) -> None:
    result = await run_node(broker.grpc_target, "--produce", "4")
    produce = result["produce"]
    assert produce["status"] == 0  # OK, once every batch is answered
    answers = produce["answers"]
    assert [a["code"] for a in answers] == [0, 3, 0, 0]  # the second refused, all or none
    assert answers[1]["ids"] == []
    assert answers[1]["message"].startswith("tasks[2].payload")
    ids = [a["ids"] for a in answers]
    assert all(len(batch) == 3 for batch in ids[:1] + ids[2:])
    for b, batch in ((0, ids[0]), (2, ids[2]), (3, ids[3])):
        for i, task_id in enumerate(batch):
            status, body = await http.request("GET", f"/jobs/{task_id}")
            assert status == 200
            assert body["payload"] == {"b": b, "i": i}
    stats = result["stats"]
    assert stats["totals"]["enqueued"] == 9
