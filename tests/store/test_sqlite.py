"""What is particular to the SQLite store: the refusals at start, restarts through the real
command, group commit, and the fail-stop after a failed commit. (The store contract and the state
machine run against SQLite too, in store/test_contract.py and store/test_state_machine.py; kill -9
is in e2e/test_sqlite_kill9.py.)"""

from __future__ import annotations

import asyncio
import json
import random
import sqlite3
import subprocess
import tracemalloc
import urllib.error
import urllib.request
from contextlib import closing
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.helpers import http_client, running_broker, settle
from tests.procs import broker_command, broker_process
from wqbroker.clock import FakeClock
from wqbroker.errors import Cancelled, StoreError
from wqbroker.models import (
    DEFAULT_QUEUE,
    Delivery,
    NewTask,
    ParentResult,
    QueueStats,
    Released,
    Stats,
    Totals,
)
from wqbroker.retry import Backoff
from wqbroker.store import enqueue_one
from wqbroker.store.sqlite import SCHEMA_VERSION, SqliteStore
from wqwire.pb import broker_pb2 as pb
from wqwire.pb import broker_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(60)

NOW = 1_800_000_000.0


def call(method: str, url: str, body: Any = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def start_fails(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        broker_command("-addr", "127.0.0.1:0", "-grpc-addr", "off", *args),
        capture_output=True,
        text=True,
        timeout=30,
    )


def one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


def test_a_file_that_is_not_a_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "wq.db"
    path.write_bytes(b"this is not an SQLite database, just some text\n" * 100)
    line = one_line_error(start_fails("-store", f"sqlite:{path}"))
    assert "not a valid wq database" in line
    assert str(path) in line


def test_a_corrupt_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "wq.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE t (x)")
        conn.executemany("INSERT INTO t VALUES (?)", [(b"x" * 1000,)] * 200)
    data = bytearray(path.read_bytes())
    data[4096:8192] = b"\xff" * 4096  # smash a page
    path.write_bytes(bytes(data))
    line = one_line_error(start_fails("-store", f"sqlite:{path}"))
    assert str(path) in line


def test_a_database_of_another_application_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "other.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        conn.execute("INSERT INTO meta VALUES ('schema', '99')")
    line = one_line_error(start_fails("-store", f"sqlite:{path}"))
    assert "schema" in line


def test_a_file_locked_by_another_broker_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "wq.db"
    with broker_process("-grpc-addr", "off", "-store", f"sqlite:{path}"):
        line = one_line_error(start_fails("-store", f"sqlite:{path}"))
        assert "locked" in line
        assert "another broker" in line


