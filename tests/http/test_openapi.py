"""``GET /openapi.json`` (``wqbroker/http/openapi.py``): the document names every route the app
registers and nothing else, is valid OpenAPI 3.1, is what the broker serves (without a token),
and a live broker answers as it says.

The live broker has a token file (so 401 and 403 are exercised too) and runs in a thread of its
own (the clients here block). Against it:

- Schemathesis, over every operation: its examples, coverage and fuzzing phases, valid and
  invalid requests (``MAX_EXAMPLES`` each, derandomized), the token with every scope. Checks: no
  5xx, every status documented, the content type, body schema and headers of every answer as
  documented, a valid request accepted, an invalid one refused, a wrong method 405 with
  ``Allow``, a request without the token 401. Long polls stay short: a claim's ``wait_ms`` is
  cut to a few milliseconds before it is sent (the document does not bound it: the broker
  clamps it to 30 s).
- What generated requests never reach (a task held, acked, nacked, dead, requeued, purged; a
  wrong lease; each kind of refusal; the dashboard's files), called with chosen values and each
  answer checked by the same checks.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import aiohttp
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings
from openapi_spec_validator import OpenAPIV31SpecValidator
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.authkit import ONLY, ROOT, write_token_file
from tests.helpers import examples, http_broker
from wqbroker.auth import Access, http_rule, scopes_of
from wqbroker.http import create_app
from wqbroker.http.openapi import DOCUMENT, build

pytestmark = pytest.mark.timeout(120)

Case = schemathesis.Case[schemathesis.APIOperation[Any, Any, Any, Any]]

METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")


def registered() -> set[str]:
    """``METHOD /path`` for every route of the app (paths as registered, ``{id}`` for patterns),
    without the ``HEAD`` aiohttp adds beside a ``GET``."""
    app = create_app(cast(Any, None))  # the routes only; no request is served
    routes: set[str] = set()
    for resource in app.router.resources():
        methods = {route.method for route in resource}
        if "GET" in methods:
            methods.discard("HEAD")
        routes |= {f"{method} {resource.canonical}" for method in methods}
    return routes


def documented() -> set[str]:
    return {
        f"{method.upper()} {path}"
        for path, item in DOCUMENT["paths"].items()
        for method in item
        if method in METHODS
    }


def test_every_route_is_documented_and_every_operation_is_a_route() -> None:
    routes, operations = registered(), documented()
    assert routes - operations == set(), "routes missing from wqbroker/http/openapi.py"
    assert operations - routes == set(), "documented operations the app does not serve"


def test_the_document_is_valid_openapi_3_1() -> None:
    assert DOCUMENT["openapi"].startswith("3.1.")
    errors = [e.message for e in OpenAPIV31SpecValidator(DOCUMENT).iter_errors()]
    assert errors == []


def test_every_operation_declares_its_token_rule() -> None:
    for operation in documented():
        method, path = operation.split(" ", 1)
        item = DOCUMENT["paths"][path][method.lower()]
        rule = http_rule(method, path)
        codes = set(item["responses"])
        if rule is Access.OPEN:
            assert item["security"] == [], operation
            assert not codes & {"401", "403"}, operation
        elif rule is Access.ANY:
            assert item["security"] == [{"bearer": []}], operation
            assert "401" in codes, operation
            assert "403" not in codes, operation
        else:
            # (a route several scopes open: each a requirement of its own, any one will do)
            assert item["security"] == [{"bearer": [s]} for s in scopes_of(rule)], operation
            assert {"401", "403"} <= codes, operation


def test_every_error_answer_is_the_error_shape() -> None:
    for operation in documented():
        method, path = operation.split(" ", 1)
        for code, answer in DOCUMENT["paths"][path][method.lower()]["responses"].items():
            if int(code) < 400 or path == "/healthz":
                continue
            if "$ref" in answer:
                name = answer["$ref"].rsplit("/", 1)[1]
                answer = DOCUMENT["components"]["responses"][name]
            schema = answer["content"]["application/json"]["schema"]
            assert schema == {"$ref": "#/components/schemas/Error"}, (operation, code)


async def test_it_is_served_without_a_token(tmp_path: Path) -> None:
    async with (
        http_broker(token_file=str(write_token_file(tmp_path))) as broker,
        aiohttp.ClientSession() as session,
    ):
        async with session.get(broker.http_url + "/openapi.json") as resp:
            assert resp.status == 200
            assert resp.content_type == "application/json"
            assert await resp.json() == DOCUMENT
        async with session.head(broker.http_url + "/openapi.json") as resp:
            assert resp.status == 200
        async with session.post(broker.http_url + "/openapi.json") as resp:
            assert resp.status == 405
            assert resp.headers["Allow"] == "GET,HEAD"


async def test_with_public_metrics_it_says_so(tmp_path: Path) -> None:
    public = build(metrics_public=True)
    assert public["paths"]["/metrics"]["get"]["security"] == []
    assert "401" not in public["paths"]["/metrics"]["get"]["responses"]
    assert DOCUMENT["paths"]["/metrics"]["get"]["security"] == [{"bearer": ["metrics"]}]
    async with (
        http_broker(token_file=str(write_token_file(tmp_path)), metrics_public=True) as broker,
        aiohttp.ClientSession() as session,
    ):
        async with session.get(broker.http_url + "/openapi.json") as resp:
            assert await resp.json() == public


# -- Schemathesis against a live broker ---------------------------------------------------------

MAX_EXAMPLES = examples(30)
MAX_BODY = 64 * 1024
WAIT_MS_AT_MOST = 20  # a claim's wait, as sent (the generated value is cut to this)


@contextmanager
def broker_in_a_thread(tmp_path: Path, **config: Any) -> Iterator[str]:
    """A real broker with a token file, in a thread with its own event loop (the clients here
    block); its base URL."""
    token_file = write_token_file(tmp_path)
    ready: list[str] = []
    started = threading.Event()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    async def serve() -> None:
        async with http_broker(token_file=str(token_file), **config) as broker:
            ready.append(broker.http_url)
            started.set()
            await stop.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    try:
        assert started.wait(30), "the broker did not start"
        yield ready[0]
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        loop.close()


@pytest.fixture(scope="module")
def live_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with broker_in_a_thread(tmp_path_factory.mktemp("tokens"), max_body=MAX_BODY) as url:
        yield url


# The document as the broker serves it (test_it_is_served_without_a_token checks that it is this
# very dict). Loaded here, at import, rather than from the live broker with a lazy fixture:
# Schemathesis's from_fixture needs pytest's Node._nodeid, which pytest 9.2 no longer has.
schema = schemathesis.openapi.from_dict(
    DOCUMENT,
    config=schemathesis.Config.from_dict(
        {
            "seed": 13,
            # (Unknown query parameters are ignored, as by most HTTP APIs: none is sent.)
            "generation": {
                "deterministic": True,
                "max-examples": MAX_EXAMPLES,
                "allow-extra-parameters": False,
            },
            # The token with every scope, as the scheme the document names (so a request
            # made without it on purpose goes without it, and must get 401).
            "auth": {"openapi": {"bearer": {"bearer": ROOT}}},
        }
    ),
)


def integers_as_integers(case: Case) -> None:
    """JSON Schema's integers include ``3.0``, which Schemathesis sends for them; the broker
    refuses it (as the document says in words): a body's integers are sent as integers."""
    if isinstance(case.body, dict):
        body = _integral(case.body)
        if isinstance(body.get("rate"), dict):  # (PUT /queues/{name}/limits)
            body["rate"] = _integral(body["rate"])
        # POST /jobs/batch: each task's too; POST /jobs/settle: each nack's.
        for name in ("tasks", "nacks"):
            items = body.get(name)
            if isinstance(items, list):
                body[name] = [_integral(t) if isinstance(t, dict) else t for t in items]
        case.body = body


