"""The gRPC side of the broker's metrics (:mod:`wqbroker.metrics`): one server interceptor that
counts every call of a known method by its final status code (``wq_grpc_requests_total``).

The broker installs it first, outside the auth interceptor (``auth.py``), so refused calls are
counted with their code too.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from wqbroker.grpc.auth import behavior_of, with_behavior
from wqbroker.metrics import Metrics


class MetricsInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Counts every call of a known method by its final status code."""

    def __init__(self, metrics: Metrics) -> None:
        self._counter = metrics.grpc_requests

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None  # UNIMPLEMENTED: not counted (its name is the caller's to choose)
        service, _, method = handler_call_details.method.lstrip("/").rpartition("/")
        counter = self._counter

        def count(context: grpc.aio.ServicerContext[Any, Any], error: BaseException | None) -> None:
            counter.add((service, method, _code(context, error)))

        behavior = behavior_of(handler)
        if inspect.isasyncgenfunction(behavior):

            async def streaming(
                request: Any, context: grpc.aio.ServicerContext[Any, Any]
            ) -> AsyncIterator[Any]:
                try:
                    async for response in behavior(request, context):
                        yield response
                except BaseException as e:
                    count(context, e)
                    raise
                count(context, None)

            return with_behavior(handler, streaming)

        async def call(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            try:
                result = await behavior(request, context)
            except BaseException as e:
                count(context, e)
                raise
            count(context, None)
            return result

        return with_behavior(handler, call)


def _code(context: grpc.aio.ServicerContext[Any, Any], error: BaseException | None) -> str:
    """The name of the status code the call ends with."""
    try:
        code: Any = context.code()
    except Exception:  # (an experimental API of grpc.aio)
        code = None
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int):
        for status in grpc.StatusCode:
            if status.value[0] == code:
                return status.name
    if error is None:
        return "OK"
    if isinstance(error, (GeneratorExit, asyncio.CancelledError)):  # the client went away
        return "CANCELLED"
    return "UNKNOWN"
