"""One way to wait between retries: exponential growth, a cap, and jitter.

Everything in the project that retries something that failed (the
supervisor restarting a runnable, a BMDB transaction that lost a
serialization race, the etcd watch reconnecting, the lease keep-alive)
computes its waits here::

    attempt n (1-based):  d = min(maximum, initial * multiplier ** (n - 1))
                          wait = d * U(low, high)       jitter = (low, high)

``jitter`` is the range of the random factor: `NO_JITTER` (1, 1) gives exact
waits, `FULL_JITTER` (0, 1) spreads colliding retries over ``[0, d]`` (what
database retries want), ``(0.75, 1.25)`` keeps a wait near ``d`` while still
spreading restarts of things that failed together.

The randomness is injected: a policy with jitter needs a `random.Random`,
so that tests (and simulations) can seed it and no module-global generator
is shared. Nothing here sleeps except `Retrier.sleep`, which is an ordinary
Trio checkpoint (cancellable, raises nothing else).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import trio

__all__ = ["FULL_JITTER", "NO_JITTER", "ExponentialBackoff", "Retrier"]

#: Exact waits.
NO_JITTER = (1.0, 1.0)
#: Waits spread uniformly over ``[0, d]``.
FULL_JITTER = (0.0, 1.0)

# Far past any cap: bounds the exponent so that the power never overflows.
_MAX_EXPONENT = 1000


@dataclass(frozen=True, slots=True)
class ExponentialBackoff:
    """Exponentially growing waits, capped, scaled by a random factor.

    Raises `ValueError` at construction for a non-positive ``initial``, a
    ``multiplier`` below 1, a ``maximum`` below ``initial``, or a jitter
    range that is empty or negative.
    """

    initial: float
    maximum: float
    multiplier: float = 2.0
    jitter: tuple[float, float] = NO_JITTER

    def __post_init__(self) -> None:
        if not (math.isfinite(self.initial) and self.initial > 0):
            raise ValueError(f"backoff initial must be > 0, got {self.initial!r}")
        if not (math.isfinite(self.multiplier) and self.multiplier >= 1):
            raise ValueError(f"backoff multiplier must be >= 1, got {self.multiplier!r}")
        if not (math.isfinite(self.maximum) and self.maximum >= self.initial):
            raise ValueError(f"backoff maximum must be >= initial, got {self.maximum!r}")
        low, high = self.jitter
        if not (0 <= low <= high and math.isfinite(high)):
            raise ValueError(f"jitter must be a range 0 <= low <= high, got {self.jitter!r}")

    @property
    def jittered(self) -> bool:
        """True if delays are random (a `random.Random` is needed)."""
        return self.jitter != NO_JITTER

    def ceiling(self, attempt: int) -> float:
        """The wait after failed ``attempt`` (1-based) before jitter."""
        if attempt < 1:
            raise ValueError(f"attempts count from 1, got {attempt}")
        exponent = min(attempt - 1, _MAX_EXPONENT)
        return min(self.maximum, self.initial * math.pow(self.multiplier, exponent))

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """The wait after failed ``attempt`` (1-based). ``rng`` is required
        when the policy has jitter (`ValueError` otherwise)."""
        ceiling = self.ceiling(attempt)
        if not self.jittered:
            return ceiling
        if rng is None:
            raise ValueError("a jittered backoff needs a random.Random")
        low, high = self.jitter
        return ceiling * rng.uniform(low, high)


class Retrier:
    """Counts consecutive failures of one retry loop and sleeps accordingly.

    ::

        retrier = Retrier(policy, rng)
        while True:
            try:
                ...; retrier.reset()        # success: the next failure starts over
            except Transient:
                await retrier.sleep()       # wait for failure n, n = 1, 2, ...
    """

    def __init__(self, policy: ExponentialBackoff, rng: random.Random | None = None) -> None:
        if policy.jittered and rng is None:
            raise ValueError("a jittered backoff needs a random.Random")
        self.policy = policy
        self._rng = rng
        #: Consecutive failures since the last `reset`.
        self.failures = 0

    def reset(self) -> None:
        """Forget earlier failures."""
        self.failures = 0

    def next_delay(self) -> float:
        """Count one more failure and return the wait that follows it."""
        self.failures += 1
        return self.policy.delay(self.failures, self._rng)

    async def sleep(self, *, at_most: float = math.inf) -> float:
        """Count one more failure, sleep the wait that follows it (but at
        most ``at_most`` seconds), and return how long that was."""
        delay = min(self.next_delay(), max(at_most, 0.0))
        await trio.sleep(delay)
        return delay
