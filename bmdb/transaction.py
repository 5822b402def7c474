"""Running a function in a database transaction, retrying what may succeed.

PostgreSQL aborts SERIALIZABLE and REPEATABLE READ transactions that would
break isolation (SQLSTATE 40001) and breaks deadlocks by aborting one side
(40P01). Neither is a bug: the transaction can run again from the start.
`Transactor.run` does that, a bounded number of times, sleeping a jittered,
growing delay between attempts so that colliding transactions spread out::

    attempt 1: BEGIN ─ body(pg) ─ COMMIT ──────────────────────▶ result
                          │ 40001 / 40P01 (also at COMMIT)
                          ▼
               ROLLBACK, sleep U(0, min(cap, base·2^n)), attempt n+1
                          │ attempts exhausted
                          ▼
                   TransactionFailed

Any other exception rolls back and propagates: `BMDBError`s as they are,
database errors translated by one rule (`bmdb.pgerrors.as_bmdb_error`:
constraint violations and malformed values as `InvalidArgument`, unknown
tables as `SchemaNotMigrated`, the rest by SQLSTATE, e.g. a missing
privilege as `PermissionDenied`). Cancellation rolls back (under a shield)
and propagates. Because the body runs again on retry, it must not
have effects outside the transaction other than idempotent ones.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import trio

from bmdb import migrations, pgerrors
from bmdb._pool import Pool
from bmdb.errors import DatabaseUnavailable, TransactionFailed
from bmdb.model import Queries
from bmdb.model.enums import Isolation as Isolation
from common.backoff import FULL_JITTER, ExponentialBackoff

logger = logging.getLogger("bmdb.transaction")

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often and how patiently to retry serialization failures.

    The wait after failed attempt n is uniform in ``[0, min(max_delay,
    base_delay * 2**n)]`` ("full jitter", `common.backoff`), drawn from
    ``rng`` (pass a seeded `random.Random` for reproducible runs).
    """

    attempts: int = 20
    base_delay: float = 0.002
    max_delay: float = 0.2
    rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)

    @property
    def backoff(self) -> ExponentialBackoff:
        """The waits between attempts, as a `common.backoff` policy."""
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
    #: Transactions given up: retries exhausted, or an error of the database
    #: itself (not an exception of the body such as `NothingToDo`).
    failed: int = 0
    #: Sessions opened, by component.
    sessions_started: Counter[str] = field(default_factory=Counter)
    #: Work claimed, by (component, process).
    work_started: Counter[tuple[str, str]] = field(default_factory=Counter)
    #: Work closed, by (component, process, "Finished" / "Failed" / "Canceled").
    work_finished: Counter[tuple[str, str, str]] = field(default_factory=Counter)


class Transactor:
    """The transaction layer of one open BMDB: its connection pool, its
    retry policy and its counters. `Connection`, `Session` and `Work` all run
    their statements through one.

    Bodies get a `Queries` bound to the open transaction (its ``execute`` is
    there for the few raw statements of sessions and work); nothing above
    this layer sees a driver connection.
    """

    def __init__(self, pool: Pool, retry: RetryPolicy) -> None:
        self._pool = pool
        self.retry = retry
        #: Counters of transactions, retries and work claims.
        self.stats = Stats()

    @property
    def pool(self) -> Pool:
        """Its connection pool (for what needs a connection of its own to the
        same server, with the same bounds: `bmdb.notify.Listener`)."""
        return self._pool

    async def run(
        self,
        isolation: Isolation,
        body: Callable[[Queries], Awaitable[T]],
        *,
        locking: bool = False,
    ) -> T:
        """Run ``body(queries)`` in a transaction and commit, retrying
        serialization failures and deadlocks (so ``body`` may run more than
        once). ``locking`` makes sourcing queries lock what they return.

        Raises `TransactionFailed` when retries are exhausted,
        `DatabaseUnavailable` when the server cannot be reached, and whatever
        ``body`` raises (database errors as `BMDBError`s). Cancellation rolls
        back and propagates.
        """
        policy = self.retry
        for attempt in range(1, policy.attempts + 1):
            try:
                result = await _attempt(self._pool, isolation, body, locking)
            except BaseException as e:
                if not pgerrors.is_retryable(e):
                    if isinstance(e, DatabaseUnavailable) or pgerrors.is_database_error(e):
                        self.stats.failed += 1
                    translated = pgerrors.as_bmdb_error(e)
                    if translated is not None and translated is not e:
                        raise translated from e
                    raise
                logger.debug("attempt %d: %s, retrying", attempt, pgerrors.error_message(e))
            else:
                self.stats.commits += 1
                return result
            self.stats.retries += 1
            await trio.sleep(policy.delay(attempt))
        self.stats.failed += 1
        raise TransactionFailed(f"transaction still conflicting after {policy.attempts} attempts")

    async def prepare_schema(self, *, migrate: bool) -> list[migrations.Migration]:
        """Bring the schema up to date (``migrate``) or check it; return the
        migrations applied. Raises `SchemaTooNew`, `SchemaNotMigrated`,
        `DatabaseUnavailable`, and (migrating) `SchemaConflict` and
        `PermissionDenied`; any database error as a `BMDBError` (see
        `bmdb.migrations`)."""
        async with self._pool.connection() as pg:
            if migrate:
                return await migrations.migrate(pg)
            await migrations.check_schema(pg)
            return []

    async def aclose(self) -> None:
        """Close the pooled connections."""
        await self._pool.aclose()


async def _attempt(
    pool: Pool, isolation: Isolation, body: Callable[[Queries], Awaitable[T]], locking: bool
) -> T:
    """One attempt: begin, run ``body``, commit; roll back on any exception.

    BEGIN goes out with the body's first statement (`bmdb._pg`'s ``begin``).
    A connection that died while idle in the pool (the server restarted)
    fails at that statement, before anything ran; the pool then drops its
    idle connections, and we try once more on a fresh one instead of failing
    the caller for a restart that is already over.
    """
    for last_try in (False, True):
        async with pool.connection() as pg:
            pg.begin(isolation)
            try:
                result = await body(Queries(pg, locking=locking))
                await pg.commit()
            except BaseException as e:
                await pg.rollback_quietly()
                if isinstance(e, DatabaseUnavailable) and pg.lost_at_begin and not last_try:
                    continue
                raise
            return result
    raise AssertionError("unreachable")
