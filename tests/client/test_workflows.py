"""Workflows (issue 27, wqclient.workflow): chains, groups and chords of signatures, each submitted
as one batch, and their handles.

What each builds (the batch's items, naming earlier items by index) is checked without a broker;
how they run is checked with a real Worker, first on the fake transport (with its fake clock, for
time-outs), then against a real broker on port 0 over HTTP and over gRPC, with the asyncio client
and the blocking one.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fake_clock import FakeClock
from tests.fake_transport import FakeStreamingTransport, FakeTransport
from tests.helpers import running_broker
from wqbroker.broker import Broker
from wqclient import (
    AsyncChainHandle,
    AsyncClient,
    AsyncGroupHandle,
    AsyncTaskHandle,
    Chain,
    ChainHandle,
    Client,
    GroupHandle,
    InvalidArgument,
    NotFound,
    ResultTimeout,
    Signature,
    Task,
    TaskHandle,
    TaskNotSucceeded,
    chain,
    chord,
    group,
    signature,
)
from wqclient.worker import Worker

pytestmark = pytest.mark.timeout(60)


def shape(items: list[Any]) -> list[tuple[Any, tuple[Any, ...] | None]]:
    """Each item's payload and what it waits for."""
    return [(json.loads(item.payload_json), item.after) for item in items]


# -- what each builds -----------------------------------------------------------------------------


def test_a_chain_makes_each_step_wait_for_the_one_before() -> None:
    flow = chain("a", signature("b", queue="q", priority=9), "c")
    assert shape(flow.items()) == [("a", None), ("b", (0,)), ("c", (1,))]
    assert (flow.items()[1].queue, flow.items()[1].priority) == ("q", 9)


def test_a_group_waits_for_nothing_and_a_chord_waits_for_the_whole_group() -> None:
    assert shape(group("a", "b", "c").items()) == [("a", None), ("b", None), ("c", None)]
    assert shape(group(["a", "b"]).items()) == shape(group("a", "b").items())
    assert shape(group(signature(n) for n in range(2)).items()) == [(0, None), (1, None)]
    flow = chord([{"n": n} for n in range(3)], signature("sum", result_ttl_ms=10))
    assert shape(flow.items()) == [
        ({"n": 0}, None),
        ({"n": 1}, None),
        ({"n": 2}, None),
        ("sum", (0, 1, 2)),
    ]
    assert flow.items()[3].result_ttl_ms == 10


def test_workflows_nest() -> None:
    flow = chain(
        "start",
        group(chain("a1", "a2"), "b"),
        chord(["x", "y"], "xy"),
        "end",
    )
    assert shape(flow.items()) == [
        ("start", None),
        ("a1", (0,)),
        ("a2", (1,)),
        ("b", (0,)),
        ("x", (2, 3)),  # the group before ends with a2 and b
        ("y", (2, 3)),
        ("xy", (4, 5)),
        ("end", (6,)),
    ]


def test_a_signature_carries_its_options_and_outside_parents() -> None:
    base = Signature({"op": "resize"}, queue="images", max_attempts=5, timeout_ms=60_000)
    urgent = base.set(priority=9, after=["f00d"], idempotency_key="k1")
    assert base.priority is None  # (set() made a copy)
    [item] = urgent.items()
    assert (item.queue, item.priority, item.max_attempts, item.timeout_ms) == (
        "images",
        9,
        5,
        60_000,
    )
    assert (item.after, item.idempotency_key) == (("f00d",), "k1")
    # In a chain, its outside parents come after those the chain gives it.
    assert chain("first", urgent).items()[1].after == (0, "f00d")


def test_a_list_is_a_payload_in_a_chain_and_members_in_a_group() -> None:
    assert shape(chain([1, 2]).items()) == [([1, 2], None)]
    assert shape(group([1, 2]).items()) == [(1, None), (2, None)]
    assert shape(group(signature([1, 2])).items()) == [([1, 2], None)]


def test_empty_workflows_are_refused() -> None:
    with pytest.raises(InvalidArgument):
        chain()
    with pytest.raises(InvalidArgument):
        group([])
    with pytest.raises(InvalidArgument):
        chord([], "callback")
    with pytest.raises(InvalidArgument):
        signature("x", after=[0]).items()  # (an index only names an item of the same batch)


# A workflow drawn at random: signatures, chains and groups nested up to a few levels.
workflows = st.recursive(
    st.integers(0, 999).map(lambda n: signature({"n": n})),
    lambda inner: st.one_of(
        st.lists(inner, min_size=1, max_size=4).map(lambda steps: chain(*steps)),
        st.lists(inner, min_size=1, max_size=4).map(group),
    ),
    max_leaves=20,
)


