"""`Connection`: a handle on one BMDB, and `open_connection` to get one.

A `Connection` owns a small pool of database connections and starts
sessions. It runs no background task of its own: each `Session` keeps its
own heartbeat in a nursery that lives inside the ``async with
conn.session(...)`` block.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TypeVar

from bmdb import migrations
from bmdb._pg import PgConnection
from bmdb._pool import Pool
from bmdb.model import Queries
from bmdb.session import DEFAULT_INTERVAL, Session, open_session
from bmdb.transaction import Isolation, RetryPolicy, Stats, run_transaction

logger = logging.getLogger("bmdb.connection")

T = TypeVar("T")

#: How transactions retry unless told otherwise.
DEFAULT_RETRY = RetryPolicy()

#: Default upper bound of simultaneously open database connections.
DEFAULT_MAX_CONNECTIONS = 32


class Connection:
    """An open BMDB. Create with `open_connection`."""

    def __init__(self, pool: Pool, *, retry: RetryPolicy) -> None:
        self._pool = pool
        self.retry = retry
        #: Counters of transactions, retries and work claims (see `Stats`).
        self.stats = Stats()

    def session(
        self, component: str, runtime_info: str = "", *, interval: float = DEFAULT_INTERVAL
    ) -> AbstractAsyncContextManager[Session]:
        """Start a session of ``component``; see `bmdb.session.open_session`."""
        return open_session(self, component, runtime_info, interval=interval)

    async def transact(
        self,
        fn: Callable[[Queries], Awaitable[T]],
        *,
        isolation: Isolation = Isolation.SERIALIZABLE,
    ) -> T:
        """Run ``fn`` in a transaction outside any session (for tools and
        read-only listings). Retries like `Session.transact`."""

        async def body(pg: PgConnection) -> T:
            return await fn(Queries(pg))

        return await self.run(isolation, body)

    async def run(self, isolation: Isolation, body: Callable[[PgConnection], Awaitable[T]]) -> T:
        """Low-level: run ``body`` on a raw connection in a retried transaction."""
        return await run_transaction(
            self._pool, isolation, body, stats=self.stats, policy=self.retry
        )

    async def aclose(self) -> None:
        """Close the pooled connections."""
        await self._pool.aclose()


@asynccontextmanager
async def open_connection(
    url: str | None = None,
    *,
    migrate: bool = False,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    retry: RetryPolicy = DEFAULT_RETRY,
) -> AsyncIterator[Connection]:
    """Connect to the BMDB at ``url`` (a libpq URL or key=value string; None
    means the standard ``PG*`` environment variables).

    With ``migrate`` the schema is brought up to date first; without it, the
    schema is checked.

    Raises `DatabaseUnavailable` if the server cannot be reached,
    `SchemaTooNew` if the database was migrated by a newer release, and
    `SchemaNotMigrated` if it lacks migrations and ``migrate`` is false.
    """
    pool = Pool(url or "", max_connections)
    conn = Connection(pool, retry=retry)
    try:
        async with pool.connection() as pg:
            if migrate:
                applied = await migrations.migrate(pg)
                if applied:
                    logger.info("applied %d migration(s)", len(applied))
            else:
                await migrations.check_schema(pg)
        yield conn
    finally:
        await conn.aclose()
