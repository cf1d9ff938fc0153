"""Whether a broker on PostgreSQL announces what it makes ready (wqbroker/store/postgres/
listener.py): only when another broker may be listening, as of the last sweep's count of the
brokers listening (this one included) or a hello since. A count made while this broker's own
listening connection was down left it out; once it listens again, that count must not read as
"nobody else" (it did: a task enqueued on a broker that had just recovered from a partition woke
nobody on the other broker until its polling came round). No database: the count is given."""

from __future__ import annotations

import time

from wqbroker.store.postgres.listener import Listener


def listener() -> Listener:
    return Listener("postgres://nowhere/db", "me", pool=None)  # type: ignore[arg-type]


def later() -> float:
    """A sweep's start, after whatever the listener did so far (monotonic)."""
    return time.monotonic() + 1.0


async def test_with_no_count_yet_it_announces() -> None:
    assert listener()._others_listen()


async def test_a_count_of_this_broker_alone_stops_announcing_and_of_two_starts_again() -> None:
    lis = listener()
    lis._started_listening()
    lis.counted(1, later())
    assert not lis._others_listen()
    lis.counted(2, later())
    assert lis._others_listen()


async def test_a_count_made_while_it_was_not_listening_is_not_read_as_nobody_else() -> None:
    lis = listener()
    lis._started_listening()
    lis.counted(2, later())
    lis._listening.clear()  # its connection is lost: a sweep counts the other broker alone
    lis.counted(1, later())
    assert lis._others_listen()  # (one listens, and it is not this one)
    began = time.monotonic() - 1.0
    lis._started_listening()  # it listens again
    assert lis._others_listen()
    lis.counted(1, began)  # a sweep that began before it listened again: out of date
    assert lis._others_listen()
    lis.counted(2, later())  # a sweep after it: the two of them
    assert lis._others_listen()
    lis.counted(1, later())  # and after that, this one alone
    assert not lis._others_listen()


async def test_a_count_made_before_another_broker_said_hello_is_out_of_date() -> None:
    lis = listener()
    lis._started_listening()
    began = later()
    lis._hello_at = began + 1.0  # (another broker said hello since the sweep began)
    lis.counted(1, began)
    assert lis._others_listen()
