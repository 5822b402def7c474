"""The one place where the BMDB touches psycopg's asyncio API.

psycopg 3's async connection is an asyncio object. We drive it through
trio-asyncio (`trio_asyncio.aio_as_trio`), so the rest of the package sees
plain Trio functions and never imports asyncio or psycopg. Every statement is
one crossing of the bridge::

    Trio task ──aio_as_trio──▶ asyncio task: await conn.execute(); fetchall()
         ◀──────── rows ─────┘

Cancellation: when the calling Trio scope is cancelled, trio-asyncio cancels
the asyncio task and waits for it. psycopg reacts to that by sending a
cancel request to the server and draining the aborted query, so the
connection ends up idle or in a failed transaction, never stuck mid-query.
The caller (`bmdb.transaction`) then rolls back under a shield, and
`PgConnection.reusable` tells the pool whether the connection can serve the
next user. A connection psycopg had to give up on is closed, not reused.

Why this and not sync psycopg in threads: a thread cannot be interrupted
mid-query, so cancelling would mean abandoning a thread holding a connection
in an unknown state; the asyncio driver cancels queries properly.

Errors: connection failures become `DatabaseUnavailable`; SQL errors stay
psycopg's (`psycopg.Error` subclasses) for the transaction layer to classify
with the helpers at the bottom of this module.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import psycopg
import psycopg.errors
import psycopg.waiting
import trio
import trio_asyncio
from psycopg import pq

from bmdb.errors import DatabaseUnavailable

logger = logging.getLogger("bmdb.pg")

# trio-asyncio makes asyncio.get_running_loop() find its loop by patching the
# asyncio module when trio_asyncio is first imported. psycopg.waiting binds
# that function by name at its own import; if psycopg was imported first (by
# anyone, anywhere in the process) it keeps the unpatched one, which cannot
# see trio-asyncio's loop and every query fails with "no running event loop".
# Point it at the patched function, whatever the import order was.
if psycopg.waiting.get_running_loop is not asyncio.get_running_loop:  # type: ignore[attr-defined]
    psycopg.waiting.get_running_loop = asyncio.get_running_loop  # type: ignore[attr-defined]

Row = tuple[Any, ...]
#: Statement parameters: positional (``%s``) or named (``%(name)s``).
Params = Sequence[Any] | Mapping[str, Any]

#: Seconds allowed to establish a connection before it counts as unavailable.
CONNECT_TIMEOUT = 5


class PgConnection:
    """One PostgreSQL connection in autocommit mode, driven from Trio.

    Transactions are explicit (`BEGIN` ... `COMMIT`), issued by the caller.
    Not safe for concurrent use: one Trio task at a time (the pool ensures it).
    """

    def __init__(self, conn: psycopg.AsyncConnection[Row]) -> None:
        self._conn = conn

    @classmethod
    async def connect(cls, conninfo: str) -> PgConnection:
        """Open a connection. ``conninfo`` is a libpq URL or key/value string;
        an empty string means the ``PG*`` environment variables.

        Raises `DatabaseUnavailable` when the server cannot be reached.
        """
        _require_loop()
        try:
            conn = await trio_asyncio.aio_as_trio(psycopg.AsyncConnection.connect)(
                conninfo, autocommit=True, connect_timeout=CONNECT_TIMEOUT
            )
        except psycopg.OperationalError as e:
            raise DatabaseUnavailable(f"cannot connect to the BMDB: {_first_line(e)}") from e
        return cls(conn)

    async def execute(self, query: str, params: Params | None = None) -> list[Row]:
        """Run one statement and return its rows (empty if it returns none).

        Raises `DatabaseUnavailable` if the connection is lost, a
        `psycopg.Error` for errors reported by the server, and `trio.Cancelled`
        when cancelled (the query is then cancelled on the server too).
        """
        try:
            rows: list[Row] = await trio_asyncio.aio_as_trio(self._execute)(query, params)
        except psycopg.OperationalError as e:
            if self._conn.closed or self._conn.broken:
                raise DatabaseUnavailable(f"lost the BMDB connection: {_first_line(e)}") from e
            raise
        return rows

    async def _execute(self, query: str, params: Params | None) -> list[Row]:
        # asyncio side of the bridge.
        cur = await self._conn.execute(query, params)
        if cur.description is None:
            return []
        rows: list[Row] = await cur.fetchall()
        return rows

    @property
    def in_transaction(self) -> bool:
        """True while a transaction is open (healthy or failed)."""
        status = self._conn.info.transaction_status
        return status in (pq.TransactionStatus.INTRANS, pq.TransactionStatus.INERROR)

    @property
    def reusable(self) -> bool:
        """True if the connection is open and idle outside a transaction."""
        return (
            not self._conn.closed
            and self._conn.info.transaction_status == pq.TransactionStatus.IDLE
        )

    async def rollback_quietly(self) -> None:
        """Roll back any open transaction, swallowing errors.

        Runs shielded with a short bound: it is called while unwinding from
        errors and cancellation. If it fails the connection is not `reusable`.
        """
        with trio.CancelScope(shield=True) as scope:
            scope.relative_deadline = CONNECT_TIMEOUT
            try:
                if not self._conn.closed and self.in_transaction:
                    await trio_asyncio.aio_as_trio(self._conn.execute)("ROLLBACK")
            except (psycopg.Error, OSError) as e:
                logger.debug("rollback failed, dropping connection: %s", e)
                await self.close()

    async def close(self) -> None:
        """Close the connection (shielded; never raises)."""
        with trio.CancelScope(shield=True) as scope:
            scope.relative_deadline = CONNECT_TIMEOUT
            try:
                await trio_asyncio.aio_as_trio(self._conn.close)()
            except (psycopg.Error, OSError) as e:
                logger.debug("closing connection failed: %s", e)
        if scope.cancelled_caught:
            self._conn.pgconn.finish()


def is_retryable(e: BaseException) -> bool:
    """True for serialization failures and deadlocks: the transaction can be
    run again from the start and may then succeed."""
    return isinstance(e, psycopg.errors.SerializationFailure | psycopg.errors.DeadlockDetected)


def is_undefined_object(e: BaseException) -> bool:
    """True if the server does not know a table, type or function we used."""
    return isinstance(
        e,
        psycopg.errors.UndefinedTable
        | psycopg.errors.UndefinedObject
        | psycopg.errors.UndefinedFunction
        | psycopg.errors.UndefinedColumn,
    )


def is_bad_data(e: BaseException) -> bool:
    """True for errors caused by the values a statement was given (constraint
    violations, malformed input)."""
    return isinstance(e, psycopg.errors.IntegrityError | psycopg.errors.DataError)


def is_database_error(e: BaseException) -> bool:
    """True for any error reported by psycopg."""
    return isinstance(e, psycopg.Error)


def error_message(e: BaseException) -> str:
    """The server's primary message of a psycopg error, else ``str(e)``."""
    if isinstance(e, psycopg.Error) and e.diag.message_primary:
        return e.diag.message_primary
    return _first_line(e)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _require_loop() -> None:
    if trio_asyncio.current_loop.get() is None:
        raise RuntimeError(
            "the BMDB needs a trio-asyncio loop:"
            " run it inside `async with trio_asyncio.open_loop():`"
        )