def _depends(items: list[Any]) -> list[set[int]]:
    """For each item, every earlier item it waits for, directly or not."""
    out: list[set[int]] = []
    for item in items:
        direct = {ref for ref in item.after or () if isinstance(ref, int)}
        out.append(direct.union(*(out[i] for i in direct)))
    return out


def _spans(flow: Any, start: int = 0) -> tuple[range, list[tuple[Any, list[range]]]]:
    """The items a workflow makes (a range of the batch) and, for each chain or group in it,
    its range and its parts' ranges."""
    if isinstance(flow, Signature):
        return range(start, start + 1), []
    parts: list[range] = []
    found: list[tuple[Any, list[range]]] = []
    at = start
    for part in flow.steps if isinstance(flow, Chain) else flow.members:
        span, inner = _spans(part, at)
        parts.append(span)
        found.extend(inner)
        at = span.stop
    found.append((flow, parts))
    return range(start, at), found


@given(workflows)
def test_any_workflow_is_one_valid_batch_that_keeps_its_order(flow: Any) -> None:
    items = flow.items()
    for i, item in enumerate(items):  # an index only ever names an earlier item
        assert all(0 <= ref < i for ref in item.after or ())
    depends = _depends(items)
    whole, nested = _spans(flow)
    assert len(whole) == len(items)
    for node, parts in nested:
        for k, later in enumerate(parts):
            for earlier in parts[:k]:
                for j in later:
                    if isinstance(node, Chain):  # a step runs after all of every step before
                        assert set(earlier) <= depends[j]
                    else:  # a group's members wait for none of each other
                        assert not set(earlier) & depends[j]


# -- run by a Worker, on the fake transport -------------------------------------------------------


async def compute(task: Task) -> Any:
    """The handler of every test here: ``{"n": N}`` returns N, ``{"add": K}`` the sum of its
    parents' results (those it has) plus K, ``{"fail": why}`` raises, ``{"none": true}``
    returns None."""
    payload = task.payload
    if "n" in payload:
        return payload["n"]
    if "fail" in payload:
        raise RuntimeError(payload["fail"])
    if "none" in payload:
        return None
    return sum(p.result or 0 for p in task.parents or ()) + payload["add"]


@asynccontextmanager
async def working(client: AsyncClient, handler: Callable[[Task], Any]) -> AsyncIterator[Worker]:
    worker = Worker(client, handler, concurrency=4)
    run = asyncio.ensure_future(worker.run())
    try:
        yield worker
    finally:
        worker.stop()
        await asyncio.wait_for(run, 10)


@pytest.fixture(params=["unary", "stream"])
def fake(request: pytest.FixtureRequest) -> FakeTransport:
    return FakeStreamingTransport() if request.param == "stream" else FakeTransport()


async def test_a_chain_hands_each_result_to_the_next(fake: FakeTransport) -> None:
    async with AsyncClient(transport=fake) as wq, working(wq, compute):
        handle = await chain({"n": 1}, {"add": 10}, {"add": 100}).submit(wq)
        assert isinstance(handle, AsyncChainHandle)
        assert await handle.result(5) == 111
        assert [await step.result(5) for step in handle.steps] == [1, 11, 111]
    assert fake.calls_to("enqueue_many") == [None]  # one batch
    assert len(handle.ids) == 3


async def test_a_group_gives_every_result_in_order_and_a_chord_their_sum(
    fake: FakeTransport,
) -> None:
    async with AsyncClient(transport=fake) as wq, working(wq, compute):
        members = await group({"n": n} for n in (3, 1, 2)).submit(wq)
        assert isinstance(members, AsyncGroupHandle)
        assert await members.result(5) == [3, 1, 2]
        tally = await chord([{"n": n} for n in range(10)], {"add": 0}).submit(wq)
        assert await tally.result(5) == 45
        header = tally.steps[0]
        assert isinstance(header, AsyncGroupHandle)
        assert await header.result(5) == list(range(10))


async def test_a_step_that_fails_buries_the_rest_and_the_handle_says_why(
    fake: FakeTransport,
) -> None:
    async with AsyncClient(transport=fake) as wq, working(wq, compute):
        flow = chain({"n": 1}, signature({"fail": "no disk"}, max_attempts=1), {"add": 1})
        handle = await flow.submit(wq)
        with pytest.raises(TaskNotSucceeded) as failed:
            await handle.result(5)
        middle = handle.steps[1]
        assert isinstance(middle, AsyncTaskHandle)
    assert failed.value.state == "dead"
    assert failed.value.task_id == handle.ids[2]
    assert failed.value.last_error == f"parent {middle.id} is dead: RuntimeError: no disk"
    assert str(middle.id) in str(failed.value)


