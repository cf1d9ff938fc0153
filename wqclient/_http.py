"""The HTTP/JSON transport (aiohttp), one keep-alive session per client."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any, NoReturn
from urllib.parse import quote

import aiohttp

from wqclient.errors import (
    InvalidArgument,
    LeaseLost,
    NotFound,
    PayloadTooLarge,
    ProtocolError,
    Unavailable,
    WqError,
)
from wqclient.models import Delivery, Stats, Task, Totals
from wqclient.transport import AsyncStream

_ERRORS: dict[int, type[WqError]] = {
    400: InvalidArgument,
    404: NotFound,
    409: LeaseLost,
    413: PayloadTooLarge,
    503: Unavailable,
}

# Extra time allowed beyond a long-poll's wait before the request is considered lost.
_POLL_SLACK = 15.0


def _ts(text: str) -> datetime:
    return datetime.fromisoformat(text)


def _task(data: dict[str, Any]) -> Task:
    return Task(
        id=data["id"],
        payload_json=json.dumps(data["payload"], separators=(",", ":")).encode(),
        attempts=data["attempts"],
        max_attempts=data["max_attempts"],
        created_at=_ts(data["created_at"]),
        available_at=_ts(data["available_at"]),
        last_error=data.get("last_error"),
    )


def _q(value: str) -> str:
    return quote(value, safe="")


class HttpTransport:
    def __init__(self, base_url: str, *, timeout: float = 30.0) -> None:
        self._base = base_url.rstrip("/")
        self._timeout = timeout
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self._timeout),
            )
        return self._session

    async def _call(
        self,
        method: str,
        path: str,
        *,
        body: bytes | None = None,
        timeout: float | None = None,
    ) -> tuple[int, bytes]:
        session = self._http()
        try:
            async with session.request(
                method,
                self._base + path,
                data=body,
                headers={"Content-Type": "application/json"} if body is not None else None,
                timeout=aiohttp.ClientTimeout(total=timeout or self._timeout),
            ) as resp:
                data = await resp.read()
                if resp.status >= 400:
                    self._raise(resp.status, data)
                return resp.status, data
        except aiohttp.ClientConnectionError as e:
            raise Unavailable(f"cannot reach the broker at {self._base}: {e}") from None
        except TimeoutError:
            raise Unavailable(f"the broker at {self._base} did not answer in time") from None

    def _raise(self, status: int, data: bytes) -> NoReturn:
        try:
            message = str(json.loads(data)["error"])
        except (ValueError, KeyError, TypeError):
            message = data.decode("utf-8", "replace").strip() or f"HTTP {status}"
        kind = _ERRORS.get(status)
        if kind is None:
            kind = Unavailable if status >= 500 else WqError
        raise kind(message)

    @staticmethod
    def _json(data: bytes) -> Any:
        try:
            return json.loads(data)
        except ValueError:
            raise ProtocolError(f"the broker sent invalid JSON: {data[:200]!r}") from None

    @staticmethod
    def _enqueue_body(payload_json: bytes, max_attempts: int | None, delay_ms: int | None) -> bytes:
        parts = [b'{"payload":', payload_json]
        if max_attempts is not None:
            parts.append(b',"max_attempts":%d' % max_attempts)
        if delay_ms is not None:
            parts.append(b',"delay_ms":%d' % delay_ms)
        parts.append(b"}")
        return b"".join(parts)

    async def enqueue(
        self, payload_json: bytes, max_attempts: int | None, delay_ms: int | None
    ) -> str:
        _, data = await self._call(
            "POST", "/jobs", body=self._enqueue_body(payload_json, max_attempts, delay_ms)
        )
        return str(self._json(data)["id"])

    async def enqueue_many(
        self, items: Sequence[tuple[bytes, int | None, int | None]]
    ) -> list[str]:
        # The HTTP API has one task per request: send them in order.
        return [await self.enqueue(*item) for item in items]

    async def claim(self, wait_ms: int | None, lease_ms: int | None) -> Delivery | None:
        params = []
        if wait_ms is not None:
            params.append(f"wait_ms={wait_ms}")
        if lease_ms is not None:
            params.append(f"lease_ms={lease_ms}")
        query = "?" + "&".join(params) if params else ""
        wait = min(wait_ms if wait_ms is not None else 20_000, 30_000) / 1000.0
        status, data = await self._call("GET", "/jobs/next" + query, timeout=wait + _POLL_SLACK)
        if status == 204:
            return None
        body = self._json(data)
        return Delivery(_task(body["task"]), body["lease_id"], _ts(body["deadline"]))

    async def ack(self, task_id: str, lease_id: str) -> None:
        await self._call("POST", f"/jobs/{_q(task_id)}/ack?lease_id={_q(lease_id)}")

    async def nack(self, task_id: str, lease_id: str, error: str | None) -> None:
        body = json.dumps({"error": error}).encode() if error is not None else None
        await self._call("POST", f"/jobs/{_q(task_id)}/nack?lease_id={_q(lease_id)}", body=body)

    async def stats(self) -> Stats:
        _, data = await self._call("GET", "/stats")
        body = self._json(data)
        return Stats(
            ready=body["ready"],
            handed_out=body["handed_out"],
            delayed=body["delayed"],
            dead=body["dead"],
            totals=Totals(**body["totals"]),
        )

    async def dead(self, limit: int | None) -> list[Task]:
        query = f"?limit={limit}" if limit is not None else ""
        _, data = await self._call("GET", "/dlq" + query)
        return [_task(t) for t in self._json(data)]

    async def requeue(self, task_id: str) -> None:
        await self._call("POST", f"/dlq/{_q(task_id)}/requeue")

    async def stream(self, prefetch: int, lease_ms: int | None) -> AsyncStream:
        raise WqError("streamed consumption needs a gRPC broker URL (grpc://host:port)")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
