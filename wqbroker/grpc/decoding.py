"""Requests that cannot be decoded: an answer, not a crash.

gRPC hands a request's bytes to the method's deserializer before any servicer code runs; if it
raises (corrupt protobuf, invalid UTF-8 in a ``string`` field, a truncated message), grpc.aio logs
a traceback and the caller gets UNKNOWN. So the Broker service is registered with a handler table
of its own, built from the generated one (``add_BrokerServicer_to_server``), with two changes to
every method:

- the request deserializer never raises: bytes it cannot decode become an :class:`Undecodable`
  (logged in one line at DEBUG), and
- the method's behaviour turns an :class:`Undecodable` into INVALID_ARGUMENT, saying the request
  could not be decoded: a unary call before the servicer sees it; on a stream, when the servicer
  reads it (the stream then ends as on any other invalid request: its unfinished tasks are
  reclaimed).

A unary method is served as a client-streaming one (the same on the wire) that takes the first
message: a call that half-closes without sending any is answered INVALID_ARGUMENT, where grpc.aio
would never answer it (its caller would wait for its deadline, or forever).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, NoReturn, TypeAlias

import grpc
from google.protobuf.descriptor import ServiceDescriptor

from wqbroker.errors import InvalidArgument, WqError

log = logging.getLogger("wqbroker.grpc")

EOF: Final[object] = grpc.aio.EOF  # type: ignore[attr-defined]  # not in grpc-stubs
Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"
#: Ends a call with the status for ``error`` (never returns).
Reject = Callable[[Any, WqError], Awaitable[NoReturn]]


@dataclass(frozen=True, slots=True)
class Undecodable:
    """What the deserializer returns for bytes that are not a valid request message."""

    message: str  # for the client: what could not be decoded, and why


def handler_table(
    add_to_server: Callable[[Any, Any], None], servicer: object
) -> dict[str, Handler]:
    """The generated ``add_XServicer_to_server``'s method handlers for ``servicer``, by name."""
    table = _Table()
    add_to_server(servicer, table)
    if not table.handlers:
        raise RuntimeError("the generated code registered no method handlers by name")
    return table.handlers


def guarded(
    handlers: Mapping[str, Handler], service: ServiceDescriptor, reject: Reject
) -> dict[str, Handler]:
    """``handlers`` (a service's table, by method name), each with a deserializer that never
    raises and a behaviour that rejects what it could not decode with ``reject``."""
    return {name: _guarded(handler, service, name, reject) for name, handler in handlers.items()}


def _guarded(handler: Handler, service: ServiceDescriptor, name: str, reject: Reject) -> Handler:
    h: Any = handler  # a namedtuple (grpc-stubs does not say so)
    response = "stream" if h.response_streaming else "unary"
    slot = ("stream_" if h.request_streaming else "unary_") + response
    behaviour = getattr(h, slot)
    if h.request_deserializer is None or not inspect.iscoroutinefunction(behaviour):
        raise TypeError(f"{name}: expected a deserializer and an async servicer method")
    wanted = service.methods_by_name[name].input_type.full_name
    decode = _decoder(h.request_deserializer, wanted, f"/{service.full_name}/{name}")
    if h.request_streaming:
        guarded: Handler = h._replace(request_deserializer=decode, **{slot: _streaming(behaviour)})
    else:
        # Served as a client-streaming method (the same on the wire) that takes the first message.
        guarded = h._replace(
            request_streaming=True,
            request_deserializer=decode,
            **{slot: None, "stream_" + response: _unary(behaviour, reject)},
        )
    return guarded


def _decoder(parse: Callable[[bytes], Any], wanted: str, method: str) -> Callable[[bytes], Any]:
    def decode(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception as e:  # DecodeError, or anything else a parser may raise on bad bytes
            reason = _reason(e)
            log.debug(
                "%s: a request of %d bytes could not be decoded (%s)", method, len(data), reason
            )
            return Undecodable(f"the request could not be decoded as a {wanted}: {reason}")

    return decode


def _reason(error: Exception) -> str:
    """protobuf's reason, without its "Error parsing message with type 'x': " preamble."""
    text = " ".join(str(error).split()) or type(error).__name__
    _, sep, rest = text.partition("': ")
    return rest if sep and rest else text


def _unary(behaviour: Callable[..., Any], reject: Reject) -> Callable[..., Any]:
    async def call(requests: object, context: Any) -> Any:
        request = await context.read()
        if request is EOF:
            await reject(context, InvalidArgument("the call carried no request message"))
        if isinstance(request, Undecodable):
            await reject(context, InvalidArgument(request.message))
        return await behaviour(request, context)

    return call


def _streaming(behaviour: Callable[..., Any]) -> Callable[..., Any]:
    async def call(requests: Any, context: Any) -> Any:
        return await behaviour(_Decoded(requests), context)

    return call


class _Decoded:
    """A stream's requests; an undecodable one raises InvalidArgument where it is read (the
    servicer handles it as it handles any other invalid request)."""

    __slots__ = ("_requests",)

    def __init__(self, requests: AsyncIterator[Any]) -> None:
        self._requests = aiter(requests)

    def __aiter__(self) -> _Decoded:
        return self

    async def __anext__(self) -> Any:
        request = await anext(self._requests)
        if isinstance(request, Undecodable):
            raise InvalidArgument(request.message)
        return request


class _Table:
    """Stands in for a server to collect what a generated ``add_XServicer_to_server`` adds."""

    def __init__(self) -> None:
        self.handlers: dict[str, Handler] = {}

    def add_generic_rpc_handlers(self, handlers: object) -> None:
        pass  # the same handlers come again, by name, in add_registered_method_handlers

    def add_registered_method_handlers(self, service: str, handlers: Mapping[str, Handler]) -> None:
        self.handlers.update(handlers)
