"""No statement and no commit waits forever (`bmdb.pgbounds.Bounds`), against a
real PostgreSQL that is made to hang the way a fenced primary does.

A private server whose ``synchronous_standby_names`` names a standby that
never connects: every commit with ``synchronous_commit = on`` then waits
for it forever, as the commits on a primary whose Patroni died waited for
a standby that had moved to the new leader. A stopped backend (SIGSTOP)
stands for a server that no longer answers at all.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psycopg
import pytest
import trio

import bmdb
from bmdb import _pg
from bmdb._pg import PgConnection
from bmdb.connection import migrate
from bmdb.errors import CommitOutcomeUnknown, DatabaseUnavailable
from bmdb.localserver import LocalPostgres
from bmdb.pgbounds import Bounds

#: A standby that never comes: commits that wait for it hang.
NOBODY = "ALTER SYSTEM SET synchronous_standby_names = 'nobody'"


@pytest.fixture(scope="module")
def hanging_server() -> Iterator[LocalPostgres]:
    """A private server whose synchronous commits never return."""
    root = Path(tempfile.mkdtemp(prefix="bmdb-bounds-"))
    os.chmod(root, 0o711)  # user postgres enters it
    server = LocalPostgres(root / "pg")
    try:
        server.create()
        server.start()
        server.admin(NOBODY)
        server.admin("SELECT pg_reload_conf()")
        server.admin("CREATE TABLE t (x int)")
        server.admin("CREATE DATABASE bmdb")
        trio.run(migrate, server.url("bmdb"))
        yield server
    finally:
        if server.running:
            server.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
async def short_grace(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[None]:
    """The client's grace and its abort's bounds shortened, so that a test
    of a server that never answers takes seconds, not half a minute."""
    monkeypatch.setattr(_pg, "STATEMENT_GRACE", 0.5)
    monkeypatch.setattr(_pg, "CANCEL_TIMEOUT", 0.5)
    monkeypatch.setattr(_pg, "TERMINATE_TIMEOUT", 0.5)
    yield


async def _synchronous_insert(pg: PgConnection) -> None:
    pg.begin("READ COMMITTED")
    await pg.execute("SET LOCAL synchronous_commit = on")
    await pg.execute("INSERT INTO t VALUES (%s)", (1,))


async def test_a_commit_that_waits_for_a_lost_standby_ends_at_its_bound(
    hanging_server: LocalPostgres,
) -> None:
    pg = await PgConnection.connect(hanging_server.url(), Bounds(statement=30, commit=1))
    await _synchronous_insert(pg)
    with trio.fail_after(10):
        with pytest.raises(CommitOutcomeUnknown, match="did not return within 1 s"):
            await pg.commit()
    assert not pg.reusable  # dropped, never reused mid-commit


async def test_without_a_commit_bound_the_same_commit_hangs(
    hanging_server: LocalPostgres,
) -> None:
    """The test above fails without its bound: the commit does not return."""
    pg = await PgConnection.connect(hanging_server.url(), Bounds(statement=None, commit=None))
    await _synchronous_insert(pg)
    with trio.move_on_after(3) as waited:
        await pg.commit()
    assert waited.cancelled_caught
    await pg.close()


async def test_a_commit_whose_wait_an_operator_cancels_is_not_taken_for_a_success(
    hanging_server: LocalPostgres,
) -> None:
    """A cancel (``pg_cancel_backend``, or a client's cancel request) ends the
    wait for the standby, and the server then answers COMMIT as if it had
    succeeded, with a warning: the transaction committed locally only. That
    is an unknown outcome, not a success."""
    pg = await PgConnection.connect(hanging_server.url(), Bounds(statement=30, commit=None))
    pid = pg._pgconn.backend_pid
    await _synchronous_insert(pg)

    async def cancel_once_waiting() -> None:
        operator = await PgConnection.connect(hanging_server.url())
        try:
            waiting = "SELECT 1 FROM pg_stat_activity WHERE pid = %s AND wait_event = 'SyncRep'"
            while not await operator.execute(waiting, (pid,)):  # noqa: ASYNC110 (polls the server)
                await trio.sleep(0.05)
            await operator.execute("SELECT pg_cancel_backend(%s)", (pid,))
        finally:
            await operator.close()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancel_once_waiting)
            with pytest.raises(CommitOutcomeUnknown, match="synchronous replication"):
                await pg.commit()
    assert not pg.reusable


async def test_a_transaction_whose_commit_hangs_raises_a_documented_error(
    hanging_server: LocalPostgres,
) -> None:
    """Through the public API: `Connection.transact` raises the commit's
    `CommitOutcomeUnknown` (a `DatabaseUnavailable`), and the connection
    goes on serving once the server commits again."""
    url = hanging_server.url("bmdb")
    async with bmdb.open_connection(url, bounds=Bounds(statement=30, commit=1)) as conn:

        async def write(q: bmdb.Queries) -> None:
            await q.execute("SET LOCAL synchronous_commit = on")
            await q.execute(
                "INSERT INTO audit_log (operator, action, reason, detail)"
                " VALUES ('t', 'x', 'r', '')"
            )

        with trio.fail_after(10):
            with pytest.raises(DatabaseUnavailable) as caught:
                await conn.transact(write, isolation=bmdb.Isolation.READ_COMMITTED)
        assert isinstance(caught.value, CommitOutcomeUnknown)

        async def read(q: bmdb.Queries) -> int:
            [(n,)] = await q.execute("SELECT count(*) FROM machines")
            return int(n)

        assert await conn.transact(read) == 0


async def test_statement_timeout_is_set_and_a_url_of_its_own_is_kept(
    hanging_server: LocalPostgres,
) -> None:
    pg = await PgConnection.connect(hanging_server.url(), Bounds(statement=2.5))
    assert await pg.execute("SHOW statement_timeout") == [("2500ms",)]
    await pg.close()
    own = hanging_server.url() + "?options=-c%20statement_timeout%3D7s"
    pg = await PgConnection.connect(own, Bounds(statement=2.5))
    assert await pg.execute("SHOW statement_timeout") == [("7s",)]
    await pg.close()
    with pytest.raises(psycopg.errors.QueryCanceled):
        pg = await PgConnection.connect(hanging_server.url(), Bounds(statement=0.2))
        await pg.execute("SELECT pg_sleep(5)")
    await pg.close()


async def test_a_server_that_never_answers_is_given_up_after_the_bound_and_grace(
    hanging_server: LocalPostgres, short_grace: None
) -> None:
    pg = await PgConnection.connect(hanging_server.url(), Bounds(statement=0.5))
    pid = pg._pgconn.backend_pid
    os.kill(pid, signal.SIGSTOP)
    try:
        with trio.fail_after(15):
            with pytest.raises(DatabaseUnavailable, match="did not answer a statement within 1 s"):
                await pg.execute("SELECT 1")
    finally:
        os.kill(pid, signal.SIGCONT)
    assert not pg.reusable
