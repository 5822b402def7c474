"""What every domain's statements stand on: the transaction they run in.

`QueriesBase` holds the open transaction (an `Executor`) and ``locking``
(set by `Session.work` for its source function), and runs one statement
with the BMDB's error translation (`QueriesBase.execute`). The domain
mixins (`bmdb.model.machines`, `agents`, `installs`, `sourcing`,
`decommission`, `upgrades`, `history`) derive from it and reach the
database only through ``execute``; `bmdb.model.queries.Queries` composes
them into the one object callers get.
"""

from __future__ import annotations

from typing import Protocol

from bmdb import pgerrors
from bmdb._pg import Params, Row


class Executor(Protocol):
    """What `Queries` runs its statements on: an open transaction, and the
    role it runs as (named in errors about privileges)."""

    async def execute(self, query: str, params: Params | None = None) -> list[Row]: ...

    @property
    def user(self) -> str: ...


class QueriesBase:
    """Statements run in the transaction of ``pg``.

    ``locking`` is set by `Session.work` for its source function: sourcing
    queries then lock what they return (see `bmdb.model.sourcing`).
    """

    def __init__(self, pg: Executor, *, locking: bool = False) -> None:
        self._pg = pg
        self.locking = locking

    async def execute(self, sql: str, params: Params | None = None) -> list[Row]:
        """Run one raw statement in this transaction and return its rows.

        For the BMDB's own session and work statements, and for tools and
        tests that need a statement no method offers; prefer the methods.
        Database errors are raised as `BMDBError`s (see
        `bmdb.pgerrors.as_bmdb_error`), except serialization failures, which the
        surrounding transaction retries.
        """
        try:
            return await self._pg.execute(sql, params)
        except Exception as e:
            translated = pgerrors.as_bmdb_error(e, role=self._pg.user)
            if translated is None or translated is e:
                raise
            raise translated from e
