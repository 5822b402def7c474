"""A cancel that arrives while a statement is still being sent.

The statements here are larger than the socket buffers, so libpq cannot send
them in one go and the driver waits for the socket (`bmdb._pg._wait` with
``Wait.RW``). A spy on that wait cancels the caller exactly then, with the
statement half sent. The server ignores a cancel request while it is still
reading a statement (or parsing it: it has not started then), so a driver
that sends one at once (or none) leaves the statement running there; these
tests fail on that, on an exception group instead of a plain
`trio.Cancelled`, and on a connection left unusable.

Whether the driver's first cancel request lands before or after the server
started the statement is a race (the server reads the tail of a large
statement from its socket buffer and parses it, slowly under load). The
tests without `DropCancels` leave it to chance, with bounds generous enough
for a loaded machine (`generous_bounds`); those with it decide it: the first
requests, or all of them, are dropped, as the server drops a request that
arrives too early.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
from psycopg.waiting import Ready, Wait

import bmdb
from bmdb import _pg
from bmdb._pg import PgConnection
from bmdb.errors import DatabaseUnavailable

#: Larger than the send buffer every connection here gets (`small_send_buffers`)
#: a thousand times over, and than default socket buffers too.
BLOB = b"\x01" * (4 << 20)
#: Long enough to be still running when the test looks, were it not cancelled.
SLEEP = 600


@pytest.fixture(autouse=True)
def generous_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bounds of the abort far above what a loaded machine needs: sending
    32 MB took up to 5 s on two busy cores, which the driver's own bound
    (`bmdb._pg.ABORT_TIMEOUT`) would cut short by closing the connection,
    a legitimate outcome but not the one most of these tests look at."""
    monkeypatch.setattr(_pg, "ABORT_TIMEOUT", 30.0)
    monkeypatch.setattr(_pg, "CANCEL_TIMEOUT", 30.0)


@pytest.fixture(autouse=True)
def small_send_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every connection gets the smallest send buffer the kernel allows, so
    that sending a large statement must wait for the socket (and the spy
    sees it) however fast the server reads. With the default buffers a
    server reading on the other core as fast as libpq writes could take the
    whole statement without the socket ever filling: the spy never fires,
    nothing is cancelled and ``pg_sleep`` runs out the test's bound."""
    real = PgConnection.connect.__func__  # type: ignore[attr-defined]

    async def connect(cls: type[PgConnection], conninfo: str, *args: Any) -> PgConnection:
        pg: PgConnection = await real(cls, conninfo, *args)
        with socket.socket(fileno=os.dup(pg._pgconn.socket)) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        return pg

    monkeypatch.setattr(PgConnection, "connect", classmethod(connect))


class DropCancels:
    """Drops the driver's first ``drop`` cancel requests (all if None), as
    the server drops those that arrive before the statement started; counts
    the requests dropped and sent."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, drop: int | None) -> None:
        self.dropped = 0
        self.sent = 0
        real = PgConnection._request_cancel

        async def hook(pg: PgConnection) -> None:
            if drop is None or self.dropped < drop:
                self.dropped += 1
                await trio.lowlevel.checkpoint()
                return
            self.sent += 1
            await real(pg)

        monkeypatch.setattr(PgConnection, "_request_cancel", hook)


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
                text = simple_sleep()

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


def simple_sleep() -> str:
    """A simple-protocol statement larger than the socket buffers that
    sleeps for `SLEEP` seconds."""
    return f"SELECT pg_sleep({SLEEP}), length('{'x' * len(BLOB)}')"


async def test_cancel_repeated_until_the_statement_ends(
    bmdb_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first cancel requests are lost (they arrived, say, while the
    server still parsed the statement): the driver must go on asking until
    the statement's result arrives, not stop at the first request the server
    answered. Cancelled on the server, the connection stays usable."""
    pg = await PgConnection.connect(bmdb_url)
    try:
        with trio.fail_after(60):
            drops = DropCancels(monkeypatch, drop=3)
            spy = CancelMidSend(monkeypatch)
            text = simple_sleep()
            assert_plain_cancelled(await spy.run(lambda: pg.execute(text)), spy)
            assert drops.dropped == 3
            assert drops.sent >= 1
            assert await running_sleeps(bmdb_url) == []
            assert pg.reusable
            assert await pg.execute("SELECT %s::int", (7,)) == [(7,)]
    finally:
        await pg.close()


async def test_cancel_never_taken_closes_and_ends_the_statement(
    bmdb_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every cancel request is lost: past `CANCEL_TIMEOUT` the driver gives
    the connection up. Closing its socket alone would leave the backend
    sleeping for `SLEEP` seconds (it notices only when it next reads or
    writes); the statement must not be running when `Cancelled` is raised."""
    monkeypatch.setattr(_pg, "CANCEL_TIMEOUT", 0.5)
    pg = await PgConnection.connect(bmdb_url)
    try:
        with trio.fail_after(60):
            drops = DropCancels(monkeypatch, drop=None)
            spy = CancelMidSend(monkeypatch)
            text = simple_sleep()
            assert_plain_cancelled(await spy.run(lambda: pg.execute(text)), spy)
            assert drops.dropped >= 1
            assert await running_sleeps(bmdb_url) == []
            assert not pg.reusable
            with pytest.raises(DatabaseUnavailable):
                await pg.execute("SELECT 1")
    finally:
        await pg.close()


async def test_cancel_never_taken_through_the_pool(
    bmdb_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, in a transaction of the pool: the pool does not hand out
    the given-up connection again; the next transaction gets a new one."""
    monkeypatch.setattr(_pg, "CANCEL_TIMEOUT", 0.5)
    async with bmdb.open_connection(bmdb_url, max_connections=1) as conn:
        [[first_pid]] = await conn.transact(lambda q: q.execute("SELECT pg_backend_pid()"))

        async def body(q: bmdb.Queries) -> object:
            return await q.execute("SELECT pg_sleep(%s), length(%s::bytea)", (SLEEP, BLOB))

        async def statement() -> object:
            return await conn.transact(body)

        with trio.fail_after(60):
            DropCancels(monkeypatch, drop=None)
            spy = CancelMidSend(monkeypatch)
            assert_plain_cancelled(await spy.run(statement), spy)
            assert await running_sleeps(bmdb_url) == []
            [[pid]] = await conn.transact(lambda q: q.execute("SELECT pg_backend_pid()"))
            assert pid != first_pid
