"""Helpers for the tests of retry loops that wait through `common.backoff`."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from bmdb.errors import DatabaseUnavailable
from common.backoff import ExponentialBackoff, Retrier


class DeadBMDB:
    """A connection whose sessions never open (the database is gone)."""

    def __init__(self) -> None:
        self.attempts = 0

    @contextlib.asynccontextmanager
    async def session(self, *args: Any, **kwargs: Any) -> AsyncIterator[None]:
        self.attempts += 1
        raise DatabaseUnavailable("database gone")
        yield  # pragma: no cover


def recorded_waits(retrier: Retrier) -> list[float]:
    """The waits ``retrier`` computes from now on, in order; it then sleeps
    none of them (a checkpoint only), so the test does not wait them out."""
    waits: list[float] = []
    real_next = retrier.next_delay

    def next_delay() -> float:
        waits.append(real_next())
        return 0.0

    retrier.next_delay = next_delay  # type: ignore[method-assign]
    return waits


def assert_backed_off(waits: list[float], policy: ExponentialBackoff) -> None:
    """``waits`` are the policy's waits for failures 1, 2, ..., jitter included,
    and grow (at least four of them)."""
    assert len(waits) >= 4, waits
    low, high = policy.jitter
    ceilings = [policy.ceiling(n + 1) for n in range(len(waits))]
    assert all(c * low <= w <= c * high for w, c in zip(waits, ceilings, strict=True)), waits
    assert waits[3] > waits[0], waits
