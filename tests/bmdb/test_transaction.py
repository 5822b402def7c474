"""Transactions: retries of serialization failures, bounded."""

from __future__ import annotations

import random

import pytest

import bmdb
from bmdb.errors import TransactionFailed
from bmdb.model import Queries

# A real serialization failure (SQLSTATE 40001), raised by the server.
_FAIL_TO_SERIALIZE = "DO $$ BEGIN RAISE EXCEPTION 'conflict' USING ERRCODE = '40001'; END $$"

FAST = bmdb.RetryPolicy(attempts=4, base_delay=0.0001, max_delay=0.001)


async def test_retries_until_success(bmdb_url: str) -> None:
    calls = 0

    async def body(q: Queries) -> str:
        nonlocal calls
        calls += 1
        await q.execute("INSERT INTO machines DEFAULT VALUES")
        if calls < 3:
            await q.execute(_FAIL_TO_SERIALIZE)
        return "done"

    async with bmdb.open_connection(bmdb_url, retry=FAST) as conn:
        assert await conn.transact(body) == "done"
        assert (calls, conn.stats.retries, conn.stats.commits) == (3, 2, 1)
        # The failed attempts were rolled back: one machine, not three.
        assert len(await conn.transact(lambda q: q.machines())) == 1


async def test_gives_up_after_the_last_attempt(bmdb_url: str) -> None:
    async def body(q: Queries) -> None:
        await q.execute(_FAIL_TO_SERIALIZE)

    async with bmdb.open_connection(bmdb_url, retry=FAST) as conn:
        with pytest.raises(TransactionFailed, match="4 attempts"):
            await conn.transact(body)
        assert conn.stats.retries == 4


def test_retry_delays_are_bounded_and_jittered() -> None:
    policy = bmdb.RetryPolicy(attempts=10, base_delay=0.01, max_delay=0.05)
    delays = [policy.delay(n) for n in range(1, 11) for _ in range(20)]
    assert all(0 <= d <= 0.05 for d in delays)
    assert len(set(delays)) > 1


def test_retry_delays_come_from_the_injected_rng() -> None:
    def delays(seed: int) -> list[float]:
        policy = bmdb.RetryPolicy(base_delay=0.01, max_delay=0.5, rng=random.Random(seed))
        return [policy.delay(n) for n in range(1, 8)]

    assert delays(3) == delays(3)
    assert delays(3) != delays(4)
