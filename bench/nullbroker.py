"""The "null broker": an aiohttp app whose handlers return canned answers for the three requests
of the HTTP workload (enqueue, claim, ack). Its rate is what aiohttp itself allows on this machine
for the same client load, the yardstick for wq's HTTP figure.

    python -m bench.nullbroker PORT
"""

from __future__ import annotations

import asyncio
import sys

from aiohttp import web

ENQUEUED = b'{"id":"0123456789abcdef"}'
DELIVERY = (
    b'{"task":{"id":"0123456789abcdef","payload":{"line":"benchmark task","pad":"'
    + b"x" * 40
    + b'"},"attempts":1,"max_attempts":3,"created_at":"2026-11-29T23:14:20.774938Z",'
    b'"available_at":"2026-11-29T23:14:20.774938Z","last_error":null},'
    b'"lease_id":"f49cbe1ef2e4fdb1","deadline":"2026-11-29T23:14:50.782998Z"}'
)


async def enqueue(request: web.Request) -> web.Response:
    await request.read()
    return web.Response(body=ENQUEUED, status=201, content_type="application/json")


async def claim(request: web.Request) -> web.Response:
    return web.Response(body=DELIVERY, content_type="application/json")


async def ack(request: web.Request) -> web.Response:
    return web.Response(status=204)


def app() -> web.Application:
    application = web.Application()
    application.router.add_post("/jobs", enqueue)
    application.router.add_get("/jobs/next", claim)
    application.router.add_post("/jobs/{id}/ack", ack)
    return application


def main(port: int) -> None:
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:  # pragma: no cover
        pass
    web.run_app(app(), host="127.0.0.1", port=port, access_log=None, print=None)


if __name__ == "__main__":
    main(int(sys.argv[1]))
