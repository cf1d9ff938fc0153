"""Wake-ups between brokers sharing one PostgreSQL database: LISTEN/NOTIFY, with reconnection.

Whatever makes tasks ready in one broker (an enqueue, a promotion, a requeue, a release, a resume)
is announced after its commit with a NOTIFY on :data:`CHANNEL` carrying the queue names: one in
flight at a time, gathering the rest meanwhile (a NOTIFY inside every changing transaction would
serialize the commits on the database's notification lock). Now and then (an idle broker: every
time) an enqueue carries its own announcement in its transaction instead (:meth:`Listener.inline`),
and the others hear of it a round trip sooner. With no other broker listening (as of the last
sweep's count, or a hello since), nothing is announced.

A connection of its own LISTENs for the others' announcements and tells the store's callback
(:meth:`Listener.on_ready`), which pumps the consumers waiting for those queues. The same
connection is the store's probe: it pings the database every second, so a silent partition is
noticed within a few seconds with or without traffic, and tells the pool (pool.py) that the
database is away (a ping unanswered, the connection not to be made) or back. It is made again
when lost (at once, then with backoff), and then every queue is re-checked (announcements may have
been missed). When it starts listening, a broker says hello, so that the others announce to it.

Cancels (docs/design/control.md) go on the same channel: a cancel that makes a handed-out task
cancelling NOTIFYs its lease id in its own transaction (so the other brokers hear it exactly when
it is committed: :meth:`Listener.cancel_head`), and a broker that hears one tells the store's
cancel callback (:meth:`Listener.on_cancel`), whose dispatcher tells the stream holding that lease,
if it is one of its own.

Watched tasks that end (docs/design/results.md: a waiter for their result, on some broker) go on
it too: whatever ends one (an ack, a burial, a cancel, an expiry, on whichever broker) NOTIFYs its
id and how it ended in its own transaction (:meth:`Listener.finish_head`; a task nobody waits for
costs nothing: the flag is read with the change), and a broker that hears one tells the store's
callback (:meth:`Listener.on_finished`), whose service answers the waiters of that task, if it
has any. What is heard is parsed defensively: anyone with access to the database
may NOTIFY on the channel, and a payload that is not one of these messages at worst has consumers
look again (read as queue names); in a cancel message, only lease ids (16 hex digits) are taken.
Nothing heard is ever a failure.

The messages, one per NOTIFY, each the sender's random id (so that a broker ignores its own),
a newline, then the body, whose lines are:

- queue names: tasks are ready in these queues (``*``: in any);
- ``+``: the sender listens now (announce to it);
- ``~``, then lease ids: the tasks held under these leases are cancelling (a batch, of one or
  more: a cancel sends its one);
- ``!``, then a line per watched task that ended, its id and how (``1`` succeeded, ``2`` acked,
  ``3`` dead, ``4`` cancelled, ``5`` expired), a space between (at most 250 a message).
  ``~``, ``!`` and ``+`` are never queue names.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Final

import asyncpg

from wqbroker.errors import StoreError
from wqbroker.models import (
    ACKED,
    CANCELLED_STATE,
    DEAD,
    EXPIRED_STATE,
    SUCCEEDED,
    NewTask,
)
from wqbroker.store import FinishedCallback
from wqbroker.store.postgres import dsn as dsns
from wqbroker.store.postgres.pool import (
    PROBE_EVERY,
    PROBE_TIMEOUT,
    READ_ONLY,
    RETRY_CAP,
    RETRY_FIRST,
    UNREACHABLE,
    Pool,
    bounded,
    cancel,
    one_line,
    tune,
)
from wqbroker.store.postgres.queries import Q

log = logging.getLogger("wqbroker.store.postgres")

# The channel on which brokers tell each other which queues have tasks ready (the functions
# wq.enqueue and wq.announce NOTIFY on it: sql/functions.sql).
CHANNEL: Final = "wq_ready"
# The application_name of the connections that LISTEN (so brokers can count each other: wq.sweep
# counts the connections of this name).
LISTENER_NAME: Final = "wq listener"
# What a broker announces when it starts listening (so that the others announce to it).
_HELLO: Final = "+"
# The first line of the body of a message of cancelled leases (one a line after it).
_CANCELS: Final = "~"
# The first line of the body of a message of watched tasks that ended.
_FINISHED: Final = "!"
_LEASE_ID: Final = re.compile(r"[0-9a-f]{16}")
#: How a watched task ended, by its number in the functions' rows and the messages.
FINISHED_AS: Final = {1: SUCCEEDED, 2: ACKED, 3: DEAD, 4: CANCELLED_STATE, 5: EXPIRED_STATE}
_FINISHED_AS: Final = {str(n): state for n, state in FINISHED_AS.items()}
# An enqueue carries its own announcement (NOTIFY in its transaction) at most this often.
_INLINE_GAP: Final = 0.005
# NOTIFY payloads stop at 8000 bytes: a longer list of queues is sent as "any queue".
_MOST: Final = 7000

ReadyCallback = Callable[[Iterable[str] | None], None]
CancelCallback = Callable[[Iterable[str]], None]


class Listener:
    """One broker's side of the wake-ups: what it announces, and what it hears."""

    def __init__(self, dsn: str, me: str, pool: Pool) -> None:
        self._dsn = dsn
        self._me = me  # tells our own announcements apart
        self._pool = pool
        self.closed = False
        self._ready_elsewhere: ReadyCallback | None = None
        self._cancelled_elsewhere: CancelCallback | None = None
        self._finished: FinishedCallback | None = None
        self._to_announce: set[str] = set()
        self._announcer: asyncio.Task[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._listening = asyncio.Event()
        self._listens = 0  # LISTENs made (the first at open, then one per reconnection)
        # Brokers listening, this one included, as of the last sweep (None: not known yet). With
        # no other, there is nobody to announce anything to.
        self._listeners: int | None = None
        self._hello_at = 0.0  # when another broker last said it started listening (monotonic)
        self._listened_at = 0.0  # when this broker last started listening (monotonic)
        self._inline_after = 0.0  # when an enqueue may next carry its announcement (monotonic)
        self.announcements = 0  # NOTIFYs sent (for the tests)

    async def start(self) -> None:
        """Start listening; wait (briefly) for the first LISTEN, so that a broker that answers
        has heard everything announced since. If it fails, the listener keeps trying and polling
        covers the gap."""
        self._task = asyncio.get_running_loop().create_task(
            self._listen(), name="wq-postgres-listener"
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._listening.wait(), 10)

    async def close(self) -> None:
        """Stop listening; let the last announcement go out (a second at most)."""
        self.closed = True
        await cancel(self._task)
        if self._announcer is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._announcer), 1)

    # -- told ----------------------------------------------------------------------------------

    def on_ready(self, callback: ReadyCallback) -> None:
        self._ready_elsewhere = callback

    def on_cancel(self, callback: CancelCallback) -> None:
        self._cancelled_elsewhere = callback

    def on_finished(self, callback: FinishedCallback) -> None:
        self._finished = callback

    def finished(self, pairs: Sequence[tuple[str, str]]) -> None:
        """Tell the store's callback that these watched tasks ended (this broker's changes, once
        committed, or another's, heard)."""
        if pairs and self._finished is not None and not self.closed:
            self._finished(pairs)

    def tell(self, queues: Iterable[str] | None) -> None:
        """Tell the store's callback that tasks became ready in ``queues`` (None: any queue)."""
        if self._ready_elsewhere is not None and not self.closed:
            self._ready_elsewhere(queues)

    # -- announcing ----------------------------------------------------------------------------

    def announce(self, queues: Iterable[str]) -> None:
        """Tell the other brokers these queues have tasks ready (NOTIFY, after the commit)."""
        if not self._others_listen():
            return
        self._to_announce.update(queues)
        if self._to_announce and self._announcer is None and not self.closed:
            self._announcer = asyncio.get_running_loop().create_task(self._send_announcements())

    def inline(self, items: Sequence[NewTask]) -> str | None:
        """The announcement an enqueue of ``items`` may carry in its own transaction, or None.
        Not more often than every ``_INLINE_GAP``: a transaction that notifies holds the
        database's notification lock through its commit's flush to disk, and busy brokers would
        queue on it."""
        started = time.monotonic()
        if started < self._inline_after or self._announcer is not None:
            return None
        if not self._others_listen():
            return None
        queues = {t.queue for t in items if t.delay <= 0}
        if not queues:
            return None
        self._inline_after = started + _INLINE_GAP
        return self._payload(queues)

    def cancel_head(self) -> str | None:
        """The start of the message a cancel sends in its own transaction (its lease id follows),
        or None when no other broker listens."""
        if not self._others_listen():
            return None
        return f"{self._me}\n{_CANCELS}\n"

    def finish_head(self) -> str | None:
        """The start of the message a change that ends watched tasks sends in its own
        transaction (their lines follow), or None when no other broker listens."""
        if not self._others_listen():
            return None
        return f"{self._me}\n{_FINISHED}\n"

    def counted(self, listeners: int, started: float) -> None:
        """A sweep that began at ``started`` (monotonic) counted this many brokers listening
        (out of date if another said hello since it began, or if this one started listening
        since: a count made while it was not listening leaves it out, and would read as
        nobody else once it listens)."""
        if started > self._hello_at and started > self._listened_at:
            self._listeners = listeners

    def _started_listening(self) -> None:
        """A LISTEN was made. Who else listens is not known again until a sweep that began
        after it counts (a count made meanwhile left this broker out): announce till then."""
        self._listens += 1
        self._listened_at = time.monotonic()
        self._listeners = None
        self._listening.set()

    def _others_listen(self) -> bool:
        """Whether another broker may be listening (as of the last sweep, or a hello since)."""
        return self._listeners is None or self._listeners > self._listening.is_set()

    def _payload(self, queues: Iterable[str]) -> str:
        payload = self._me + "\n" + "\n".join(sorted(queues))
        if len(payload) > _MOST:
            payload = self._me + "\n*"
        return payload

    async def _send_announcements(self) -> None:
        try:
            while self._to_announce and not self.closed and self._pool.raw is not None:
                queues, self._to_announce = self._to_announce, set()
                payload = self._payload(queues)
                try:
                    await self._pool.execute(Q.announce, payload)  # (bounded; fails fast)
                    self.announcements += 1
                except StoreError as e:
                    # The others poll (and re-check everything when they reconnect).
                    log.debug("could not announce ready queues: %s", one_line(e))
                    return
        finally:
            self._announcer = None

    # -- hearing -------------------------------------------------------------------------------

    def _heard(self, _conn: object, _pid: int, _channel: str, payload: object) -> None:
        # (Called by asyncpg for each notification: whatever it holds, nothing may escape.)
        try:
            self._hear(str(payload))
        except Exception:
            log.exception("a notification on %s could not be handled (ignored)", CHANNEL)

    def _hear(self, payload: str) -> None:
        sender, _, body = payload.partition("\n")
        if sender == self._me:
            return
        if body == _HELLO:
            # Another broker listens now: announce again (a count from a sweep that began
            # before this is out of date).
            self._listeners = None
            self._hello_at = time.monotonic()
            return
        kind, _, rest = body.partition("\n")
        if kind == _CANCELS:
            leases = [x for x in rest.split("\n") if _LEASE_ID.fullmatch(x)]
            if leases and self._cancelled_elsewhere is not None and not self.closed:
                self._cancelled_elsewhere(leases)
            return
        if kind == _FINISHED:
            pairs = []
            for line in rest.split("\n"):
                task_id, _, how = line.partition(" ")
                state = _FINISHED_AS.get(how)
                if state is not None and _LEASE_ID.fullmatch(task_id):
                    pairs.append((task_id, state))
            self.finished(pairs)
            return
        self.tell(None if body == "*" else body.split("\n"))

    async def _listen(self) -> None:
        """Keep a connection LISTENing for other brokers' announcements, and probing the
        database on it (:meth:`_hear_on`): made again when lost (at once the first time, then
        with backoff), and then every queue is re-checked (announcements may have been missed).
        When it cannot be made, the database is taken for away (pool.py)."""
        delay = 0.0  # (a connection lost is made again at once: only failing to make it waits)
        while not self.closed:
            try:
                conn = await bounded(
                    dsns.connect(
                        self._dsn,
                        timeout=PROBE_TIMEOUT,  # (each server of the DSN)
                        server_settings={"application_name": LISTENER_NAME},
                    ),
                    dsns.connect_time(self._dsn, PROBE_TIMEOUT),
                )
            except (*UNREACHABLE, asyncpg.PostgresError) as e:
                self._pool.unreachable(e)
                log.debug("listener: cannot connect (%s); again in %.2f s", one_line(e), delay)
                await asyncio.sleep(delay)
                delay = min(max(delay * 2, RETRY_FIRST), RETRY_CAP)
                continue
            delay = 0.0
            try:
                await tune(conn)
                await self._hear_on(conn)
            except Exception:  # whatever it was, listen again (the polls cover the gap)
                log.exception("the listening connection failed; listening again")
                await asyncio.sleep(RETRY_CAP)
            finally:
                self._listening.clear()
                conn.terminate()  # (no goodbye to wait for: the link may be dead)

    async def _hear_on(self, conn: asyncpg.Connection) -> None:
        lost = asyncio.Event()
        conn.add_termination_listener(lambda _c: lost.set())
        try:
            await bounded(conn.add_listener(CHANNEL, self._heard), PROBE_TIMEOUT)
        except (*UNREACHABLE, asyncpg.PostgresError) as e:
            self._pool.unreachable(e)
            return
        self._started_listening()
        with contextlib.suppress(*UNREACHABLE, asyncpg.PostgresError):
            await bounded(conn.execute(Q.announce, f"{self._me}\n{_HELLO}"), PROBE_TIMEOUT)
        if self._pool.failed is not None:
            await self._pool.recovered()
        elif self._listens > 1:
            self.tell(None)
        await self._probe(conn, lost)

    async def _probe(self, conn: asyncpg.Connection, lost: asyncio.Event) -> None:
        """Ping the database on this connection every PROBE_EVERY seconds (at once when a call
        ran past its deadline), until the connection is lost. A ping unanswered within
        PROBE_TIMEOUT means the database is away (a silent partition sends nothing back): the
        pool fails fast from then on, whether or not this broker has traffic. The ping also
        tells whether the server has become read-only (a primary demoted, or
        ``default_transaction_read_only`` turned on): then the same, and the pool's connections
        are made again (through the DSN's servers, to the primary) as this one is."""
        look = self._pool.look
        while not lost.is_set() and not self.closed:
            look.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(_either(lost, look), PROBE_EVERY)
            if lost.is_set() or self.closed:
                return
            try:
                read_only = await bounded(conn.fetchval(Q.ping), PROBE_TIMEOUT)
            except TimeoutError:
                self._pool.unreachable(f"no answer to a ping within {PROBE_TIMEOUT:g} s")
                return
            except (*UNREACHABLE, asyncpg.PostgresError) as e:
                self._pool.unreachable(e)
                return
            if read_only:
                self._pool.unreachable(READ_ONLY)
                self._pool.expire()
                return


async def _either(*events: asyncio.Event) -> None:
    """Wait until one of ``events`` is set."""
    waits = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
