"""GET /metrics: a real broker (over every store), a known workload, the scrape parsed with the
Prometheus parser and checked against /stats and /queues; gRPC calls by method and code; the
token rules. Timings run on a FakeClock, so the histograms' sums are exact."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.authkit import ONLY, ROOT, bearer, write_token_file
from tests.helpers import Http, http_client, make_store, running_broker, wait_until
from wqbroker.broker import Broker
from wqbroker.clock import FakeClock
from wqbroker.errors import StoreError
from wqbroker.metrics import _STORE_BUCKETS, _Histogram
from wqbroker.models import QueueReport, Totals
from wqbroker.retry import Backoff
from wqbroker.service import Submission
from wqbroker.store.memory import MemoryStore
from wqwire.pb import broker_pb2 as pb
from wqwire.pb import broker_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(60)

TOTALS = tuple(Totals.__slots__)
GAUGES = ("ready", "handed_out", "delayed", "dead", "waiting", "succeeded")

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


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


async def scrape(http: Http, **kw: Any) -> Samples:
    """Every sample of GET /metrics, by (name, sorted labels)."""
    async with http.session.get(http.base + "/metrics", **kw) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = await resp.text()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def series(samples: Samples, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: v for (n, labels), v in samples.items() if n == name}


async def ok(http: Http, method: str, path: str, want: int, **kw: Any) -> Any:
    status, body = await http.request(method, path, **kw)
    assert status == want, body
    return body


async def workload(http: Http, clock: FakeClock) -> dict[str, float]:
    """Enqueue, claim, ack, nack to dead, pause a queue; returns when things happened."""
    t0 = clock.now()
    for n in range(3):
        await http.enqueue({"n": n})
    for n in range(2):
        await http.enqueue({"mail": n}, queue="mail", max_attempts=1)
    await http.enqueue({"later": True}, queue="later", delay_ms=60_000)
    clock.advance(2.0)
    first = await http.claim()  # waited 2 s
    clock.advance(3.0)
    assert await http.ack(first["task"]["id"], first["lease_id"]) == 204  # held 3 s
    mail = await ok(http, "GET", "/jobs/next?wait_ms=0&queue=mail", 200)  # waited 5 s
    clock.advance(1.0)
    assert await http.nack(mail["task"]["id"], mail["lease_id"], "it broke") == 204  # buried
    await ok(http, "POST", "/queues/mail/pause", 204)
    second = await http.claim()  # waited 6 s; left handed out
    assert second["task"]["payload"] == {"n": 1}
    return {"t0": t0, "now": clock.now()}


async def test_gauges_and_counters_match_stats_and_queues(
    broker: Broker, http: Http, clock: FakeClock
) -> None:
    times = await workload(http, clock)
    samples = await scrape(http)
    queues = await ok(http, "GET", "/queues", 200)
    assert {q["name"] for q in queues} == {"default", "mail", "later"}
    for q in queues:
        name = q["name"]
        for gauge in GAUGES:
            assert value(samples, f"wq_queue_{gauge}", queue=name) == q[gauge], (name, gauge)
        assert value(samples, "wq_queue_paused", queue=name) == (1 if q["paused"] else 0)
        per_queue = await ok(http, "GET", f"/stats?queue={name}", 200)
        for total in TOTALS:
            got = value(samples, f"wq_tasks_{total}_total", queue=name)
            assert got == per_queue["totals"][total], (name, total)
    stats = await http.stats()
    for total in TOTALS:
        assert sum(series(samples, f"wq_tasks_{total}_total").values()) == stats["totals"][total]
    for gauge in GAUGES:
        assert sum(series(samples, f"wq_queue_{gauge}").values()) == stats[gauge]
    assert stats["totals"]["buried"] == 1
    assert value(samples, "wq_queue_paused", queue="mail") == 1
    # The oldest ready task: "default"'s third task and "mail"'s second (paused: still waiting)
    # were enqueued at t0; "later" has none ready.
    age = times["now"] - times["t0"]
    assert value(samples, "wq_queue_oldest_ready_age_seconds", queue="default") == age
    assert value(samples, "wq_queue_oldest_ready_age_seconds", queue="mail") == age
    assert value(samples, "wq_queue_oldest_ready_age_seconds", queue="later") == 0
    assert value(samples, "wq_store_up") == 1


async def test_histograms_count_what_happened(broker: Broker, http: Http, clock: FakeClock) -> None:
    await workload(http, clock)
    samples = await scrape(http)
    # Three hand-outs, after 2 s, 5 s and 6 s of waiting.
    assert value(samples, "wq_task_wait_seconds_count") == 3
    assert value(samples, "wq_task_wait_seconds_sum") == 2 + 5 + 6
    assert value(samples, "wq_task_wait_seconds_bucket", le="1.0") == 0
    assert value(samples, "wq_task_wait_seconds_bucket", le="5.0") == 2
    assert value(samples, "wq_task_wait_seconds_bucket", le="+Inf") == 3
    # One acked after 3 s, one nacked after 1 s; the third is still out.
    assert value(samples, "wq_task_processing_seconds_count", outcome="acked") == 1
    assert value(samples, "wq_task_processing_seconds_sum", outcome="acked") == 3
    assert value(samples, "wq_task_processing_seconds_count", outcome="nacked") == 1
    assert value(samples, "wq_task_processing_seconds_sum", outcome="nacked") == 1
    # Store calls that write: six enqueues, three claims, two settlements, one pause.
    commits = {
        op: value(samples, "wq_store_commit_seconds_count", operation=op)
        for op in ("enqueue", "claim", "settle", "pause")
    }
    assert commits == {"enqueue": 6, "claim": 3, "settle": 2, "pause": 1}
    # HTTP requests by route and status.
    assert value(samples, "wq_http_requests_total", method="POST", route="/jobs", status="201") == 6
    assert (
        value(samples, "wq_http_requests_total", method="GET", route="/jobs/next", status="200")
        == 3
    )
    ack = {"method": "POST", "route": "/jobs/{id}/ack", "status": "204"}
    assert value(samples, "wq_http_requests_total", **ack) == 1
    await ok(http, "POST", "/jobs/nope/ack?lease_id=x", 404)
    await ok(http, "GET", "/no/such/thing", 404)
    samples = await scrape(http)
    assert value(samples, "wq_http_requests_total", **{**ack, "status": "404"}) == 1
    assert value(samples, "wq_http_requests_total", **ack) == 1
    unmatched = {"method": "GET", "route": "unmatched", "status": "404"}
    assert value(samples, "wq_http_requests_total", **unmatched) == 1
    scrapes = {"method": "GET", "route": "/metrics", "status": "200"}
    assert value(samples, "wq_http_requests_total", **scrapes) == 1  # (the first scrape)


async def test_batches_and_streams_are_timed_per_task(
    broker: Broker, http: Http, clock: FakeClock
) -> None:
    service = broker.service
    await service.enqueue_many([Submission(b'{"n": 1}')] * 4)
    clock.advance(2.0)
    a, b, c, d = await service.claim_batch(0, None, 4)  # each waited 2 s
    clock.advance(1.0)
    await service.settle_many(
        [(a.task.id, a.lease_id), (b.task.id, b.lease_id), (c.task.id, "not its lease")],
        [(c.task.id, c.lease_id, "it broke"), ("nope", "x", None)],
    )  # two acked and one nacked after 1 s; two refused
    await service.enqueue_many([Submission(b'{"n": 2}')] * 2)
    clock.advance(0.5)
    stream = await service.open_stream(2, None)  # each waited 0.5 s
    assert len(stream.take_ready()) == 2
    await stream.close()  # both reclaimed: no settlement
    samples = await scrape(http)
    assert value(samples, "wq_task_wait_seconds_count") == 6
    assert value(samples, "wq_task_wait_seconds_sum") == 4 * 2 + 2 * 0.5
    assert value(samples, "wq_task_processing_seconds_count", outcome="acked") == 2
    assert value(samples, "wq_task_processing_seconds_sum", outcome="acked") == 2
    assert value(samples, "wq_task_processing_seconds_count", outcome="nacked") == 1
    assert value(samples, "wq_task_processing_seconds_sum", outcome="nacked") == 1
    commits = {
        op: value(samples, "wq_store_commit_seconds_count", operation=op)
        for op in ("enqueue", "claim", "settle", "reclaim", "release")
    }
    assert commits == {"enqueue": 2, "claim": 2, "settle": 1, "reclaim": 2, "release": 0}
    # d is still out: settled now, its time runs from its hand-out.
    clock.advance(4.0)
    await service.ack(d.task.id, d.lease_id)
    samples = await scrape(http)
    assert value(samples, "wq_task_processing_seconds_count", outcome="acked") == 3
    assert value(samples, "wq_task_processing_seconds_sum", outcome="acked") == 2 + 5.5


async def test_counters_never_go_down_across_scrapes(
    broker: Broker, http: Http, clock: FakeClock
) -> None:
    await workload(http, clock)
    await http.enqueue({"n": 9})
    delivery = await broker.service.claim()  # a hand-out nobody sees
    assert delivery is not None
    before = await scrape(http)
    await broker.service.give_back(delivery)  # undone: the store's delivered goes down by one
    await http.enqueue({"n": 10})
    after = await scrape(http)
    stats = await ok(http, "GET", "/stats?queue=default", 200)
    delivered = value(before, "wq_tasks_delivered_total", queue="default")
    assert stats["totals"]["delivered"] == delivered - 1
    assert value(after, "wq_tasks_delivered_total", queue="default") == delivered
    for key, was in before.items():
        if key[0].endswith(("_total", "_count", "_sum", "_bucket")):
            assert after[key] >= was, key
    assert value(after, "wq_tasks_enqueued_total", queue="default") == 5


async def test_parked_long_polls_and_open_streams(broker: Broker, http: Http) -> None:
    poll = asyncio.ensure_future(http.request("GET", "/jobs/next?wait_ms=600000&queue=idle"))
    async with grpc.aio.insecure_channel(broker.grpc_target) as channel:
        stub = pb_grpc.BrokerStub(channel)
        stream = stub.StreamJobs(None)
        await stream.write(pb.StreamJobsRequest(open=pb.StreamOpen(queues=["idle"])))
        await wait_until(
            lambda: (broker.service.parked_polls, broker.service.open_streams),
            lambda n: n == (1, 1),
            what="a parked long-poll and an open stream",
        )
        samples = await scrape(http)
        assert value(samples, "wq_parked_long_polls") == 1
        assert value(samples, "wq_open_streams") == 1
        stream.cancel()
    poll.cancel()
    await wait_until(
        lambda: (broker.service.parked_polls, broker.service.open_streams),
        lambda n: n == (0, 0),
        what="the poll and the stream to end",
    )
    samples = await scrape(http)
    assert value(samples, "wq_parked_long_polls") == 0
    assert value(samples, "wq_open_streams") == 0


async def test_waiting_tasks_results_held_and_result_waits(broker: Broker, http: Http) -> None:
    """docs/design/results.md: wq_queue_waiting and wq_queue_succeeded per queue, as /queues
    says; wq_result_waiters, the result waits parked now."""
    parent = await http.enqueue({"parent": True}, queue="flow")
    await http.enqueue({"child": True}, queue="flow", after=[parent])
    done = await http.enqueue({"done": True}, queue="flow")
    claimed = await ok(http, "GET", "/jobs/next?wait_ms=0&queue=flow", 200)
    assert claimed["task"]["id"] == parent
    claimed = await ok(http, "GET", "/jobs/next?wait_ms=0&queue=flow", 200)
    assert claimed["task"]["id"] == done
    status, _ = await http.request(
        "POST", f"/jobs/{done}/ack?lease_id={claimed['lease_id']}", data=b'{"result": 1}'
    )
    assert status == 204
    waiter = asyncio.ensure_future(http.request("GET", f"/jobs/{parent}/result?wait_ms=600000"))
    await wait_until(lambda: broker.service.result_waiters, lambda n: n == 1, what="the wait")
    samples = await scrape(http)
    assert value(samples, "wq_queue_waiting", queue="flow") == 1
    assert value(samples, "wq_queue_succeeded", queue="flow") == 1
    assert value(samples, "wq_queue_handed_out", queue="flow") == 1
    assert value(samples, "wq_result_waiters") == 1
    (row,) = [q for q in await ok(http, "GET", "/queues", 200) if q["name"] == "flow"]
    assert (row["waiting"], row["succeeded"]) == (1, 1)
    waiter.cancel()
    await wait_until(lambda: broker.service.result_waiters, lambda n: n == 0, what="its end")
    assert value(await scrape(http), "wq_result_waiters") == 0


async def test_grpc_calls_by_method_and_code(broker: Broker, http: Http) -> None:
    async with grpc.aio.insecure_channel(broker.grpc_target) as channel:
        stub = pb_grpc.BrokerStub(channel)
        for _ in range(2):
            await stub.Enqueue(pb.EnqueueRequest(payload=b"{}"))
        await stub.Stats(pb.StatsRequest())
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Ack(pb.AckRequest(id="nope", lease_id="x"))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Enqueue(pb.EnqueueRequest(payload=b"{not json"))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # (A call refused is counted just after its status is sent: by then the client may be here.)
    samples = await wait_until(
        lambda: scrape(http),
        lambda s: sum(series(s, "wq_grpc_requests_total").values()) >= 5,
        what="the five calls to be counted",
    )
    grpc_calls = series(samples, "wq_grpc_requests_total")
    service = ("service", "wq.v1.Broker")

    def calls(method: str, code: str) -> float:
        return grpc_calls.get((("code", code), ("method", method), service), 0)

    assert calls("Enqueue", "OK") == 2
    assert calls("Enqueue", "INVALID_ARGUMENT") == 1
    assert calls("Stats", "OK") == 1
    assert calls("Ack", "NOT_FOUND") == 1
    assert sum(grpc_calls.values()) == 5


# -- tokens ---------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["memory"])
async def test_metrics_needs_the_metrics_scope(backend: str, tmp_path: Path) -> None:
    tokens = write_token_file(tmp_path)
    async with (
        running_broker(token_file=str(tokens)) as broker,
        http_client(broker.http_url) as http,
    ):
        status, body = await http.request("GET", "/metrics")
        assert status == 401, body
        assert "Bearer" in body["error"]
        status, body = await http.request("GET", "/metrics", headers=bearer(ONLY["admin"]))
        assert status == 403, body
        assert body == {"error": "GET /metrics needs a token with the metrics scope"}
        for token in (ONLY["metrics"], ROOT):
            await scrape(http, headers=bearer(token))
        # The metrics scope opens nothing else.
        status, _ = await http.request("GET", "/dlq", headers=bearer(ONLY["metrics"]))
        assert status == 403
        # Refused gRPC calls are counted with their code.
        async with grpc.aio.insecure_channel(broker.grpc_target) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await pb_grpc.BrokerStub(channel).Stats(pb.StatsRequest())
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        refused = {"service": "wq.v1.Broker", "method": "Stats", "code": "UNAUTHENTICATED"}
        key = ("wq_grpc_requests_total", tuple(sorted(refused.items())))
        samples = await wait_until(
            lambda: scrape(http, headers=bearer(ONLY["metrics"])),
            lambda s: key in s,  # (counted just after its status is sent)
            what="the refused call to be counted",
        )
        assert value(samples, "wq_grpc_requests_total", **refused) == 1
        dlq = {"method": "GET", "route": "/dlq", "status": "403"}
        assert value(samples, "wq_http_requests_total", **dlq) == 1


@pytest.mark.parametrize("backend", ["memory"])
async def test_metrics_public_opens_metrics_only(backend: str, tmp_path: Path) -> None:
    tokens = write_token_file(tmp_path)
    async with (
        running_broker(token_file=str(tokens), metrics_public=True) as broker,
        http_client(broker.http_url) as http,
    ):
        samples = await scrape(http)
        assert value(samples, "wq_store_up") == 1
        status, _ = await http.request("HEAD", "/metrics")
        assert status == 200
        status, _ = await http.request("GET", "/stats")
        assert status == 401
        samples = await scrape(http)
        assert (
            value(samples, "wq_http_requests_total", method="GET", route="/stats", status="401")
            == 1
        )


async def test_a_reclaimed_lease_is_no_settlement(
    broker: Broker, http: Http, clock: FakeClock
) -> None:
    await http.enqueue({"n": 1})
    await http.claim(lease_ms=1000)
    samples = await scrape(http)
    assert value(samples, "wq_store_commit_seconds_count", operation="sweep") == 0
    clock.advance(2.0)
    await broker.service.sweep()  # (the sweeper would, at the deadline: this is that tick)
    samples = await wait_until(
        lambda: scrape(http),
        lambda s: value(s, "wq_tasks_reclaimed_total", queue="default") == 1,
        what="the lease to be reclaimed",
    )
    assert value(samples, "wq_store_commit_seconds_count", operation="sweep") >= 1
    assert value(samples, "wq_task_processing_seconds_count", outcome="acked") == 0
    assert value(samples, "wq_task_processing_seconds_count", outcome="nacked") == 0
    assert value(samples, "wq_queue_delayed", queue="default") == 1


class _StoreAway(MemoryStore):
    """A memory store whose database, so to speak, is away when asked for its state."""

    away = False

    async def queue_report(self, *, now: float | None = None) -> list[QueueReport]:
        if self.away:
            raise StoreError("the database is unreachable: connection refused")
        return await super().queue_report(now=now)


async def test_a_scrape_while_the_store_is_away_says_so() -> None:
    store = _StoreAway()
    async with running_broker(store=store) as broker, http_client(broker.http_url) as http:
        await http.enqueue({"n": 1})
        samples = await scrape(http)
        assert value(samples, "wq_store_up") == 1
        assert value(samples, "wq_queue_ready", queue="default") == 1
        store.away = True
        samples = await scrape(http)  # still 200: the broker's own series are worth having
        assert value(samples, "wq_store_up") == 0
        assert series(samples, "wq_queue_ready") == {}
        assert (
            value(samples, "wq_http_requests_total", method="POST", route="/jobs", status="201")
            == 1
        )


@given(st.lists(st.floats(min_value=0, max_value=1e5, allow_nan=False), max_size=30))
@example([*_STORE_BUCKETS, 0.0, 3.0])  # on each bound: in that bucket
def test_our_histogram_renders_as_the_librarys_would(values: list[float]) -> None:
    """The broker's lock-free histogram (observed on every task) shows the same series as
    prometheus-client's own Histogram given the same values."""
    theirs_registry, ours_registry = CollectorRegistry(), CollectorRegistry()
    theirs = Histogram("h_seconds", "h", ("op",), registry=theirs_registry, buckets=_STORE_BUCKETS)
    ours = _Histogram("h_seconds", "h", _STORE_BUCKETS, ("op",))
    ours_registry.register(ours)
    for value in values:
        theirs.labels("x").observe(value)
        ours.labels("x").observe(value)
    rendered = [
        sorted(line for line in generate_latest(r).decode().splitlines() if "_created" not in line)
        for r in (theirs_registry, ours_registry)
    ]
    assert rendered[0] == rendered[1]


