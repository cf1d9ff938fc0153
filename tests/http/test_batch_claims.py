"""GET /jobs/next/batch and POST /jobs/settle (extensions: many tasks claimed, many settled, in
one request each) over real HTTP: what a worker sees."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from tests.authkit import ONLY, ROOT, bearer, write_token_file
from tests.helpers import http_broker, wait_until
from tests.rawhttp import exchange, raw_connection, request
from wqbroker.broker import Broker


def _json(value: object) -> bytes:
    return json.dumps(value).encode()


async def enqueue(b: Broker, n: int, queue: str = "default") -> list[str]:
    body = _json({"tasks": [{"payload": i, "queue": queue} for i in range(n)]})
    answer = await exchange(b.http_addresses[0], request("POST", "/jobs/batch", body))
    assert answer.status == 201, answer
    return list(answer.json()["ids"])


async def test_a_parked_batch_claim_is_answered_with_what_comes() -> None:
    async with http_broker() as b:
        async with raw_connection(b.http_addresses[0]) as conn:
            await conn.send(request("GET", "/jobs/next/batch?max=3&wait_ms=20000"))
            await wait_until(lambda: b.service.parked_polls == 1, what="the claim to park")
            ids = await enqueue(b, 5)
            answer = await conn.response()
        assert answer.status == 200
        deliveries = answer.json()["deliveries"]
        assert [d["task"]["id"] for d in deliveries] == ids[:3]
        assert [d["task"]["payload"] for d in deliveries] == [0, 1, 2]
        assert all(d["task"]["attempts"] == 1 and d["lease_id"] for d in deliveries)
        stats = (await exchange(b.http_addresses[0], request("GET", "/stats"))).json()
        assert (stats["ready"], stats["handed_out"]) == (2, 3)


async def test_a_batch_claim_whose_client_went_away_loses_nothing() -> None:
    async with http_broker() as b:
        async with raw_connection(b.http_addresses[0]) as conn:
            await conn.send(request("GET", "/jobs/next/batch?max=3&wait_ms=20000&queue=q"))
            await wait_until(lambda: b.service.parked_polls == 1, what="the claim to park")
        await wait_until(lambda: b.service.parked_polls == 0, what="the claim to go")
        ids = await enqueue(b, 2, queue="q")
        answer = await exchange(
            b.http_addresses[0], request("GET", "/jobs/next/batch?max=5&queue=q&wait_ms=0")
        )
        assert [d["task"]["id"] for d in answer.json()["deliveries"]] == ids
        assert all(d["task"]["attempts"] == 1 for d in answer.json()["deliveries"])


async def test_the_batch_routes_take_only_their_methods() -> None:
    async with http_broker() as b:
        address = b.http_addresses[0]
        head = await exchange(address, request("HEAD", "/jobs/next/batch?wait_ms=0"), head=True)
        assert head.status == 405  # it would claim
        assert (await exchange(address, request("GET", "/jobs/settle"))).status == 405
        assert (await exchange(address, request("POST", "/jobs/next/batch"))).status == 405
        assert await enqueue(b, 1)  # nothing was claimed by any of them
        stats = (await exchange(address, request("GET", "/stats"))).json()
        assert stats["totals"]["delivered"] == 0


async def test_a_settle_reports_each_outcome_and_counts_as_acks_and_nacks() -> None:
    async with http_broker() as b:
        address = b.http_addresses[0]
        await enqueue(b, 3)
        got = (await exchange(address, request("GET", "/jobs/next/batch?max=3&wait_ms=0"))).json()
        d = got["deliveries"]
        body = {
            "acks": [
                {"id": d[0]["task"]["id"], "lease_id": d[0]["lease_id"]},
                {"id": d[1]["task"]["id"], "lease_id": "not-the-lease"},
            ],
            "nacks": [
                {"id": d[2]["task"]["id"], "lease_id": d[2]["lease_id"], "error": "boom"},
                {"id": d[0]["task"]["id"], "lease_id": d[0]["lease_id"]},  # acked just before
            ],
        }
        answer = await exchange(address, request("POST", "/jobs/settle", _json(body)))
        assert answer.status == 200
        outcomes = answer.json()
        assert outcomes["acks"][0] is None
        assert outcomes["acks"][1]["status"] == 409
        assert outcomes["nacks"][0] is None
        assert outcomes["nacks"][1]["status"] == 404
        stats = (await exchange(address, request("GET", "/stats"))).json()
        assert (stats["totals"]["acked"], stats["totals"]["nacked"]) == (1, 1)
        assert (stats["handed_out"], stats["delayed"]) == (1, 1)
        refused = await exchange(
            address, request("POST", "/jobs/settle", _json({"nacks": [{"id": "x"}]}))
        )
        assert refused.status == 400
        assert refused.json()["error"] == "nacks[0].lease_id must be a string, got null"


async def test_the_batch_routes_need_the_consume_scope(tmp_path: Path) -> None:
    tokens = write_token_file(tmp_path)
    async with http_broker(token_file=str(tokens)) as b:
        address = b.http_addresses[0]
        for method, target, body in (
            ("GET", "/jobs/next/batch?wait_ms=0", None),
            ("POST", "/jobs/settle", b"{}"),
        ):
            assert (await exchange(address, request(method, target, body))).status == 401
            produce = await exchange(
                address, request(method, target, body, bearer(ONLY["produce"]))
            )
            assert produce.status == 403
            for token in (ONLY["consume"], ROOT):
                answer = await exchange(address, request(method, target, body, bearer(token)))
                assert answer.status in (200, 204), answer


async def test_batch_requests_are_counted_by_route() -> None:
    async with http_broker() as b:
        address = b.http_addresses[0]
        await enqueue(b, 2)
        await exchange(address, request("GET", "/jobs/next/batch?max=5&wait_ms=0"))
        await exchange(address, request("GET", "/jobs/next/batch?max=5&wait_ms=0"))
        await exchange(address, request("POST", "/jobs/settle", b"{}"))
        await asyncio.sleep(0)
        metrics = (await exchange(address, request("GET", "/metrics"))).body.decode()
        for line in (
            'wq_http_requests_total{method="GET",route="/jobs/next/batch",status="200"} 1.0',
            'wq_http_requests_total{method="GET",route="/jobs/next/batch",status="204"} 1.0',
            'wq_http_requests_total{method="POST",route="/jobs/settle",status="200"} 1.0',
        ):
            assert line in metrics
