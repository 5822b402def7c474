"""Running a function in a database transaction, retrying what may succeed.

PostgreSQL aborts SERIALIZABLE and REPEATABLE READ transactions that would
break isolation (SQLSTATE 40001) and breaks deadlocks by aborting one side
(40P01). Neither is a bug: the transaction can run again from the start.
`run_transaction` does that, a bounded number of times, sleeping a jittered,
growing delay between attempts so that colliding transactions spread out::

    attempt 1: BEGIN ─ body(pg) ─ COMMIT ──────────────────────▶ result
                          │ 40001 / 40P01 (also at COMMIT)
                          ▼
               ROLLBACK, sleep U(0, min(cap, base·2^n)), attempt n+1
                          │ attempts exhausted
                          ▼
                   TransactionFailed

Any other exception rolls back and propagates: `BMDBError`s as they are,
constraint violations and malformed values as `InvalidArgument`, other
psycopg errors wrapped in `BMDBError`. Cancellation rolls back (under a
shield) and propagates. Because the body runs again on retry, it must not
have effects outside the transaction other than idempotent ones.
"""

from __future__ import annotations

import enum
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import trio

from bmdb import _pg
from bmdb._pg import PgConnection
from bmdb._pool import Pool
from bmdb.errors import BMDBError, DatabaseUnavailable, InvalidArgument, TransactionFailed
from monotrio.backoff import FULL_JITTER, ExponentialBackoff

logger = logging.getLogger("bmdb.transaction")

T = TypeVar("T")


class Isolation(enum.StrEnum):
    """Transaction isolation levels, as SQL spells them."""

    SERIALIZABLE = "SERIALIZABLE"
    REPEATABLE_READ = "REPEATABLE READ"
    READ_COMMITTED = "READ COMMITTED"


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often and how patiently to retry serialization failures.

    The wait after failed attempt n is uniform in ``[0, min(max_delay,
    base_delay * 2**n)]`` ("full jitter", `monotrio.backoff`), drawn from
    ``rng`` (pass a seeded `random.Random` for reproducible runs).
    """

    attempts: int = 20
    base_delay: float = 0.002
    max_delay: float = 0.2
    rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)

    @property
    def backoff(self) -> ExponentialBackoff:
        """The waits between attempts, as a `monotrio.backoff` policy."""
        return ExponentialBackoff(
            initial=min(self.base_delay * 2, self.max_delay),
            maximum=self.max_delay,
            multiplier=2.0,
            jitter=FULL_JITTER,
        )

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed ``attempt`` (1-based)."""
        return self.backoff.delay(attempt, self.rng)


@dataclass(slots=True)
class Stats:
    """Counters of one `Connection`, for benchmarks and monitoring."""

    commits: int = 0
    #: Attempts that hit a serialization failure or deadlock and ran again.
    retries: int = 0
    #: Successful work claims.
    claims: int = 0
    #: Claims refused because the machine had live work (`WorkConflict`).
    conflicts: int = 0
    #: Work sources that found nothing (`NothingToDo`).
    nothing_to_do: int = 0


async def run_transaction(
    pool: Pool,
    isolation: Isolation,
    body: Callable[[PgConnection], Awaitable[T]],
    *,
    stats: Stats,
    policy: RetryPolicy = RetryPolicy(),
) -> T:
    """Run ``body`` in a transaction on a pooled connection and commit.

    Raises `TransactionFailed` when retries are exhausted,
    `DatabaseUnavailable` when the server cannot be reached, and whatever
    ``body`` raises (psycopg errors wrapped in `BMDBError`).
    """
    for attempt in range(1, policy.attempts + 1):
        try:
            result = await _attempt(pool, isolation, body)
        except BaseException as e:
            if not _pg.is_retryable(e):
                if _pg.is_bad_data(e):
                    raise InvalidArgument(_pg.error_message(e)) from e
                if _pg.is_database_error(e) and not isinstance(e, BMDBError):
                    raise BMDBError(f"database error: {_pg.error_message(e)}") from e
                raise
            logger.debug("attempt %d: %s, retrying", attempt, _pg.error_message(e))
        else:
            stats.commits += 1
            return result
        stats.retries += 1
        await trio.sleep(policy.delay(attempt))
    raise TransactionFailed(f"transaction still conflicting after {policy.attempts} attempts")


async def _attempt(
    pool: Pool, isolation: Isolation, body: Callable[[PgConnection], Awaitable[T]]
) -> T:
    """One attempt: begin, run ``body``, commit; roll back on any exception.

    BEGIN goes out with the body's first statement (`PgConnection.begin`).
    A connection that died while idle in the pool (the server restarted)
    fails at that statement, before anything ran; the pool then drops its
    idle connections, and we try once more on a fresh one instead of failing
    the caller for a restart that is already over.
    """
    for last_try in (False, True):
        async with pool.connection() as pg:
            pg.begin(isolation)
            try:
                result = await body(pg)
                await pg.execute("COMMIT")
            except BaseException as e:
                await pg.rollback_quietly()
                if isinstance(e, DatabaseUnavailable) and pg.lost_at_begin and not last_try:
                    continue
                raise
            return result
    raise AssertionError("unreachable")
