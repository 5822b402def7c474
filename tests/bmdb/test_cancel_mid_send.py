"""A cancel that arrives while a statement is still being sent.

The statements here are larger than the socket buffers, so libpq cannot send
them in one go and the driver waits for the socket (`bmdb._pg._wait` with
``Wait.RW``). A spy on that wait cancels the caller exactly then, with the
statement half sent. The server ignores a cancel request while it is still
reading a statement, so a driver that sends one at once (or none) leaves the
statement running there; these tests fail on that, on an exception group
instead of a plain `trio.Cancelled`, and on a connection left unusable.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
import trio
from psycopg.waiting import Ready, Wait

import bmdb
from bmdb import _pg
from bmdb._pg import PgConnection

#: Larger than the loopback socket buffers (a few MB) many times over.
BLOB = b"\x01" * (32 << 20)
#: Long enough to be still running when the test looks, were it not cancelled.
SLEEP = 600


class CancelMidSend:
    """Cancels `scope` the first time the driver waits to send more of a
    statement; `seen` tells whether that happened."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.scope = trio.CancelScope()
        self.seen = False
        real = _pg._wait

        async def spy(fileno: int, state: Wait) -> Ready:
            if state == Wait.RW and not self.seen:
                self.seen = True
                self.scope.cancel()
            return await real(fileno, state)

        monkeypatch.setattr(_pg, "_wait", spy)

    async def run(self, statement: Callable[[], Awaitable[object]]) -> BaseException | None:
        """Run ``statement`` under `scope`; what it raised."""
        raised: BaseException | None = None
        with self.scope:
            try:
                await statement()
            except BaseException as exc:
                raised = exc
                raise
        return raised


async def running_sleeps(url: str) -> list[str]:
    """Statements of ours that the server is running (from a new connection)."""
    observer = await PgConnection.connect(url)
    try:
        rows = await observer.execute(
            """SELECT query FROM pg_stat_activity
               WHERE datname = current_database() AND pid <> pg_backend_pid()
                 AND state = 'active' AND query LIKE '%pg_sleep%'"""
        )
        return [r[0] for r in rows]
    finally:
        await observer.close()


def assert_plain_cancelled(raised: BaseException | None, spy: CancelMidSend) -> None:
    assert spy.seen, "the statement was sent in one go: make it larger"
    assert isinstance(raised, trio.Cancelled), repr(raised)
    assert spy.scope.cancelled_caught


@pytest.mark.parametrize("protocol", ["prepared", "simple"])
async def test_cancel_mid_send_on_one_connection(
    bmdb_url: str, monkeypatch: pytest.MonkeyPatch, protocol: str
) -> None:
    pg = await PgConnection.connect(bmdb_url)
    try:
        with trio.fail_after(60):
            if protocol == "prepared":
                # Prepared by a small first run, so the large one is a lone
                # Bind/Execute outside pipeline mode.
                query = "SELECT pg_sleep(%s), length(%s::bytea)"
                assert await pg.execute(query, (0, b"x")) == [("", 1)]

                async def statement() -> object:
                    return await pg.execute(query, (SLEEP, BLOB))
            else:
                text = f"SELECT pg_sleep({SLEEP}), length('{'x' * len(BLOB)}')"

                async def statement() -> object:
                    return await pg.execute(text)

            spy = CancelMidSend(monkeypatch)
            assert_plain_cancelled(await spy.run(statement), spy)
            assert await running_sleeps(bmdb_url) == []
            # Cancelled on the server and answered: idle, not closed.
            assert pg.reusable
            assert await pg.execute("SELECT %s::int", (7,)) == [(7,)]
    finally:
        await pg.close()


async def test_cancel_mid_send_through_the_pool(
    bmdb_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first run of a statement in a transaction: BEGIN, Parse and the
    execution in one pipeline; then the pool's only connection serves the
    next transaction."""
    async with bmdb.open_connection(bmdb_url, max_connections=1) as conn:

        async def body(q: bmdb.Queries) -> object:
            return await q.execute("SELECT pg_sleep(%s), length(%s::bytea)", (SLEEP, BLOB))

        async def statement() -> object:
            return await conn.transact(body)

        with trio.fail_after(60):
            spy = CancelMidSend(monkeypatch)
            assert_plain_cancelled(await spy.run(statement), spy)
            assert await running_sleeps(bmdb_url) == []
            assert await conn.transact(lambda q: q.sessions()) == []
