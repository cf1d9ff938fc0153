"""Bearer tokens on the gRPC API: one server interceptor, before every method.

It looks up the rule of the method called (``wqbroker.auth``) and checks the call's
``authorization`` metadata (``Bearer TOKEN``) against it. A refused call gets a handler of the same
kind that only aborts, with the code the error table (``CODES``) gives ``Unauthenticated``
(UNAUTHENTICATED) or ``PermissionDenied`` (PERMISSION_DENIED). A method that takes a stream of
requests (StreamJobs) is checked again at each message the client sends, so a token removed by a
reload ends the streams opened with it at their next ack, nack or drain. An unknown method goes on
to UNIMPLEMENTED unchecked.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc

from wqbroker.auth import Rule, Tokens, grpc_rule
from wqbroker.errors import Unauthenticated, WqError
from wqbroker.grpc.server import code_for

_AUTHORIZATION = "authorization"

Handler = Any  # grpc.RpcMethodHandler; grpc-stubs types its behaviours as synchronous ones


def authorization(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    """The call's one ``authorization`` value, or None; two of them are refused."""
    values = [value for key, value in metadata or () if key == _AUTHORIZATION]
    if len(values) > 1:
        raise Unauthenticated("more than one authorization metadata entry")
    if not values:
        return None
    value = values[0]
    return value if isinstance(value, str) else value.decode("latin-1")


_MAKERS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def behavior_of(handler: Handler) -> Callable[..., Any]:
    kind = (handler.request_streaming, handler.response_streaming)
    name = {
        (False, False): "unary_unary",
        (False, True): "unary_stream",
        (True, False): "stream_unary",
        (True, True): "stream_stream",
    }[kind]
    behavior: Callable[..., Any] = getattr(handler, name)
    return behavior


def with_behavior(handler: Handler, behavior: Callable[..., Any]) -> Handler:
    """A handler like ``handler`` (same kind, same (de)serializers) running ``behavior``."""
    make: Any = _MAKERS[(handler.request_streaming, handler.response_streaming)]
    return make(
        behavior,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


# How long a refused call that takes a stream may take to send its first message.
_FIRST_MESSAGE_WAIT = 1.0


def _refusal(handler: Handler, error: WqError) -> Handler:
    async def refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        if handler.request_streaming:
            # Take the first message the client is sending before ending the call: a client
            # still writing when the call ends sees INTERNAL (grpc.aio), not this status.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(anext(aiter(request)), _FIRST_MESSAGE_WAIT)
        await context.abort(code_for(error), error.message)

    return with_behavior(handler, refuse)


def _checked_again(handler: Handler, check: Callable[[], None]) -> Handler:
    """``handler`` with each incoming message checked first (methods that take a stream)."""
    behavior = behavior_of(handler)

    async def requests(iterator: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for request in iterator:
            check()
            yield request

    if inspect.isasyncgenfunction(behavior):

        async def streaming(
            iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
        ) -> AsyncIterator[Any]:
            try:
                async for response in behavior(requests(iterator), context):
                    yield response
            except WqError as e:
                await context.abort(code_for(e), e.message)

        return with_behavior(handler, streaming)

    async def call(
        iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
    ) -> Any:
        try:
            return await behavior(requests(iterator), context)
        except WqError as e:
            await context.abort(code_for(e), e.message)

    return with_behavior(handler, call)


class AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Checks every call's bearer token against ``tokens`` (which SIGHUP may reload)."""

    def __init__(self, tokens: Tokens) -> None:
        self._tokens = tokens

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None  # no such method: UNIMPLEMENTED
        method = handler_call_details.method
        rule: Rule = grpc_rule(method)
        metadata = handler_call_details.invocation_metadata

        def check() -> None:
            self._tokens.check(authorization(metadata), rule, method)

        try:
            check()
        except WqError as e:
            return _refusal(handler, e)
        if handler.request_streaming:
            return _checked_again(handler, check)
        return handler
