"""`Connection`: a handle on one BMDB, and `open_connection` to get one.

A `Connection` owns a small pool of database connections and starts
sessions. It runs no background task of its own: each `Session` keeps its
own heartbeat in a nursery that lives inside the ``async with
conn.session(...)`` block.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, TypeVar

from bmdb._pool import Pool
from bmdb.errors import DatabaseUnavailable
from bmdb.migrations import Migration
from bmdb.model import Queries
from bmdb.pgbounds import UNBOUNDED, Bounds
from bmdb.session import DEFAULT_INTERVAL, Session, collect_expired, open_session
from bmdb.transaction import Isolation, RetryPolicy, Stats, Transactor

if TYPE_CHECKING:
    from bmdb.notify import Listener

logger = logging.getLogger("bmdb.connection")

T = TypeVar("T")

#: How transactions retry unless told otherwise.
DEFAULT_RETRY = RetryPolicy()

#: Default upper bound of simultaneously open database connections.
DEFAULT_MAX_CONNECTIONS = 32

#: How long a statement and a commit may take unless told otherwise.
DEFAULT_BOUNDS = Bounds()


#: What a view read from a standby says of itself (`Connection.on_standby`).
STANDBY_NOTE = "(read from a standby: it may lag the primary by a moment)"


class Connection:
    """An open BMDB. Create with `open_connection`.

    A thin facade over the transaction layer (`bmdb.transaction.Transactor`):
    it starts sessions and runs session-less transactions.
    """

    def __init__(self, tx: Transactor) -> None:
        self._tx = tx

    @property
    def retry(self) -> RetryPolicy:
        """How transactions retry serialization failures."""
        return self._tx.retry

    @property
    def stats(self) -> Stats:
        """Counters of transactions, retries and work claims (see `Stats`)."""
        return self._tx.stats

    def session(
        self, component: str, runtime_info: str = "", *, interval: float = DEFAULT_INTERVAL
    ) -> AbstractAsyncContextManager[Session]:
        """Start a session of ``component``; see `bmdb.session.open_session`."""
        return open_session(self._tx, component, runtime_info, interval=interval)

    async def transact(
        self,
        fn: Callable[[Queries], Awaitable[T]],
        *,
        isolation: Isolation = Isolation.SERIALIZABLE,
    ) -> T:
        """Run ``fn`` in a transaction outside any session (for tools and
        read-only listings). Retries like `Session.transact`."""
        return await self._tx.run(isolation, fn)

    def listener(
        self,
        channels: Sequence[str],
        on_notify: Callable[[str, str], None],
        *,
        on_listening: Callable[[], Awaitable[None]] | None = None,
        ping_interval: float | None = None,
    ) -> Listener:
        """A `bmdb.notify.Listener` on ``channels`` (`bmdb.model.channels`)
        of this BMDB, with a connection of its own (outside the pool) and
        the pool's bounds; it listens while its ``run`` runs.
        ``ping_interval``: `bmdb.notify.DEFAULT_PING_INTERVAL` unless given."""
        from bmdb.notify import DEFAULT_PING_INTERVAL, Listener  # only where one listens

        pool = self._tx.pool
        return Listener(
            pool.conninfo,
            pool.bounds,
            channels,
            on_notify,
            on_listening=on_listening,
            ping_interval=DEFAULT_PING_INTERVAL if ping_interval is None else ping_interval,
        )

    async def on_standby(self) -> bool:
        """True if this connection's transactions run on a standby (a server
        in recovery), as with ``target_session_attrs=prefer-standby``: what
        they read may lag the primary, and they cannot write. Asks the
        server; raises `DatabaseUnavailable` like `transact`."""

        async def body(q: Queries) -> bool:
            [(in_recovery,)] = await q.execute("SELECT pg_is_in_recovery()")
            return bool(in_recovery)

        return await self._tx.run(Isolation.REPEATABLE_READ, body)

    async def check_schema(self) -> None:
        """Check the schema again, as `open_connection` did (for a
        connection kept across commands, e.g. by a kept-open session: a
        migration since may have made it newer than this program). Raises
        what `open_connection` raises for the schema, and
        `DatabaseUnavailable`.

        A kept connection may have died while idle (the server restarted):
        the check, which writes nothing, is then made once more on a
        fresh one, as a transaction's first statement is."""
        try:
            await self._tx.prepare_schema(migrate=False)
        except DatabaseUnavailable:
            await self._tx.prepare_schema(migrate=False)

    async def collect_expired(self) -> None:
        """Delete every session past its deadline now, releasing its work
        (session owners do this on their own every `bmdb.session.GC_PERIOD`;
        this is for tools and tests). Errors are logged, not raised."""
        await collect_expired(self._tx)

    async def aclose(self) -> None:
        """Close the pooled connections."""
        await self._tx.aclose()


@asynccontextmanager
async def open_connection(
    url: str | None = None,
    *,
    migrate: bool = False,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    retry: RetryPolicy = DEFAULT_RETRY,
    bounds: Bounds = DEFAULT_BOUNDS,
) -> AsyncIterator[Connection]:
    """Connect to the BMDB at ``url`` (a libpq URL or key=value string; None
    means the standard ``PG*`` environment variables).

    With ``migrate`` the schema is brought up to date first; without it, the
    schema is checked.

    Raises `DatabaseUnavailable` if the server cannot be reached,
    `SchemaTooNew` if the database was migrated by a newer release,
    `SchemaNotMigrated` if it lacks migrations and ``migrate`` is false,
    and with ``migrate`` what `migrate` raises.

    ``bounds`` bound every statement (the server's ``statement_timeout``,
    30 s by default, unless the URL's ``options`` set one) and every
    ``COMMIT`` (10 s, by the client): a statement or commit that does not
    return in time raises `DatabaseUnavailable`, a commit's with its
    outcome unknown (`bmdb._pg`, "Bounds"). ``bounds=Bounds(None, None)``
    removes them.
    """
    tx = Transactor(Pool(url or "", max_connections, bounds), retry)
    try:
        applied = await tx.prepare_schema(migrate=migrate)
        if applied:
            logger.info("applied %d migration(s)", len(applied))
        yield Connection(tx)
    finally:
        await tx.aclose()


async def migrate(url: str | None = None) -> list[Migration]:
    """Apply the migrations the BMDB at ``url`` lacks; return those applied.

    Safe to run from several processes at once: they serialize on a lock
    taken before anything is read or created, and each migration is applied
    once (see `bmdb.migrations`). Raises `DatabaseUnavailable` and
    `SchemaTooNew` like `open_connection`, `SchemaConflict` if the database
    holds tables of ours that migrations did not create, `PermissionDenied`
    if the role may not create them; a failing migration is rolled back and
    its error raised as a `BMDBError` naming it. Its statements are not
    bounded: an index built over a large fleet may take minutes.
    """
    tx = Transactor(Pool(url or "", 1, UNBOUNDED), DEFAULT_RETRY)
    try:
        return await tx.prepare_schema(migrate=True)
    finally:
        await tx.aclose()
