"""common.backoff: the one retry-wait policy, its bounds and its injected randomness."""

from __future__ import annotations

import random

import pytest
import trio
import trio.testing

from common.backoff import FULL_JITTER, NO_JITTER, ExponentialBackoff, Retrier


def test_exact_waits_grow_and_cap() -> None:
    policy = ExponentialBackoff(initial=0.1, maximum=1.0, multiplier=2.0)
    assert [policy.delay(n) for n in range(1, 7)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])


def test_multiplier_one_is_constant() -> None:
    policy = ExponentialBackoff(initial=1.0, maximum=1.0, multiplier=1.0)
    assert {policy.delay(n) for n in range(1, 50)} == {1.0}


def test_huge_attempts_do_not_overflow() -> None:
    policy = ExponentialBackoff(initial=0.5, maximum=60.0, multiplier=1.5)
    assert policy.delay(10**9) == 60.0


def test_jitter_stays_in_range() -> None:
    policy = ExponentialBackoff(initial=1.0, maximum=8.0, jitter=(0.75, 1.25))
    rng = random.Random(1)
    for attempt in range(1, 10):
        ceiling = policy.ceiling(attempt)
        for _ in range(50):
            assert 0.75 * ceiling <= policy.delay(attempt, rng) <= 1.25 * ceiling


def test_full_jitter_spreads_over_zero_to_ceiling() -> None:
    policy = ExponentialBackoff(initial=0.004, maximum=0.2, jitter=FULL_JITTER)
    rng = random.Random(2)
    delays = [policy.delay(3, rng) for _ in range(200)]
    assert all(0 <= d <= 0.016 for d in delays)
    assert len(set(delays)) > 1


def test_randomness_is_injected_and_reproducible() -> None:
    policy = ExponentialBackoff(initial=1.0, maximum=10.0, jitter=(0.5, 1.5))
    first = [policy.delay(n, random.Random(7)) for n in range(1, 6)]
    again = [policy.delay(n, random.Random(7)) for n in range(1, 6)]
    assert first == again
    with pytest.raises(ValueError, match="random"):
        policy.delay(1)
    with pytest.raises(ValueError, match="random"):
        Retrier(policy)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"initial": 0.0, "maximum": 1.0},
        {"initial": 1.0, "maximum": 0.5},
        {"initial": 1.0, "maximum": 2.0, "multiplier": 0.5},
        {"initial": 1.0, "maximum": 2.0, "jitter": (1.5, 0.5)},
        {"initial": 1.0, "maximum": 2.0, "jitter": (-0.1, 1.0)},
        {"initial": float("nan"), "maximum": 2.0},
    ],
)
def test_rejects_nonsense(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        ExponentialBackoff(**kwargs)  # type: ignore[arg-type]


def test_attempts_count_from_one() -> None:
    with pytest.raises(ValueError):
        ExponentialBackoff(initial=1.0, maximum=1.0).delay(0)


async def test_retrier_counts_resets_and_sleeps(autojump_clock: trio.testing.MockClock) -> None:
    retrier = Retrier(ExponentialBackoff(initial=0.1, maximum=2.0, jitter=NO_JITTER))
    waits = [await retrier.sleep() for _ in range(6)]
    assert waits == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 2.0])
    assert retrier.failures == 6
    retrier.reset()
    assert await retrier.sleep(at_most=0.05) == pytest.approx(0.05)
    assert retrier.failures == 1