def _integral(members: dict[str, Any]) -> dict[str, Any]:
    return {
        name: int(value) if isinstance(value, float) and value.is_integer() else value
        for name, value in members.items()
    }


# Concrete paths that a templated one would also match: the concrete one is another operation.
FIXED_WORDS = {"/jobs/{id}": ("next", "batch", "settle"), "/dlq/{id}": ("requeue",)}


def not_another_operation(case: Case) -> None:
    """``GET /jobs/{id}`` with the id ``next`` is ``GET /jobs/next`` (a claim), as OpenAPI matches
    a concrete path before a templated one: such an id is sent as another one."""
    words = FIXED_WORDS.get(case.operation.path, ())
    if case.path_parameters and case.path_parameters.get("id") in words:
        case.path_parameters = {**case.path_parameters, "id": case.path_parameters["id"] + "-"}


def bound_the_wait(case: Case) -> None:
    """A claim's or a result's long poll cut to a few milliseconds (default 20 s for a claim,
    generated up to any size)."""
    if case.operation.path not in ("/jobs/next", "/jobs/next/batch", "/jobs/{id}/result"):
        return
    query = dict(case.query or {})
    wait = query.get("wait_ms", 0)
    if isinstance(wait, str):  # as the broker reads it: spaces and a plus sign are fine
        text = wait.strip().removeprefix("+")
        if text.isascii() and text.isdigit():
            wait = int(text)
    if isinstance(wait, int) and not isinstance(wait, bool):
        query["wait_ms"] = min(wait, WAIT_MS_AT_MOST)
        case.query = query


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_the_broker_answers_as_documented(case: Case, live_broker: str) -> None:
    prepare(case)
    case.call_and_validate(base_url=live_broker, timeout=10)


