"""Issue 26: the agent server's retry loops wait through `common.backoff`, not fixed sleeps."""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import AsyncIterator
from typing import Any, cast

import trio

from bmdb import Connection
from bmdb.errors import BMDBError
from common.backoff import ExponentialBackoff, Retrier
from shepherd.agent_server import server, workers


class _DeadBMDB:
    """A connection whose sessions never open."""

    def __init__(self) -> None:
        self.attempts = 0

    @contextlib.asynccontextmanager
    async def session(self, *args: Any, **kwargs: Any) -> AsyncIterator[None]:
        self.attempts += 1
        raise BMDBError("database gone")
        yield  # pragma: no cover


async def test_lost_session_is_reopened_after_growing_jittered_waits() -> None:
    dead = _DeadBMDB()
    holder = server._SessionHolder(cast(Connection, dead), "", 1.0, random.Random(7))
    waits: list[float] = []
    real_next = holder._retrier.next_delay

    def next_delay() -> float:
        waits.append(real_next())
        return 0.0  # the test does not wait them out

    holder._retrier.next_delay = next_delay  # type: ignore[method-assign]
    with trio.move_on_after(0.5):
        await holder.run()
    assert len(waits) >= 4
    assert dead.attempts in (len(waits), len(waits) + 1)  # one wait after each failure
    ceilings = [server.SESSION_BACKOFF.ceiling(n + 1) for n in range(len(waits))]
    low, high = server.SESSION_BACKOFF.jitter
    assert all(c * low <= w <= c * high for w, c in zip(waits, ceilings, strict=True))
    assert waits[3] > waits[0]  # grows (jitter (0.5, 1): ceiling doubles)


async def test_a_crashing_worker_is_restarted_through_the_retrier() -> None:
    retrier = Retrier(ExponentialBackoff(0.001, 0.01), random.Random(1))
    with trio.move_on_after(2):
        await workers._keep_running(0, [sys.executable, "-c", "raise SystemExit(3)"], None, retrier)
    assert retrier.failures >= 2  # each restart counted: waits grow until one ran STABLE_RUN
