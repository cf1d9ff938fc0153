"""Protected mode on the gRPC API (``wqbroker.protected``): one server interceptor that serves
only callers on this machine, and ends every other call with PERMISSION_DENIED and
:data:`~wqbroker.protected.REFUSAL`, before the method runs (health checking excepted: the
probes are answered for everyone).

gRPC has no hook on a connection, and an interceptor does not see the caller: each call's
behaviour is wrapped to look at ``context.peer()`` first. What a peer string (address and port:
one connection) was found to be is remembered, so a connection's calls after its first cost a
dict lookup. A method that takes a stream of requests takes the first message before the refusal
(as ``auth.py``'s refusals do: a client still writing when the call ends sees INTERNAL, not the
status).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any, Final

import grpc

from wqbroker.errors import PermissionDenied
from wqbroker.grpc.auth import Handler, behavior_of, with_behavior
from wqbroker.grpc.server import abort
from wqbroker.protected import PROBES, REFUSAL, RefusalLog, grpc_peer_is_local

Context = grpc.aio.ServicerContext[Any, Any]

# Peers remembered (a connection each) before the memory is cleared and starts again.
MAX_PEERS: Final = 4096
# How long a refused call that takes a stream may take to send its first message.
_FIRST_MESSAGE_WAIT: Final = 1.0

_PROBES: Final = frozenset(PROBES.grpc)


class LocalOnlyInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Serves calls from loopback peers (and health checks from anyone); refuses the others."""

    def __init__(self) -> None:
        self._peers: dict[str, bool] = {}
        self._wrapped: dict[str, tuple[Handler, Handler]] = {}  # method -> (handler, guarded)
        self._refusals = RefusalLog("gRPC")

    def local(self, context: Context) -> bool:
        """Whether the call's peer is on this machine (logging a refused one)."""
        peer = context.peer()
        known = self._peers.get(peer)
        if known is None:
            if len(self._peers) >= MAX_PEERS:
                self._peers.clear()
            known = self._peers[peer] = grpc_peer_is_local(peer)
            if not known:
                self._refusals.refused(asyncio.get_running_loop().time(), peer)
        return known

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method in _PROBES:
            return handler  # (no such method: UNIMPLEMENTED, to anyone)
        held = self._wrapped.get(method)
        if held is not None and held[0] is handler:
            return held[1]
        guarded = _guarded(handler, self.local)
        self._wrapped[method] = (handler, guarded)
        return guarded


async def _refuse(handler: Handler, request: Any, context: Context) -> None:
    if handler.request_streaming:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(anext(aiter(request)), _FIRST_MESSAGE_WAIT)
    await abort(context, PermissionDenied(REFUSAL))


def _guarded(handler: Handler, local: Callable[[Context], bool]) -> Handler:
    """``handler`` with its caller's peer checked before its behaviour runs."""
    behavior = behavior_of(handler)
    if inspect.isasyncgenfunction(behavior):

        async def streaming(request: Any, context: Context) -> AsyncIterator[Any]:
            if not local(context):
                await _refuse(handler, request, context)
            async with contextlib.aclosing(behavior(request, context)) as responses:
                async for response in responses:
                    yield response

        return with_behavior(handler, streaming)

    async def call(request: Any, context: Context) -> Any:
        if not local(context):
            await _refuse(handler, request, context)
        return await behavior(request, context)

    return with_behavior(handler, call)