def test_an_unwritable_place_is_refused(tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    for place in (tmp_path / "missing" / "dir" / "wq.db", a_file / "wq.db", tmp_path):
        line = one_line_error(start_fails("-store", f"sqlite:{place}"))
        assert "cannot open" in line
        assert str(place) in line


def test_an_unknown_store_is_refused() -> None:
    line = one_line_error(start_fails("-store", "mysql://nowhere"))
    assert "unknown store" in line


def test_everything_survives_a_restart_of_the_real_command(tmp_path: Path) -> None:
    path = tmp_path / "wq.db"
    args = ("-grpc-addr", "off", "-store", f"sqlite:{path}", "-backoff-base-ms", "60000")
    with broker_process(*args) as b:
        ids = [call("POST", b.url + "/jobs", {"payload": {"n": n}})[1]["id"] for n in range(5)]
        call("POST", b.url + "/jobs", {"payload": "later", "delay_ms": 3_600_000})
        _, held = call("GET", b.url + "/jobs/next?wait_ms=0&lease_ms=300000")  # ids[0]
        _, failed = call("GET", b.url + "/jobs/next?wait_ms=0")  # ids[1]
        nack = f"/jobs/{failed['task']['id']}/nack?lease_id={failed['lease_id']}"
        assert call("POST", b.url + nack, {"error": "first try"})[0] == 204
        _, doomed = call("POST", b.url + "/jobs", {"payload": "doomed", "max_attempts": 1})
        claimed = None
        for _ in range(4):  # ids[2..4] come first, then the doomed one
            _, claimed = call("GET", b.url + "/jobs/next?wait_ms=0")
            if claimed["task"]["id"] == doomed["id"]:
                break
            ack = f"/jobs/{claimed['task']['id']}/ack?lease_id={claimed['lease_id']}"
            assert call("POST", b.url + ack)[0] == 204
        assert claimed is not None
        assert claimed["task"]["id"] == doomed["id"]
        nack = f"/jobs/{doomed['id']}/nack?lease_id={claimed['lease_id']}"
        assert call("POST", b.url + nack, {"error": "no hope"})[0] == 204
        _, before = call("GET", b.url + "/stats")
        _, dlq_before = call("GET", b.url + "/dlq")
    assert held["task"]["id"] == ids[0]
    with broker_process(*args) as b:
        _, after = call("GET", b.url + "/stats")
        _, dlq_after = call("GET", b.url + "/dlq")
        assert after == before
        assert (after["handed_out"], after["delayed"], after["dead"]) == (1, 2, 1)
        assert dlq_after == dlq_before
        assert dlq_after[0]["last_error"] == "no hope"
        # The lease handed out before the restart is still good.
        ack = f"/jobs/{held['task']['id']}/ack?lease_id={held['lease_id']}"
        assert call("POST", b.url + ack)[0] == 204
        _, final = call("GET", b.url + "/stats")
        assert final["totals"]["acked"] == before["totals"]["acked"] + 1


async def test_concurrent_requests_share_commits(tmp_path: Path) -> None:
    store = await SqliteStore.open(str(tmp_path / "wq.db"), Backoff(1, 30, random.Random(1)))
    try:
        await asyncio.gather(
            *(enqueue_one(store, b"1", max_attempts=3, delay=0, now=NOW) for _ in range(500))
        )
        assert (await store.stats()).ready == 500
        assert store.transactions < 50, f"500 concurrent enqueues took {store.transactions} commits"
    finally:
        await store.close()


async def test_a_failed_commit_stops_the_store_and_the_broker_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = await SqliteStore.open(str(tmp_path / "wq.db"), Backoff(1, 30, random.Random(1)))
    clock = FakeClock()

    def broken_write(rows: Any) -> None:
        raise sqlite3.OperationalError("disk I/O error")

    async with running_broker(clock=clock, store=store) as broker:
        async with (
            http_client(broker.http_url) as http,
            grpc.aio.insecure_channel(broker.grpc_target) as channel,
        ):
            health = health_pb2_grpc.HealthStub(channel)
            check = health_pb2.HealthCheckRequest(service="wq.v1.Broker")
            serving = health_pb2.HealthCheckResponse.SERVING
            assert (await health.Check(check)).status == serving
            assert (await http.request("GET", "/readyz"))[0] == 200
            monkeypatch.setattr(store, "_write", broken_write)
            status, body = await http.request("POST", "/jobs", json={"payload": 1})
            assert status == 503
            assert "disk I/O error" in body["error"]
            # Everything after that is refused too, with the reason: 503, never another 5xx.
            status, body = await http.request("GET", "/stats")
            assert status == 503
            assert "unavailable" in body["error"]
            status, body = await http.request("GET", "/readyz")
            assert status == 503
            assert body["status"] == "unavailable"
            assert (await health.Check(check)).status == health_pb2.HealthCheckResponse.NOT_SERVING
            # Alive all the same (liveness): restarting the broker would not mend its disk.
            assert (await http.request("GET", "/healthz"))[0] == 200
            alive = health_pb2.HealthCheckRequest(service="")
            assert (await health.Check(alive)).status == serving
            stub = pb_grpc.BrokerStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Enqueue(pb.EnqueueRequest(payload=b"1"))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(StoreError):
                await enqueue_one(store, b"1", max_attempts=3, delay=0, now=NOW)
            # The sweeper keeps ticking against the failed store, and says so once.
            ticks = broker.service.sweeper.ticks
            for _ in range(5):
                clock.advance(1.0)
                await settle()
            assert broker.service.sweeper.ticks >= ticks + 5
            failures = [r for r in caplog.records if "sweeper tick failed" in r.getMessage()]
            assert len(failures) == 1


def _backoff() -> Backoff:
    return Backoff(1, 30, random.Random(1))


async def test_a_batch_that_fails_to_commit_leaves_nothing_behind(tmp_path: Path) -> None:
    path = str(tmp_path / "wq.db")
    store = await SqliteStore.open(path, _backoff())
    kept = await enqueue_one(store, b'"kept"', max_attempts=3, delay=0, now=NOW)
    await store.close()
    # A real failure half-way through the batch's transaction: rows before it were written.
    with closing(sqlite3.connect(path)) as conn:
        conn.execute(
            "CREATE TRIGGER refuse BEFORE INSERT ON bodies WHEN NEW.payload = CAST('\"boom\"' AS "
            "BLOB) BEGIN SELECT RAISE(ABORT, 'injected failure'); END"
        )
    store = await SqliteStore.open(path, _backoff())
    batch = [NewTask(p, 3, 0.0) for p in (b'"a"', b'"b"', b'"boom"', b'"c"')]
    with pytest.raises(StoreError, match="injected failure"):
        await store.enqueue_many(batch, now=NOW)
    with pytest.raises(StoreError):  # it stopped: memory is ahead of the file
        await store.stats()
    await store.close()
    with closing(sqlite3.connect(path)) as conn:
        conn.execute("DROP TRIGGER refuse")
    store = await SqliteStore.open(path, _backoff())
    try:
        stats = await store.stats()
        assert (stats.ready, stats.totals.enqueued) == (1, 1)
        delivery = await store.claim(lease=30, now=NOW)
        assert delivery is not None
        assert (delivery.task.id, delivery.task.payload) == (kept.id, b'"kept"')
        assert await store.claim(lease=30, now=NOW) is None
    finally:
        await store.close()


V1_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO meta VALUES ('schema', '1');
CREATE TABLE tasks (id INTEGER PRIMARY KEY, payload BLOB NOT NULL, attempts INTEGER NOT NULL,
    max_attempts INTEGER NOT NULL, created_at REAL NOT NULL, available_at REAL NOT NULL,
    last_error TEXT, state INTEGER NOT NULL, lease_id TEXT, deadline REAL, ord INTEGER);
CREATE TABLE totals (id INTEGER PRIMARY KEY CHECK (id = 1), enqueued INTEGER NOT NULL,
    delivered INTEGER NOT NULL, acked INTEGER NOT NULL, nacked INTEGER NOT NULL,
    reclaimed INTEGER NOT NULL, retried INTEGER NOT NULL, buried INTEGER NOT NULL,
    requeued INTEGER NOT NULL);
INSERT INTO totals VALUES (1, 5, 3, 1, 1, 0, 0, 1, 0);
-- ready (second in line, then first), handed out, dead (as an earlier release wrote them)
INSERT INTO tasks VALUES (-9223372036854775807, '{"n":1}', 0, 3, 100.0, 100.0, NULL, 0, NULL,
    NULL, 2);
INSERT INTO tasks VALUES (1, '{"n":2}', 0, 3, 101.0, 101.0, NULL, 0, NULL, NULL, -1);
INSERT INTO tasks VALUES (2, '{"n":3}', 1, 3, 102.0, 102.0, NULL, 1, 'aaaaaaaaaaaaaaaa',
    1800000030.0, 7);
INSERT INTO tasks VALUES (3, '"dead"', 1, 1, 103.0, 103.0, 'gave up', 3, NULL, NULL, 1);
"""


async def test_a_file_of_schema_1_is_upgraded_keeping_everything(tmp_path: Path) -> None:
    path = str(tmp_path / "old.db")
    with closing(sqlite3.connect(path)) as conn:
        conn.executescript(V1_SCHEMA)
    store = await SqliteStore.open(path, _backoff())
    try:
        stats = await store.stats()
        assert (stats.ready, stats.handed_out, stats.delayed, stats.dead) == (2, 1, 0, 1)
        assert stats.totals.enqueued == 5
        [dead] = await store.dead_letters()
        assert (dead.id, dead.payload, dead.last_error) == (
            "8000000000000003",
            b'"dead"',
            "gave up",
        )
        first = await store.claim(lease=30, now=NOW)
        second = await store.claim(lease=30, now=NOW)
        assert first is not None
        assert second is not None
        assert (first.task.payload, first.task.created_at) == (b'{"n":2}', 101.0)
        assert (first.task.id, second.task.id) == ("8000000000000001", "0000000000000001")
        await store.ack("8000000000000002", "aaaaaaaaaaaaaaaa", now=NOW)
    finally:
        await store.close()
    with closing(sqlite3.connect(path)) as conn:
        assert conn.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone() == (
            str(SCHEMA_VERSION),
        )


async def test_payloads_stay_in_the_file_not_in_memory(tmp_path: Path) -> None:
    """50 MB of payloads enqueued and handed out: the process keeps a few MB at most (the index
    and the cache of payloads just enqueued), also after a restart."""
    path = str(tmp_path / "wq.db")
    big = b'"' + b"x" * (100 * 1024) + b'"'
    tracemalloc.start()
    try:
        store = await SqliteStore.open(path, _backoff(), sync="normal")
        base = tracemalloc.get_traced_memory()[0]
        for _ in range(10):
            await store.enqueue_many([NewTask(big, 3, 0.0)] * 50, now=NOW)
        grown = tracemalloc.get_traced_memory()[0] - base
        assert grown < 12 * 2**20, f"{grown / 2**20:.1f} MB kept for 50 MB of payloads"
        await store.close()
        store = await SqliteStore.open(path, _backoff(), sync="normal")
        assert tracemalloc.get_traced_memory()[0] - base < 2 * 2**20
        deliveries = await store.claim_many([30.0] * 500, now=NOW)
        assert len(deliveries) == 500
        assert all(d.task.payload == big for d in deliveries)
        del deliveries
        await asyncio.sleep(0)  # the loop drops its last reference to the rows read
        assert tracemalloc.get_traced_memory()[0] - base < 2 * 2**20
        await store.close()
    finally:
        tracemalloc.stop()


async def test_a_file_of_schema_1_goes_to_the_default_queue(tmp_path: Path) -> None:
    path = str(tmp_path / "old.db")
    with closing(sqlite3.connect(path)) as conn:
        conn.executescript(V1_SCHEMA)
    store = await SqliteStore.open(path, _backoff())
    try:
        stats = await store.stats()
        assert await store.stats(DEFAULT_QUEUE) == stats
        assert await store.queues() == [QueueStats(DEFAULT_QUEUE, 2, 1, 0, 1, False)]
        [dead] = await store.dead_letters(queue=DEFAULT_QUEUE)
        assert (dead.queue, dead.priority) == (DEFAULT_QUEUE, 0)
    finally:
        await store.close()


# Schema 2 as a broker before queues wrote it (one queue, no priorities, no keys).
V2_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO meta VALUES ('schema', '2');
INSERT INTO meta VALUES ('id_key', '12345');
CREATE TABLE tasks (
    id INTEGER PRIMARY KEY, attempts INTEGER NOT NULL, max_attempts INTEGER NOT NULL,
    available_at REAL NOT NULL, state INTEGER NOT NULL, lease_id TEXT, deadline REAL,
    ord INTEGER NOT NULL, last_error TEXT
);
CREATE TABLE bodies (id INTEGER PRIMARY KEY, payload BLOB NOT NULL, created_at REAL NOT NULL);
CREATE TABLE totals (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    enqueued INTEGER NOT NULL, delivered INTEGER NOT NULL, acked INTEGER NOT NULL,
    nacked INTEGER NOT NULL, reclaimed INTEGER NOT NULL, retried INTEGER NOT NULL,
    buried INTEGER NOT NULL, requeued INTEGER NOT NULL
);
INSERT INTO totals VALUES (1, 7, 5, 1, 2, 1, 2, 1, 1);
-- ready (second, first in line), delayed, handed out, dead
INSERT INTO tasks VALUES (10, 0, 3, 100.0, 0, NULL, NULL, 5, NULL);
INSERT INTO tasks VALUES (11, 1, 3, 101.0, 0, NULL, NULL, -1, 'old error');
INSERT INTO tasks VALUES (12, 1, 3, 1800000050.0, 2, NULL, NULL, 6, 'retry me');
INSERT INTO tasks VALUES (13, 1, 3, 102.0, 1, 'bbbbbbbbbbbbbbbb', 1800000030.0, 7, NULL);
INSERT INTO tasks VALUES (14, 2, 2, 103.0, 3, NULL, NULL, 3, 'gave up');
INSERT INTO bodies VALUES (10, '{"n":10}', 100.0);
INSERT INTO bodies VALUES (11, '{"n":11}', 101.0);
INSERT INTO bodies VALUES (12, '{"n":12}', 99.0);
INSERT INTO bodies VALUES (13, '{"n":13}', 102.0);
INSERT INTO bodies VALUES (14, '"dead"', 103.0);
"""


def _v2_id(key: int) -> str:
    return f"{key + 2**63:016x}"


async def test_a_file_of_schema_2_is_upgraded_into_the_default_queue(tmp_path: Path) -> None:
    path = str(tmp_path / "v2.db")
    with closing(sqlite3.connect(path)) as conn:
        conn.executescript(V2_SCHEMA)
    store = await SqliteStore.open(path, _backoff())
    try:
        stats = await store.stats()
        assert (stats.ready, stats.handed_out, stats.delayed, stats.dead) == (2, 1, 1, 1)
        assert stats.totals == Totals(7, 5, 1, 2, 1, 2, 1, 1, 0)
        assert await store.stats(DEFAULT_QUEUE) == stats  # the queue's totals are the broker's
        assert await store.queues() == [QueueStats(DEFAULT_QUEUE, 2, 1, 1, 1, False)]
        for key, state in ((10, "ready"), (11, "ready"), (12, "delayed"), (14, "dead")):
            found = await store.lookup(_v2_id(key))
            assert found is not None
            assert found.state == state
            assert (found.task.queue, found.task.priority) == (DEFAULT_QUEUE, 0)
        [dead] = await store.dead_letters()
        assert (dead.id, dead.payload, dead.last_error) == (_v2_id(14), b'"dead"', "gave up")
        first = await store.claim(lease=30, now=NOW)
        second = await store.claim(lease=30, now=NOW)
        assert first is not None
        assert second is not None
        assert (first.task.id, first.task.last_error) == (_v2_id(11), "old error")
        assert (second.task.id, second.task.payload) == (_v2_id(10), b'{"n":10}')
        await store.ack(_v2_id(13), "b" * 16, now=NOW)  # a lease from before the upgrade
        # new tasks go on from there, in named queues too
        new = await enqueue_one(
            store, b"1", max_attempts=3, delay=0, now=NOW, queue="q", priority=2
        )
        assert new.id not in {_v2_id(k) for k in range(10, 15)}
        stats = await store.stats()
        assert stats.totals.enqueued == 8
        assert stats.totals.acked == 2
    finally:
        await store.close()
    with closing(sqlite3.connect(path)) as conn:
        assert conn.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone() == (
            str(SCHEMA_VERSION),
        )
    store = await SqliteStore.open(path, _backoff())  # and it opens again as schema 3
    try:
        assert [r.name for r in await store.queues()] == [DEFAULT_QUEUE, "q"]
        assert (await store.stats("q")).totals.enqueued == 1
        assert (await store.stats(DEFAULT_QUEUE)).totals.enqueued == 7
    finally:
        await store.close()


async def test_a_new_file_has_no_queue_and_an_unused_file_of_schema_2_gets_the_default(
    tmp_path: Path,
) -> None:
    # A new file runs every migration, the one that moves schema 2's tasks into the default queue
    # too: only a file that was at schema 2 gets that queue, even one that never held a task.
    empty_v2 = V2_SCHEMA.split("INSERT INTO totals")[0]
    old = str(tmp_path / "v2.db")
    with closing(sqlite3.connect(old)) as conn:
        conn.executescript(empty_v2 + "INSERT INTO totals VALUES (1, 0, 0, 0, 0, 0, 0, 0, 0);")
    new = str(tmp_path / "new.db")
    for path, queues in ((new, []), (old, [QueueStats(DEFAULT_QUEUE, 0, 0, 0, 0, False)])):
        store = await SqliteStore.open(path, _backoff())
        try:
            assert await store.queues() == queues
            assert await store.stats() == Stats(0, 0, 0, 0, Totals())
        finally:
            await store.close()
        with closing(sqlite3.connect(path)) as conn:
            assert conn.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone() == (
                str(SCHEMA_VERSION),
            )


async def test_an_upgrade_that_fails_leaves_the_file_as_it_was(tmp_path: Path) -> None:
    path = str(tmp_path / "v2.db")
    with closing(sqlite3.connect(path)) as conn:
        conn.executescript(V2_SCHEMA)
        conn.execute("CREATE TABLE keys (x)")  # in the way of the migration to schema 3
    with pytest.raises(StoreError, match="keys already exists"):
        await SqliteStore.open(path, _backoff())
    with closing(sqlite3.connect(path)) as conn:
        assert conn.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone() == ("2",)
        columns = [row[1] for row in conn.execute("PRAGMA table_info(tasks)")]
        assert "queue" not in columns  # the migration's first steps were rolled back
        assert conn.execute("SELECT count(*) FROM tasks").fetchone() == (5,)
    with closing(sqlite3.connect(path)) as conn:
        conn.execute("DROP TABLE keys")
    store = await SqliteStore.open(path, _backoff())  # and with the obstacle gone, it upgrades
    try:
        assert (await store.stats()).totals.enqueued == 7
    finally:
        await store.close()


async def test_a_restart_keeps_queues_priorities_pauses_and_keys(tmp_path: Path) -> None:
    path = str(tmp_path / "wq.db")
    store = await SqliteStore.open(path, _backoff(), hot_ready=2)
    until = NOW + 300.0
    low = await enqueue_one(store, b'"low"', max_attempts=3, delay=0, now=NOW, queue="a")
    high = await enqueue_one(
        store,
        b'"high"',
        max_attempts=3,
        delay=0,
        now=NOW,
        queue="a",
        priority=9,
        key="k",
        key_until=until,
    )
    mid = [
        (
            await enqueue_one(
                store, b"%d" % n, max_attempts=3, delay=0, now=NOW, queue="b", priority=4
            )
        ).id
        for n in range(4)
    ]
    keyed_b = await enqueue_one(
        store, b'"kb"', max_attempts=1, delay=0, now=NOW, queue="b", key="k", key_until=until
    )
    held = await store.claim(lease=60, now=NOW, queues=["b"])
    assert held is not None
    assert held.task.id == mid[0]
    await store.extend(mid[0], held.lease_id, lease=120, now=NOW)
    await store.set_paused("a", True)
    await store.set_paused("c", True)
    before_rows = await store.queues()
    before = {name: await store.stats(name) for name in ("a", "b", "c", DEFAULT_QUEUE)}
    await store.close()

    store = await SqliteStore.open(path, _backoff(), hot_ready=2)
    try:
        assert await store.queues() == before_rows
        assert [r.paused for r in before_rows] == [True, False, True]
        for name, stats in before.items():
            assert await store.stats(name) == stats
        # every ready task is cold after a restart: a lookup reads it back
        found = await store.lookup(high.id)
        assert found is not None
        assert (found.state, found.task.queue, found.task.priority) == ("ready", "a", 9)
        assert found.task.payload == b'"high"'
        # keys: still duplicates, per queue
        again = await enqueue_one(
            store, b"x", max_attempts=3, delay=0, now=NOW + 1, queue="a", key="k", key_until=until
        )
        assert (again.id, again.duplicate) == (high.id, True)
        again = await enqueue_one(
            store, b"x", max_attempts=3, delay=0, now=NOW + 1, queue="b", key="k", key_until=until
        )
        assert (again.id, again.duplicate) == (keyed_b.id, True)
        # the paused queue hands nothing out; the other one, by priority then age
        assert await store.claim(lease=30, now=NOW + 1, queues=["a"]) is None
        got = await store.claim_many([30.0] * 5, now=NOW + 1, queues=["a", "b"])
        assert [d.task.id for d in got] == [*mid[1:], keyed_b.id]
        for d in got:
            await store.ack(d.task.id, d.lease_id, now=NOW + 1)
        # the extended lease is still good and due at its new deadline
        result, next_due = await store.sweep(now=NOW + 60)
        assert (result.reclaimed, next_due) == ([], NOW + 120)
        await store.ack(mid[0], held.lease_id, now=NOW + 60)
        await store.set_paused("a", False)
        got = await store.claim_many([30.0] * 3, now=NOW + 61, queues=["a"])
        assert [d.task.id for d in got] == [high.id, low.id]
    finally:
        await store.close()


async def test_keys_past_their_window_are_forgotten_across_a_restart(tmp_path: Path) -> None:
    path = str(tmp_path / "wq.db")
    store = await SqliteStore.open(path, _backoff())
    first = await enqueue_one(
        store, b"1", max_attempts=3, delay=0, now=NOW, key="k", key_until=NOW + 5
    )
    await store.close()
    store = await SqliteStore.open(path, _backoff())
    try:
        await store.sweep(now=NOW + 5)  # forgets the key (and writes that down)
        second = await enqueue_one(
            store, b"2", max_attempts=3, delay=0, now=NOW + 5, key="k", key_until=NOW + 10
        )
        assert not second.duplicate
        assert second.id != first.id
    finally:
        await store.close()
    with closing(sqlite3.connect(path)) as conn:
        rows = conn.execute("SELECT queue, key, until FROM keys").fetchall()
    assert rows == [(DEFAULT_QUEUE, "k", NOW + 10)]


async def test_a_restart_keeps_what_control_over_tasks_set(tmp_path: Path) -> None:
    """Cancelling tasks, unique keys, expiries (of hot and of cold ready tasks), time limits,
    progress, the cancelled and expired totals and a deleted queue all survive a restart
    (docs/design/control.md); a file of schema 3 (before them) opens as schema 4."""
    path = str(tmp_path / "control.db")
    store = await SqliteStore.open(path, _backoff(), hot_ready=2)
    try:
        cancelling = (await enqueue_one(store, b"1", max_attempts=3, delay=0.0, now=NOW)).id
        held = await store.claim(lease=300, now=NOW)
        assert held is not None
        assert held.task.id == cancelling
        await store.cancel(cancelling, now=NOW)
        limited = NewTask(b"2", 3, 0.0, timeout=100.0)
        (limited_task,) = await store.enqueue_many([limited], now=NOW)
        worked = await store.claim(lease=30, now=NOW)
        assert worked is not None
        assert worked.task.id == limited_task.id
        await store.extend(worked.task.id, worked.lease_id, lease=30, now=NOW, progress=b'"half"')
        unique = NewTask(b"3", 3, 0.0, DEFAULT_QUEUE, 0, "only-one", 0.0, unique=True)
        (first,) = await store.enqueue_many([unique], now=NOW)
        expiring = [NewTask(b"4", 3, 0.0, expires_at=NOW + 50) for _ in range(4)]
        await store.enqueue_many(expiring, now=NOW)  # (beyond two hot: cold after a restart)
        await enqueue_one(store, b"5", max_attempts=3, delay=0.0, now=NOW, queue="gone")
        await store.empty_queue("gone", now=NOW)
        await store.delete_queue("gone")
    finally:
        await store.close()
    store = await SqliteStore.open(path, _backoff(), hot_ready=2)
    try:
        found = await store.lookup(cancelling)
        assert found is not None
        assert (found.state, found.task.cancelling) == ("handed_out", True)
        with pytest.raises(Cancelled):
            await store.extend(cancelling, held.lease_id, lease=30, now=NOW + 1)
        found = await store.lookup(limited_task.id)
        assert found is not None
        assert (found.task.progress, found.task.timeout) == (b'"half"', 100.0)
        again = await store.extend(worked.task.id, worked.lease_id, lease=300, now=NOW + 2)
        assert again == pytest.approx(NOW + 100)  # the time limit came back too
        (dup,) = await store.enqueue_many([unique], now=NOW + 3)
        assert (dup.id, dup.duplicate) == (first.id, True)
        assert [q.name for q in await store.queues()] == [DEFAULT_QUEUE]
        swept, _ = await store.sweep(now=NOW + 60)
        assert swept.expired == 4
        stats = await store.stats()
        assert (stats.totals.cancelled, stats.totals.expired) == (1, 4)
        assert stats.ready == 1  # the unique one
        await store.nack(cancelling, held.lease_id, "stop", now=NOW + 61)
        stats = await store.stats()
        assert (stats.handed_out, stats.totals.cancelled) == (1, 2)
        store.check_invariants()
    finally:
        await store.close()
    with closing(sqlite3.connect(path)) as conn:
        schema = conn.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
        assert schema == (str(SCHEMA_VERSION),)


async def test_a_restart_keeps_burial_times_and_an_older_dead_task_has_none(
    tmp_path: Path,
) -> None:
    """A dead task's burial time is in the file (schema 8); a task buried before it (its
    column NULL, as an upgraded file's dead tasks have it) is shown without one."""
    path = str(tmp_path / "buried.db")
    store = await SqliteStore.open(path, _backoff())
    ids = []
    try:
        for n in range(2):
            ids.append((await enqueue_one(store, b"1", max_attempts=1, delay=0.0, now=NOW)).id)
            d = await store.claim(lease=30, now=NOW)
            assert d is not None
            await store.nack(d.task.id, d.lease_id, "no", now=NOW + 10 + n)
    finally:
        await store.close()
    with closing(sqlite3.connect(path)) as conn, conn:
        # (the second as a broker before schema 8 left it)
        conn.execute("UPDATE tasks SET buried_at = NULL WHERE id = ?", (_row_key(ids[1]),))
    store = await SqliteStore.open(path, _backoff())
    try:
        dead = await store.dead_letters()
        assert [(t.id, t.buried_at) for t in dead] == [(ids[0], NOW + 10), (ids[1], None)]
        for task_id, at in zip(ids, [NOW + 10, None], strict=True):
            found = await store.lookup(task_id)
            assert found is not None
            assert (found.state, found.task.buried_at) == ("dead", at)
        await store.requeue(ids[0], now=NOW + 20)
    finally:
        await store.close()
    with closing(sqlite3.connect(path)) as conn:
        rows = conn.execute("SELECT state, buried_at FROM tasks ORDER BY ord").fetchall()
        assert sorted(rows, key=repr) == sorted([(0, None), (3, None)], key=repr)


def _row_key(task_id: str) -> int:
    """A task's key in the file (its id's number, offset into a signed 64-bit integer)."""
    return int(task_id, 16) - 2**63


# -- results and workflows (docs/design/results.md) -----------------------------------------------


def _task(payload: bytes = b"{}", **kw: Any) -> NewTask:
    """A task; ``ttl``: its result TTL (given), ``after``, ``queue``, ``delay``."""
    ttl = kw.pop("ttl", None)
    new = NewTask(payload, 3, kw.pop("delay", 0.0), kw.pop("queue", DEFAULT_QUEUE), **kw)
    if ttl is not None:
        new.result_ttl, new.result_ttl_given = ttl, True
    return new


async def _run(store: SqliteStore, queue: str, now: float, result: bytes | None = None) -> Delivery:
    """Claim the next task of ``queue`` and ack it (with ``result``)."""
    d = await store.claim(lease=30, now=now, queues=(queue,))
    assert d is not None
    await store.ack(d.task.id, d.lease_id, now=now, result=result)
    return d


async def test_a_restart_keeps_waiting_tasks_their_parents_and_results(tmp_path: Path) -> None:
    """Waiting tasks (what they wait for counted again), the edges to their parents (the cold
    ones too), results with their finish times and TTLs, pins, a released child's delay: all
    come back after a restart, and go on as if there had been none."""
    path = str(tmp_path / "flows.db")
    store = await SqliteStore.open(path, _backoff(), hot_ready=2)
    try:
        done = await store.enqueue_many(
            [
                _task(b'"a"', queue="p", ttl=100.0),  # 0: succeeds before the restart
                _task(b'"b"', queue="p"),  # 1: pending (cold after the restart)
                _task(b'"c"', queue="q", ttl=5.0),  # 2: succeeds; pinned by 5
                _task(b'"x"', queue="c", after=(0, 1)),  # 3: waits for 1
                _task(b'"y"', queue="g", after=(3,), ttl=7.0),  # 4: waits for 3
                _task(b'"z"', queue="c", after=(2,), delay=10.0),  # 5: released, delayed
            ],
            now=NOW,
        )
        a, b, c, x, y, z = (d.id for d in done)
        await _run(store, "p", NOW + 1, b'{"a": 1}')
        await _run(store, "q", NOW + 1, b'"c\\u00e9"')
        alone = (await store.enqueue_many([_task(ttl=50.0)], now=NOW + 1))[0].id
        await _run(store, DEFAULT_QUEUE, NOW + 2, b"null")
        before = await store.stats()
    finally:
        await store.close()
    store = await SqliteStore.open(path, _backoff(), hot_ready=2)
    try:
        store.check_invariants()
        assert await store.stats() == before
        assert (before.waiting, before.succeeded, before.delayed) == (2, 3, 1)
        found = await store.lookup(x)
        assert found is not None
        assert (found.state, found.task.waiting_for, found.task.after) == ("waiting", 1, (a, b))
        found = await store.lookup(a)
        assert found is not None
        assert (found.state, found.task.result, found.task.finished_at) == (
            "succeeded",
            b'{"a": 1}',
            NOW + 1,
        )
        assert found.task.result_ttl == 100.0
        found = await store.lookup(z)
        assert found is not None
        assert (found.state, found.task.available_at) == ("delayed", NOW + 11)
        assert await store.children(b, limit=5) == ([x], 1)  # (b: a cold ready task)
        assert await store.children(a, limit=5) == ([x], 1)
        assert await store.children(x, limit=5) == ([y], 1)
        page = await store.list_tasks("c", "waiting", limit=5)
        assert [t.task.id for t in page.tasks] == [x]
        page = await store.list_tasks(DEFAULT_QUEUE, "succeeded", limit=5)
        assert [(t.task.id, t.task.result) for t in page.tasks] == [(alone, b"null")]
        # The results are pruned when due, but those still pinned by a child.
        swept, _ = await store.sweep(now=NOW + 60)
        assert swept.pruned == 1  # ``alone``; ``c`` is pinned by ``z``, ``a`` by ``x``
        assert await store.lookup(alone) is None
        # b's ack releases x, whose delivery carries a's result read back from the file.
        await _run(store, "p", NOW + 61)
        assert store.take_released() == Released({"c"}, None)
        d = await store.claim(lease=30, now=NOW + 61, queues=("c",))
        assert d is not None
        assert d.task.id == z  # (due since NOW + 11: promoted first)
        assert d.parents == [ParentResult(c, b'"c\\u00e9"')]
        await store.ack(z, d.lease_id, now=NOW + 61)
        d = await store.claim(lease=30, now=NOW + 61, queues=("c",))
        assert d is not None
        assert d.task.id == x
        assert d.parents == [ParentResult(a, b'{"a": 1}'), ParentResult(b, None)]
        store.check_invariants()
    finally:
        await store.close()
    store = await SqliteStore.open(path, _backoff(), hot_ready=2)
    try:
        store.check_invariants()
        assert await store.lookup(c) is None  # unpinned by z's ack, and due: pruned
        found = await store.lookup(y)
        assert found is not None
        assert (found.state, found.task.waiting_for) == ("waiting", 1)
        await store.ack(x, d.lease_id, now=NOW + 62, result=b"[]")
        assert store.take_released() == Released({"g"}, None)
        d = await store.claim(lease=30, now=NOW + 62, queues=("g",))
        assert d is not None
        assert d.parents == [ParentResult(x, b"[]")]
        store.check_invariants()
    finally:
        await store.close()
    with closing(sqlite3.connect(path)) as conn:
        edges = conn.execute("SELECT count(*) FROM edges").fetchone()[0]
        assert edges == 3  # x's two (it holds its result) and y's (z is gone, and its edge)


def _copy_database(path: Path, copy: Path) -> None:
    """The file and its write-ahead log, as they are (a broker killed now leaves them so)."""
    for suffix in ("", "-wal"):
        source = Path(str(path) + suffix)
        if source.exists():
            Path(str(copy) + suffix).write_bytes(source.read_bytes())


async def test_a_parents_ack_and_its_childrens_release_are_one_commit(tmp_path: Path) -> None:
    """A parent's ack and the release of its children are one transaction: a copy of the file
    taken right after the acks (as a broker killed then would leave it) has the children ready,
    the fan-in child waiting for the one parent not yet acked, nothing half done."""
    path = tmp_path / "live.db"
    store = await SqliteStore.open(str(path), _backoff())
    try:
        parents = [d.id for d in await store.enqueue_many([_task(queue="p")] * 3, now=NOW)]
        fan_out = await store.enqueue_many([_task(queue="c", after=(parents[0],))] * 1000, now=NOW)
        (fan_in,) = await store.enqueue_many([_task(queue="i", after=tuple(parents))], now=NOW)
        held = await store.claim(lease=30, now=NOW + 1, queues=("p",))
        assert held is not None
        before = store.transactions
        await store.ack(held.task.id, held.lease_id, now=NOW + 1, result=b'"first"')
        assert store.transactions == before + 1  # the ack and 1000 releases: one commit
        await _run(store, "p", NOW + 2)
        # (the broker is "killed" here: its file and its write-ahead log copied as they are)
        copy = tmp_path / "after-kill.db"
        _copy_database(path, copy)
    finally:
        await store.close()
    store = await SqliteStore.open(str(copy), _backoff())
    try:
        stats = await store.stats()
        assert (stats.ready, stats.waiting, stats.succeeded) == (1001, 1, 1)
        assert stats.totals.acked == 2
        found = await store.lookup(fan_in.id)
        assert found is not None
        assert (found.state, found.task.waiting_for) == ("waiting", 1)
        claimed = await store.claim_many([30.0] * 1000, now=NOW + 3, queues=("c",))
        assert [d.task.id for d in claimed] == [d.id for d in fan_out]
        assert all(d.parents == [ParentResult(parents[0], b'"first"')] for d in claimed)
        await _run(store, "p", NOW + 3)
        assert store.take_released() == Released({"i"}, None)
        store.check_invariants()
    finally:
        await store.close()


async def test_results_stay_in_the_file_not_in_memory(tmp_path: Path) -> None:
    """20 MB of results held: the process keeps the index's records, not the results; a child's
    delivery reads its parent's back from the file."""
    path = str(tmp_path / "results.db")
    store = await SqliteStore.open(path, _backoff(), sync="normal")
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        parents = [d.id for d in await store.enqueue_many([_task(queue="p")] * 200, now=NOW)]
        (child,) = await store.enqueue_many([_task(after=(parents[-1],))], now=NOW)
        for _ in range(4):
            claimed = await store.claim_many([30.0] * 50, now=NOW, queues=("p",))
            results = {d.task.id: b'"%s"' % d.task.id.encode() * 6000 for d in claimed}
            acks = [(d.task.id, d.lease_id) for d in claimed]
            acked, _ = await store.settle_many(acks, [], now=NOW, results=results)
            assert acked == [None] * 50
            del claimed, results
        await asyncio.sleep(0)  # the loop drops its last reference to the batch written
        grown = tracemalloc.get_traced_memory()[0] - base
        assert grown < 4 * 2**20, f"{grown / 2**20:.1f} MB kept for 20 MB of results"
        assert (await store.stats()).succeeded == 200
        d = await store.claim(lease=30, now=NOW)
        assert d is not None
        assert d.task.id == child.id
        assert d.parents == [ParentResult(parents[-1], b'"%s"' % parents[-1].encode() * 6000)]
    finally:
        tracemalloc.stop()
        await store.close()


async def test_a_call_that_comes_while_the_store_closes_is_refused_quietly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A broker stopping with workers still acking: a change made after the store closed is
    refused ("the store is closed"), not committed on a closed connection, and the store does not
    call itself broken ("refuses further work")."""
    store = await SqliteStore.open(str(tmp_path / "wq.db"), _backoff())
    done = await store.enqueue_many([NewTask(b"1", 3, 0.0)] * 2, now=1.0)
    delivery = await store.claim(lease=30.0, now=1.0)
    assert delivery is not None
    closing_ = asyncio.ensure_future(store.close())
    await asyncio.sleep(0)  # close is under way
    with pytest.raises(StoreError, match="closed"):
        await store.ack(delivery.task.id, delivery.lease_id, now=2.0)
    await closing_
    with pytest.raises(StoreError, match="closed"):
        await store.enqueue_many([NewTask(b"2", 3, 0.0)], now=3.0)
    assert not [r for r in caplog.records if "refuses further work" in r.getMessage()]
    reopened = await SqliteStore.open(str(tmp_path / "wq.db"), _backoff())
    try:
        stats = await reopened.stats()
        assert (stats.ready, stats.handed_out) == (1, 1)  # the ack was refused: nothing lost
        assert {d.id for d in done} >= {delivery.task.id}
    finally:
        await reopened.close()