async def test_cancelled_and_expired_are_counted_and_a_deleted_queue_counts_anew(
    broker: Broker, http: Http, clock: FakeClock
) -> None:
    ids = [await http.enqueue(n, queue="c") for n in range(3)]
    await ok(http, "DELETE", f"/jobs/{ids[0]}", 204)
    await http.enqueue("soon gone", queue="c", expires_in_ms=1000)
    clock.advance(2.0)
    await broker.service.sweep()
    samples = await scrape(http)
    assert value(samples, "wq_tasks_cancelled_total", queue="c") == 1
    assert value(samples, "wq_tasks_expired_total", queue="c") == 1
    assert await ok(http, "POST", "/queues/c/empty", 200) == {"cancelled": 2}
    samples = await scrape(http)
    assert value(samples, "wq_tasks_cancelled_total", queue="c") == 3
    assert value(samples, "wq_tasks_enqueued_total", queue="c") == 4
    # Deleted, its series go; made again, it counts from nothing (not from its old peak).
    await ok(http, "DELETE", "/queues/c", 204)
    samples = await scrape(http)
    assert not [key for key in samples if ("queue", "c") in key[1]]
    await http.enqueue("again", queue="c")
    samples = await scrape(http)
    assert value(samples, "wq_tasks_enqueued_total", queue="c") == 1
    assert value(samples, "wq_tasks_cancelled_total", queue="c") == 0
    # The broker's own totals keep what it counted.
    assert (await http.stats())["totals"]["cancelled"] == 3


async def test_the_new_totals_have_help_texts(http: Http) -> None:
    await http.enqueue(1)
    async with http.session.get(http.base + "/metrics") as resp:
        text = await resp.text()
    helps = {f.name: f.documentation for f in text_string_to_metric_families(text)}
    assert "cancelled" in helps["wq_tasks_cancelled"].lower()
    assert "expir" in helps["wq_tasks_expired"].lower()
    assert helps["wq_tasks_cancelled"] != "Tasks cancelled."  # (not the generic fallback)