def unique_with_a_key(case: Case) -> None:
    """``"unique": true`` takes an idempotency key, which POST /jobs takes in a header (a schema
    cannot make a body member need a header): such a body is sent with one."""
    if case.operation.path == "/jobs" and case.operation.method.lower() == "post":
        body = case.body
        if isinstance(body, dict) and body.get("unique") is True:
            if "Idempotency-Key" not in case.headers:  # (case-insensitive)
                case.headers["Idempotency-Key"] = "schemathesis-unique"


def cursors_the_broker_gave(case: Case) -> None:
    """A listing's ``cursor`` is one the broker gave (any other is refused, 400): a valid one
    generated is left out (cursors are tested in tests/http/test_control.py)."""
    if case.operation.path != "/jobs" or not case.query or case.query.get("cursor") in (None, ""):
        return
    meta = case.meta
    if meta is not None and meta.generation.mode.is_positive:
        case.query = {k: v for k, v in case.query.items() if k != "cursor"}


def parents_the_broker_knows(case: Case) -> None:
    """An ``after`` names live tasks (or, in a batch, earlier items): generated ones name none
    (refused, 400), so a valid one is left out of a valid body (workflows are tested in
    tests/http/test_results.py, and below)."""
    if case.operation.path not in ("/jobs", "/jobs/batch") or not isinstance(case.body, dict):
        return
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive:
        return
    body = {k: v for k, v in case.body.items() if k != "after"}
    tasks = body.get("tasks")
    if isinstance(tasks, list):
        body["tasks"] = [
            {k: v for k, v in t.items() if k != "after"} if isinstance(t, dict) else t
            for t in tasks
        ]
    case.body = body


def rules_that_parse(case: Case) -> None:
    """A schedule's ``cron`` parses and its ``timezone`` is an IANA name (a schema cannot say
    so): in a valid body, a generated one is replaced by one that does (the rules are tested in
    tests/http/test_schedules.py). A valid body's schedule is put paused: a live one would fire
    into the queues the other calls use."""
    if case.operation.path != "/schedules/{name}" or not isinstance(case.body, dict):
        return
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive:
        return
    body = dict(case.body)
    if isinstance(body.get("cron"), str):
        body["cron"] = "*/5 * * * *"
    if isinstance(body.get("timezone"), str):
        body["timezone"] = "Europe/Paris"
    body["paused"] = True
    case.body = body


