"""The control loop's rate limiter and its "DURATION,BURST" syntax."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from shepherd.rate_limit import Rate, RateLimiter, RateSyntaxError, parse_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("250ms", 0.25),
        ("2m", 120.0),
        ("1h30m", 5400.0),
        ("1.5s", 1.5),
        (".5s", 0.5),
        ("100us", 1e-4),
        ("100µs", 1e-4),
        ("0", 0.0),
        ("+3s", 3.0),
    ],
)
def test_durations_parse_like_go(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("250ms,8", None),
        ("250ms", "invalid syntax, want: 'duration,count'"),
        ("250ms,8,1", "invalid syntax"),
        ("250,8", 'invalid duration: time: missing unit in duration "250"'),
        ("2d,8", 'invalid duration: time: unknown unit "d" in duration "2d"'),
        (",8", 'invalid duration: time: invalid duration ""'),
        ("ms,8", 'invalid duration: time: invalid duration "ms"'),
        ("-1s,8", "invalid duration: '-1s' is negative"),
        ("1s,x", "invalid refill rate: 'x' is not a whole number"),
        ("1s,-1", "invalid refill rate"),
        ("1s,0", "invalid refill rate: 0 is not in 1..2147483647"),
        ("1s,2147483648", "invalid refill rate: 2147483648 is not in"),
    ],
)
def test_rate_syntax(text: str, error: str | None) -> None:
    if error is None:
        assert Rate.parse(text) == Rate(0.25, 8)
    else:
        with pytest.raises(RateSyntaxError, match=error.replace("(", r"\(")):
            Rate.parse(text)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_bucket_arithmetic() -> None:
    """Burst tokens are free, then one per interval; waits queue up behind each other."""
    clock = FakeClock()
    limiter = RateLimiter(Rate(0.25, 3), clock=clock)
    assert [limiter._reserve() for _ in range(3)] == [0, 0, 0]
    # Two more callers at the same instant wait for the 1st and 2nd refill.
    assert [limiter._reserve() for _ in range(2)] == pytest.approx([0.25, 0.5])
    clock.now = 10.0  # long idle: the bucket refills to its burst, no more
    assert [limiter._reserve() for _ in range(4)] == pytest.approx([0, 0, 0, 0.25])


@settings(max_examples=200)
@given(
    arrivals=st.lists(st.floats(0, 50), min_size=1, max_size=40).map(sorted),
    interval=st.floats(0.01, 5),
    burst=st.integers(1, 10),
)
def test_no_window_gets_more_than_burst_plus_refills(
    arrivals: list[float], interval: float, burst: int
) -> None:
    """However callers arrive, the tokens granted in any window [a, b] are at
    most burst + (b - a) / interval, and grants keep arrival order."""
    clock = FakeClock()
    limiter = RateLimiter(Rate(interval, burst), clock=clock)
    grants = []
    for at in arrivals:
        clock.now = at
        grants.append(at + limiter._reserve())
    assert grants == sorted(grants)
    for i in range(len(grants)):
        for j in range(i, len(grants)):
            assert j - i + 1 <= burst + (grants[j] - grants[i]) / interval + 1e-6


def test_zero_interval_means_unlimited() -> None:
    limiter = RateLimiter(Rate(0.0, 1), clock=FakeClock())
    assert [limiter._reserve() for _ in range(100)] == [0] * 100


async def test_acquire_waits_for_a_token(autojump_clock: trio.testing.MockClock) -> None:
    limiter = RateLimiter(Rate(10.0, 1))
    await limiter.acquire()  # the burst token
    with trio.move_on_after(5) as scope:
        await limiter.acquire()  # needs the refill 10 s away
    assert scope.cancelled_caught
    # The cancelled waiter gave its reservation back: the next one waits for
    # the same refill, not one interval later.
    with trio.move_on_after(5.5) as scope:
        await limiter.acquire()
    assert not scope.cancelled_caught
