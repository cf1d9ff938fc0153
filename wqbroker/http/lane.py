"""What the fast lane (``fast.py``) and aiohttp's side of a connection (``server.py``) share.
``server.py`` makes the lane's connections (it imports ``fast.py``); the lane never imports
``server.py``, not even for its types: it knows aiohttp's handler only as a :class:`SlowPath`.

- :class:`Lane`: what the lane serves with (``app.create_app`` makes it; ``LANE`` is its key in
  the application);
- :class:`SlowPath`: what the lane needs of the aiohttp handler it passes requests to (and may
  hand the connection to for good), ``server.Protocol``;
- :class:`Deadline`: the one timer a connection keeps its time-outs with (head, body, idle),
  on either side.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Protocol

from aiohttp import web

from wqbroker.auth import Tokens
from wqbroker.metrics import Metrics
from wqbroker.service import Service


@dataclass(frozen=True, slots=True)
class Lane:
    """What the fast lane serves with (the application's own: ``app.create_app`` makes it)."""

    service: Service
    metrics: Metrics
    tokens: Tokens | None
    max_body: int
    read_body_timeout: float
    # The application's own middleware: the lane does what it does, and serves only while the
    # application has no other (one added would be bypassed), nor a response hook.
    middleware: object

    def serves(self, app: web.Application) -> bool:
        return list(app.middlewares) == [self.middleware] and not app.on_response_prepare


LANE: Final = web.AppKey("lane", Lane)


class SlowPath(Protocol):
    """aiohttp's handler of a connection, as the fast lane uses it (``server.Protocol`` is one):
    it is given the transport, then the bytes of each request passed to it (and says when it has
    answered, through the lane's ``slow_done``), the transport's flow control, and the end."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None: ...

    def data_received(self, data: bytes) -> None: ...

    def connection_lost(self, exc: BaseException | None) -> None: ...

    def pause_writing(self) -> None: ...

    def resume_writing(self) -> None: ...

    def take_over(self, transport: asyncio.Transport) -> None:
        """The connection is the handler's from now on: it becomes the transport's protocol, and
        keeps the time-outs."""


class Deadline:
    """One timer per connection for its time-outs: ``set`` a deadline, ``clear`` it (while a
    request is answered, none runs), ``cancel`` the timer when the connection ends.

    The timer is not cancelled and re-made each time the deadline moves: it is re-armed only
    when the deadline moves sooner than it is set for, or when it fires early (the deadline
    moved later since). Once the deadline has passed, ``expire`` runs one loop turn later (so a
    head parsed in this very turn goes first), and only if the deadline is still passed then."""

    __slots__ = ("_loop", "_expire", "_due", "_timer")

    def __init__(self, loop: asyncio.AbstractEventLoop, expire: Callable[[], None]) -> None:
        self._loop = loop
        self._expire = expire
        self._due: float | None = None
        self._timer: asyncio.TimerHandle | None = None

    def set(self, due: float) -> None:
        """Time out at ``due`` (the loop's time)."""
        self._due = due
        timer = self._timer
        if timer is not None and timer.when() > due:  # sooner than the timer is set for
            timer.cancel()
            timer = None
        if timer is None:
            self._timer = self._loop.call_at(due, self._check)

    def clear(self) -> None:
        """No time-out, until the next ``set`` (the timer, if armed, fires and finds none)."""
        self._due = None

    def cancel(self) -> None:
        """The connection has ended (or is another's now): no time-out, and no timer."""
        self._due = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        self._timer = None
        due = self._due
        if due is None:
            return
        if self._loop.time() < due:  # the deadline moved later: wait for the new one
            self._timer = self._loop.call_at(due, self._check)
            return
        self._loop.call_soon(self._fire)

    def _fire(self) -> None:
        due = self._due
        if due is not None and self._loop.time() >= due:
            self._expire()