def prepare(case: Case) -> None:
    integers_as_integers(case)
    not_another_operation(case)
    bound_the_wait(case)
    unique_with_a_key(case)
    cursors_the_broker_gave(case)
    parents_the_broker_knows(case)
    rules_that_parse(case)


# -- every answer a generated request never gets, checked against the document ------------------

CONFORMANCE = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]


class Api:
    """Calls one documented operation of a live broker with chosen values, checks the status and
    that the answer (status, content type, body, headers) is as the document says."""

    def __init__(self, base: str) -> None:
        self.base = base

    def __call__(
        self,
        method: str,
        path: str,
        status: int,
        *,
        token: str | None = ROOT,
        data: bytes | None = None,
        headers: dict[str, str] | None = None,
        **values: Any,
    ) -> Any:
        case = schema[path][method].Case(**values)
        sent = dict(headers or {})
        if token is not None:
            sent["Authorization"] = f"Bearer {token}"
        response: Any
        if data is None:
            response = case.call(base_url=self.base, headers=sent, timeout=10)
        else:
            url = self.base + path.format(**(values.get("path_parameters") or {}))
            response = requests.request(
                method, url, params=values.get("query"), data=data, headers=sent, timeout=10
            )
        assert response.status_code == status, (method, path, response.text)
        case.validate_response(response, checks=CONFORMANCE)
        try:
            return json.loads(response.text) if response.text else None
        except ValueError:  # (the metrics: text)
            return response.text


def test_a_task_s_life_answers_as_documented(live_broker: str) -> None:
    api = Api(live_broker)
    q: dict[str, Any] = {"queue": "openapi-life"}
    api("POST", "/queues/{name}/resume", 204, path_parameters={"name": q["queue"]})
    key = {"Idempotency-Key": "openapi-life-1"}
    body = {"payload": {"n": 1}, "max_attempts": 2, **q}
    task_id = api("POST", "/jobs", 201, body=body, headers=key)["id"]
    assert api("POST", "/jobs", 200, body=body, headers=key) == {"id": task_id, "duplicate": True}
    assert api("GET", "/jobs/{id}", 200, path_parameters={"id": task_id})["state"] == "ready"
    claim: dict[str, Any] = {"query": {**q, "wait_ms": 0}}
    held = api("GET", "/jobs/next", 200, **claim)
    lease = held["lease_id"]
    ids: dict[str, Any] = {"id": task_id}
    wrong: dict[str, Any] = {"path_parameters": ids, "query": {"lease_id": "not-" + lease}}
    right: dict[str, Any] = {"path_parameters": ids, "query": {"lease_id": lease}}
    api("POST", "/jobs/{id}/extend", 409, **wrong)
    api("POST", "/jobs/{id}/ack", 409, **wrong)
    api("POST", "/jobs/{id}/nack", 409, **wrong)
    api("POST", "/jobs/{id}/extend", 200, **right)
    api("POST", "/jobs/{id}/nack", 204, body={"error": "no", "terminal": True}, **right)
    api("POST", "/jobs/{id}/ack", 404, **right)
    assert [t["id"] for t in api("GET", "/dlq", 200, query=q)] == [task_id]
    api("POST", "/dlq/{id}/requeue", 204, path_parameters=ids)
    lease = api("GET", "/jobs/next", 200, **claim)["lease_id"]
    api("POST", "/jobs/{id}/nack", 204, path_parameters=ids, query={"lease_id": lease})
    api("GET", "/jobs/next", 204, **claim)  # delayed: the backoff
    assert api("GET", "/jobs/{id}", 200, path_parameters=ids)["state"] == "delayed"
    api("POST", "/dlq/requeue", 200, query=q)
    api("DELETE", "/dlq/{id}", 404, path_parameters=ids)
    other = api("POST", "/jobs", 201, body={"payload": None, **q})["id"]
    api("POST", "/queues/{name}/pause", 204, path_parameters={"name": q["queue"]})
    api("GET", "/jobs/next", 204, **claim)
    api("POST", "/queues/{name}/resume", 204, path_parameters={"name": q["queue"]})
    held = api("GET", "/jobs/next", 200, **claim)
    assert held["task"]["id"] == other
    other_ids: dict[str, Any] = {"path_parameters": {"id": other}}
    api("POST", "/jobs/{id}/ack", 204, query={"lease_id": held["lease_id"]}, **other_ids)
    api("GET", "/jobs/{id}", 404, **other_ids)
    assert api("GET", "/stats", 200, query=q)["totals"]["acked"] == 1
    assert q["queue"] in [row["name"] for row in api("GET", "/queues", 200)]
    api("GET", "/healthz", 200, token=None)
    api("GET", "/openapi.json", 200, token=None)
    api("GET", "/metrics", 200)


