"""Retry backoff: roughly 1 s, 2 s, 4 s ... capped at 30 s, half fixed and half random."""

from __future__ import annotations

import math
import random

import pytest

from wqbroker.retry import DEFAULT_BASE, DEFAULT_CAP, Backoff, backoff_delay

ALMOST_ONE = math.nextafter(1.0, 0.0)  # the largest value random.random() can return
DRAWS = [0.0, 0.25, 0.5, 0.75, ALMOST_ONE]


def nominal(attempts: int, base: float = 1.0, cap: float = 30.0) -> float:
    return min(cap, base * 2.0 ** (attempts - 1))


def test_defaults_are_the_spec_values() -> None:
    assert DEFAULT_BASE == 1.0
    assert DEFAULT_CAP == 30.0
    backoff = Backoff(rng=random.Random(0))
    assert 0.5 <= backoff.delay(1) <= 1.0
    assert 15.0 <= backoff.delay(40) <= 30.0


@pytest.mark.parametrize("attempts", range(1, 41))
def test_delay_lies_between_half_and_all_of_the_nominal_delay(attempts: int) -> None:
    expected = nominal(attempts)
    for u in DRAWS:
        delay = backoff_delay(attempts, 1.0, 30.0, u)
        assert expected / 2 <= delay <= expected, (attempts, u, delay)


def test_the_nominal_delay_doubles_from_one_second() -> None:
    # u = 0 gives exactly the fixed half: 0.5, 1, 2, 4, 8 (nominal 1, 2, 4, 8, 16) ...
    halves = [backoff_delay(a, 1.0, 30.0, 0.0) for a in range(1, 6)]
    assert halves == [0.5, 1.0, 2.0, 4.0, 8.0]


@pytest.mark.parametrize("attempts", [6, 7, 10, 40])
def test_the_delay_is_capped_at_thirty_seconds(attempts: int) -> None:
    assert backoff_delay(attempts, 1.0, 30.0, 0.0) == 15.0
    assert backoff_delay(attempts, 1.0, 30.0, ALMOST_ONE) == pytest.approx(30.0)
    assert backoff_delay(attempts, 1.0, 30.0, ALMOST_ONE) <= 30.0


@pytest.mark.parametrize("attempts", [64, 65, 100, 1_000, 2**40, 10**100])
def test_huge_attempt_counts_do_not_overflow(attempts: int) -> None:
    for u in DRAWS:
        delay = backoff_delay(attempts, 1.0, 30.0, u)
        assert math.isfinite(delay)
        assert 15.0 <= delay <= 30.0


def test_huge_attempts_with_a_large_base_still_hit_the_cap() -> None:
    assert backoff_delay(10**9, 1e6, 30.0, 0.5) == 22.5


@pytest.mark.parametrize("attempts", [0, -1, -(10**9)])
def test_nonsense_attempt_counts_fall_back_to_the_base_delay(attempts: int) -> None:
    assert 0.5 <= backoff_delay(attempts, 1.0, 30.0, 0.5) <= 1.0


def test_u_zero_gives_the_fixed_half_and_u_near_one_the_whole() -> None:
    for attempts in range(1, 10):
        whole = nominal(attempts)
        assert backoff_delay(attempts, 1.0, 30.0, 0.0) == whole / 2
        near = backoff_delay(attempts, 1.0, 30.0, ALMOST_ONE)
        assert whole / 2 < near <= whole
        assert near == pytest.approx(whole)


def test_the_random_half_scales_linearly_with_u() -> None:
    # nominal 8 s: 4 s fixed, plus 4 s scaled by u
    assert backoff_delay(4, 1.0, 30.0, 0.5) == 6.0
    assert backoff_delay(4, 1.0, 30.0, 0.25) == 5.0


def test_the_delay_never_shrinks_as_attempts_grow() -> None:
    for u in DRAWS:
        delays = [backoff_delay(a, 1.0, 30.0, u) for a in range(1, 41)]
        assert delays == sorted(delays)


def test_base_and_cap_are_honoured() -> None:
    assert backoff_delay(1, 0.1, 5.0, 0.0) == pytest.approx(0.05)
    assert backoff_delay(3, 0.1, 5.0, 0.0) == pytest.approx(0.2)
    assert backoff_delay(20, 0.1, 5.0, ALMOST_ONE) <= 5.0
    assert backoff_delay(20, 0.1, 5.0, 0.0) == 2.5
    # a cap below the base wins
    assert backoff_delay(1, 10.0, 4.0, 0.0) == 2.0


def test_backoff_delay_uses_its_rng_draws_in_order() -> None:
    backoff = Backoff(1.0, 30.0, random.Random(42))
    reference = random.Random(42)
    for attempts in [1, 2, 3, 4, 5, 6, 7, 1, 40]:
        assert backoff.delay(attempts) == backoff_delay(attempts, 1.0, 30.0, reference.random())


def test_backoffs_with_the_same_seed_agree_and_different_seeds_differ() -> None:
    a = [Backoff(1.0, 30.0, random.Random(7)).delay(5) for _ in range(3)]
    assert a[0] == a[1] == a[2]
    one, two = Backoff(1.0, 30.0, random.Random(7)), Backoff(1.0, 30.0, random.Random(8))
    assert [one.delay(5) for _ in range(5)] != [two.delay(5) for _ in range(5)]


def test_jitter_spreads_tasks_that_failed_together() -> None:
    backoff = Backoff(1.0, 30.0, random.Random(3))
    delays = [backoff.delay(4) for _ in range(200)]
    assert all(4.0 <= d <= 8.0 for d in delays)
    assert len(set(delays)) == 200
    # both halves of the random range get used
    assert min(delays) < 5.0
    assert max(delays) > 7.0


def test_a_backoff_without_an_rng_gets_its_own() -> None:
    backoff = Backoff()
    assert backoff.rng is not None
    for attempts in range(1, 10):
        assert nominal(attempts) / 2 <= backoff.delay(attempts) <= nominal(attempts)
