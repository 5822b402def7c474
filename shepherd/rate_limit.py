"""A token bucket rate limiter for control loop iterations.

Its `Rate` and the rate's flag syntax are :mod:`shepherd.rate`'s (re-exported
here). One limiter is shared by all workers of a control loop: it bounds how often
the loop as a whole queries the BMDB, however many workers it runs.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from shepherd.rate import SYNTAX as SYNTAX
from shepherd.rate import Rate as Rate
from shepherd.rate import RateSyntaxError as RateSyntaxError
from shepherd.rate import parse_duration as parse_duration


class RateLimiter:
    """A token bucket. :meth:`acquire` waits for a token.

    The bucket starts full. An interval of 0 means no limit. Waiters are
    served in the order they call :meth:`acquire`: each one reserves the next
    token when it arrives (the count may go negative, meaning tokens promised
    to sleeping waiters), then sleeps until that token exists.
    """

    def __init__(self, rate: Rate, *, clock: Callable[[], float] = trio.current_time) -> None:
        self._rate = rate
        self._clock = clock
        self._tokens = float(rate.burst)
        self._updated: float | None = None

    @property
    def rate(self) -> Rate:
        return self._rate

    def _reserve(self) -> float:
        """Take one token and return how long to wait until it exists."""
        now = self._clock()
        if self._rate.interval == 0:
            return 0.0
        if self._updated is not None:
            refill = (now - self._updated) / self._rate.interval
            self._tokens = min(float(self._rate.burst), self._tokens + refill)
        self._updated = now
        self._tokens -= 1
        return max(0.0, -self._tokens * self._rate.interval)

    async def acquire(self) -> float:
        """Wait until a token is available and take it; return the seconds
        it had to wait for one (0 when a token was there).

        Cancellation while waiting gives the reserved token back, so a
        cancelled waiter does not slow down the others.
        """
        delay = self._reserve()
        if delay == 0:
            await trio.lowlevel.checkpoint()
            return 0.0
        try:
            await trio.sleep(delay)
        except trio.Cancelled:
            self._tokens += 1
            raise
        return delay
