"""aiohttp application: routes and handlers.

Handlers parse the request, call the service and render the answer (what each route does with
what a request carries is in ``core.py``, shared with the fast lane); every rule lives in the
service. Every error answer is JSON, ``{"error": "<message naming the problem>"}``, including the
ones aiohttp produces itself (unknown path, wrong method, body too large). What any request may
cost the transport (bodies, time-outs, malformed HTTP) is bounded in ``transport.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Final

from aiohttp import web
from aiohttp.typedefs import Middleware

from wqbroker import codec
from wqbroker.auth import Tokens
from wqbroker.clock import SystemClock
from wqbroker.errors import WqError
from wqbroker.http import dashboard, openapi
from wqbroker.http.auth import token_check
from wqbroker.http.core import (
    BATCH_ROUTE,
    CLAIM_BATCH_ROUTE,
    IDEMPOTENCY_KEY,
    SETTLE_ROUTE,
    STATUS,
    enqueue_answer,
    enqueue_batch_answer,
    error_parts,
    extend_answer,
    idempotency_key,
    int_value,
    nack_task,
    one_value,
    render_deliveries,
    render_delivery,
    render_queue,
    render_stats,
    render_task,
    render_task_state,
    required_lease_id,
    settle_answer,
)
from wqbroker.http.fast import LANE, Lane
from wqbroker.http.metrics import ROUTE as METRICS_ROUTE
from wqbroker.http.metrics import count_http
from wqbroker.http.metrics import handler as metrics_handler
from wqbroker.http.server import DEFAULT_IDLE_TIMEOUT, DEFAULT_READ_HEADER_TIMEOUT, Runner
from wqbroker.http.transport import (
    BODY,
    DEFAULT_MAX_BODY,
    DEFAULT_READ_BODY_TIMEOUT,
    BodyRules,
    RequestTimeout,
    body_refusal,
    error_response,
    expect_continue,
    finish_body,
    json_response,
    no_content,
    read_body,
)
from wqbroker.metrics import Metrics
from wqbroker.models import Delivery
from wqbroker.service import Service

__all__ = ["STATUS", "create_app", "error_answer", "make_runner"]

log = logging.getLogger("wqbroker.http")

SERVICE: Final = web.AppKey("service", Service)

# A task id in a path where a fixed word sits at the same place: anything but that word (no task
# is called so). Else a method the fixed route does not take would fall through to the task's
# route: HEAD /jobs/next to the lookup of a task "next" (rather than 405: HEAD never claims),
# DELETE /dlq/requeue to the purge of a task "requeue".
_JOB_ID: Final = "{id:(?!next$|batch$|settle$)[^{}/]+}"
_DEAD_ID: Final = "{id:(?!requeue$)[^{}/]+}"


# -- request parsing ----------------------------------------------------------------------------


def _query_str(request: web.Request, name: str) -> str | None:
    return one_value(name, request.query.getall(name, []))


def _query_int(request: web.Request, name: str) -> int | None:
    return int_value(name, _query_str(request, name))


def _lease_id(request: web.Request) -> str:
    return required_lease_id(_query_str(request, "lease_id"))


def _idempotency_key(request: web.Request) -> str | None:
    return idempotency_key(request.headers.getall(IDEMPOTENCY_KEY, []))


# -- handlers -----------------------------------------------------------------------------------


async def enqueue(request: web.Request) -> web.Response:
    key = _idempotency_key(request)
    status, body = await enqueue_answer(request.app[SERVICE], await read_body(request), key)
    return json_response(body, status)


async def enqueue_batch(request: web.Request) -> web.Response:
    """An extension: ``{"tasks": [...]}``, each task as POST /jobs takes one (its idempotency key
    as the member ``idempotency_key``), all enqueued or none (an invalid one is named by its
    index); 201 ``{"ids": [...], "duplicates": [...]}`` in order, as gRPC's EnqueueBatch. The
    ``Idempotency-Key`` header is refused rather than ignored: it cannot say which task it keys."""
    keyed = IDEMPOTENCY_KEY in request.headers
    body = b"" if keyed else await read_body(request)
    return json_response(await enqueue_batch_answer(request.app[SERVICE], body, keyed), 201)


async def _written(request: web.Request, body: bytes) -> web.StreamResponse:
    """A claim's answer, written now: before the service lets go of the tasks it carries (if
    the client is gone or the answer cannot be written, nobody saw them: they go back)."""
    transport = request.transport
    if transport is None or transport.is_closing():
        raise ConnectionResetError("the client went away")
    answer = json_response(body)
    await answer.prepare(request)
    await answer.write_eof()
    return answer


async def claim(request: web.Request) -> web.StreamResponse:
    answer: web.StreamResponse | None = None  # (none made while the poll is parked)

    async def hand_over(delivery: Delivery) -> None:
        nonlocal answer
        answer = await _written(request, render_delivery(delivery))

    await request.app[SERVICE].claim(
        _query_int(request, "wait_ms"),
        _query_int(request, "lease_ms"),
        hand_over,
        queues=_query_str(request, "queue"),
    )
    return answer if answer is not None else no_content()


async def claim_batch(request: web.Request) -> web.StreamResponse:
    """An extension: up to ``max`` tasks in one long-poll (see Service.claim_batch):
    200 ``{"deliveries": [...]}``, or 204 if none came within ``wait_ms``."""
    answer: web.StreamResponse | None = None

    async def hand_over(deliveries: list[Delivery]) -> None:
        nonlocal answer
        answer = await _written(request, render_deliveries(deliveries))

    await request.app[SERVICE].claim_batch(
        _query_int(request, "wait_ms"),
        _query_int(request, "lease_ms"),
        _query_int(request, "max"),
        hand_over,
        queues=_query_str(request, "queue"),
    )
    return answer if answer is not None else no_content()


async def settle(request: web.Request) -> web.Response:
    """An extension: many acks and nacks in one request (see core.settle_answer)."""
    return json_response(await settle_answer(request.app[SERVICE], await read_body(request)))


async def ack(request: web.Request) -> web.Response:
    task_id = request.match_info["id"]
    lease_id = _lease_id(request)
    await request.app[SERVICE].ack(task_id, lease_id)
    return no_content()


async def nack(request: web.Request) -> web.Response:
    task_id = request.match_info["id"]
    lease_id = _lease_id(request)
    await nack_task(request.app[SERVICE], task_id, lease_id, await read_body(request))
    return no_content()


async def extend(request: web.Request) -> web.Response:
    task_id = request.match_info["id"]
    lease_id = _lease_id(request)
    lease_ms = _query_int(request, "lease_ms")
    return json_response(await extend_answer(request.app[SERVICE], task_id, lease_id, lease_ms))


async def lookup_task(request: web.Request) -> web.Response:
    found = await request.app[SERVICE].lookup(request.match_info["id"])
    return json_response(render_task_state(found))


async def stats(request: web.Request) -> web.Response:
    found = await request.app[SERVICE].stats(_query_str(request, "queue"))
    return json_response(render_stats(found))


async def queues(request: web.Request) -> web.Response:
    rows = await request.app[SERVICE].queue_report()
    return json_response(
        b"[" + b",".join(render_queue(r.queue, r.oldest_ready) for r in rows) + b"]"
    )


async def pause(request: web.Request) -> web.Response:
    await request.app[SERVICE].pause(request.match_info["name"])
    return no_content()


async def resume(request: web.Request) -> web.Response:
    await request.app[SERVICE].resume(request.match_info["name"])
    return no_content()


async def dlq(request: web.Request) -> web.Response:
    tasks = await request.app[SERVICE].dead_letters(
        _query_int(request, "limit"), queue=_query_str(request, "queue")
    )
    return json_response(b"[" + b",".join(render_task(t) for t in tasks) + b"]")


async def requeue(request: web.Request) -> web.Response:
    await request.app[SERVICE].requeue(request.match_info["id"])
    return no_content()


async def requeue_all(request: web.Request) -> web.Response:
    count = await request.app[SERVICE].requeue_all(_query_str(request, "queue"))
    return json_response(f'{{"requeued":{count}}}'.encode())


async def purge(request: web.Request) -> web.Response:
    await request.app[SERVICE].purge(request.match_info["id"])
    return no_content()


async def healthz(request: web.Request) -> web.Response:
    problem = request.app[SERVICE].problem()
    if problem is not None:
        return json_response(codec.dumps({"status": "unavailable", "error": problem}), 503)
    return json_response(b'{"status":"ok"}')


# -- errors -------------------------------------------------------------------------------------

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_answer(error: WqError) -> web.Response:
    """The JSON answer for an error of the tree, with the headers its status calls for."""
    status, headers = error_parts(error)
    response = error_response(status, error.message)
    for name, value in headers:
        response.headers[name] = value
    return response


def _answer_to_exception(request: web.Request, error: Exception) -> web.Response | None:
    """The JSON answer to an exception a handler (or the token check) raised, or None for one
    that must go on up (a cancellation, a lost connection, an HTTP exception below 400)."""
    if isinstance(error, WqError):
        return error_answer(error)
    if isinstance(error, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(error.allowed_methods))
        response = error_response(
            405, f"method {request.method} is not allowed on {request.path}; use {allowed}"
        )
        response.headers["Allow"] = ",".join(sorted(error.allowed_methods))
        return response
    if isinstance(error, web.HTTPNotFound):
        return error_response(404, f"no such endpoint: {request.method} {request.path}")
    if isinstance(error, web.HTTPException):
        return None if error.status_code < 400 else error_response(error.status_code, error.reason)
    if isinstance(error, RequestTimeout):
        return error_response(408, error.message)
    if isinstance(error, ConnectionError):
        return None
    log.error("unexpected error in %s %s", request.method, request.path, exc_info=error)
    return error_response(500, "internal error")


def middleware(
    metrics: Metrics, rules: BodyRules, check_token: Callable[[web.Request], None] | None
) -> Middleware:
    """The application's one middleware, around every handler (one layer rather than four: it
    runs on every request). In order:

    - a body the headers already rule out is refused (415, 413), before anything else;
    - the token is checked (``auth.py``), when the broker has tokens;
    - every error the check or the handler raises is answered in JSON (``_answer_to_exception``);
    - whatever of the body the handler left unread is dealt with (``transport.finish_body``);
    - every answer is counted by method, route and status (refusals included), as is an HTTP
      exception that goes on up.
    """

    @web.middleware
    async def handle(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            response: web.StreamResponse | None = body_refusal(request, rules)
            if response is None:
                try:
                    if check_token is not None:
                        check_token(request)
                    response = await handler(request)
                except Exception as e:
                    response = _answer_to_exception(request, e)
                    if response is None:
                        raise
            if not request.content.is_eof():
                response = await finish_body(request, response)
        except web.HTTPException as e:
            count_http(metrics, request, e.status)
            raise
        count_http(metrics, request, response.status)
        return response

    return handle


def create_app(
    service: Service,
    *,
    max_body: int = DEFAULT_MAX_BODY,
    read_body_timeout: float = DEFAULT_READ_BODY_TIMEOUT,
    tokens: Tokens | None = None,
    metrics: Metrics | None = None,
    metrics_public: bool = False,
) -> web.Application:
    """The app; with ``tokens``, every request but health checks needs a bearer token.
    ``metrics``: the broker's (else one of the app's own, which sees only the service's state
    and the requests), for GET /metrics (open to all with ``metrics_public``)."""
    if metrics is None:
        metrics = Metrics(SystemClock())
        metrics.watch(service)
    public = (f"GET {METRICS_ROUTE}",) if metrics_public else ()
    check_token = None if tokens is None else token_check(tokens, public)
    rules = BodyRules(max_body, read_body_timeout)
    handle = middleware(metrics, rules, check_token)
    app = web.Application(middlewares=[handle], client_max_size=max_body)
    app[SERVICE] = service
    app[BODY] = rules
    app[LANE] = Lane(service, metrics, tokens, max_body, read_body_timeout, handle)
    # The documented methods, and HEAD on the read-only GETs (it changes nothing); aiohttp adds
    # HEAD to every GET unless told not to, and a HEAD on /jobs/next would claim a task.
    routes = app.router
    expect = expect_continue
    routes.add_post("/jobs", enqueue, expect_handler=expect)
    routes.add_post(BATCH_ROUTE, enqueue_batch, expect_handler=expect)
    routes.add_get("/jobs/next", claim, allow_head=False, expect_handler=expect)
    routes.add_get(CLAIM_BATCH_ROUTE, claim_batch, allow_head=False, expect_handler=expect)
    routes.add_post(SETTLE_ROUTE, settle, expect_handler=expect)
    routes.add_get(f"/jobs/{_JOB_ID}", lookup_task, expect_handler=expect)
    routes.add_post("/jobs/{id}/ack", ack, expect_handler=expect)
    routes.add_post("/jobs/{id}/nack", nack, expect_handler=expect)
    routes.add_post("/jobs/{id}/extend", extend, expect_handler=expect)
    routes.add_get("/stats", stats, expect_handler=expect)
    routes.add_get("/queues", queues, expect_handler=expect)
    routes.add_post("/queues/{name}/pause", pause, expect_handler=expect)
    routes.add_post("/queues/{name}/resume", resume, expect_handler=expect)
    routes.add_get("/dlq", dlq, expect_handler=expect)
    routes.add_post("/dlq/requeue", requeue_all, expect_handler=expect)
    routes.add_post("/dlq/{id}/requeue", requeue, expect_handler=expect)
    routes.add_delete(f"/dlq/{_DEAD_ID}", purge, expect_handler=expect)
    routes.add_get("/healthz", healthz, expect_handler=expect)
    routes.add_get(METRICS_ROUTE, metrics_handler(metrics), expect_handler=expect)
    routes.add_get(
        openapi.PATH, openapi.handler(metrics_public=metrics_public), expect_handler=expect
    )
    dashboard.add_routes(routes, expect_handler=expect)  # GET /ui: static files, no token
    return app


def make_runner(
    app: web.Application,
    *,
    access_log: bool = False,
    read_header_timeout: float = DEFAULT_READ_HEADER_TIMEOUT,
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
) -> web.AppRunner:
    return Runner(
        app,
        access_log=log if access_log else None,
        read_header_timeout=read_header_timeout,
        idle_timeout=idle_timeout,
        shutdown_timeout=5.0,
    )