def test_control_over_tasks_answers_as_documented(live_broker: str) -> None:
    api = Api(live_broker)
    q: dict[str, Any] = {"queue": "openapi-control"}
    name: dict[str, Any] = {"path_parameters": {"name": q["queue"]}}
    api("POST", "/queues/{name}/empty", 404, **name)
    api("DELETE", "/queues/{name}", 404, **name)
    body = {"payload": 1, "expires_in_ms": 60_000, "timeout_ms": 60_000, **q}
    ids = [api("POST", "/jobs", 201, body=body)["id"] for _ in range(3)]
    page = api("GET", "/jobs", 200, query={**q, "limit": 2})
    assert [t["id"] for t in page["tasks"]] == ids[:2]
    rest = api("GET", "/jobs", 200, query={**q, "cursor": page["next_cursor"]})
    assert (rest["next_cursor"], len(rest["tasks"])) == (None, 1)
    api("GET", "/jobs", 400, query={**q, "cursor": "bm90LW91cnM"})
    api("GET", "/jobs", 400, query={**q, "state": "gone"})
    api("DELETE", "/queues/{name}", 409, **name)
    held = api("GET", "/jobs/next", 200, query={**q, "wait_ms": 0})
    task: dict[str, Any] = {"path_parameters": {"id": held["task"]["id"]}}
    lease = {"lease_id": held["lease_id"]}
    progress = {"progress": {"done": 1}}
    api("POST", "/jobs/{id}/extend", 200, query=lease, body=progress, **task)
    assert api("GET", "/jobs/{id}", 200, **task)["progress"] == {"done": 1}
    api("POST", "/jobs/{id}/extend", 400, query=lease, data=b"[1]", **task)
    assert api("GET", "/jobs", 200, query={**q, "state": "handed_out"})["tasks"][0]["progress"]
    assert api("DELETE", "/jobs/{id}", 202, **task) == {"state": "cancelling"}
    assert api("GET", "/jobs/{id}", 200, **task)["cancelling"] is True
    refused = api("POST", "/jobs/{id}/extend", 409, query=lease, **task)
    assert refused["cancelled"] is True
    api("POST", "/jobs/{id}/nack", 204, query=lease, **task)
    api("DELETE", "/jobs/{id}", 404, **task)
    api("DELETE", "/jobs/{id}", 204, path_parameters={"id": ids[1]})
    assert api("POST", "/queues/{name}/empty", 200, **name) == {"cancelled": 1}
    api("DELETE", "/queues/{name}", 204, **name)
    totals = api("GET", "/stats", 200, query=q)["totals"]
    assert (totals["cancelled"], totals["expired"]) == (0, 0)  # (the queue was forgotten)


