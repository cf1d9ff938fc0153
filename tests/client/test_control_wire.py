"""Task control (issue 26) on the wire, both transports, against scripted brokers: what the client
sends for cancel, listing, emptying and deleting queues, enqueue's new options and progress, and
what it makes of the answers docs/design/control.md specifies (the task view's new members, the
409 / FAILED_PRECONDITION refusals that are Cancelled, TimeLimitReached or Conflict, a stream's
cancels).

The brokers here answer exactly what the design says a broker answers, so these tests pin the
client to the contract whatever state the broker's side is in; the same calls against real
brokers are in client/test_control_end_to_end.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import grpc
import pytest
from aiohttp import web
from google.protobuf.timestamp_pb2 import Timestamp

from tests.helpers import wait_until
from wqclient import (
    AsyncClient,
    Cancelled,
    Client,
    Conflict,
    EnqueueItem,
    LeaseLost,
    NotFound,
    ProtocolError,
    TimeLimitReached,
)
from wqclient._grpc import GrpcStream, GrpcTransport
from wqclient.models import Delivery, Task
from wqclient.worker import Worker
from wqwire.pb import broker_pb2 as pb

pytestmark = pytest.mark.timeout(30)

CREATED = "2026-12-01T10:00:00.000000Z"
EXPIRES = "2026-12-01T11:00:00.000000Z"


def view(task_id: str = "t1", **members: Any) -> dict[str, Any]:
    """A task view as the HTTP API writes it (the new members only when given)."""
    return {
        "id": task_id,
        "payload": {"n": 1},
        "attempts": 1,
        "max_attempts": 3,
        "created_at": CREATED,
        "available_at": CREATED,
        "last_error": None,
        "queue": "default",
        "priority": 0,
        **members,
    }


# -- a scripted HTTP broker -----------------------------------------------------------------------


@dataclass
class Seen:
    method: str
    path: str
    query: dict[str, str]
    body: bytes
    headers: dict[str, str]


@dataclass
class HttpScript:
    """Answers by (method, path): (status, body text or JSON, or None for no body)."""

    answers: dict[tuple[str, str], tuple[int, Any]] = field(default_factory=dict)
    seen: list[Seen] = field(default_factory=list)
    custom: Callable[[web.Request], Awaitable[web.Response]] | None = None  # answers all

    def on(self, method: str, path: str, status: int, body: Any = None) -> None:
        self.answers[(method, path)] = (status, body)

    async def handle(self, request: web.Request) -> web.Response:
        if self.custom is not None:
            return await self.custom(request)
        body = await request.read()
        self.seen.append(
            Seen(request.method, request.path, dict(request.query), body, dict(request.headers))
        )
        status, answer = self.answers.get((request.method, request.path), (404, None))
        if answer is None:
            if status == 404:
                answer = {"error": f"{request.path} not found"}
            else:
                return web.Response(status=status)
        text = answer if isinstance(answer, str) else json.dumps(answer)
        return web.Response(status=status, text=text, content_type="application/json")

    def requests(self) -> list[tuple[str, str]]:
        return [(s.method, s.path) for s in self.seen]


@pytest.fixture
async def http() -> AsyncIterator[tuple[HttpScript, AsyncClient]]:
    script = HttpScript()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", script.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        async with AsyncClient(f"http://127.0.0.1:{runner.addresses[0][1]}") as client:
            yield script, client
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(
    ("before", "status", "answer", "expected"),
    [
        ("ready", 204, None, "cancelled"),
        ("delayed", 204, None, "cancelled"),
        ("dead", 204, None, "purged"),
        ("handed_out", 202, {"state": "cancelling"}, "cancelling"),
    ],
)
async def test_http_cancel_is_delete_jobs_id_and_says_what_it_did(
    http: tuple[HttpScript, AsyncClient], before: str, status: int, answer: Any, expected: str
) -> None:
    script, client = http
    script.on("GET", "/jobs/t1", 200, view(state=before))
    script.on("DELETE", "/jobs/t1", status, answer)
    assert await client.cancel("t1") == expected
    # (A 204 is the same for a cancelled task and a purged one: the lookup before tells.)
    assert script.requests() == [("GET", "/jobs/t1"), ("DELETE", "/jobs/t1")]


async def test_http_cancel_of_an_unknown_task_is_not_found(
    http: tuple[HttpScript, AsyncClient],
) -> None:
    script, client = http
    with pytest.raises(NotFound):
        await client.cancel("nope")
    with pytest.raises(NotFound):
        await client.cancel("next")  # (GET /jobs/next would claim a task)
    assert script.requests() == [("GET", "/jobs/nope")]


async def test_http_list_tasks_sends_its_query_and_reads_the_new_members(
    http: tuple[HttpScript, AsyncClient],
) -> None:
    script, client = http
    page_text = json.dumps(
        {
            "tasks": [
                view(
                    "t1",
                    state="handed_out",
                    expires_at=EXPIRES,
                    timeout_ms=5000,
                    cancelling=True,
                    progress={"done": 3},
                ),
                view("t2", state="handed_out"),
            ],
            "next_cursor": "WyJoYW5kZWRfb3V0IiwxXQ",
        }
    ).replace('{"done": 3}', '{"done": 3.10}')  # (kept byte for byte: not 3.1)
    script.on("GET", "/jobs", 200, page_text)
    page = await client.list_tasks("mail", "handed_out", limit=2, cursor="abc")
    assert script.seen[0].query == {
        "queue": "mail",
        "state": "handed_out",
        "limit": "2",
        "cursor": "abc",
    }
    assert [t.id for t in page] == ["t1", "t2"]
    assert len(page) == 2
    assert page.next_cursor == "WyJoYW5kZWRfb3V0IiwxXQ"
    first, second = page.tasks
    assert first.state == "handed_out"
    assert first.expires_at == datetime(2026, 12, 1, 11, 0, tzinfo=UTC)
    assert first.timeout_ms == 5000
    assert first.cancelling is True
    assert first.progress_json == b'{"done": 3.10}'
    assert first.progress_value == {"done": 3.1}
    assert first.payload == {"n": 1}
    assert (second.expires_at, second.timeout_ms, second.progress_json, second.cancelling) == (
        None,
        None,
        None,
        False,
    )


async def test_http_list_tasks_defaults_and_the_last_page(
    http: tuple[HttpScript, AsyncClient],
) -> None:
    script, client = http
    script.on("GET", "/jobs", 200, {"tasks": [], "next_cursor": None})
    page = await client.list_tasks()
    assert (page.tasks, page.next_cursor) == ([], None)
    assert script.seen[0].query == {"queue": "default", "state": "ready", "limit": "100"}


async def test_http_list_tasks_that_is_not_a_page_is_a_protocol_error(
    http: tuple[HttpScript, AsyncClient],
) -> None:
    script, client = http
    script.on("GET", "/jobs", 200, [view()])  # a broker of another kind: a bare list
    with pytest.raises(ProtocolError):
        await client.list_tasks()


async def test_http_iter_tasks_follows_the_cursors(http: tuple[HttpScript, AsyncClient]) -> None:
    script, client = http
    pages = {
        "": {"tasks": [view("t1", state="ready"), view("t2", state="ready")], "next_cursor": "c1"},
        "c1": {"tasks": [view("t3", state="ready")], "next_cursor": "c2"},
        "c2": {"tasks": [], "next_cursor": None},
    }

    async def paged(request: web.Request) -> web.Response:
        script.seen.append(Seen("GET", request.path, dict(request.query), b"", {}))
        return web.json_response(pages[request.query.get("cursor", "")])

    script.custom = paged
    ids = [t.id async for t in client.iter_tasks("q", limit=2)]
    assert ids == ["t1", "t2", "t3"]
    assert [s.query.get("cursor") for s in script.seen] == [None, "c1", "c2"]
    assert {s.query["queue"] for s in script.seen} == {"q"}


async def test_http_empty_and_delete_a_queue(http: tuple[HttpScript, AsyncClient]) -> None:
    script, client = http
    script.on("POST", "/queues/mail/empty", 200, {"cancelled": 7})
    script.on("DELETE", "/queues/mail", 204)
    script.on(
        "DELETE",
        "/queues/busy",
        409,
        {"error": "queue busy holds tasks: 1 ready, 0 handed out, 0 delayed, 2 dead"},
    )
    assert await client.empty_queue("mail") == 7
    await client.delete_queue("mail")
    assert script.requests()[-1] == ("DELETE", "/queues/mail")
    with pytest.raises(Conflict, match="1 ready, 0 handed out, 0 delayed, 2 dead") as refused:
        await client.delete_queue("busy")
    assert not isinstance(refused.value, LeaseLost)
    with pytest.raises(NotFound):
        await client.empty_queue("never")
    with pytest.raises(NotFound):
        await client.delete_queue("never")


async def test_http_extend_sends_progress_as_its_body(
    http: tuple[HttpScript, AsyncClient],
) -> None:
    script, client = http
    script.on("POST", "/jobs/t1/extend", 200, {"deadline": EXPIRES})
    deadline = await client.extend("t1", 5000, lease_id="L1", progress={"done": 1})
    assert deadline == datetime(2026, 12, 1, 11, 0, tzinfo=UTC)
    await client.extend("t1", lease_id="L1", progress=None)  # JSON null
    await client.extend("t1", lease_id="L1")  # no progress: no body, as before
    first, null, plain = script.seen
    assert first.query == {"lease_id": "L1", "lease_ms": "5000"}
    assert json.loads(first.body) == {"progress": {"done": 1}}
    assert null.body == b'{"progress":null}'
    assert plain.body == b""


@pytest.mark.parametrize(
    ("answer", "kind"),
    [
        ({"error": "task t1 was cancelled", "cancelled": True}, Cancelled),
        ({"error": "task t1 has reached its time limit of 5000 ms"}, TimeLimitReached),
        ({"error": "task t1 is held under another lease"}, LeaseLost),
    ],
)
async def test_http_a_refused_extension_says_why(
    http: tuple[HttpScript, AsyncClient], answer: dict[str, Any], kind: type[LeaseLost]
) -> None:
    script, client = http
    script.on("POST", "/jobs/t1/extend", 409, answer)
    with pytest.raises(LeaseLost) as refused:
        await client.extend("t1", lease_id="L1")
    assert type(refused.value) is kind
    assert refused.value.message == answer["error"]


async def test_http_enqueue_sends_the_new_options(http: tuple[HttpScript, AsyncClient]) -> None:
    script, client = http
    script.on("POST", "/jobs", 201, {"id": "t1"})
    script.on("POST", "/jobs/batch", 201, {"ids": ["t2", "t3"], "duplicates": [False, True]})
    await client.enqueue(
        {"n": 1}, expires_in_ms=60_000, timeout_ms=5_000, unique=True, idempotency_key="k"
    )
    ids = await client.enqueue_many(
        [EnqueueItem(b"1", idempotency_key="k2", unique=True, timeout_ms=9), 2],
        expires_in_ms=1_000,
        timeout_ms=3_000,
    )
    assert [(i, i.duplicate) for i in ids] == [("t2", False), ("t3", True)]
    one, batch = script.seen
    assert json.loads(one.body) == {
        "payload": {"n": 1},
        "expires_in_ms": 60000,
        "timeout_ms": 5000,
        "unique": True,
    }
    assert one.headers["Idempotency-Key"] == "k"
    assert json.loads(batch.body) == {
        "tasks": [
            {
                "payload": 1,
                "idempotency_key": "k2",
                "expires_in_ms": 1000,
                "timeout_ms": 9,
                "unique": True,
            },
            {"payload": 2, "expires_in_ms": 1000, "timeout_ms": 3000},
        ]
    }


async def test_http_an_enqueue_without_the_new_options_sends_none_of_them(
    http: tuple[HttpScript, AsyncClient],
) -> None:
    script, client = http
    script.on("POST", "/jobs", 201, {"id": "t1"})
    await client.enqueue({"n": 1}, queue="q")
    assert json.loads(script.seen[0].body) == {"payload": {"n": 1}, "queue": "q"}


async def test_http_stats_read_the_new_totals(http: tuple[HttpScript, AsyncClient]) -> None:
    script, client = http
    totals = {"enqueued": 9, "acked": 2, "purged": 1, "cancelled": 4, "expired": 2}
    script.on("GET", "/stats", 200, {"ready": 0, "totals": totals})
    stats = await client.stats()
    assert (stats.totals.cancelled, stats.totals.expired) == (4, 2)


async def test_http_a_lookup_shows_progress_and_cancelling(
    http: tuple[HttpScript, AsyncClient],
) -> None:
    script, client = http
    text = json.dumps(view(state="handed_out", cancelling=True, progress=[1, "x"]))
    script.on("GET", "/jobs/t1", 200, text)
    task = await client.get_task("t1")
    assert (task.state, task.cancelling, task.progress_value) == ("handed_out", True, [1, "x"])
    assert task.payload == {"n": 1}


# -- a scripted gRPC broker -----------------------------------------------------------------------


def ts(text: str) -> Timestamp:
    out = Timestamp()
    out.FromDatetime(datetime.fromisoformat(text))
    return out


def pb_task(task_id: str = "t1", **fields: Any) -> pb.Task:
    return pb.Task(
        id=task_id,
        payload=b'{"n":1}',
        attempts=1,
        max_attempts=3,
        created_at=ts(CREATED),
        available_at=ts(CREATED),
        queue="default",
        **fields,
    )


def pb_delivery(task_id: str, lease_id: str, **fields: Any) -> pb.Delivery:
    return pb.Delivery(task=pb_task(task_id, **fields), lease_id=lease_id, deadline=ts(EXPIRES))


Unary = Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[Any]]


@dataclass
class GrpcScript:
    """The methods a test scripts, and the requests they got."""

    unary: dict[str, tuple[type[Any], Unary]] = field(default_factory=dict)
    seen: list[Any] = field(default_factory=list)
    # StreamJobs: the responses to send after the open's empty one, and the outcomes of the
    # extends the stream sends (in order).
    pushed: list[pb.StreamJobsResponse] = field(default_factory=list)
    push_more: asyncio.Queue[pb.StreamJobsResponse] = field(default_factory=asyncio.Queue)
    extend_outcomes: list[pb.Settled] = field(default_factory=list)

    def on(self, name: str, request: type[Any], answer: Unary) -> None:
        self.unary[name] = (request, answer)

    def handlers(self) -> dict[str, grpc.RpcMethodHandler[Any, Any]]:
        table: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
        for name, (request, answer) in self.unary.items():
            table[name] = grpc.unary_unary_rpc_method_handler(
                self._recorded(answer),
                request_deserializer=request.FromString,
                response_serializer=lambda m: m.SerializeToString(),
            )
        table["StreamJobs"] = grpc.stream_stream_rpc_method_handler(
            self._stream_jobs,
            request_deserializer=pb.StreamJobsRequest.FromString,
            response_serializer=pb.StreamJobsResponse.SerializeToString,
        )
        table["Produce"] = grpc.stream_stream_rpc_method_handler(
            self._produce,
            request_deserializer=pb.EnqueueBatchRequest.FromString,
            response_serializer=pb.ProduceResponse.SerializeToString,
        )
        return table

    def _recorded(self, answer: Unary) -> Unary:
        async def call(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            self.seen.append(request)
            return await answer(request, context)

        return call

    async def _produce(
        self, requests: AsyncIterator[pb.EnqueueBatchRequest], context: Any
    ) -> AsyncIterator[pb.ProduceResponse]:
        async for batch in requests:
            self.seen.append(batch)
            yield pb.ProduceResponse(ids=[f"p{i}" for i in range(len(batch.tasks))])

    async def _stream_jobs(
        self, requests: AsyncIterator[pb.StreamJobsRequest], context: Any
    ) -> AsyncIterator[pb.StreamJobsResponse]:
        reading = requests.__aiter__()
        self.seen.append(await reading.__anext__())  # the open
        yield pb.StreamJobsResponse()
        for response in self.pushed:
            yield response
        outcomes = iter(self.extend_outcomes)
        more = asyncio.ensure_future(self.push_more.get())
        nxt = asyncio.ensure_future(reading.__anext__())
        try:
            while True:
                done, _ = await asyncio.wait({more, nxt}, return_when=asyncio.FIRST_COMPLETED)
                if more in done:
                    yield more.result()
                    more = asyncio.ensure_future(self.push_more.get())
                if nxt in done:
                    try:
                        request = nxt.result()
                    except StopAsyncIteration:
                        return
                    self.seen.append(request)
                    settled = [next(outcomes) for _ in request.extends]
                    settled += [pb.Settled(id=a.id, lease_id=a.lease_id) for a in request.acks]
                    settled += [
                        pb.Settled(id=n.id, lease_id=n.lease_id, nack=True) for n in request.nacks
                    ]
                    if settled:
                        yield pb.StreamJobsResponse(settled=settled)
                    if request.drain:
                        yield pb.StreamJobsResponse(drained=pb.Drained(unsettled=0))
                        return
                    nxt = asyncio.ensure_future(reading.__anext__())
        finally:
            more.cancel()
            nxt.cancel()


@asynccontextmanager
async def grpc_broker(script: GrpcScript) -> AsyncIterator[GrpcTransport]:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("wq.v1.Broker", script.handlers()),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    transport = GrpcTransport(f"127.0.0.1:{port}", timeout=5)
    try:
        yield transport
    finally:
        await transport.close()
        await server.stop(None)


def answer(message: Any) -> Unary:
    async def call(request: Any, context: Any) -> Any:
        return message

    return call


def refuse(code: grpc.StatusCode, details: str, **trailing: str) -> Unary:
    async def call(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        metadata = tuple((k.replace("_", "-"), v) for k, v in trailing.items())
        await context.abort(code, details, trailing_metadata=metadata)

    return call


@pytest.mark.parametrize("state", ["cancelled", "cancelling", "purged"])
async def test_grpc_cancel_task(state: str) -> None:
    script = GrpcScript()
    script.on("CancelTask", pb.CancelTaskRequest, answer(pb.CancelTaskResponse(state=state)))
    async with grpc_broker(script) as transport:
        client = AsyncClient(transport=transport)
        assert await client.cancel("t1") == state
    assert script.seen == [pb.CancelTaskRequest(id="t1")]


async def test_grpc_cancel_errors() -> None:
    script = GrpcScript()
    script.on("CancelTask", pb.CancelTaskRequest, refuse(grpc.StatusCode.NOT_FOUND, "no t9"))
    async with grpc_broker(script) as transport:
        with pytest.raises(NotFound, match="no t9"):
            await transport.cancel("t9")
    script = GrpcScript()
    script.on("CancelTask", pb.CancelTaskRequest, answer(pb.CancelTaskResponse(state="gone?")))
    async with grpc_broker(script) as transport:
        with pytest.raises(ProtocolError):
            await transport.cancel("t1")


async def test_grpc_list_tasks_sends_its_request_and_reads_the_new_fields() -> None:
    script = GrpcScript()
    rows = [
        pb.TaskInState(
            task=pb_task(
                "t1",
                expires_at=ts(EXPIRES),
                timeout_ms=5000,
                progress=b'{"done": 3.10}',
                cancelling=True,
            ),
            state="handed_out",
        ),
        pb.TaskInState(task=pb_task("t2"), state="handed_out"),
    ]
    script.on(
        "ListTasks",
        pb.ListTasksRequest,
        answer(pb.ListTasksResponse(tasks=rows, next_cursor="next")),
    )
    async with grpc_broker(script) as transport:
        page = await AsyncClient(transport=transport).list_tasks(
            "mail", "handed_out", limit=2, cursor="abc"
        )
    assert script.seen == [
        pb.ListTasksRequest(queue="mail", state="handed_out", limit=2, cursor="abc")
    ]
    assert page.next_cursor == "next"
    first, second = page.tasks
    assert (first.id, first.state, first.timeout_ms, first.cancelling) == (
        "t1",
        "handed_out",
        5000,
        True,
    )
    assert first.expires_at == datetime(2026, 12, 1, 11, 0, tzinfo=UTC)
    assert first.progress_json == b'{"done": 3.10}'
    assert (second.expires_at, second.timeout_ms, second.progress_json, second.cancelling) == (
        None,
        None,
        None,
        False,
    )


async def test_grpc_list_tasks_last_page_has_no_cursor() -> None:
    script = GrpcScript()
    script.on("ListTasks", pb.ListTasksRequest, answer(pb.ListTasksResponse()))
    async with grpc_broker(script) as transport:
        page = await transport.list_tasks(None, None, None, None)
    assert (page.tasks, page.next_cursor) == ([], None)
    assert script.seen == [pb.ListTasksRequest()]


async def test_grpc_empty_and_delete_a_queue() -> None:
    script = GrpcScript()
    script.on("EmptyQueue", pb.EmptyQueueRequest, answer(pb.EmptyQueueResponse(cancelled=7)))

    async def delete(request: pb.DeleteQueueRequest, context: Any) -> pb.DeleteQueueResponse:
        if request.queue == "busy":
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "queue busy holds tasks: 2 ready"
            )
        if request.queue == "never":
            await context.abort(grpc.StatusCode.NOT_FOUND, "queue never not found")
        return pb.DeleteQueueResponse()

    script.on("DeleteQueue", pb.DeleteQueueRequest, delete)
    async with grpc_broker(script) as transport:
        client = AsyncClient(transport=transport)
        assert await client.empty_queue("mail") == 7
        await client.delete_queue("mail")
        with pytest.raises(Conflict, match="2 ready") as refused:
            await client.delete_queue("busy")
        assert not isinstance(refused.value, LeaseLost)
        with pytest.raises(NotFound):
            await client.delete_queue("never")
    assert script.seen[0] == pb.EmptyQueueRequest(queue="mail")


async def test_grpc_extend_sends_progress() -> None:
    script = GrpcScript()
    script.on(
        "ExtendLease",
        pb.ExtendLeaseRequest,
        answer(pb.ExtendLeaseResponse(deadline=ts(EXPIRES))),
    )
    async with grpc_broker(script) as transport:
        client = AsyncClient(transport=transport)
        await client.extend("t1", 5000, lease_id="L1", progress={"done": 1})
        await client.extend("t1", lease_id="L1")
    assert script.seen == [
        pb.ExtendLeaseRequest(id="t1", lease_id="L1", lease_ms=5000, progress=b'{"done":1}'),
        pb.ExtendLeaseRequest(id="t1", lease_id="L1"),
    ]


@pytest.mark.parametrize(
    ("details", "trailing", "kind"),
    [
        ("task t1 was cancelled", {"wq_cancelled": "1"}, Cancelled),
        ("task t1 has reached its time limit of 5000 ms", {}, TimeLimitReached),
        ("task t1 is held under another lease", {}, LeaseLost),
    ],
)
async def test_grpc_a_refused_extension_says_why(
    details: str, trailing: dict[str, str], kind: type[LeaseLost]
) -> None:
    script = GrpcScript()
    script.on(
        "ExtendLease",
        pb.ExtendLeaseRequest,
        refuse(grpc.StatusCode.FAILED_PRECONDITION, details, **trailing),
    )
    async with grpc_broker(script) as transport:
        with pytest.raises(LeaseLost) as refused:
            await transport.extend("t1", "L1", None)
    assert type(refused.value) is kind
    assert refused.value.message == details


async def test_grpc_enqueue_sends_the_new_options_over_the_producing_stream() -> None:
    script = GrpcScript()
    async with grpc_broker(script) as transport:
        client = AsyncClient(transport=transport)
        await client.enqueue(
            1, expires_in_ms=60_000, timeout_ms=5_000, unique=True, idempotency_key="k"
        )
        await client.enqueue_many(
            [EnqueueItem(b"2", idempotency_key="k2", unique=True), 3], timeout_ms=7
        )
        await client.enqueue(4)
    one, batch, plain = script.seen
    assert list(one.tasks) == [
        pb.EnqueueRequest(
            payload=b"1", expires_in_ms=60000, timeout_ms=5000, unique=True, idempotency_key="k"
        )
    ]
    assert list(batch.tasks) == [
        pb.EnqueueRequest(payload=b"2", idempotency_key="k2", unique=True, timeout_ms=7),
        pb.EnqueueRequest(payload=b"3", timeout_ms=7),
    ]
    [task] = plain.tasks
    assert not task.HasField("expires_in_ms")
    assert not task.HasField("timeout_ms")
    assert task.unique is False


async def test_grpc_stats_read_the_new_totals() -> None:
    script = GrpcScript()
    stats = pb.StatsResponse(ready=1, totals=pb.Totals(enqueued=5, cancelled=3, expired=1))
    script.on("Stats", pb.StatsRequest, answer(stats))
    async with grpc_broker(script) as transport:
        got = await transport.stats()
    assert (got.totals.cancelled, got.totals.expired, got.totals.enqueued) == (3, 1, 5)


# -- the gRPC stream's cancels ------------------------------------------------------------------


async def opened(transport: GrpcTransport) -> GrpcStream:
    return await transport.stream(4, None)


async def test_a_streams_cancels_reach_its_callback_once_each_delivery_is_taken() -> None:
    script = GrpcScript()
    script.pushed = [
        pb.StreamJobsResponse(
            deliveries=[pb_delivery("t1", "L1"), pb_delivery("t2", "L2")],
            cancels=[pb.Cancel(id="t2", lease_id="L2")],
        )
    ]
    told: list[tuple[str, str]] = []
    async with grpc_broker(script) as transport:
        stream = await opened(transport)
        stream.on_cancel(lambda task_id, lease_id: told.append((task_id, lease_id)))
        first = await stream.__anext__()
        assert first.lease_id == "L1"
        for _ in range(20):
            await asyncio.sleep(0)
        assert told == []  # t2 not taken yet: its cancel waits for it
        second = await stream.__anext__()
        assert second.lease_id == "L2"
        assert told == []  # (told once the code that took it has run on)
        await asyncio.sleep(0)
        assert told == [("t2", "L2")]
        # A cancel of a delivery already taken is told as it comes.
        await script.push_more.put(
            pb.StreamJobsResponse(cancels=[pb.Cancel(id="t1", lease_id="L1")])
        )
        await wait_until(lambda: len(told) == 2, what="the second cancel")
        assert told[1] == ("t1", "L1")
        await stream.close()


async def test_a_streams_cancels_wait_for_take_cancels_without_a_callback() -> None:
    script = GrpcScript()
    script.pushed = [
        pb.StreamJobsResponse(deliveries=[pb_delivery("t1", "L1")]),
        pb.StreamJobsResponse(cancels=[pb.Cancel(id="t1", lease_id="L1")]),
    ]
    async with grpc_broker(script) as transport:
        stream = await opened(transport)
        await stream.__anext__()
        taken = await wait_until(stream.take_cancels, what="the cancel")
        assert taken == [("t1", "L1")]
        assert stream.take_cancels() == []
        # A callback set later gets none of those taken, and those still kept at once.
        await script.push_more.put(
            pb.StreamJobsResponse(cancels=[pb.Cancel(id="t1", lease_id="L1")])
        )
        await wait_until(lambda: stream._cancels, what="the kept cancel")
        told: list[tuple[str, str]] = []
        stream.on_cancel(lambda task_id, lease_id: told.append((task_id, lease_id)))
        assert told == [("t1", "L1")]
        await stream.close()


async def test_a_blocking_stream_hands_over_its_cancels() -> None:
    script = GrpcScript()
    script.pushed = [
        pb.StreamJobsResponse(
            deliveries=[pb_delivery("t1", "L1")], cancels=[pb.Cancel(id="t1", lease_id="L1")]
        )
    ]
    async with grpc_broker(script) as transport:
        address = transport._target

        def consume() -> list[tuple[str, str]]:
            with Client(f"grpc://{address}") as client:
                stream = client.stream(prefetch=1)
                delivery = next(stream)
                assert delivery.id == "t1"
                got: list[tuple[str, str]] = []
                for _ in range(200):
                    got = stream.take_cancels()
                    if got:
                        break
                    time.sleep(0.01)
                stream.close()
                return got

        assert await asyncio.to_thread(consume) == [("t1", "L1")]


@pytest.mark.parametrize(
    ("outcome", "kind"),
    [
        (
            pb.Settled(code=9, message="task t1 was cancelled", extend=True, cancelled=True),
            Cancelled,
        ),
        (
            pb.Settled(code=9, message="task t1 has reached its time limit of 5 ms", extend=True),
            TimeLimitReached,
        ),
        (pb.Settled(code=9, message="task t1 is held under another lease", extend=True), LeaseLost),
    ],
)
async def test_a_streams_refused_extension_says_why(
    outcome: pb.Settled, kind: type[LeaseLost]
) -> None:
    script = GrpcScript()
    script.pushed = [pb.StreamJobsResponse(deliveries=[pb_delivery("t1", "L1")])]
    outcome.id, outcome.lease_id = "t1", "L1"
    script.extend_outcomes = [outcome]
    async with grpc_broker(script) as transport:
        stream = await opened(transport)
        delivery = await stream.__anext__()
        with pytest.raises(LeaseLost) as refused:
            await stream.extend(delivery, 1000, progress=b'{"p":1}')
        assert type(refused.value) is kind
        await stream.close()
    [extend_request] = [r for r in script.seen if isinstance(r, pb.StreamJobsRequest) and r.extends]
    assert list(extend_request.extends) == [
        pb.ExtendLeaseRequest(id="t1", lease_id="L1", lease_ms=1000, progress=b'{"p":1}')
    ]


async def test_a_delivery_reads_the_new_task_fields() -> None:
    script = GrpcScript()
    script.pushed = [
        pb.StreamJobsResponse(
            deliveries=[pb_delivery("t1", "L1", timeout_ms=2500, expires_at=ts(EXPIRES))]
        )
    ]
    async with grpc_broker(script) as transport:
        stream = await opened(transport)
        delivery: Delivery = await stream.__anext__()
        await stream.close()
    task: Task = delivery.task
    assert (task.timeout_ms, task.expires_at) == (2500, datetime(2026, 12, 1, 11, 0, tzinfo=UTC))
    assert (task.progress_json, task.cancelling) == (None, False)


async def test_a_worker_on_a_grpc_stream_stops_the_handler_of_a_cancelled_task_and_nacks_it() -> (
    None
):
    script = GrpcScript()
    script.pushed = [pb.StreamJobsResponse(deliveries=[pb_delivery("t1", "L1")])]
    running = asyncio.Event()
    cancelled: list[str] = []

    async def handler(task: Task) -> None:
        running.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(task.id)
            raise

    def nacks() -> list[pb.NackRequest]:
        return [n for r in script.seen if isinstance(r, pb.StreamJobsRequest) for n in r.nacks]

    async with grpc_broker(script) as transport:
        client = AsyncClient(transport=transport)
        worker = Worker(client, handler, concurrency=1, prefetch=1)
        run = asyncio.ensure_future(worker.run())
        await asyncio.wait_for(running.wait(), 5)
        cancel = pb.Cancel(id="t1", lease_id="L1")
        await script.push_more.put(pb.StreamJobsResponse(cancels=[cancel]))
        await wait_until(nacks, what="the nack")
        worker.stop()
        await asyncio.wait_for(run, 10)
    assert cancelled == ["t1"]
    assert [(n.id, n.lease_id, n.error) for n in nacks()] == [("t1", "L1", "cancelled")]
    assert (worker.cancelled, worker.failed, worker.succeeded) == (1, 0, 0)