async def test_a_result_not_yet_there_is_a_time_out_on_the_clients_clock() -> None:
    clock = FakeClock()
    fake = FakeTransport(clock)
    async with AsyncClient(transport=fake, clock=clock) as wq:  # (no worker: nothing runs)
        handle = await chain({"n": 1}, {"add": 1}).submit(wq)
        waiting = asyncio.ensure_future(handle.result(45))
        await clock.sleeping()
        await clock.advance(30)
        await clock.sleeping()
        await clock.advance(15)
        with pytest.raises(ResultTimeout) as late:
            await waiting
    assert late.value.task_id == handle.ids[1]
    assert isinstance(late.value, TimeoutError)
    assert [wait for _, wait in fake.result_waits] == [30_000, 15_000]


async def test_a_step_that_returns_nothing_keeps_no_result(fake: FakeTransport) -> None:
    async with AsyncClient(transport=fake) as wq, working(wq, compute):
        handle = await chain({"none": True}, {"add": 5}).submit(wq)
        assert await handle.result(5) == 5  # (a parent without a result counts for nothing)
        first = handle.steps[0]
        assert isinstance(first, AsyncTaskHandle)
        with pytest.raises(NotFound):  # acked without a result before anyone waited: gone
            await first.result(0)


# -- against a real broker ------------------------------------------------------------------------


@pytest.fixture
async def broker() -> AsyncIterator[Broker]:
    async with running_broker() as b:
        yield b


@pytest.fixture(params=["http", "grpc"])
def url(request: pytest.FixtureRequest, broker: Broker) -> str:
    return broker.http_url if request.param == "http" else "grpc://" + broker.grpc_target


async def test_chain_group_and_chord_end_to_end(url: str) -> None:
    async with AsyncClient(url) as wq, working(wq, compute) as worker:
        steps = await chain({"n": 2}, {"add": 3}, {"add": 4}).submit(wq)
        fan = await group({"n": n} for n in range(5)).submit(wq)
        tally = await chord([{"n": n} for n in range(20)], {"add": 1000}).submit(wq)
        nested = await chain(
            {"n": 1}, group(chain({"add": 1}, {"add": 1}), {"add": 10}), {"add": 0}
        ).submit(wq)
        assert await steps.result(20) == 9
        assert await fan.result(20) == [0, 1, 2, 3, 4]
        assert await tally.result(20) == 1000 + sum(range(20))
        assert await nested.result(20) == (1 + 1 + 1) + (1 + 10)
        callback = await wq.get_task(tally.ids[-1])
        stats = await wq.stats()
    assert callback.state == "succeeded"
    assert callback.after == tuple(tally.ids[:-1])
    assert worker.failed == 0
    assert (stats.waiting, stats.ready, stats.handed_out) == (0, 0, 0)


async def test_a_failing_chord_member_buries_the_callback_end_to_end(url: str) -> None:
    async with AsyncClient(url) as wq, working(wq, compute):
        members = [{"n": 1}, signature({"fail": "bad shard"}, max_attempts=1), {"n": 3}]
        handle = await chord(members, {"add": 0}).submit(wq)
        with pytest.raises(TaskNotSucceeded) as failed:
            await handle.result(20)
        dead = await wq.dead_letters()
    assert failed.value.state == "dead"
    assert failed.value.last_error == (f"parent {handle.ids[1]} is dead: RuntimeError: bad shard")
    assert {t.id for t in dead} == {handle.ids[1], handle.ids[3]}


async def test_a_workflow_is_submitted_all_or_none_end_to_end(url: str) -> None:
    async with AsyncClient(url) as wq:
        flow = chain(
            {"n": 1}, signature({"add": 1}, priority=99)
        )  # (a priority the broker refuses)
        with pytest.raises(InvalidArgument) as refused:
            await flow.submit(wq)
        stats = await wq.stats()
    assert "tasks[1].priority" in refused.value.message
    assert stats.totals.enqueued == 0


def run_blocking(url: str) -> tuple[Any, Any, list[Any]]:
    """A workflow from the blocking client (run in a thread: the broker serves this loop)."""
    with Client(url) as wq:
        steps = chain({"n": 5}, {"add": 5}).submit(wq)
        fan = group({"n": 1}, {"n": 2}).submit(wq)
        tally = chord([{"n": 4}, {"n": 6}], {"add": 0}).submit(wq)
        assert isinstance(steps, ChainHandle)
        assert isinstance(fan, GroupHandle)
        first = steps.steps[0]
        assert isinstance(first, TaskHandle)
        return steps.result(20), tally.result(20), [fan.result(20), first.wait(0)]


async def test_the_blocking_client_submits_and_waits_end_to_end(url: str) -> None:
    async with AsyncClient(url) as wq, working(wq, compute):
        chained, chorded, (grouped, first) = await asyncio.to_thread(run_blocking, url)
    assert (chained, chorded, grouped) == (10, 10, [1, 2])
    assert (first.state, first.result) == ("succeeded", 5)
