"""PostgreSQL restarted under running workers: they recover with new
sessions, and nothing is lost or half-written."""

from __future__ import annotations

import logging
from collections.abc import Generator

import pytest
import trio
from psycopg import generators
from psycopg.pq.abc import PGconn, PGresult
from psycopg.waiting import Ready, Wait

import bmdb
from bmdb import Process
from bmdb._pg import PgConnection
from bmdb.errors import DatabaseUnavailable, NothingToDo, SessionExpired, WorkConflict
from bmdb.localserver import LocalPostgres
from tests.bmdb.helpers import (
    agent_start_source,
    bulk_provided_machines,
    finish_agent_start,
    outcome_counts,
)

logger = logging.getLogger("tests.bmdb.restart")

MACHINES = 400
WORKERS = 8
INTERVAL = 1.0


async def _all_tagged(conn: bmdb.Connection) -> bool:
    return (await outcome_counts(conn))["tagged"] == MACHINES


async def resilient_worker(conn: bmdb.Connection, name: str, sessions: list[int]) -> None:
    """Like a Shepherd control loop: a new session whenever one is lost."""
    while True:
        try:
            async with conn.session("restart-worker", name, interval=INTERVAL) as sess:
                sessions.append(1)
                while True:
                    try:
                        work = await sess.work(Process.SHEPHERD_AGENT_START, agent_start_source)
                    except NothingToDo:
                        if await _all_tagged(conn):
                            return
                        # Left: machines whose dead locks have not expired yet.
                        await trio.sleep(0.1)
                        continue
                    except WorkConflict:
                        continue
                    async with work:
                        await finish_agent_start(work)
        except (SessionExpired, DatabaseUnavailable) as e:
            logger.info("%s: %s; starting over", name, e)
            await trio.sleep(0.1)


@pytest.mark.parametrize("how", ["stop", "kill"])
async def test_workers_survive_postgres_restart(
    bmdb_conn: bmdb.Connection, postgres_server: LocalPostgres, how: str
) -> None:
    """``stop`` is a fast shutdown (clients are disconnected, transactions
    aborted); ``kill`` a crash of every server process mid-transaction."""
    await bulk_provided_machines(bmdb_conn, MACHINES)
    sessions: list[int] = []

    async def restart_midway() -> None:
        async def some_done() -> bool:
            return (await outcome_counts(bmdb_conn))["tagged"] >= MACHINES // 4

        while True:
            if await some_done():
                break
            await trio.sleep(0.05)
        await trio.to_thread.run_sync(getattr(postgres_server, how))
        await trio.sleep(0.5)
        await trio.to_thread.run_sync(postgres_server.start)

    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(restart_midway)
            for i in range(WORKERS):
                nursery.start_soon(resilient_worker, bmdb_conn, f"w{i}", sessions)

    counts = await outcome_counts(bmdb_conn)
    assert counts["tagged"] == counts["finished"] == counts["finished_once"] == MACHINES
    assert counts["work"] == 0
    assert counts["mirror_off"] == 0
    # The restart really cut the workers off: they had to start over.
    assert len(sessions) > WORKERS


async def test_pooled_connections_survive_a_restart_in_between(
    bmdb_conn: bmdb.Connection, postgres_server: LocalPostgres
) -> None:
    # Warm the pool: after this, an idle connection waits in it.
    await bulk_provided_machines(bmdb_conn, 1)
    await trio.to_thread.run_sync(postgres_server.stop)
    await trio.to_thread.run_sync(postgres_server.start)
    # The idle connection is dead; the transaction notices at BEGIN and
    # runs on a fresh connection instead of failing.
    assert (await outcome_counts(bmdb_conn))["machines"] == 1


async def test_a_pipeline_the_server_cut_short_is_a_lost_connection(
    bmdb_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fast shutdown can end a backend mid-pipeline (BEGIN, statement, Sync)
    before libpq notices the closed socket: the Sync's reply never comes and
    libpq refuses to leave pipeline mode ("cannot exit pipeline mode while
    busy"). That is a lost connection (`DatabaseUnavailable`, which workers
    start over on), not a database error; this failed test_workers_survive_
    postgres_restart[stop] about once in a few dozen runs. The server cannot
    be made to time it, so the Sync's reply is left unread here instead."""
    pg = await PgConnection.connect(bmdb_url)
    real_fetch_many = generators.fetch_many
    fetches: list[int] = []

    def fetch_many(pgconn: PGconn) -> Generator[Wait, Ready, list[PGresult]]:
        fetches.append(1)
        if len(fetches) == 3:  # BEGIN's, the statement's, then the Sync's: unread
            return []
        results: list[PGresult] = yield from real_fetch_many(pgconn)
        return results

    # bmdb._pg calls it through the module: patched for its pipelines too.
    monkeypatch.setattr(generators, "fetch_many", fetch_many)
    pg.begin("REPEATABLE READ")
    with pytest.raises(DatabaseUnavailable, match="while busy"):
        await pg.execute("SELECT %s::int", (1,))
    # Nothing can have run in that transaction: it may be retried.
    assert pg.lost_at_begin