def test_results_and_workflows_answer_as_documented(live_broker: str) -> None:
    api = Api(live_broker)
    q: dict[str, Any] = {"queue": "openapi-results"}
    tasks = [
        {"payload": 0, **q},
        {"payload": 1, "after": [0], "result_ttl_ms": 60_000, **q},
        {"payload": 2, "after": [0, 1], **q},
    ]
    first, second, third = api("POST", "/jobs/batch", 201, body={"tasks": tasks})["ids"]
    found = api("GET", "/jobs/{id}", 200, path_parameters={"id": first})
    assert (found["children"], found["children_count"]) == ([second, third], 2)
    waiting = api("GET", "/jobs/{id}", 200, path_parameters={"id": second})
    assert (waiting["state"], waiting["waiting_for"]) == ("waiting", 1)
    listed = api("GET", "/jobs", 200, query={**q, "state": "waiting"})
    assert [t["id"] for t in listed["tasks"]] == [second, third]
    result: dict[str, Any] = {"path_parameters": {"id": first}}
    api("GET", "/jobs/{id}/result", 204, query={"wait_ms": 0}, **result)
    api("GET", "/jobs/{id}/result", 400, query={"wait_ms": -1}, **result)
    api("GET", "/jobs/{id}/result", 404, path_parameters={"id": "ffffffffffffffff"})
    held = api("GET", "/jobs/next", 200, query={**q, "wait_ms": 0})
    lease: dict[str, Any] = {"lease_id": held["lease_id"]}
    api("POST", "/jobs/{id}/ack", 400, query=lease, data=b'{"result": NaN}', **result)
    api("POST", "/jobs/{id}/ack", 204, query=lease, body={"result": {"n": 1}}, **result)
    answer = api("GET", "/jobs/{id}/result", 200, **result)
    assert (answer["state"], answer["result"]) == ("succeeded", {"n": 1})
    assert api("GET", "/jobs/{id}", 200, **result)["state"] == "succeeded"
    listed = api("GET", "/jobs", 200, query={**q, "state": "succeeded"})
    assert [t["id"] for t in listed["tasks"]] == [first]
    child = api("GET", "/jobs/next", 200, query={**q, "wait_ms": 0})
    assert child["parents"] == [{"id": first, "result": {"n": 1}}]
    body = {"acks": [{"id": second, "lease_id": child["lease_id"], "result": None}]}
    assert api("POST", "/jobs/settle", 200, body=body) == {"acks": [None], "nacks": []}
    last = api("GET", "/jobs/next", 200, query={**q, "wait_ms": 0})
    assert last["parents"] == [{"id": first, "result": {"n": 1}}, {"id": second, "result": None}]
    doomed: dict[str, Any] = {"path_parameters": {"id": third}}
    api(
        "POST",
        "/jobs/{id}/nack",
        204,
        query={"lease_id": last["lease_id"]},
        body={"terminal": True},
        **doomed,
    )
    dead = api("GET", "/jobs/{id}/result", 200, **doomed)
    assert (dead["state"], dead["attempts"]) == ("dead", 1)
    api("POST", "/jobs", 400, body={"payload": 1, "after": ["ffffffffffffffff"]})
    stats = api("GET", "/stats", 200, query=q)
    assert (stats["waiting"], stats["succeeded"]) == (0, 2)
    row = [r for r in api("GET", "/queues", 200) if r["name"] == q["queue"]]
    assert (row[0]["waiting"], row[0]["succeeded"]) == (0, 2)


