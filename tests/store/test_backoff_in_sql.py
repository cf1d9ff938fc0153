"""The retry delay the PostgreSQL store computes in the database (``wq.backoff``) is exactly the
one every other store computes in Python (:func:`wqbroker.retry.backoff_delay`, the reference), bit
for bit, whatever the attempts, base, cap and random draw: a task nacked on a broker with the
PostgreSQL store comes back when it would on any other.

The database computes it because only the settling transaction knows a task's attempts (one round
trip); this is what keeps the two formulas, and their constants (``MAX_DOUBLINGS``), one.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterator

import asyncpg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests import pg
from tests.helpers import examples
from wqbroker.retry import MAX_DOUBLINGS, backoff_delay
from wqbroker.store.postgres import PostgresStore

Inputs = tuple[int, float, float, float]  # attempts, base, cap, u
Compute = Callable[[list[Inputs]], list[float]]

ALMOST_ONE = math.nextafter(1.0, 0.0)  # the largest draw random.random() returns
INT4_MAX = 2**31 - 1  # the most attempts the tasks table holds

# The inputs a broker can have: a base and a cap in whole milliseconds (0, or from 1 ms; bases up
# to 1e280 s), a draw of random.random() (a multiple of 2**-53). (Past them the two part ways where
# they cannot matter: the database raises on a float8 overflow or underflow where Python's floats
# become inf or 0.)
attempts = st.integers(0, INT4_MAX) | st.sampled_from(
    [0, 1, 2, MAX_DOUBLINGS - 1, MAX_DOUBLINGS, MAX_DOUBLINGS + 1, MAX_DOUBLINGS + 2, INT4_MAX]
)
bases = st.floats(1e-3, 1e280) | st.sampled_from([0.0, 0.001, 1.0, 30.0])
caps = st.floats(1e-3, 1e300) | st.sampled_from([0.0, 30.0, math.inf])
draws = st.integers(0, 2**53 - 1).map(lambda k: k / 2**53) | st.sampled_from([0.0, ALMOST_ONE])


@pytest.fixture(scope="module")
def in_sql() -> Iterator[Compute]:
    """``wq.backoff`` of a batch of inputs, in one query, on a database the store made."""
    loop = asyncio.new_event_loop()
    try:
        dsn = loop.run_until_complete(pg.create_database("backoff"))
        store = loop.run_until_complete(PostgresStore.open(dsn))  # the schema, its functions
        loop.run_until_complete(store.close())
        conn = loop.run_until_complete(asyncpg.connect(dsn))

        def compute(batch: list[Inputs]) -> list[float]:
            rows = loop.run_until_complete(
                conn.fetch(
                    "SELECT wq.backoff(a, b, c, u) FROM unnest($1::int[], $2::float8[], "
                    "$3::float8[], $4::float8[]) WITH ORDINALITY AS x(a, b, c, u, i) ORDER BY i",
                    *([x[k] for x in batch] for k in range(4)),
                )
            )
            return [float(r[0]) for r in rows]

        yield compute
        loop.run_until_complete(conn.close())
    finally:
        loop.close()


def in_python(batch: list[Inputs]) -> list[float]:
    return [backoff_delay(a, b, c, u) for a, b, c, u in batch]


def test_the_edges_agree(in_sql: Compute) -> None:
    batch = [
        (a, b, c, u)
        for a in (0, 1, 2, 5, MAX_DOUBLINGS, MAX_DOUBLINGS + 1, MAX_DOUBLINGS + 2, INT4_MAX)
        for b in (0.0, 1.0, 0.25, 1e6)
        for c in (0.0, 30.0, 1e30, math.inf)
        for u in (0.0, 0.5, ALMOST_ONE)
    ]
    assert in_sql(batch) == in_python(batch)
    # (the doublings stop at the same place: past it, an uncapped delay no longer grows)
    assert in_sql([(MAX_DOUBLINGS + 1, 1.0, math.inf, 0.0)]) == [2.0**MAX_DOUBLINGS / 2]


@settings(max_examples=examples(60), deadline=None)
@given(batch=st.lists(st.tuples(attempts, bases, caps, draws), min_size=1, max_size=200))
def test_any_inputs_agree(in_sql: Compute, batch: list[Inputs]) -> None:
    assert in_sql(batch) == in_python(batch)
