"""Migrators started together on a fresh database all succeed, and the schema
is applied once: through the CLI (separate processes) and through the
library (one process, concurrent tasks).

Started together means that their first statements reach the server
together: processes that start at once still reach it spread over seconds
(Python's start-up on a busy machine), enough to hide the race that the old
code lost (``CREATE TABLE IF NOT EXISTS schema_migrations`` before the lock:
a unique violation on ``pg_type``, 11 of 40 migrators in a test run). So
`run_together` holds their connections at the server's door and lets them
in at once.
"""

from __future__ import annotations

import functools
import itertools
import os
import sys
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import psycopg
import pytest
import trio

from bmdb import migrations
from bmdb._pg import PgConnection
from bmdb.connection import migrate
from bmdb.localserver import LocalPostgres

T = TypeVar("T")

MIGRATORS = 8
ROUNDS = 3

#: Seconds the first held connection may wait for the others, well within
#: the five a BMDB connection attempt is allowed (`bmdb._pg.CONNECT_TIMEOUT`).
HOLD_AT_MOST = 2.5

_names = itertools.count()


@pytest.fixture
def fresh_databases(postgres_server: LocalPostgres) -> Iterator[list[str]]:
    """`ROUNDS` empty databases (names), dropped afterwards."""
    names = [f"bmdb_concurrent_{os.getpid()}_{next(_names)}" for _ in range(ROUNDS)]
    for name in names:
        postgres_server.admin(f"CREATE DATABASE {name}")
    yield names
    for name in names:
        postgres_server.admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


async def run_together(
    server: LocalPostgres, db: str, count: int, fn: Callable[[], Awaitable[T]]
) -> list[T]:
    """``count`` calls of ``fn``, each connecting to ``db``, let in together;
    their results.

    A backend starting up takes a lock on its database that conflicts with
    the one renaming the database takes: the renaming transaction (rolled
    back, the name never changes for anyone else) holds new connections at
    their start until all ``count`` wait, or the first has waited
    `HOLD_AT_MOST` seconds.
    """
    results: list[T] = []

    async def one() -> None:
        results.append(await fn())

    gate = await PgConnection.connect(server.url())
    try:
        [(oid,)] = await gate.execute("SELECT oid FROM pg_database WHERE datname = %s", (db,))
        await gate.execute("BEGIN")
        await gate.execute(f"ALTER DATABASE {db} RENAME TO {db}_held")
        async with trio.open_nursery() as nursery:
            for _ in range(count):
                nursery.start_soon(one)
            first_seen: float | None = None
            while True:
                [(waiting,)] = await gate.execute(
                    """SELECT count(*) FROM pg_locks WHERE locktype = 'object'
                       AND classid = 'pg_database'::regclass AND objid = %s AND NOT granted""",
                    (oid,),
                )
                now = trio.current_time()
                if waiting and first_seen is None:
                    first_seen = now
                if waiting == count or (first_seen is not None and now - first_seen > HOLD_AT_MOST):
                    break
                await trio.sleep(0.01)
            await gate.execute("ROLLBACK")
    finally:
        await gate.rollback_quietly()
        await gate.close()
    return results


def label(m: migrations.Migration) -> str:
    """How the CLI names a migration it applied."""
    return f"{m.version:04d}_{m.name}"


def assert_applied_once(url: str, applied: list[str]) -> None:
    """Every shipped migration was reported applied by exactly one migrator,
    and the database records each once."""
    shipped = [label(m) for m in migrations.available()]
    assert Counter(applied) == Counter(shipped)
    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT version FROM schema_migrations ORDER BY 1").fetchall()
    assert [v for (v,) in rows] == [m.version for m in migrations.available()]


async def test_concurrent_cli_migrators(
    postgres_server: LocalPostgres, fresh_databases: list[str]
) -> None:
    for db in fresh_databases:
        url = postgres_server.url(db)
        migrator = functools.partial(
            trio.run_process,
            [sys.executable, "-m", "bmdb", "--url", url, "migrate"],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
        with trio.fail_after(120):
            results = await run_together(postgres_server, db, MIGRATORS, migrator)
        failed = [r.stderr.decode() for r in results if r.returncode != 0 or r.stderr]
        assert not failed, failed
        outputs = [r.stdout.decode() for r in results]
        applied = [
            line.removeprefix("applied ")
            for out in outputs
            for line in out.splitlines()
            if line.startswith("applied ")
        ]
        assert_applied_once(url, applied)
        # Those that found nothing left to do say so.
        assert all("applied " in out or "schema up to date" in out for out in outputs)


async def test_concurrent_library_migrators(
    postgres_server: LocalPostgres, fresh_databases: list[str]
) -> None:
    for db in fresh_databases:
        url = postgres_server.url(db)
        with trio.fail_after(60):
            results = await run_together(
                postgres_server, db, MIGRATORS, functools.partial(migrate, url)
            )
        assert_applied_once(url, [label(m) for applied in results for m in applied])
