"""The short cuts the per-task paths take give the answers of the long way round: a payload's
JSON check, the dispatcher's share-out of slots, the timestamps a gRPC answer carries."""

from __future__ import annotations

import json
import math

import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers import json_values
from wqbroker import codec
from wqbroker.dispatch import Consumer, Dispatcher
from wqbroker.errors import InvalidArgument
from wqbroker.grpc import server as grpc_server

# -- a payload's JSON check ------------------------------------------------------------------------

_JSONISH = json_values


def _long_way(data: bytes) -> str | None:
    """The check's verdict as the standard decoder gives it (None: valid)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return "utf-8"
    if not text.strip(" \t\n\r"):
        return "empty"
    return codec._diagnose(text)


def _verdict(data: bytes) -> str | None:
    try:
        assert codec.validate_json(data) == data
    except InvalidArgument as e:
        return e.message
    return None


@given(_JSONISH, st.sampled_from(["", " ", "\n", "\t \r\n"]), st.sampled_from(["", " ", "\n"]))
def test_valid_json_is_accepted_with_or_without_space_around_it(
    value: object, before: str, after: str
) -> None:
    data = (before + json.dumps(value) + after).encode()
    assert _verdict(data) is None


@given(st.binary(max_size=40) | st.text(max_size=40).map(str.encode))
def test_the_check_refuses_exactly_what_the_standard_decoder_refuses(data: bytes) -> None:
    verdict, expected = _verdict(data), _long_way(data)
    assert (verdict is None) == (expected is None), (data, verdict, expected)
    if expected is not None and expected not in ("utf-8", "empty"):
        assert verdict == f"payload {expected}"  # the same words, whichever way it went


@pytest.mark.parametrize(
    "data",
    [b"NaN", b"[Infinity]", b'{"a":1}x', b'{"a":1} {"b":2}', b"1 2", b'"\\ud800"x', b"[" * 100_000],
)
def test_near_misses_are_refused_with_the_long_way_s_reason(data: bytes) -> None:
    assert _verdict(data) is not None
    assert _verdict(data) == f"payload {_long_way(data)}"


def test_valid_json_from_a_lone_surrogate_escape_is_kept() -> None:
    assert _verdict(b'"\\ud800"') is None  # as the standard decoder has it


# -- the dispatcher's share-out of slots -----------------------------------------------------------


def _slots_round_by_round(rooms: list[int], limit: int) -> list[int]:
    """The share-out one round at a time: each consumer with room once per round, in order."""
    slots: list[int] = []
    round_ = 0
    front = list(range(len(rooms)))
    while front and len(slots) < limit:
        front = [c for c in front if rooms[c] > round_]
        slots.extend(front[: limit - len(slots)])
        round_ += 1
    return slots


@given(
    st.lists(st.integers(min_value=1, max_value=70), min_size=1, max_size=6), st.integers(1, 200)
)
def test_slots_are_shared_out_round_by_round(rooms: list[int], limit: int) -> None:
    # (A consumer waits in line only while it has room: at least one.)
    dispatcher = Dispatcher.__new__(Dispatcher)
    consumers = [Consumer(30.0, room) for room in rooms]
    dispatcher._lines = {("default",): dict.fromkeys(consumers)}  # type: ignore[dict-item]
    got = dispatcher._slots(("default",), limit)
    assert [consumers.index(c) for c in got] == _slots_round_by_round(rooms, limit)


# -- timestamps ------------------------------------------------------------------------------------


@given(st.floats(min_value=0, max_value=2**33, allow_nan=False, allow_infinity=False))
def test_a_remembered_time_is_set_as_a_fresh_one_would_be(ts: float) -> None:
    grpc_server._splits.clear()
    first, again = Timestamp(), Timestamp()
    grpc_server._set_time(first, ts)
    grpc_server._set_time(again, ts)  # (from what was remembered)
    assert (first.seconds, first.nanos) == (again.seconds, again.nanos) == grpc_server._split(ts)
    assert 0 <= first.nanos < 1_000_000_000
    assert math.isclose(first.seconds + first.nanos / 1e9, ts, abs_tol=1e-6)
