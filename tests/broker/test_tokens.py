"""Bearer tokens (``-token-file``): the file, the rules, and every route of both protocols with no
token, an unknown one, one without the scope and one with it, through raw HTTP and gRPC calls and
through wqclient and its Worker. (The commands, and SIGHUP on a real broker:
e2e/test_commands_with_tokens.py.)"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import aiohttp
import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2

from tests.authkit import (
    ALL_BUT,
    ONLY,
    ROOT,
    UNKNOWN,
    bearer,
    metadata,
    rewrite,
    write_token_file,
)
from tests.helpers import Http, running_broker, wait_until
from wqbroker.auth import (
    GRPC_RULES,
    HTTP_RULES,
    NO_TOKEN,
    SCOPES,
    UNLISTED,
    Access,
    Rule,
    TokenFileError,
    Tokens,
    describe_rule,
    grpc_rule,
    http_rule,
    parse_tokens,
)
from wqbroker.broker import Broker, StartupError
from wqbroker.errors import PermissionDenied, Unauthenticated
from wqbroker.grpc import reflection as grpc_reflection
from wqbroker.http import create_app
from wqclient import AsyncClient, Client, Worker
from wqclient import PermissionDenied as ClientPermissionDenied
from wqclient import Unauthenticated as ClientUnauthenticated
from wqclient import WqError as ClientWqError
from wqclient._http import HttpTransport
from wqclient.models import Task
from wqwire.pb import broker_pb2 as pb
from wqwire.pb import broker_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(60)

Code = grpc.StatusCode
TRANSPORTS = ["http", "grpc"]


# -- the token file -------------------------------------------------------------------------------


def test_a_token_file_gives_each_token_its_scopes() -> None:
    tokens = Tokens(
        parse_tokens(
            [
                "# comment",
                "",
                "   ",
                "  # indented comment",
                "p1 produce",
                "c1\tconsume , admin   # a comment after the scopes",
                "x#y produce,produce",
            ],
            "test",
        )
    )
    assert len(tokens) == 3
    tokens.check("Bearer p1", "produce", "x")
    tokens.check("Bearer c1", "consume", "x")
    tokens.check("Bearer c1", "admin", "x")
    tokens.check("Bearer x#y", "produce", "x")
    with pytest.raises(PermissionDenied):
        tokens.check("Bearer p1", "consume", "x")


@pytest.mark.parametrize(
    ("lines", "problem"),
    [
        (["ok produce", "s3cret-token-value"], "line 2: expected TOKEN SCOPE"),
        (["s3cret-token-value produce,delete"], "line 1: unknown scope 'delete'"),
        (["# x", "s3cret-token-value produce,"], "line 2: an empty scope"),
        (["s3cret-token-value ,produce"], "line 1: an empty scope"),
        (
            ["s3cret-token-value produce", "s3cret-token-value admin"],
            "line 2: the same token as line 1",
        ),
        (["s3cret-token-valué produce"], "line 1: a token must be printable ASCII"),
        (["s3cret-token-value\x07 produce"], "line 1: a token must be printable ASCII"),
        (["s3cret-token-value # produce"], "line 1: an empty scope"),
    ],
)
def test_a_bad_line_is_named_by_number_and_the_token_never_shown(
    lines: list[str], problem: str
) -> None:
    with pytest.raises(TokenFileError) as e:
        parse_tokens(lines, "token file t")
    message = str(e.value)
    assert message.startswith(f"token file t, {problem}"), message
    assert "s3cret" not in message
    assert "\n" not in message


def test_every_scope_of_the_table_is_accepted_in_the_file() -> None:
    # A new scope is one entry in SCOPES: the file takes it with no other change.
    tokens = Tokens(parse_tokens([f"t-{scope} {scope}" for scope in SCOPES], "test"))
    for scope in SCOPES:
        tokens.check(f"Bearer t-{scope}", scope, "x")


def test_tokens_are_kept_as_digests_only(tmp_path: Path) -> None:
    tokens = Tokens.load(str(write_token_file(tmp_path)))
    assert ROOT not in repr(tokens)
    assert all(len(key) == 32 and ROOT.encode() not in key for key in tokens._scopes)


def test_an_empty_token_file_refuses_everything_but_health(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write_token_file(tmp_path, "# nobody yet\n")
    with caplog.at_level(logging.WARNING, logger="wqbroker.auth"):
        tokens = Tokens.load(str(path))
    assert len(tokens) == 0
    assert "has no tokens" in caplog.text
    tokens.check(None, Access.OPEN, "GET /healthz")
    with pytest.raises(Unauthenticated):
        tokens.check(f"Bearer {ROOT}", Access.ANY, "GET /stats")


def test_an_unreadable_token_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(TokenFileError, match=r"^cannot read token file .*missing: No such file"):
        Tokens.load(str(tmp_path / "missing"))
    (tmp_path / "latin1").write_bytes(b"caf\xe9 produce\n")
    with pytest.raises(TokenFileError, match="is not UTF-8"):
        Tokens.load(str(tmp_path / "latin1"))


async def test_a_broker_with_a_bad_token_file_does_not_start(tmp_path: Path) -> None:
    path = write_token_file(tmp_path, "fine produce\nsecret-value producer\n")
    with pytest.raises(StartupError) as e:
        async with running_broker(token_file=str(path)):
            pass
    assert "line 2: unknown scope 'producer'" in str(e.value)
    assert "secret-value" not in str(e.value)


# -- checking a call ---------------------------------------------------------------------------


@pytest.fixture
def tokens(tmp_path: Path) -> Tokens:
    return Tokens.load(str(write_token_file(tmp_path)))


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        "Bearer",
        "Bearer ",
        f"Basic {ROOT}",
        ROOT,
        f"Bearer {UNKNOWN}",
        f"Bearer {ROOT[:-1]}",  # a prefix of a real token
        f"Bearer {ROOT}x",  # a real token and more
        f"Bearer {ROOT[:-1]}{'0' if ROOT[-1] != '0' else '1'}",  # all but the last character
        f"Bearer {ROOT.upper()}",  # tokens are case-sensitive
        f"Bearer {ROOT} {ROOT}",
        f"Bearer {ROOT}\x7f",
    ],
)
def test_anything_but_a_known_bearer_token_is_unauthenticated(
    tokens: Tokens, header: str | None
) -> None:
    with pytest.raises(Unauthenticated) as e:
        tokens.check(header, Access.ANY, "GET /stats")
    assert ROOT not in e.value.message
    assert ROOT.upper() not in e.value.message


@pytest.mark.parametrize("header", [f"Bearer {ROOT}", f"bearer {ROOT}", f"BEARER   {ROOT}  "])
def test_the_scheme_is_case_insensitive_and_spaces_around_the_token_do_not_count(
    tokens: Tokens, header: str
) -> None:
    tokens.check(header, "admin", "GET /dlq")


def test_scopes_do_not_imply_each_other(tokens: Tokens) -> None:
    for scope in SCOPES:
        tokens.check(f"Bearer {ONLY[scope]}", scope, "x")
        tokens.check(f"Bearer {ONLY[scope]}", Access.ANY, "x")
        with pytest.raises(PermissionDenied) as e:
            tokens.check(f"Bearer {ALL_BUT[scope]}", scope, "THE CALL")
        assert e.value.message == f"THE CALL needs a token with the {scope} scope"


def test_open_routes_need_nothing(tokens: Tokens) -> None:
    tokens.check(None, Access.OPEN, "GET /healthz")
    tokens.check("Bearer garbage", Access.OPEN, "GET /healthz")


async def test_reload_takes_the_new_file_and_a_bad_one_changes_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write_token_file(tmp_path, "first produce\n")
    tokens = Tokens.load(str(path))
    path.write_text("second produce\n")
    assert tokens.reload()
    tokens.check("Bearer second", "produce", "x")
    with pytest.raises(Unauthenticated):
        tokens.check("Bearer first", "produce", "x")
    path.write_text("third-secret produce\nbroken\n")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="wqbroker.auth"):
        assert not tokens.reload()
    (record,) = caplog.records
    assert record.levelno == logging.ERROR
    assert "line 2" in record.getMessage()
    assert "keeping the 1 tokens in use" in record.getMessage()
    assert "third-secret" not in record.getMessage()
    tokens.check("Bearer second", "produce", "x")
    path.unlink()
    assert not tokens.reload()
    tokens.check("Bearer second", "produce", "x")


# -- the rule tables ------------------------------------------------------------------------------


def _http_routes() -> set[str]:
    app = create_app(cast(Any, None))  # the routes only; no request is served
    return {
        f"{route.method} {route.resource.canonical}"
        for route in app.router.routes()
        if route.method != "HEAD" and route.resource is not None
    }


def _grpc_methods() -> set[str]:
    methods = set()
    for descriptor in (
        pb.DESCRIPTOR,
        health_pb2.DESCRIPTOR,
        reflection_pb2.DESCRIPTOR,
        grpc_reflection.V1_DESCRIPTOR,
    ):
        for service in descriptor.services_by_name.values():
            methods |= {f"/{service.full_name}/{m.name}" for m in service.methods}
    return methods


def test_every_http_route_has_a_rule_and_every_rule_a_route() -> None:
    routes = _http_routes()
    assert routes == set(HTTP_RULES)
    assert {r for r in routes if HTTP_RULES[r] is Access.OPEN} == set(NO_TOKEN.http)
    assert http_rule("HEAD", "/stats") is Access.ANY


def test_every_grpc_method_has_a_rule() -> None:
    methods = _grpc_methods()
    assert methods <= set(GRPC_RULES)
    assert set(GRPC_RULES) <= methods  # (no rule for a method not served: v1 reflection is)
    assert {m for m in methods if GRPC_RULES[m] is Access.OPEN} == set(NO_TOKEN.grpc)


def test_a_route_no_rule_names_is_for_admins_only() -> None:
    assert UNLISTED == "admin"
    assert http_rule("GET", "/something-new") == "admin"
    assert grpc_rule("/wq.v1.Broker/SomethingNew") == "admin"


# -- every HTTP route ---------------------------------------------------------------------------


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    return write_token_file(tmp_path)


@pytest.fixture
async def broker(token_file: Path) -> AsyncIterator[Broker]:
    async with running_broker(token_file=str(token_file)) as b:
        yield b


@pytest.fixture
async def root_http(broker: Broker) -> AsyncIterator[Http]:
    """An HTTP client holding every scope, to set the scene."""
    async with aiohttp.ClientSession(headers=bearer(ROOT)) as session:
        yield Http(session, broker.http_url)


@pytest.fixture
async def bare_http(broker: Broker) -> AsyncIterator[Http]:
    """An HTTP client that sends only the headers each request is given."""
    async with aiohttp.ClientSession() as session:
        yield Http(session, broker.http_url)


async def _held(http: Http) -> tuple[str, str]:
    """A task claimed by somebody: (id, lease_id)."""
    await http.enqueue({"held": True})
    delivery = await http.claim()
    return delivery["task"]["id"], delivery["lease_id"]


async def _dead(http: Http) -> str:
    """A task in the DLQ: its id."""
    await http.enqueue({"doomed": True}, max_attempts=1)
    delivery = await http.claim()
    assert await http.nack(delivery["task"]["id"], delivery["lease_id"], "no") == 204
    return str(delivery["task"]["id"])


@dataclass(frozen=True)
class HttpCall:
    method: str
    route: str  # as registered
    ok: int  # the status with a token that may make the call
    body: Any = None

    async def path(self, root: Http) -> str:
        """The concrete path, after setting the scene the call needs with ``root``."""
        if "{name}" in self.route:
            if self.route.startswith("/schedules/") and self.method != "PUT":
                # (docs/design/schedules.md: a schedule to read, pause, resume or delete)
                body = {"every_ms": 60_000, "payload": 1}
                assert (await root.request("PUT", "/schedules/mail", json=body))[0] == 200
            if self.route == "/queues/{name}/limits" and self.method == "DELETE":
                body = {"concurrency": 1}
                assert (await root.request("PUT", "/queues/mail/limits", json=body))[0] == 200
            if self.route in ("/queues/{name}", "/queues/{name}/empty"):
                # (a queue known and empty: emptied or deleted, either answers at once)
                assert (await root.request("POST", "/queues/known/pause"))[0] == 204
                return self.route.replace("{name}", "known")
            return self.route.replace("{name}", "mail")
        if "{id}" not in self.route:
            concrete = {
                "/jobs/next": "/jobs/next?wait_ms=0",
                "/jobs/next/batch": "/jobs/next/batch?wait_ms=0",
                "/ui/{file}": "/ui/app.js",
            }
            return concrete.get(self.route, self.route)
        if self.route.startswith("/dlq/"):
            return self.route.replace("{id}", await _dead(root))
        task_id, lease_id = await _held(root)
        return self.route.replace("{id}", task_id) + f"?lease_id={lease_id}"


HTTP_CALLS = [
    HttpCall("POST", "/jobs", 201, {"payload": {"line": "hi"}}),
    HttpCall("POST", "/jobs/batch", 201, {"tasks": [{"payload": 1}, {"payload": 2}]}),
    HttpCall("GET", "/jobs/next", 204),
    HttpCall("GET", "/jobs/next/batch", 204),
    HttpCall("POST", "/jobs/settle", 200, {"acks": []}),
    HttpCall("POST", "/jobs/{id}/ack", 204),
    HttpCall("POST", "/jobs/{id}/nack", 204, {"error": "bad"}),
    HttpCall("GET", "/stats", 200),
    HttpCall("POST", "/jobs/{id}/extend", 200),
    HttpCall("POST", "/jobs/{id}/release", 204),  # (an extension: a stopping worker's hand-back)
    HttpCall("GET", "/jobs/{id}", 200),
    HttpCall("GET", "/dlq", 200),
    HttpCall("POST", "/dlq/{id}/requeue", 204),
    HttpCall("POST", "/dlq/requeue", 200),
    HttpCall("DELETE", "/dlq/{id}", 204),
    HttpCall("GET", "/queues", 200),
    HttpCall("POST", "/queues/{name}/pause", 204),
    HttpCall("POST", "/queues/{name}/resume", 204),
    HttpCall("GET", "/healthz", 200),
    HttpCall("GET", "/readyz", 200),
    HttpCall("GET", "/metrics", 200),
    HttpCall("GET", "/ui", 200),
    HttpCall("GET", "/ui/", 200),
    HttpCall("GET", "/ui/{file}", 200),
    HttpCall("GET", "/openapi.json", 200),
    # control over tasks (docs/design/control.md)
    HttpCall("GET", "/jobs", 200),
    HttpCall("DELETE", "/jobs/{id}", 202),  # (a held task: cancelling)
    HttpCall("POST", "/queues/{name}/empty", 200),
    HttpCall("DELETE", "/queues/{name}", 204),
    # results (docs/design/results.md): a held task's result, still pending
    HttpCall("GET", "/jobs/{id}/result", 204),
    # schedules and limits (docs/design/schedules.md)
    HttpCall("GET", "/schedules", 200),
    HttpCall("PUT", "/schedules/{name}", 200, {"every_ms": 60_000, "payload": {"n": 1}}),
    HttpCall("GET", "/schedules/{name}", 200),
    HttpCall("DELETE", "/schedules/{name}", 204),
    HttpCall("POST", "/schedules/{name}/pause", 200),
    HttpCall("POST", "/schedules/{name}/resume", 200),
    HttpCall("PUT", "/queues/{name}/limits", 200, {"concurrency": 2}),
    HttpCall("DELETE", "/queues/{name}/limits", 204),
]


def test_the_extension_routes_have_the_scopes_of_their_kin() -> None:
    # Extending a lease is settling business (as ack/nack); bulk DLQ operations and pausing are
    # the admin's; a lookup and the list of queues are open to any token (as /stats).
    assert HTTP_RULES["POST /jobs/{id}/extend"] == HTTP_RULES["POST /jobs/{id}/ack"] == "consume"
    assert HTTP_RULES["POST /jobs/{id}/release"] == HTTP_RULES["POST /jobs/{id}/nack"]
    for route in (
        "POST /dlq/requeue",
        "DELETE /dlq/{id}",
        "POST /queues/{name}/pause",
        "POST /queues/{name}/resume",
    ):
        assert HTTP_RULES[route] == "admin", route
    for route in ("GET /jobs/{id}", "GET /queues", "GET /jobs/{id}/result"):
        assert HTTP_RULES[route] is Access.ANY, route


def test_control_over_tasks_is_the_admin_s_and_listing_a_worker_s_too() -> None:
    # docs/design/control.md: cancel, empty and delete need admin; listing consume or admin.
    for route in ("DELETE /jobs/{id}", "POST /queues/{name}/empty", "DELETE /queues/{name}"):
        assert HTTP_RULES[route] == "admin", route
    assert HTTP_RULES["GET /jobs"] == ("consume", "admin")
    for method in ("CancelTask", "EmptyQueue", "DeleteQueue"):
        assert GRPC_RULES[f"/wq.v1.Broker/{method}"] == "admin", method
    assert GRPC_RULES["/wq.v1.Broker/ListTasks"] == ("consume", "admin")
    assert describe_rule(("consume", "admin")) == "the consume or admin scope"


def test_schedules_are_read_with_any_token_and_changed_with_admin() -> None:
    # docs/design/schedules.md: reading schedules as reading the queues; changing schedules and
    # a queue's limits, the admin's.
    for route in ("GET /schedules", "GET /schedules/{name}"):
        assert HTTP_RULES[route] is Access.ANY is HTTP_RULES["GET /queues"], route
    for route in (
        "PUT /schedules/{name}",
        "DELETE /schedules/{name}",
        "POST /schedules/{name}/pause",
        "POST /schedules/{name}/resume",
        "PUT /queues/{name}/limits",
        "DELETE /queues/{name}/limits",
    ):
        assert HTTP_RULES[route] == "admin", route


def test_a_route_under_several_scopes_is_opened_by_any_of_them() -> None:
    tokens = Tokens(parse_tokens(["c consume", "a admin", "p produce,metrics"], "test"))
    for token in ("c", "a"):
        tokens.check(f"Bearer {token}", ("consume", "admin"), "GET /jobs")
    with pytest.raises(PermissionDenied) as e:
        tokens.check("Bearer p", ("consume", "admin"), "GET /jobs")
    assert e.value.message == "GET /jobs needs a token with the consume or admin scope"


def test_the_http_calls_cover_every_route() -> None:
    assert {f"{c.method} {c.route}" for c in HTTP_CALLS} == _http_routes()


async def _refused_http(
    http: Http, call: HttpCall, path: str, token: str | None, status: int
) -> None:
    headers = bearer(token) if token is not None else {}
    got, body = await http.request(call.method, path, json=call.body, headers=headers)
    assert got == status, (token, body)
    assert isinstance(body, dict)
    assert isinstance(body["error"], str)
    assert body["error"]
    assert ROOT not in body["error"]


@pytest.mark.parametrize("call", HTTP_CALLS, ids=lambda c: f"{c.method} {c.route}")
async def test_every_http_route_without_and_with_the_right_token(
    broker: Broker, root_http: Http, bare_http: Http, call: HttpCall
) -> None:
    path = await call.path(root_http)
    rule = HTTP_RULES[f"{call.method} {call.route}"]
    if rule is Access.OPEN:
        for headers in ({}, bearer(UNKNOWN), bearer(ONLY["produce"])):
            assert (await bare_http.request(call.method, path, headers=headers))[0] == call.ok
        return
    before = (await broker.service.stats()).as_dict()
    # No token, a token nobody knows, a malformed header: 401 with WWW-Authenticate: Bearer.
    for header in (None, f"Bearer {UNKNOWN}", f"Basic {ROOT}"):
        headers = {"Authorization": header} if header is not None else {}
        async with bare_http.session.request(
            call.method, bare_http.base + path, json=call.body, headers=headers
        ) as resp:
            assert resp.status == 401, header
            assert resp.headers["WWW-Authenticate"].startswith("Bearer")
            assert resp.content_type == "application/json"
            assert (await resp.json())["error"]
    if isinstance(rule, str):
        # Every scope but the one needed: 403.
        await _refused_http(bare_http, call, path, ALL_BUT[rule], 403)
        allowed = [ONLY[rule]]
    elif isinstance(rule, tuple):
        # Several scopes open it, any one of them: each other scope alone is refused.
        for scope in set(SCOPES) - set(rule):
            await _refused_http(bare_http, call, path, ONLY[scope], 403)
        allowed = [ONLY[scope] for scope in rule]
    else:
        allowed = [ONLY["produce"]]  # any token will do
    # A refused call changed nothing.
    assert (await broker.service.stats()).as_dict() == before
    for token in allowed:
        got, body = await bare_http.request(
            call.method, path, json=call.body, headers=bearer(token)
        )
        assert got == call.ok, body


async def test_a_refused_long_poll_never_parks(broker: Broker, bare_http: Http) -> None:
    # Answered at once (a parked poll would hold this test for 30 s), and nobody waits.
    status, _ = await bare_http.request(
        "GET", "/jobs/next?wait_ms=30000", headers=bearer(ONLY["produce"])
    )
    assert status == 403
    assert broker.service.waiting == 0


async def test_unknown_paths_and_methods_answer_as_without_tokens(bare_http: Http) -> None:
    # Nothing is behind them: 404 and 405, token or not.
    assert (await bare_http.request("GET", "/nope"))[0] == 404
    status, body = await bare_http.request("DELETE", "/jobs")
    assert status == 405
    assert "not allowed" in body["error"]


async def test_two_authorization_headers_are_refused(bare_http: Http) -> None:
    headers = [("Authorization", f"Bearer {ROOT}"), ("Authorization", f"Bearer {ROOT}")]
    async with bare_http.session.get(bare_http.base + "/stats", headers=headers) as resp:
        assert resp.status == 401
        assert "more than one" in (await resp.json())["error"]


async def test_a_reload_applies_to_the_next_request_on_an_open_connection(
    broker: Broker, token_file: Path
) -> None:
    async with aiohttp.ClientSession(headers=bearer(ONLY["admin"])) as session:
        http = Http(session, broker.http_url)
        assert (await http.request("GET", "/dlq"))[0] == 200
        rewrite(token_file, f"{ROOT} admin\n")
        assert broker.tokens is not None
        assert broker.tokens.reload()
        assert (await http.request("GET", "/dlq"))[0] == 401  # same keep-alive connection


# -- every gRPC method --------------------------------------------------------------------------


@pytest.fixture
async def channel(broker: Broker) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(broker.grpc_target) as ch:
        yield ch


@pytest.fixture
def stub(channel: grpc.aio.Channel) -> pb_grpc.BrokerAsyncStub:
    return pb_grpc.BrokerStub(channel)


async def _held_pb(stub: pb_grpc.BrokerAsyncStub) -> tuple[str, str]:
    md = metadata(ROOT)
    await stub.Enqueue(pb.EnqueueRequest(payload=b'{"held":true}'), metadata=md)
    response = await stub.NextJob(pb.NextJobRequest(wait_ms=0), metadata=md)
    return response.delivery.task.id, response.delivery.lease_id


async def _dead_pb(stub: pb_grpc.BrokerAsyncStub) -> str:
    md = metadata(ROOT)
    await stub.Enqueue(pb.EnqueueRequest(payload=b"1", max_attempts=1), metadata=md)
    response = await stub.NextJob(pb.NextJobRequest(wait_ms=0), metadata=md)
    d = response.delivery
    await stub.Nack(pb.NackRequest(id=d.task.id, lease_id=d.lease_id), metadata=md)
    return d.task.id


async def _unary(
    stub: pb_grpc.BrokerAsyncStub,
    name: str,
    scene: Callable[[pb_grpc.BrokerAsyncStub], Awaitable[Any]],
) -> Callable[[Any], Awaitable[object]]:
    request = await scene(stub)
    method = getattr(stub, name)

    async def invoke(md: Any) -> object:
        return await method(request, metadata=md)

    return invoke


async def _stream(stub: pb_grpc.BrokerAsyncStub) -> Callable[[Any], Awaitable[object]]:
    async def invoke(md: Any) -> object:
        call = stub.StreamJobs(None, metadata=md)
        await call.write(pb.StreamJobsRequest(open=pb.StreamOpen(prefetch=1)))
        response = await asyncio.wait_for(call.read(), 5)
        call.cancel()
        return response

    return invoke


async def _produce(stub: pb_grpc.BrokerAsyncStub) -> Callable[[Any], Awaitable[object]]:
    async def invoke(md: Any) -> object:
        call: Any = stub.Produce(None, metadata=md)
        await call.write(pb.EnqueueBatchRequest(tasks=[pb.EnqueueRequest(payload=b"1")]))
        response = await asyncio.wait_for(call.read(), 5)
        assert response.code == 0, response
        assert len(response.ids) == 1
        await call.done_writing()
        assert await asyncio.wait_for(call.read(), 5) is grpc.aio.EOF  # type: ignore[attr-defined]
        return response

    return invoke


async def _nothing(stub: pb_grpc.BrokerAsyncStub) -> None:
    return None


def _const(request: Any) -> Callable[[pb_grpc.BrokerAsyncStub], Awaitable[Any]]:
    async def scene(stub: pb_grpc.BrokerAsyncStub) -> Any:
        return request

    return scene


async def _ack_request(stub: pb_grpc.BrokerAsyncStub) -> pb.AckRequest:
    task_id, lease_id = await _held_pb(stub)
    return pb.AckRequest(id=task_id, lease_id=lease_id)


async def _nack_request(stub: pb_grpc.BrokerAsyncStub) -> pb.NackRequest:
    task_id, lease_id = await _held_pb(stub)
    return pb.NackRequest(id=task_id, lease_id=lease_id, error="bad")


async def _next_with_acks(stub: pb_grpc.BrokerAsyncStub) -> pb.NextJobRequest:
    task_id, lease_id = await _held_pb(stub)
    return pb.NextJobRequest(wait_ms=0, acks=[pb.AckRequest(id=task_id, lease_id=lease_id)])


async def _release_request(stub: pb_grpc.BrokerAsyncStub) -> pb.ReleaseRequest:
    task_id, lease_id = await _held_pb(stub)
    return pb.ReleaseRequest(id=task_id, lease_id=lease_id)


async def _requeue_request(stub: pb_grpc.BrokerAsyncStub) -> pb.RequeueRequest:
    return pb.RequeueRequest(id=await _dead_pb(stub))


async def _extend_request(stub: pb_grpc.BrokerAsyncStub) -> pb.ExtendLeaseRequest:
    task_id, lease_id = await _held_pb(stub)
    return pb.ExtendLeaseRequest(id=task_id, lease_id=lease_id, lease_ms=60_000)


async def _get_task_request(stub: pb_grpc.BrokerAsyncStub) -> pb.GetTaskRequest:
    response = await stub.Enqueue(pb.EnqueueRequest(payload=b"1"), metadata=metadata(ROOT))
    return pb.GetTaskRequest(id=response.id)


async def _wait_result_request(stub: pb_grpc.BrokerAsyncStub) -> pb.WaitResultRequest:
    response = await stub.Enqueue(pb.EnqueueRequest(payload=b"1"), metadata=metadata(ROOT))
    return pb.WaitResultRequest(id=response.id, wait_ms=0)


async def _purge_request(stub: pb_grpc.BrokerAsyncStub) -> pb.PurgeDeadRequest:
    return pb.PurgeDeadRequest(id=await _dead_pb(stub))


async def _cancel_request(stub: pb_grpc.BrokerAsyncStub) -> pb.CancelTaskRequest:
    response = await stub.Enqueue(pb.EnqueueRequest(payload=b"1"), metadata=metadata(ROOT))
    return pb.CancelTaskRequest(id=response.id)


async def _empty_queue_request(stub: pb_grpc.BrokerAsyncStub) -> pb.EmptyQueueRequest:
    await stub.PauseQueue(pb.PauseQueueRequest(queue="known"), metadata=metadata(ROOT))
    return pb.EmptyQueueRequest(queue="known")


async def _delete_queue_request(stub: pb_grpc.BrokerAsyncStub) -> pb.DeleteQueueRequest:
    await stub.PauseQueue(pb.PauseQueueRequest(queue="known"), metadata=metadata(ROOT))
    return pb.DeleteQueueRequest(queue="known")


def _scheduled(message: Callable[..., Any]) -> Callable[[pb_grpc.BrokerAsyncStub], Awaitable[Any]]:
    """A request naming a schedule that exists (put with every scope)."""

    async def scene(stub: pb_grpc.BrokerAsyncStub) -> Any:
        put = pb.PutScheduleRequest(name="s", every_ms=60_000, payload=b"1")
        await stub.PutSchedule(put, metadata=metadata(ROOT))
        return message(name="s")

    return scene


GRPC_CALLS: dict[str, Callable[[pb_grpc.BrokerAsyncStub], Awaitable[Any]]] = {
    "Enqueue": _const(pb.EnqueueRequest(payload=b"1")),
    "EnqueueBatch": _const(pb.EnqueueBatchRequest(tasks=[pb.EnqueueRequest(payload=b"1")])),
    "NextJob": _next_with_acks,
    "Ack": _ack_request,
    "Nack": _nack_request,
    "Stats": _const(pb.StatsRequest()),
    "ListDead": _const(pb.ListDeadRequest()),
    "Requeue": _requeue_request,
    "StreamJobs": _nothing,
    "ExtendLease": _extend_request,
    "Release": _release_request,
    "GetTask": _get_task_request,
    "ListQueues": _const(pb.ListQueuesRequest()),
    "PauseQueue": _const(pb.PauseQueueRequest(queue="q")),
    "ResumeQueue": _const(pb.ResumeQueueRequest(queue="q")),
    "RequeueAll": _const(pb.RequeueAllRequest()),
    "PurgeDead": _purge_request,
    "Produce": _nothing,
    "CancelTask": _cancel_request,
    "ListTasks": _const(pb.ListTasksRequest()),
    "EmptyQueue": _empty_queue_request,
    "DeleteQueue": _delete_queue_request,
    "WaitResult": _wait_result_request,
    # docs/design/schedules.md
    "PutSchedule": _const(pb.PutScheduleRequest(name="s", every_ms=60_000, payload=b"1")),
    "GetSchedule": _scheduled(pb.GetScheduleRequest),
    "ListSchedules": _const(pb.ListSchedulesRequest()),
    "DeleteSchedule": _scheduled(pb.DeleteScheduleRequest),
    "PauseSchedule": _scheduled(pb.PauseScheduleRequest),
    "ResumeSchedule": _scheduled(pb.ResumeScheduleRequest),
    "SetQueueLimits": _const(
        pb.SetQueueLimitsRequest(queue="q", limits=pb.QueueLimits(concurrency=2))
    ),
}


@pytest.mark.parametrize(
    ("name", "rule"),
    [
        ("ExtendLease", "consume"),
        ("Release", "consume"),  # a stopping worker's hand-back, as its nack
        ("GetTask", Access.ANY),
        ("ListQueues", Access.ANY),
        ("WaitResult", Access.ANY),  # a producer waits for what it enqueued
        ("PauseQueue", "admin"),
        ("ResumeQueue", "admin"),
        ("RequeueAll", "admin"),
        ("PurgeDead", "admin"),
        # docs/design/schedules.md: reading schedules is as reading the queues; changing them
        # and limits, the admin's.
        ("GetSchedule", Access.ANY),
        ("ListSchedules", Access.ANY),
        ("PutSchedule", "admin"),
        ("DeleteSchedule", "admin"),
        ("PauseSchedule", "admin"),
        ("ResumeSchedule", "admin"),
        ("SetQueueLimits", "admin"),
    ],
)
def test_the_rules_of_the_extension_grpc_methods(name: str, rule: Rule) -> None:
    # Each is explicitly named (none falls to UNLISTED): as ack; as stats; as the DLQ.
    assert f"/wq.v1.Broker/{name}" in GRPC_RULES
    assert grpc_rule(f"/wq.v1.Broker/{name}") == rule


def test_the_grpc_calls_cover_every_broker_method() -> None:
    names = {m.name for m in pb.DESCRIPTOR.services_by_name["Broker"].methods}
    assert set(GRPC_CALLS) == names


async def _code(invoke: Callable[[Any], Awaitable[object]], md: Any) -> tuple[Code, str]:
    try:
        await invoke(md)
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or ""
    return Code.OK, ""


@pytest.mark.parametrize("name", list(GRPC_CALLS))
async def test_every_grpc_method_without_and_with_the_right_token(
    broker: Broker, stub: pb_grpc.BrokerAsyncStub, name: str
) -> None:
    if name == "StreamJobs":
        invoke = await _stream(stub)
    elif name == "Produce":
        invoke = await _produce(stub)
    else:
        invoke = await _unary(stub, name, GRPC_CALLS[name])
    rule = GRPC_RULES[f"/wq.v1.Broker/{name}"]
    before = (await broker.service.stats()).as_dict()
    for md in (None, metadata(UNKNOWN), (("authorization", f"Basic {ROOT}"),)):
        code, details = await _code(invoke, md)
        assert code == Code.UNAUTHENTICATED, (md, details)
        assert details
    if isinstance(rule, str):
        code, details = await _code(invoke, metadata(ALL_BUT[rule]))
        assert code == Code.PERMISSION_DENIED, details
        assert rule in details
        allowed = [ONLY[rule]]
    elif isinstance(rule, tuple):
        for scope in set(SCOPES) - set(rule):
            code, details = await _code(invoke, metadata(ONLY[scope]))
            assert code == Code.PERMISSION_DENIED, details
            assert describe_rule(rule) in details
        allowed = [ONLY[scope] for scope in rule]
    else:
        allowed = [ONLY["consume"]]
    assert (await broker.service.stats()).as_dict() == before
    for token in allowed:
        assert await _code(invoke, metadata(token)) == (Code.OK, "")


async def test_next_job_with_acks_needs_consume(
    broker: Broker, stub: pb_grpc.BrokerAsyncStub
) -> None:
    assert GRPC_RULES["/wq.v1.Broker/NextJob"] == "consume"
    request = await _next_with_acks(stub)
    code, _ = await _code(
        lambda md: stub.NextJob(request, metadata=md), metadata(ALL_BUT["consume"])
    )
    assert code == Code.PERMISSION_DENIED
    assert (await broker.service.stats()).totals.acked == 0
    response = await stub.NextJob(request, metadata=metadata(ONLY["consume"]))
    assert [s.code for s in response.settled] == [0]


REFLECTION = {
    version: f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo"
    for version in ("v1", "v1alpha")
}


async def _reflect(
    channel: grpc.aio.Channel,
    version: str,
    request: reflection_pb2.ServerReflectionRequest,
    md: Any,
) -> reflection_pb2.ServerReflectionResponse:
    """One request to reflection ``version`` and its answer (v1 has v1alpha's messages under
    another package: the same bytes)."""
    method: Any = channel.stream_stream(  # (grpc-stubs: the request iterator is optional)
        REFLECTION[version],
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    call = method(metadata=md)
    await call.write(request)
    response: reflection_pb2.ServerReflectionResponse = await asyncio.wait_for(call.read(), 5)
    await call.done_writing()
    return response


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
async def test_health_and_reflection_are_open(channel: grpc.aio.Channel, version: str) -> None:
    """Without a token (or with one the broker does not know): the health check, and both
    versions of reflection, which generic tools (grpcurl) need to call it by name; reflection
    tells what the public .proto does, no more."""
    health = health_pb2_grpc.HealthStub(channel)
    for md in (None, metadata(UNKNOWN)):
        response = await health.Check(health_pb2.HealthCheckRequest(), metadata=md)
        assert response.status == health_pb2.HealthCheckResponse.SERVING
        watch = health.Watch(health_pb2.HealthCheckRequest(service="wq.v1.Broker"), metadata=md)
        first = await asyncio.wait_for(watch.read(), 5)
        assert first.status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()

        listed = await _reflect(
            channel, version, reflection_pb2.ServerReflectionRequest(list_services=""), md
        )
        names = {service.name for service in listed.list_services_response.service}
        assert names == {
            "wq.v1.Broker",
            "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection",
        }
        for symbol, file in (
            ("wq.v1.Broker", "wqwire/pb/broker.proto"),
            ("grpc.health.v1.Health", "grpc_health/v1/health.proto"),
            ("grpc.reflection.v1.ServerReflection", "grpc/reflection/v1/reflection.proto"),
        ):
            found = await _reflect(
                channel,
                version,
                reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol),
                md,
            )
            files = {
                descriptor_pb2.FileDescriptorProto.FromString(raw).name: raw
                for raw in found.file_descriptor_response.file_descriptor_proto
            }
            assert file in files, (symbol, list(files))
    # The rest of the API still needs a token.
    stub = pb_grpc.BrokerStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Stats(pb.StatsRequest())
    assert e.value.code() == Code.UNAUTHENTICATED


async def test_an_unknown_grpc_method_is_unimplemented_token_or_not(
    channel: grpc.aio.Channel,
) -> None:
    call = channel.unary_unary(
        "/wq.v1.Broker/Nope", request_serializer=None, response_deserializer=None
    )
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call(b"")
    assert e.value.code() == Code.UNIMPLEMENTED


async def test_two_authorization_entries_are_refused(stub: pb_grpc.BrokerAsyncStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Stats(pb.StatsRequest(), metadata=metadata(ROOT) * 2)
    assert e.value.code() == Code.UNAUTHENTICATED


async def test_a_stream_whose_token_is_removed_ends_at_its_next_message(
    broker: Broker, token_file: Path, stub: pb_grpc.BrokerAsyncStub
) -> None:
    call = stub.StreamJobs(None, metadata=metadata(ONLY["consume"]))
    await call.write(pb.StreamJobsRequest(open=pb.StreamOpen(prefetch=2)))
    await asyncio.wait_for(call.read(), 5)  # open accepted
    await stub.Enqueue(pb.EnqueueRequest(payload=b"1"), metadata=metadata(ROOT))
    response = await asyncio.wait_for(call.read(), 5)
    assert isinstance(response, pb.StreamJobsResponse)
    (delivery,) = response.deliveries
    rewrite(token_file, f"{ROOT} produce,consume,admin\n")
    assert broker.tokens is not None
    assert broker.tokens.reload()
    ack = pb.AckRequest(id=delivery.task.id, lease_id=delivery.lease_id)
    await call.write(pb.StreamJobsRequest(acks=[ack]))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await asyncio.wait_for(call.read(), 5)
    assert e.value.code() == Code.UNAUTHENTICATED
    # The ack was not applied; the stream's task went back (it is reclaimed at the stream's end).
    stats = await wait_until(
        broker.service.stats, lambda s: s.handed_out == 0, what="the task to be taken back"
    )
    assert stats.totals.acked == 0


# -- wqclient -----------------------------------------------------------------------------------


def url(broker: Broker, transport: str) -> str:
    return broker.http_url if transport == "http" else f"grpc://{broker.grpc_target}"


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_the_client_sends_its_token_on_every_call(broker: Broker, transport: str) -> None:
    async with AsyncClient(url(broker, transport), token=ROOT) as wq:
        ids = [await wq.enqueue({"n": 1}), *await wq.enqueue_many([{"n": 2}, {"n": 3}])]
        first = await wq.claim(wait_ms=0)
        assert first is not None
        await wq.ack(first)
        doomed = await wq.claim(wait_ms=0)
        assert doomed is not None
        await wq.nack(doomed, error="no")
        assert (await wq.stats()).totals.acked == 1
        assert await wq.dead_letters() == []
        if wq.can_stream:
            stream = await wq.stream(prefetch=1)
            delivery = await asyncio.wait_for(anext(stream), 5)
            await stream.ack(delivery, confirm=True)
            await stream.close()
        assert len(ids) == 3


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_the_client_raises_unauthenticated_and_permission_denied(
    broker: Broker, transport: str
) -> None:
    async with AsyncClient(url(broker, transport)) as wq:
        with pytest.raises(ClientUnauthenticated):
            await wq.enqueue(1)
        with pytest.raises(ClientUnauthenticated):
            await wq.stats()
    async with AsyncClient(url(broker, transport), token=UNKNOWN) as wq:
        with pytest.raises(ClientUnauthenticated):
            await wq.claim(wait_ms=0)
    async with AsyncClient(url(broker, transport), token=ONLY["produce"]) as wq:
        await wq.enqueue(1)
        await wq.stats()
        with pytest.raises(ClientPermissionDenied) as e:
            await wq.claim(wait_ms=0)
        assert "consume" in e.value.message
        with pytest.raises(ClientPermissionDenied):
            await wq.dead_letters()
        with pytest.raises(ClientPermissionDenied):
            await wq.requeue("x")
        if wq.can_stream:
            with pytest.raises(ClientPermissionDenied):
                await wq.stream()


async def test_the_http_transport_is_refused_the_extension_calls_its_token_lacks(
    broker: Broker,
) -> None:
    root = HttpTransport(broker.http_url, token=ROOT)
    producer = HttpTransport(broker.http_url, token=ONLY["produce"])
    try:
        task_id = await producer.enqueue(b"1", 1, None, queue="q", idempotency_key="k")
        assert (await producer.get_task(task_id)).state == "ready"  # any token
        assert [q.name for q in await producer.queues()] == ["q"]
        delivery = await root.claim(0, None, ["q"])
        assert delivery is not None
        with pytest.raises(ClientPermissionDenied, match="consume"):
            await producer.extend(task_id, delivery.lease_id, None)
        await root.nack(task_id, delivery.lease_id, None, terminal=True)
        for call in (
            producer.requeue_all(),
            producer.purge(task_id),
            producer.pause("q"),
            producer.resume("q"),
        ):
            with pytest.raises(ClientPermissionDenied, match="admin"):
                await call
        assert (await root.get_task(task_id)).state == "dead"
        await root.purge(task_id)
    finally:
        await root.close()
        await producer.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_the_client_takes_its_token_from_wq_token(
    broker: Broker, transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WQ_TOKEN", ONLY["produce"])
    async with AsyncClient(url(broker, transport)) as wq:
        await wq.enqueue(1)
    async with AsyncClient(url(broker, transport), token="") as wq:  # "": no token, whatever env
        with pytest.raises(ClientUnauthenticated):
            await wq.enqueue(1)
    async with AsyncClient(url(broker, transport), token=ONLY["consume"]) as wq:  # arg wins
        with pytest.raises(ClientPermissionDenied):
            await wq.enqueue(1)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_the_blocking_client_takes_a_token(broker: Broker, transport: str) -> None:
    def scenario() -> None:
        with Client(url(broker, transport), token=ROOT) as wq:
            wq.enqueue({"a": 1})
            assert wq.stats().ready == 1
        with Client(url(broker, transport)) as wq, pytest.raises(ClientUnauthenticated):
            wq.stats()

    await asyncio.to_thread(scenario)


@pytest.mark.parametrize("token", ["has space", "new\nline", "ünïcode", "tab\tbed"])
def test_a_token_that_cannot_be_sent_is_refused_without_repeating_it(token: str) -> None:
    for url_ in ("http://127.0.0.1:1", "grpc://127.0.0.1:1"):
        with pytest.raises(ClientWqError) as e:
            AsyncClient(url_, token=token)
        assert token not in e.value.message


def test_token_and_ca_file_configure_a_transport_made_from_a_url() -> None:
    from tests.fake_transport import FakeTransport

    with pytest.raises(ClientWqError, match="token"):
        AsyncClient(transport=FakeTransport(), token="x")
    with pytest.raises(ClientWqError, match="ca_file"):
        AsyncClient(transport=FakeTransport(), ca_file="x")


# -- the Worker ---------------------------------------------------------------------------------


async def _noop(task: Task) -> None:
    return None


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(
    ("token", "error"),
    [
        (ONLY["produce"], ClientPermissionDenied),
        (UNKNOWN, ClientUnauthenticated),
        (None, ClientUnauthenticated),
    ],
)
async def test_a_refused_worker_says_so_once_and_stops(
    broker: Broker,
    transport: str,
    token: str | None,
    error: type[Exception],
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = AsyncClient(url(broker, transport), token=token)
    worker = Worker(client, _noop, concurrency=3, wait_ms=100)
    with caplog.at_level(logging.INFO, logger="wqclient.worker"):
        with pytest.raises(error):
            await asyncio.wait_for(worker.run(), 10)
    await client.close()
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    assert "refused this worker's token" in errors[0].getMessage()
    if token is not None:
        assert token not in caplog.text


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_worker_whose_token_is_removed_stops_at_its_next_call(
    broker: Broker, token_file: Path, transport: str
) -> None:
    done: list[str] = []

    async def handle(task: Task) -> None:
        done.append(task.id)

    client = AsyncClient(url(broker, transport), token=ONLY["consume"])
    worker = Worker(client, handle, concurrency=1, wait_ms=100)
    running = asyncio.ensure_future(worker.run())
    async with AsyncClient(url(broker, transport), token=ROOT) as root:
        await root.enqueue(1)
        await wait_until(root.stats, lambda s: s.totals.acked == 1, what="the first ack")
        rewrite(token_file, f"{ROOT} produce,consume,admin\n")
        assert broker.tokens is not None
        assert broker.tokens.reload()
        await root.enqueue(2)  # the stream pushes it (pushes are not calls); its ack is refused
        with pytest.raises(ClientUnauthenticated):
            await asyncio.wait_for(running, 10)
        await client.close()
        assert (await root.stats()).totals.acked == 1