def test_schedules_and_limits_answer_as_documented(live_broker: str) -> None:
    api = Api(live_broker)
    name: dict[str, Any] = {"path_parameters": {"name": "openapi-schedule"}}
    body = {"cron": "0 3 * * *", "timezone": "Europe/Paris", "payload": {"n": 1}, "paused": True}
    view = api("PUT", "/schedules/{name}", 200, body=body, **name)
    assert (view["cron"], view["next_fire_at"]) == ("0 3 * * *", None)
    interval = {"every_ms": 3_600_000, "payload": None, "queue": "openapi-schedules"}
    view = api("PUT", "/schedules/{name}", 200, body=interval, **name)
    assert (view["cron"], view["timezone"], view["every_ms"]) == (None, None, 3_600_000)
    assert api("GET", "/schedules/{name}", 200, **name) == view
    names = [s["name"] for s in api("GET", "/schedules", 200)["schedules"]]
    assert "openapi-schedule" in names
    assert api("POST", "/schedules/{name}/pause", 200, **name)["paused"] is True
    assert api("POST", "/schedules/{name}/resume", 200, **name)["paused"] is False
    api("PUT", "/schedules/{name}", 400, body={"cron": "61 * * * *", "payload": 1}, **name)
    api(
        "PUT",
        "/schedules/{name}",
        400,
        body={"every_ms": 1000, "cron": "@daily", "payload": 1},
        **name,
    )
    api("PUT", "/schedules/{name}", 400, data=b'{"every_ms": 1000, "payload": "\xff"}', **name)
    api("DELETE", "/schedules/{name}", 204, **name)
    for method, path in (
        ("GET", "/schedules/{name}"),
        ("DELETE", "/schedules/{name}"),
        ("POST", "/schedules/{name}/pause"),
        ("POST", "/schedules/{name}/resume"),
    ):
        api(method, path, 404, **name)
    queue: dict[str, Any] = {"path_parameters": {"name": "openapi-limits"}}
    limits = {"rate": {"tasks": 5, "per_ms": 1000, "burst": 2}, "concurrency": 3}
    answer = api("PUT", "/queues/{name}/limits", 200, body=limits, **queue)
    assert answer == {"queue": "openapi-limits", "limits": limits}
    row = [r for r in api("GET", "/queues", 200) if r["name"] == "openapi-limits"]
    assert (row[0]["limits"], row[0]["tokens"]) == (limits, 2)
    api("PUT", "/queues/{name}/limits", 400, body={"concurrency": 0}, **queue)
    assert api("PUT", "/queues/{name}/limits", 200, body={}, **queue)["limits"] is None
    api("DELETE", "/queues/{name}/limits", 204, **queue)
    api("PUT", "/schedules/{name}", 403, token=ONLY["produce"], body=interval, **name)
    api("PUT", "/queues/{name}/limits", 403, token=ONLY["consume"], body=limits, **queue)
    api("GET", "/schedules", 200, token=ONLY["produce"])


def test_refusals_answer_as_documented(tmp_path: Path) -> None:
    with broker_in_a_thread(tmp_path, max_body=MAX_BODY, max_tasks=1) as url:
        api = Api(url)
        api("POST", "/jobs", 201, body={"payload": 1})
        api("POST", "/jobs", 429, body={"payload": 2})  # (Retry-After: a required header)
        api("GET", "/stats", 401, token=None)  # (WWW-Authenticate)
        api("GET", "/stats", 401, token="nobody-has-this-one")
        api("GET", "/metrics", 401, token=None)
        api("GET", "/dlq", 403, token=ONLY["produce"])
        api("GET", "/metrics", 403, token=ONLY["admin"])
        api("GET", "/metrics", 200, token=ONLY["metrics"])
        api("POST", "/jobs", 400, data=b'{"payload": 1, "max_attempts": 3.0}')
        api("POST", "/jobs", 413, data=b" " * (MAX_BODY + 1))
        api("POST", "/jobs", 415, data=b"x", headers={"Content-Encoding": "gzip"})  # (Accept-)
        api("GET", "/healthz", 417, token=None, headers={"Expect": "a-miracle"})
        api("GET", "/healthz", 413, token=None, data=b" " * (MAX_BODY + 1))


def test_the_dashboard_answers_as_documented(live_broker: str) -> None:
    api = Api(live_broker)
    assert "<html" in api("GET", "/ui", 200, token=None).lower()
    api("GET", "/ui/", 200, token=None)
    style: dict[str, Any] = {"path_parameters": {"file": "style.css"}}
    api("GET", "/ui/{file}", 200, token=None, **style)
    etag = requests.get(live_broker + "/ui/style.css", timeout=10).headers["ETag"]
    api("GET", "/ui/{file}", 304, token=None, headers={"If-None-Match": etag}, **style)
    api("GET", "/ui/{file}", 404, token=None, path_parameters={"file": "nosuch.css"})
