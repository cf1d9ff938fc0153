"""Brokers on a PostgreSQL primary with a streaming standby, through a failover.

Two clusters of the test's own (tests/replicas.py: a primary and a standby on free ports under a
temporary directory, never the machine's server); brokers in this process given a DSN that lists
both (``postgresql://postgres@primary,standby/postgres``: the store asks for a server that takes
writes, target_session_attrs=read-write); producers and workers through wqclient, over HTTP. What
is shown:

- the primary stopped dead and the standby promoted under load: every broker serves again within
  10 s, without a restart; with synchronous replication nothing answered 201 is lost, nothing
  answered 204 comes back, and leases taken before the switch are honoured (and fenced) after it;
  with asynchronous replication the loss is counted (and printed), not asserted away;
- a DSN that lists the standby first still lands on the primary; one whose first server answers
  nothing only delays the start by that server's connect time;
- a server that turns read-only under a broker (``default_transaction_read_only``, an old primary
  back as a standby) makes the broker unready with a message that says so, its calls 503 with a
  Retry-After (never 500), until a primary answers; an idle store notices by its probe alone; a
  broker pointed only at a standby does not start, and says why.

``pytest -s -n 0 tests/e2e/test_postgres_failover.py`` prints what each failover under load saw
as a JSON line (the README's figures).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests import pg
from tests.e2e.test_postgres_cluster import Cluster, Node, health
from tests.helpers import wait_until
from tests.replicas import Replicas, query
from wqbroker.broker import Broker, StartupError
from wqbroker.config import Config
from wqbroker.retry import Backoff
from wqbroker.store.postgres import PostgresStore
from wqclient import AsyncClient, Delivery, LeaseLost, NotFound, WqError

# Every broker serves again within this long after the primary is gone (the bound).
RECOVERY = 10.0
LEASE_MS = 1500  # the workers' lease: a task whose claim was lost in the switch comes back soon
ALL_QUEUES = "default,held,fenced,probe"


@pytest.fixture
async def pair() -> AsyncIterator[Replicas]:
    async with Replicas(synchronous=True) as r:
        yield r


async def serves(node: Node) -> None:
    """The broker is ready, and an enqueue, a claim and an ack go through it."""
    assert await health(node) == (200, "SERVING")
    status, body = await node.post("/jobs", {"payload": "probe", "queue": "probe"})
    assert status == 201, body
    d = await node.claim("&queue=probe", wait_ms=1000)
    assert d is not None
    assert await node.http.ack(d["task"]["id"], d["lease_id"]) == 204


async def serving(node: Node, timeout: float) -> float:
    """Wait until ``node`` serves (:func:`serves`); how long that took."""
    began = time.monotonic()

    async def attempt() -> bool:
        try:
            await serves(node)
        except Exception:  # (not yet: 503s, a health check refused...)
            return False
        return True

    await wait_until(attempt, what="the broker to serve again", timeout=timeout, interval=0.05)
    return time.monotonic() - began


# -- under load ------------------------------------------------------------------------------------


@dataclass
class Books:
    """What the clients were told."""

    accepted: set[str] = field(default_factory=set)  # answered 201
    accepted_at: dict[str, float] = field(default_factory=dict)  # ... when (monotonic)
    acked: set[str] = field(default_factory=set)  # answered 204
    ack_unknown: set[str] = field(default_factory=set)  # an ack that failed (committed or not)
    back_after_ack: set[str] = field(default_factory=set)  # delivered again after a 204
    refused: int = 0  # enqueues and claims refused (503) or unanswered during the switch


@dataclass
class Load:
    """Producers and workers through wqclient, each on one broker."""

    urls: list[str]
    books: Books = field(default_factory=Books)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def produce(self, url: str, k: int) -> None:
        async with AsyncClient(url, timeout=10) as client:
            n = 0
            while not self.stop.is_set():
                n += 1
                try:
                    task_id = await client.enqueue({"producer": k, "n": n}, max_attempts=100)
                except WqError:
                    self.books.refused += 1
                    await asyncio.sleep(0.05)
                    continue
                self.books.accepted.add(str(task_id))
                self.books.accepted_at[str(task_id)] = time.monotonic()

    async def work(self, url: str) -> None:
        async with AsyncClient(url, timeout=10) as client:
            while not self.stop.is_set():
                try:
                    d = await client.claim(wait_ms=200, lease_ms=LEASE_MS)
                except WqError:
                    self.books.refused += 1
                    await asyncio.sleep(0.05)
                    continue
                if d is not None:
                    await self.settle(client, d)

    async def settle(self, client: AsyncClient, d: Delivery) -> None:
        books = self.books
        if d.id in books.acked:
            books.back_after_ack.add(d.id)
        try:
            await client.ack(d)
        except (LeaseLost, NotFound):
            return  # its lease ran out and it went round again: it will come back
        except WqError:
            books.ack_unknown.add(d.id)  # committed or not, its answer was lost
            return
        books.acked.add(d.id)
        books.ack_unknown.discard(d.id)

    @contextlib.asynccontextmanager
    async def running(self, producers: int, workers: int) -> AsyncIterator[None]:
        self.stop.clear()
        clients = [
            asyncio.create_task(self.produce(self.urls[k % len(self.urls)], k))
            for k in range(producers)
        ]
        clients += [
            asyncio.create_task(self.work(self.urls[k % len(self.urls)])) for k in range(workers)
        ]
        try:
            yield
        finally:
            self.stop.set()
            await asyncio.gather(*clients)

    async def more(self, n: int) -> None:
        """Until ``n`` more tasks were accepted and some acked."""
        accepted, acked = len(self.books.accepted), len(self.books.acked)
        await wait_until(
            lambda: (
                len(self.books.accepted) >= accepted + n and len(self.books.acked) >= acked + n // 4
            ),
            what=f"{n} more tasks accepted",
            timeout=20,
        )

    async def drain(self, node: Node) -> set[str]:
        """Claim and ack whatever is left, until nothing is ready, held or delayed; the ids."""
        drained: set[str] = set()
        async with AsyncClient(node.broker.http_url, timeout=10) as client:
            while True:
                batch = await client.claim_many(
                    100, wait_ms=0, lease_ms=LEASE_MS, queues=ALL_QUEUES
                )
                for d in batch:
                    drained.add(d.id)
                    await self.settle(client, d)
                if batch:
                    continue
                stats = await client.stats()
                if not (stats.ready or stats.handed_out or stats.delayed):
                    return drained
                await asyncio.sleep(0.1)  # (tasks whose claims were lost, until their leases end)


async def fail_over_under_load(
    r: Replicas, cluster: Cluster, *, behind: bool = False
) -> dict[str, Any]:
    """Two brokers on the pair, under load; the primary stopped dead and the standby promoted.
    What the clients saw, and what is left (for the caller to judge). ``behind``: the WAL sent to
    the standby is held back (its relay stalled) while 50 more tasks are accepted before the
    primary stops, so an asynchronous standby is that far behind when it is promoted."""
    a, b = await cluster.add(), await cluster.add()
    load = Load([a.broker.http_url, b.broker.http_url])
    async with AsyncClient(a.broker.http_url) as client:
        # Tasks held across the switch: one under a long lease (acked after it with that lease),
        # one under a short lease (back after it; the old lease then refused).
        await client.enqueue("long", queue="held")
        await client.enqueue("short", queue="fenced")
        long_held = await client.claim(queues="held", lease_ms=60_000)
        short_held = await client.claim(queues="fenced", lease_ms=3000)
        assert long_held is not None
        assert short_held is not None
        async with load.running(producers=4, workers=2):
            await load.more(150)
            paused_at = time.monotonic()
            if behind:
                assert r.relay is not None
                r.relay.stall()
                await load.more(50)
            began = time.monotonic()
            await r.fail_over()
            took = [await serving(node, RECOVERY) for node in (a, b)]
            recovery = time.monotonic() - began
            await load.more(100)
        outcome: dict[str, Any] = {"recovery_s": round(recovery, 2), "each_s": took}
        # The leases taken on the old primary, on the new one.
        try:
            await client.ack(long_held)
            outcome["long_lease_acked"] = True
        except (LeaseLost, NotFound):
            outcome["long_lease_acked"] = False
        again = await client.claim(queues="fenced", wait_ms=8000, lease_ms=30_000)
        outcome["short_lease_back"] = again is not None and again.id == short_held.id
        with contextlib.suppress(LeaseLost, NotFound):
            await client.ack(short_held)  # (the old lease: refused if the task came back)
            outcome["old_lease_honoured"] = True
        if again is not None:
            await client.ack(again)
    drained = await load.drain(a)
    books = load.books
    # Lost: answered 201, never delivered after the switch nor acked (204), not in the database.
    left = books.accepted - books.acked - drained
    absent = set()
    for task_id in left:
        status, _ = await a.get(f"/jobs/{task_id}")
        if status == 404:
            absent.add(task_id)
    # An ack answered 204 whose task was handed out again (the ack lost in the switch).
    outcome.update(
        accepted=len(books.accepted),
        acked=len(books.acked),
        refused_during_switch=books.refused,
        lost_enqueues=len(absent - books.ack_unknown),
        acks_undone=len(books.back_after_ack),
        ack_answer_lost=len(books.ack_unknown),
    )
    lost = absent - books.ack_unknown
    outcome["_lost"] = sorted(lost)[:5]
    # (lost tasks were all accepted while the standby was behind, none before)
    outcome["_lost_before_pause"] = sum(books.accepted_at[t] < paused_at for t in lost)
    return outcome


@pytest.mark.timeout(60)
async def test_with_synchronous_replication_a_failover_loses_nothing(pair: Replicas) -> None:
    cluster = Cluster(pair.dsn())
    try:
        outcome = await fail_over_under_load(pair, cluster)
    finally:
        await cluster.close()
    print(json.dumps({"replication": "synchronous", **outcome}))
    assert outcome["recovery_s"] < RECOVERY
    assert outcome["accepted"] > 200
    assert outcome["lost_enqueues"] == 0, outcome
    assert outcome["acks_undone"] == 0, outcome
    # Leases survive the switch and stay fenced: the one held under a long lease is acked with
    # it; the one under a short lease came back after it, and its old lease was refused.
    assert outcome["long_lease_acked"], outcome
    assert outcome["short_lease_back"], outcome
    assert "old_lease_honoured" not in outcome, outcome


@pytest.mark.timeout(60)
@pytest.mark.parametrize("behind", [False, True], ids=["caught-up", "behind"])
async def test_with_asynchronous_replication_service_resumes_and_the_loss_is_counted(
    behind: bool,
) -> None:
    async with Replicas(synchronous=False, relay=behind) as r:
        cluster = Cluster(r.dsn())
        try:
            outcome = await fail_over_under_load(r, cluster, behind=behind)
        finally:
            await cluster.close()
    print(json.dumps({"replication": "asynchronous", "behind": behind, **outcome}))
    assert outcome["recovery_s"] < RECOVERY
    assert outcome["accepted"] > 200
    # What an asynchronous standby had not received is lost: counted above (and in the README),
    # not asserted away; whatever is lost, the drain emptied the queues. Only what was
    # acknowledged while it was behind can be lost.
    assert outcome["_lost_before_pause"] == 0, outcome
    if behind:
        # Paused while 50 more tasks were accepted: those (and acks made meanwhile) are gone.
        assert outcome["lost_enqueues"] >= 1, outcome


# -- the server a DSN leads to ---------------------------------------------------------------------


async def test_a_dsn_listing_the_standby_first_lands_on_the_primary(pair: Replicas) -> None:
    cluster = Cluster(pair.dsn(pair.standby, pair.primary))
    try:
        node = await cluster.add()
        task_id = await node.enqueue({"n": 1})
        rows = await query(pair.primary.dsn, "SELECT count(*) FROM wq.tasks")
        assert rows == [(1,)]
        await serves(node)
        assert (await node.task(task_id))["state"] == "ready"
    finally:
        await cluster.close()


async def test_a_broker_given_only_a_standby_does_not_start_and_says_why(pair: Replicas) -> None:
    broker = Broker(Config(addr="127.0.0.1:0", grpc_addr="off", store=pair.dsn(pair.standby)))
    with pytest.raises(StartupError) as e:
        await broker.start()
    await broker.stop()
    assert "does not take writes" in str(e.value), str(e.value)
    assert "wq needs the primary" in str(e.value), str(e.value)


async def unready_because(node: Node, words: str) -> str:
    """Wait until ``node`` is unready, saying ``words`` (within 8 s: the probe notices without
    traffic); its calls then fail with 503 and a Retry-After, never 500. The message."""

    async def readiness() -> tuple[int, str]:
        status, body = await node.get("/readyz")
        return status, str(body.get("error", "")) if isinstance(body, dict) else ""

    _, said = await wait_until(
        readiness, lambda r: r[0] == 503 and words in r[1], what=f"unready: {words}", timeout=8
    )
    assert await health(node) == (503, "NOT_SERVING")
    async with node.http.session.post(node.http.base + "/jobs", json={"payload": 1}) as answer:
        body = await answer.json()
        assert answer.status == 503, body
        assert answer.headers["Retry-After"], answer.headers
    assert words in body["error"], body
    return said


@pytest.mark.timeout(60)
async def test_a_primary_turned_read_only_makes_the_broker_unready_until_it_takes_writes(
    pair: Replicas,
) -> None:
    cluster = Cluster(pair.primary.dsn)  # (one server: nothing else to turn to)
    try:
        node = await cluster.add()
        kept = await node.enqueue({"n": "before"})
        await query(pair.primary.dsn, "ALTER SYSTEM SET default_transaction_read_only = on")
        await query(pair.primary.dsn, "SELECT pg_reload_conf()")
        said = await unready_because(node, "read-only")
        print(said)
        await query(pair.primary.dsn, "ALTER SYSTEM RESET default_transaction_read_only")
        await query(pair.primary.dsn, "SELECT pg_reload_conf()")
        await serving(node, RECOVERY)
        assert (await node.task(kept))["state"] == "ready"
    finally:
        await cluster.close()


@pytest.mark.timeout(60)
async def test_an_old_primary_back_as_a_standby_makes_its_broker_unready(pair: Replicas) -> None:
    """A switchover: the primary stopped cleanly, the standby promoted, the old primary started
    again as its standby. A broker given only the old primary says it cannot write there; one
    given both servers serves on the new primary."""
    pinned = Cluster(pair.primary.dsn)
    both = Cluster(pair.dsn())
    try:
        old = await pinned.add()
        new = await both.add()
        kept = await old.enqueue({"n": "before"})
        await pair.primary.stop("fast")
        await pair.standby.promote()
        await pair.primary.follow(pair.standby)
        await pair.primary.start()
        print(await unready_because(old, "does not take writes"))
        await serving(new, RECOVERY)
        assert (await new.task(kept))["state"] == "ready"
    finally:
        await pinned.close()
        await both.close()


@pytest.mark.timeout(60)
async def test_a_server_that_answers_nothing_listed_first_only_delays_the_start(
    pair: Replicas,
) -> None:
    """The first server of the DSN accepts connections and never answers (a machine gone
    behind a load balancer, a silent partition): the broker gives it its connect time, then
    takes the primary listed after it; and every later connection goes to the primary first."""
    silent = pg.Proxy(pair.primary.port)
    await silent.restore()
    silent.stall()
    dsn = f"postgresql://postgres@127.0.0.1:{silent.port},127.0.0.1:{pair.primary.port}/postgres"
    cluster = Cluster(dsn)
    try:
        began = time.monotonic()
        node = await cluster.add(db_timeout=1.0)  # (1 s for each server)
        assert time.monotonic() - began < 8
        for _ in range(3):
            await serves(node)
        await wait_until(lambda: health(node), lambda h: h == (200, "SERVING"), what="ready")
    finally:
        await cluster.close()
        silent.flow()
        await silent.cut()


@pytest.mark.timeout(60)
async def test_an_idle_store_notices_its_server_turned_read_only_by_its_probe(
    pair: Replicas,
) -> None:
    """No call at all (no broker, no sweeper): only the probe can tell, and does, within a few
    seconds; and the store is back once the server takes writes again."""
    store = await PostgresStore.open(pair.primary.dsn, Backoff(rng=random.Random(1)))
    try:
        assert store.problem() is None
        await query(pair.primary.dsn, "ALTER SYSTEM SET default_transaction_read_only = on")
        await query(pair.primary.dsn, "SELECT pg_reload_conf()")
        problem = await wait_until(
            store.problem, lambda p: p is not None, what="the probe to notice", timeout=8
        )
        assert "read-only" in str(problem), problem
        await query(pair.primary.dsn, "ALTER SYSTEM RESET default_transaction_read_only")
        await query(pair.primary.dsn, "SELECT pg_reload_conf()")
        await wait_until(store.problem, lambda p: p is None, what="the store back", timeout=8)
    finally:
        await store.close()
