"""A small pool of `PgConnection`s shared by the tasks of one `Connection`.

Connections are opened on demand up to ``max_size`` and kept idle for the next
user. A connection comes back to the pool only if it is idle outside a
transaction (`PgConnection.reusable`); one returned mid-transaction, failed
or closed (after a cancelled query or a lost server) is closed instead, so
no user ever inherits another's transaction state.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from bmdb._pg import PgConnection
from bmdb.errors import DatabaseUnavailable
from bmdb.pgbounds import UNBOUNDED, Bounds


class Pool:
    """Hands out at most ``max_size`` connections at a time to ``conninfo``,
    each with ``bounds`` on its statements and commits."""

    def __init__(self, conninfo: str, max_size: int, bounds: Bounds = UNBOUNDED) -> None:
        if max_size < 1:
            raise ValueError("max_size must be at least 1")
        self._conninfo = conninfo
        self._bounds = bounds
        self._slots = trio.Semaphore(max_size)
        self._idle: list[PgConnection] = []
        self._closed = False

    @property
    def conninfo(self) -> str:
        """Where its connections go (with the password, if the URL has one)."""
        return self._conninfo

    @property
    def bounds(self) -> Bounds:
        """The bounds of its connections' statements and commits."""
        return self._bounds

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[PgConnection]:
        """Borrow a connection for the duration of the block.

        Waits while ``max_size`` connections are borrowed. Raises
        `DatabaseUnavailable` if a new connection cannot be opened.
        """
        if self._closed:
            raise RuntimeError("the BMDB connection is closed")
        async with self._slots:
            if self._idle:
                pg = self._idle.pop()
            else:
                pg = await PgConnection.connect(self._conninfo, self._bounds)
            try:
                yield pg
            except DatabaseUnavailable:
                # The server went away or restarted: the idle connections
                # are dead too, and each would fail its next user once.
                for dead in self.discard_idle():
                    await dead.close()
                raise
            finally:
                if pg.reusable and not self._closed:
                    self._idle.append(pg)
                else:
                    await pg.close()

    def discard_idle(self) -> list[PgConnection]:
        """Forget every idle connection and return them (for closing). Used
        after the server went away, when idle connections are dead too."""
        idle, self._idle = self._idle, []
        return idle

    async def aclose(self) -> None:
        """Close idle connections; borrowed ones are closed when returned."""
        self._closed = True
        for pg in self.discard_idle():
            await pg.close()
