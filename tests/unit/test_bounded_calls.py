"""The deadline on a database call (``wqbroker.store.postgres.pool.bounded``): the caller is let
go at the deadline, without waiting for the call to finish being cancelled (asyncpg, cancelled on
a dead link, first waits to cancel the query on the server); the call is cancelled all the same,
and a caller that goes away takes the call with it."""

from __future__ import annotations

import asyncio

import pytest

from wqbroker.store.postgres.pool import bounded


class SlowToCancel:
    """A call that never answers, and once cancelled takes as long as it is told to end."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()
        self.may_end = asyncio.Event()
        self.ended = False

    async def __call__(self) -> int:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            await self.may_end.wait()
            self.ended = True
            raise
        return 0


async def test_an_answer_in_time_is_the_answer() -> None:
    async def answer() -> int:
        await asyncio.sleep(0)
        return 7

    assert await bounded(answer(), 5.0) == 7


async def test_an_error_in_time_is_the_error() -> None:
    async def fail() -> int:
        raise OSError("refused")

    with pytest.raises(OSError, match="refused"):
        await bounded(fail(), 5.0)


async def test_past_the_deadline_the_caller_is_let_go_and_the_call_cancelled() -> None:
    call = SlowToCancel()
    with pytest.raises(TimeoutError):
        await bounded(call(), 0.01)
    assert not call.ended  # let go while the call was still winding down
    await asyncio.wait_for(call.cancelled.wait(), 5)
    call.may_end.set()
    await asyncio.sleep(0)
    assert call.ended


async def test_a_caller_that_goes_away_takes_the_call_with_it() -> None:
    call = SlowToCancel()
    caller = asyncio.ensure_future(bounded(call(), 60.0))
    await asyncio.sleep(0.01)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    await asyncio.wait_for(call.cancelled.wait(), 5)
    call.may_end.set()
