"""Migrating never leaves a database half-done: a database that cannot store
UTF-8 text is refused before anything is written, the client speaks UTF-8
whatever the environment says, and a migrator killed between a migration and
its ``schema_migrations`` row leaves neither (the next run applies it)."""

from __future__ import annotations

import itertools
import os
import signal
import sys
from collections.abc import Iterator

import psycopg
import pytest
import trio

from bmdb import migrations
from bmdb._pg import PgConnection
from bmdb.localserver import LocalPostgres
from common.crashpoint import CRASH_ENV

_names = itertools.count()


async def cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    with trio.fail_after(60):
        result = await trio.run_process(
            [sys.executable, "-m", "bmdb", *args],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env={**os.environ, **(env or {})},
        )
    return result.returncode, result.stdout.decode(), result.stderr.decode()


def tables(server: LocalPostgres, db: str) -> list[str]:
    with psycopg.connect(server.url(db), autocommit=True) as conn:
        rows = conn.execute(
            "SELECT tablename::text FROM pg_tables WHERE schemaname = 'public' ORDER BY 1"
        ).fetchall()
    return [r[0] for r in rows]


def new_db(server: LocalPostgres, options: str = "") -> Iterator[str]:
    name = f"bmdb_enc_{os.getpid()}_{next(_names)}"
    server.admin(f"CREATE DATABASE {name} {options}")
    yield name
    server.admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def ascii_db(postgres_server: LocalPostgres) -> Iterator[str]:
    """A database as ``LC_ALL=C initdb`` makes them: SQL_ASCII."""
    yield from new_db(postgres_server, "ENCODING 'SQL_ASCII' TEMPLATE template0")


@pytest.fixture
def empty_db(postgres_server: LocalPostgres) -> Iterator[str]:
    yield from new_db(postgres_server)


async def test_sql_ascii_database_is_refused_before_anything_is_written(
    postgres_server: LocalPostgres, ascii_db: str
) -> None:
    for _ in range(2):  # and again: the first refusal left nothing behind
        code, out, err = await cli("--url", postgres_server.url(ascii_db), "migrate")
        assert code == 1, (code, out, err)
        assert "Traceback" not in err and "internal error" not in err, err
        [line] = err.splitlines()
        assert line == (
            "bmdb: error: the BMDB's database has encoding SQL_ASCII, which cannot store"
            " UTF-8 text: create the database with ENCODING 'UTF8' (a cluster with"
            " initdb --encoding=UTF8)"
        )
        assert tables(postgres_server, ascii_db) == []


async def test_client_speaks_utf8_whatever_the_environment_says(
    postgres_server: LocalPostgres, empty_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PGCLIENTENCODING", "LATIN1")
    pg = await PgConnection.connect(postgres_server.url(empty_db))
    try:
        assert await pg.execute("SHOW client_encoding") == [("UTF8",)]
        # Text comes back as str, not bytes: what broke migrating on SQL_ASCII.
        assert await pg.execute("SELECT 'ü'::text, %s::text", ("ü",)) == [("ü", "ü")]
    finally:
        await pg.close()


async def test_migrator_killed_between_statements_leaves_nothing_half_applied(
    postgres_server: LocalPostgres, empty_db: str
) -> None:
    url = postgres_server.url(empty_db)
    # Killed after migration 0001's statements ran, before its row is written.
    code, out, err = await cli("--url", url, "migrate", env={CRASH_ENV: "bmdb-migration-applied"})
    assert code == -signal.SIGKILL, (code, out, err)
    # Its transaction never committed: not one of its tables, not even
    # schema_migrations (created in the same transaction).
    assert tables(postgres_server, empty_db) == []
    code, out, err = await cli("--url", url, "migrate")
    assert code == 0, (code, out, err)
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute("SELECT version FROM schema_migrations ORDER BY 1").fetchall()
    assert [r[0] for r in rows] == [m.version for m in migrations.available()]
    code, out, err = await cli("--url", url, "sessions")
    assert code == 0, (code, out, err)


def test_the_local_server_makes_utf8_databases(postgres_server: LocalPostgres) -> None:
    # initdb -E UTF8 --locale=C, whatever LC_ALL the tests run under.
    with psycopg.connect(postgres_server.url(), autocommit=True) as conn:
        rows = conn.execute(
            "SELECT datname::text, pg_encoding_to_char(encoding) FROM pg_database"
            " WHERE datname IN ('template1', 'postgres')"
        ).fetchall()
    assert sorted(rows) == [("postgres", "UTF8"), ("template1", "UTF8")]
