"""The client's task-control API (issue 26), ``AsyncClient`` and its blocking mirror ``Client``,
over the transport seam (tests/fake_transport.py): cancel, listing and paging, emptying and
deleting queues, enqueue's new options, progress, the new fields and errors; and the ``wq``
commands built on them (cancel, tasks, queue empty|delete), run against the same fake.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from typing import Any

import pytest

import wqclient
from tests.fake_transport import FakeTransport
from wqclient import (
    AsyncClient,
    Cancelled,
    Client,
    Conflict,
    EnqueueItem,
    InvalidArgument,
    LeaseLost,
    NotFound,
    TaskPage,
    TimeLimitReached,
)
from wqclient.cli import admin, producer

pytestmark = pytest.mark.timeout(30)


def test_the_new_errors_are_exported_and_placed_in_the_tree() -> None:
    for name in ("Cancelled", "TimeLimitReached", "Conflict", "TaskPage"):
        assert name in wqclient.__all__
        assert getattr(wqclient, name) is not None
    assert issubclass(Cancelled, LeaseLost)
    assert issubclass(TimeLimitReached, LeaseLost)
    assert not issubclass(Conflict, LeaseLost)
    assert issubclass(Conflict, wqclient.WqError)


# -- AsyncClient ----------------------------------------------------------------------------------


async def test_cancel_says_what_it_did_for_each_state() -> None:
    fake = FakeTransport()
    async with AsyncClient(transport=fake) as wq:
        dead = await wq.enqueue(1, max_attempts=1)
        buried = await wq.claim(wait_ms=0)
        assert buried is not None
        await wq.nack(buried, error="boom")
        held = await wq.enqueue(2)
        assert await wq.claim(wait_ms=0) is not None
        ready = await wq.enqueue(3)
        assert [(await wq.get_task(i)).state for i in (dead, held, ready)] == [
            "dead",
            "handed_out",
            "ready",
        ]
        assert await wq.cancel(ready) == "cancelled"
        assert await wq.cancel(held) == "cancelling"
        assert await wq.cancel(held) == "cancelling"  # (already: unchanged)
        assert await wq.cancel(dead) == "purged"
        with pytest.raises(NotFound):
            await wq.cancel(ready)  # gone
        with pytest.raises(NotFound):
            await wq.cancel("never")
        stats = await wq.stats()
    assert (stats.totals.cancelled, stats.totals.purged) == (1, 1)


async def test_cancel_takes_an_id_a_task_or_a_delivery() -> None:
    fake = FakeTransport()
    first, second = fake.add(1), fake.add(2)
    async with AsyncClient(transport=fake) as wq:
        enqueued = await wq.enqueue(3)
        delivery = await wq.claim(wait_ms=0)
        assert delivery is not None
        assert await wq.cancel(delivery) == "cancelling"
        assert await wq.cancel(await wq.get_task(second)) == "cancelled"
        assert await wq.cancel(enqueued) == "cancelled"  # (an Enqueued is its id)
        with pytest.raises(InvalidArgument):
            await wq.cancel(7)  # type: ignore[arg-type]
    assert fake.calls_to("cancel") == [first, second, str(enqueued)]


async def test_a_cancelled_task_cannot_be_extended_and_its_nack_drops_it() -> None:
    fake = FakeTransport()
    task_id = fake.add("work")
    async with AsyncClient(transport=fake) as wq:
        delivery = await wq.claim(wait_ms=0)
        assert delivery is not None
        await wq.cancel(task_id)
        looked_up = await wq.get_task(task_id)
        assert (looked_up.state, looked_up.cancelling) == ("handed_out", True)
        with pytest.raises(Cancelled):
            await wq.extend(delivery, 1000)
        await wq.nack(delivery, error="stopped")
        with pytest.raises(NotFound):
            await wq.get_task(task_id)  # not retried
        assert await wq.claim(wait_ms=0) is None
        assert (await wq.stats()).totals.cancelled == 1


async def test_list_tasks_pages_with_cursors_and_iter_tasks_takes_them_all() -> None:
    fake = FakeTransport()
    ids = [fake.add(n, queue="mail", priority=n % 3) for n in range(7)]
    fake.add("elsewhere")
    async with AsyncClient(transport=fake) as wq:
        first = await wq.list_tasks("mail", limit=3)
        assert isinstance(first, TaskPage)
        assert len(first) == 3
        assert first.next_cursor is not None
        assert {t.state for t in first} == {"ready"}
        second = await wq.list_tasks("mail", limit=3, cursor=first.next_cursor)
        third = await wq.list_tasks("mail", limit=3, cursor=second.next_cursor)
        assert third.next_cursor is None
        paged = [t.id for page in (first, second, third) for t in page]
        every = [t.id async for t in wq.iter_tasks("mail", limit=3)]
        assert [t.id async for t in wq.iter_tasks("mail", limit=1000)] == every
    # In claim order: the highest priority first, then the oldest.
    by_priority = sorted(ids, key=lambda i: (-(ids.index(i) % 3), ids.index(i)))
    assert paged == every == by_priority
    assert fake.calls_to("list_tasks").count(None) == 3 + 3 + 1


async def test_list_tasks_by_state() -> None:
    fake = FakeTransport()
    held, dead, ready = fake.add(1), fake.add(2, max_attempts=1), fake.add(3)
    async with AsyncClient(transport=fake) as wq:
        first = await wq.claim(wait_ms=0)
        second = await wq.claim(wait_ms=0)
        assert first is not None
        assert second is not None
        await wq.nack(second, error="boom")
        await wq.extend(first, progress={"pct": 10})
        handed_out = await wq.list_tasks(state="handed_out")
        assert [(t.id, t.state, t.progress_value) for t in handed_out] == [
            (held, "handed_out", {"pct": 10})
        ]
        [buried] = (await wq.list_tasks(state="dead")).tasks
        assert (buried.id, buried.last_error) == (dead, "boom")
        assert [t.id for t in await wq.list_tasks()] == [ready]
        assert (await wq.list_tasks(state="delayed")).tasks == []
        with pytest.raises(InvalidArgument, match="state"):
            await wq.list_tasks(state="running")
        with pytest.raises(InvalidArgument, match="limit"):
            await wq.list_tasks(limit=0)
        with pytest.raises(InvalidArgument):
            await wq.list_tasks(limit="10")  # type: ignore[arg-type]


async def test_empty_and_delete_a_queue() -> None:
    fake = FakeTransport()
    for n in range(3):
        fake.add(n, queue="mail")
    async with AsyncClient(transport=fake) as wq:
        with pytest.raises(Conflict, match="3 ready"):
            await wq.delete_queue("mail")
        assert await wq.empty_queue("mail") == 3
        assert await wq.empty_queue("mail") == 0
        await wq.delete_queue("mail")
        assert "mail" not in [q.name for q in await wq.queues()]
        with pytest.raises(NotFound):
            await wq.delete_queue("mail")
        with pytest.raises(NotFound):
            await wq.empty_queue("never")
        assert (await wq.stats()).totals.cancelled == 3


async def test_enqueue_passes_the_new_options_only_when_set() -> None:
    fake = FakeTransport()
    async with AsyncClient(transport=fake) as wq:
        plain = await wq.enqueue(1)
        limited = await wq.enqueue(2, expires_in_ms=60_000, timeout_ms=5_000)
        unique = await wq.enqueue(3, idempotency_key="k", unique=True)
        batch = await wq.enqueue_many(
            [4, EnqueueItem(b"5", timeout_ms=9, idempotency_key="k5", unique=True)],
            expires_in_ms=1_000,
            timeout_ms=2_000,
        )
        with pytest.raises(InvalidArgument, match="expires_in_ms"):
            await wq.enqueue(6, expires_in_ms="soon")  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="unique"):
            await wq.enqueue(6, idempotency_key="k6", unique="yes")  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="unique"):
            await wq.enqueue_many([EnqueueItem(b"7", unique=1)])  # type: ignore[arg-type]

    def options(task_id: str) -> tuple[Any, ...]:
        item = fake.options[task_id]
        return (item.expires_in_ms, item.timeout_ms, item.unique, item.idempotency_key)

    assert options(plain) == (None, None, False, None)
    assert options(limited) == (60_000, 5_000, False, None)
    assert options(unique) == (None, None, True, "k")
    assert options(batch[0]) == (1_000, 2_000, False, None)
    assert options(batch[1]) == (1_000, 9, True, "k5")  # its own timeout, the call's expiry
    assert fake.tasks[limited].timeout_ms == 5_000
    assert fake.tasks[limited].expires_at is not None


async def test_extend_records_progress_of_any_json_value() -> None:
    fake = FakeTransport()
    task_id = fake.add("work")
    async with AsyncClient(transport=fake) as wq:
        delivery = await wq.claim(wait_ms=0)
        assert delivery is not None
        await wq.extend(delivery, progress={"step": 2, "of": 5})
        await wq.extend(delivery, progress=[1, 2])
        await wq.extend(delivery, progress=None)  # JSON null is a progress
        await wq.extend(delivery, progress=b'"raw"')
        await wq.extend(delivery)  # none
        with pytest.raises(InvalidArgument, match="progress cannot be encoded"):
            await wq.extend(delivery, progress=float("nan"))
        assert (await wq.get_task(task_id)).progress_value == "raw"
    assert fake.progress_reports == [
        (task_id, b'{"step":2,"of":5}'),
        (task_id, b"[1,2]"),
        (task_id, b"null"),
        (task_id, b'"raw"'),
    ]
    assert len(fake.extends) == 5


async def test_a_time_limit_refusal_is_a_lease_lost_of_its_own() -> None:
    fake = FakeTransport()
    fake.add("work")
    fake.fail("extend", TimeLimitReached("task t1 has reached its time limit of 100 ms"))
    async with AsyncClient(transport=fake) as wq:
        delivery = await wq.claim(wait_ms=0)
        assert delivery is not None
        with pytest.raises(LeaseLost) as refused:
            await wq.extend(delivery)
        assert isinstance(refused.value, TimeLimitReached)
        await wq.ack(delivery)  # the lease still holds until it runs out


# -- Client, the blocking mirror ------------------------------------------------------------------


@pytest.fixture
def sync_client() -> Iterator[tuple[FakeTransport, Client]]:
    fake = FakeTransport()
    with Client(transport=fake) as client:
        yield fake, client


def test_the_blocking_client_has_every_new_call(sync_client: tuple[FakeTransport, Client]) -> None:
    fake, wq = sync_client
    ids = [wq.enqueue(n, queue="q", timeout_ms=1000, expires_in_ms=5000) for n in range(5)]
    many = wq.enqueue_many([5, 6], queue="q", timeout_ms=7)
    assert [fake.options[i].timeout_ms for i in many] == [7, 7]
    unique = wq.enqueue(7, queue="q", idempotency_key="u", unique=True)
    assert fake.options[unique].unique is True
    page = wq.list_tasks("q", limit=2)
    assert [t.id for t in page] == ids[:2]
    assert [t.id for t in wq.iter_tasks("q", limit=2)] == [*ids, *many, unique]
    delivery = wq.claim(wait_ms=0, queues="q")
    assert delivery is not None
    wq.extend(delivery, progress={"half": True})
    assert wq.get_task(delivery.id).progress_value == {"half": True}
    assert wq.cancel(delivery.id) == "cancelling"
    assert wq.cancel(ids[1]) == "cancelled"
    with pytest.raises(Conflict):
        wq.delete_queue("q")
    assert wq.empty_queue("q") == 6
    wq.nack(delivery)  # the cancelling one: dropped
    wq.delete_queue("q")
    with pytest.raises(NotFound):
        wq.cancel(ids[0])
    totals = wq.stats().totals
    assert (totals.cancelled, totals.expired) == (8, 0)


# -- the wq commands, on the fake ------------------------------------------------------------------


@pytest.fixture
def on_fake(monkeypatch: pytest.MonkeyPatch) -> FakeTransport:
    """``wq`` talks to a fake broker (each run opens and closes a client on it)."""
    fake = FakeTransport()

    def client(*args: Any, **kwargs: Any) -> AsyncClient:
        fake.closed = False
        return AsyncClient(transport=fake)

    monkeypatch.setattr(admin, "AsyncClient", client)
    monkeypatch.setenv("COLUMNS", "120")
    return fake


def wq(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = admin.main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_wq_cancel_in_both_modes(on_fake: FakeTransport) -> None:
    fake = on_fake
    dead = fake.add(1, max_attempts=1)
    del fake.held[fake.hand_out(None).task.id]
    fake.failed(dead, "boom")
    held = fake.add(2)
    fake.hand_out(None)
    ready = fake.add(3)
    assert wq("cancel", ready) == (0, f"cancelled {ready}\n", "")
    code, out, err = wq("cancel", held)
    assert (code, err) == (0, "")
    assert out.startswith(f"{held} is cancelling")
    assert wq("cancel", dead, "-json") == (
        0,
        json.dumps({"id": dead, "state": "purged"}) + "\n",
        "",
    )
    assert wq("cancel", "never") == (3, "", "wq: task never not found\n")
    assert wq("cancel")[0] == 2  # no id


def test_wq_tasks_pages_and_all(on_fake: FakeTransport) -> None:
    fake = on_fake
    ids = [fake.add({"n": n}, queue="mail") for n in range(5)]
    code, table, err = wq("tasks", "mail", "--limit", "2")
    assert (code, err) == (0, "")
    lines = table.splitlines()
    assert lines[0].startswith("ready tasks of queue mail: 2 (more: --cursor ")
    cursor = lines[0].split("--cursor ")[1].rstrip(")")
    assert [line.split()[0] for line in lines[3:]] == ids[:2]  # (after the header and rule)
    code, out, err = wq("tasks", "mail", "-limit", "2", "-cursor", cursor, "-json")
    page = json.loads(out)
    assert [t["id"] for t in page["tasks"]] == ids[2:4]
    assert {t["state"] for t in page["tasks"]} == {"ready"}
    assert page["next_cursor"] is not None
    code, out, err = wq("tasks", "mail", "-all", "-limit", "2", "-json")
    every = json.loads(out)
    assert [t["id"] for t in every["tasks"]] == ids
    assert every["next_cursor"] is None
    assert wq("tasks", "empty-one") == (0, "no ready tasks in queue empty-one\n", "")


def test_wq_tasks_shows_a_running_tasks_progress_and_cancel(on_fake: FakeTransport) -> None:
    fake = on_fake
    task_id = fake.add({"n": 1}, queue="mail", timeout_ms=60_000)
    fake.hand_out(None, ["mail"])
    fake.progress[task_id] = b'{"pct":40}'
    fake.cancelling.add(task_id)
    code, table, err = wq("tasks", "mail", "-state", "handed_out")
    assert (code, err) == (0, "")
    row = next(line for line in table.splitlines() if line.startswith(f" {task_id} "))
    assert 'cancelling; progress {"pct": 40}; limit 60,000 ms' in row
    [view] = json.loads(wq("tasks", "mail", "-state", "handed_out", "-json")[1])["tasks"]
    assert (view["progress"], view["cancelling"], view["timeout_ms"]) == ({"pct": 40}, True, 60000)
    code, table, _ = wq("task", task_id)
    assert code == 0
    assert "cancelling" in table
    assert "60,000 ms" in table
    assert '{"pct": 40}' in table


def test_wq_tasks_usage_errors(on_fake: FakeTransport) -> None:
    assert wq("tasks", "mail", "-state", "running")[0] == 2
    assert wq("tasks", "mail", "-limit", "0")[0] == 2
    assert wq("tasks", "mail", "-limit", "5000") == (
        2,
        "",
        "wq: limit must be from 1 to 1000, got 5000\n",
    )
    assert wq("tasks")[0] == 2  # no queue


def test_wq_queue_empty_and_delete(on_fake: FakeTransport) -> None:
    fake = on_fake
    for n in range(3):
        fake.add(n, queue="mail")
    code, out, err = wq("queue", "delete", "mail")
    assert (code, out) == (1, "")  # refused: it holds tasks
    assert err == "wq: queue mail holds tasks: 3 ready, 0 handed out, 0 delayed, 0 dead\n"
    assert wq("queue", "empty", "mail") == (
        0,
        "emptied queue mail: 3 ready or delayed tasks cancelled\n",
        "",
    )
    assert wq("queue", "empty", "mail", "-json") == (
        0,
        json.dumps({"queue": "mail", "cancelled": 0}) + "\n",
        "",
    )
    assert wq("queue", "delete", "mail") == (0, "deleted queue mail\n", "")
    assert wq("queue", "delete", "mail") == (3, "", "wq: queue mail not found\n")
    assert wq("queue", "delete", "x", "-json")[0] == 3
    assert wq("queue") == (2, "", "wq: queue needs an action: one of empty, delete\n")
    assert wq("queue", "drop", "mail")[0] == 2
    assert wq("queue", "empty")[0] == 2  # no name


def test_wq_help_lists_the_new_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert admin.main(["-h"]) == 0
    help_text = capsys.readouterr().out
    for command in ("tasks", "cancel", "queue empty", "queue delete"):
        assert f"\n  {command} " in help_text


async def test_the_producer_sends_expiry_and_time_limit() -> None:
    fake = FakeTransport()
    argv = ["-n", "2", "-expires-in-ms", "60000", "--timeout-ms=5000"]
    args = producer.build_parser().parse_args(argv)
    assert (args.expires_in_ms, args.timeout_ms) == (60_000, 5_000)
    defaults = producer.build_parser().parse_args([])
    assert (defaults.expires_in_ms, defaults.timeout_ms) == (None, None)
    async with AsyncClient(transport=fake) as client:
        run = producer._Run(args, client, io.StringIO())
        await run.post()
    assert [(i.expires_in_ms, i.timeout_ms) for i in fake.options.values()] == [(60_000, 5_000)] * 2
