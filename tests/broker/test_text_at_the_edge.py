"""Text a client sends (error texts, ids, lease ids): valid Unicode or refused at the edge, error
texts cut to a documented size, and ids quoted in messages only so far. Each class over the real
HTTP API on every store: one request's text can never take the store down for anyone else."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from tests.helpers import BACKENDS, Http, http_client, invariant_holds, make_store, running_broker
from wqbroker.broker import Broker
from wqbroker.limits import MAX_ERROR_BYTES
from wqbroker.retry import Backoff
from wqwire.pb import broker_pb2 as pb
from wqwire.pb import broker_pb2_grpc as pb_grpc


@pytest.fixture(params=BACKENDS)
async def broker(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Broker]:
    rng = random.Random(7)
    store = await make_store(str(request.param), Backoff(1.0, 30.0, rng), rng, tmp_path)
    async with running_broker(store=store, backoff_base=60.0) as b:
        yield b


async def claimed(http: Http, **fields: object) -> tuple[str, str]:
    await http.enqueue({"n": 1}, **fields)
    delivery = await http.claim()
    return str(delivery["task"]["id"]), str(delivery["lease_id"])


async def assert_healthy(http: Http) -> None:
    """The store still takes work from everyone, and its books balance."""
    assert (await http.request("GET", "/healthz"))[0] == 200
    task_id, lease_id = await claimed(http)
    assert await http.ack(task_id, lease_id) == 204
    status, dead = await http.request("GET", "/dlq")
    assert status == 200, dead
    stats = await http.stats()
    assert invariant_holds(stats)


@pytest.mark.parametrize("text", ["\ud800", "ok \udfff then", "x\ud83d", "a" * 10 + "\udc00"])
async def test_an_error_that_is_not_unicode_is_refused_and_harms_nobody(
    broker: Broker, text: str
) -> None:
    async with http_client(broker.http_url) as http:
        task_id, lease_id = await claimed(http)
        status, body = await http.request(
            "POST", f"/jobs/{task_id}/nack?lease_id={lease_id}", json={"error": text}
        )
        assert status == 400, body
        assert "error is not valid Unicode" in body["error"]
        assert "surrogate" in body["error"]
        # Nothing happened to the task: its holder can still settle it.
        assert await http.nack(task_id, lease_id, "a real error") == 204
        await assert_healthy(http)


async def test_valid_unicode_of_every_plane_is_kept(broker: Broker) -> None:
    text = "é 漢字 😀 \u0000 \U0010ffff"
    async with http_client(broker.http_url) as http:
        task_id, lease_id = await claimed(http, max_attempts=1)
        assert await http.nack(task_id, lease_id, text) == 204
        status, dead = await http.request("GET", "/dlq")
        assert status == 200
        assert dead[0]["last_error"] == text
        await assert_healthy(http)


async def test_a_huge_error_is_cut_to_the_documented_size_and_says_so(broker: Broker) -> None:
    huge = "é" * 150_000  # 300,000 bytes of UTF-8
    async with http_client(broker.http_url) as http:
        task_id, lease_id = await claimed(http, max_attempts=1)
        assert await http.nack(task_id, lease_id, huge) == 204
        status, dead = await http.request("GET", "/dlq")
        assert status == 200
        error = dead[0]["last_error"]
        assert len(error.encode("utf-8")) <= MAX_ERROR_BYTES
        assert error.startswith("é" * 1000)
        assert error.endswith("[truncated: the error was 300000 bytes]")
        async with grpc.aio.insecure_channel(broker.grpc_target) as channel:
            listed = await pb_grpc.BrokerStub(channel).ListDead(pb.ListDeadRequest())
            assert listed.tasks[0].last_error == error
        await assert_healthy(http)


@pytest.mark.parametrize("where", ["id", "lease_id"])
async def test_a_huge_id_is_not_found_with_a_short_message(broker: Broker, where: str) -> None:
    long = "f" * 65_536  # over gRPC; over HTTP as much as a request line may carry
    async with http_client(broker.http_url) as http:
        task_id, lease_id = await claimed(http)
        path_id, lease = (long[:7000], lease_id) if where == "id" else (task_id, long[:7000])
        status, body = await http.request("POST", f"/jobs/{path_id}/ack?lease_id={lease}")
        assert status == (404 if where == "id" else 409), body
        assert len(body["error"]) < 300, len(body["error"])
        async with grpc.aio.insecure_channel(broker.grpc_target) as channel:
            stub = pb_grpc.BrokerStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Requeue(pb.RequeueRequest(id=long))
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            assert len(e.value.details() or "") < 300
        assert await http.ack(task_id, lease_id) == 204
        await assert_healthy(http)
