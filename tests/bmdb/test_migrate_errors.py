"""What ``python -m bmdb`` says when the database is not one it can use: one
line on stderr that names the object and what to do, never a traceback; and
the rule behind it (`bmdb.pgerrors.as_bmdb_error`), on real server errors."""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Iterator

import psycopg
import pytest
import trio

from bmdb import errors
from bmdb._pg import PgConnection
from bmdb.localserver import LocalPostgres
from bmdb.pgerrors import as_bmdb_error

_names = itertools.count()


async def cli(*args: str) -> tuple[int, str, str]:
    with trio.fail_after(60):
        result = await trio.run_process(
            [sys.executable, "-m", "bmdb", *args],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    return result.returncode, result.stdout.decode(), result.stderr.decode()


def one_error_line(code: int, out: str, err: str) -> str:
    """The one line of stderr of a command that failed as expected."""
    assert code == 1, (code, out, err)
    assert "Traceback" not in err and "internal error" not in err, err
    [line] = err.splitlines()
    assert line.startswith("bmdb: error: "), line
    return line


@pytest.fixture
def empty_db(postgres_server: LocalPostgres) -> Iterator[str]:
    """A new database without any schema (its name)."""
    name = f"bmdb_errors_{os.getpid()}_{next(_names)}"
    postgres_server.admin(f"CREATE DATABASE {name}")
    yield name
    postgres_server.admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def role(postgres_server: LocalPostgres, empty_db: str) -> Iterator[str]:
    """A role that may log in and nothing more (PostgreSQL 15 gives PUBLIC
    no CREATE on schema public), and ``empty_db`` dropped before it."""
    name = f"bmdb_role_{os.getpid()}_{next(_names)}"
    postgres_server.admin(f"CREATE ROLE {name} LOGIN")
    yield name
    postgres_server.admin(f"DROP DATABASE IF EXISTS {empty_db} WITH (FORCE)")
    postgres_server.admin(f"DROP ROLE {name}")


def url_as(server: LocalPostgres, db: str, role: str) -> str:
    url = server.url(db)
    assert url.startswith("postgresql://postgres@")
    return url.replace("postgresql://postgres@", f"postgresql://{role}@", 1)


async def test_foreign_machines_table(postgres_server: LocalPostgres, empty_db: str) -> None:
    postgres_server.admin("CREATE TABLE machines (hostname text)", db=empty_db)
    line = one_error_line(*await cli("--url", postgres_server.url(empty_db), "migrate"))
    assert 'relation "machines" already exists' in line
    assert "bmdb migrations did not create it" in line and "empty database" in line
    assert "0001_initial" in line
    # Rolled back whole: the user's table is all there is.
    with psycopg.connect(postgres_server.url(empty_db)) as conn:
        [(tables,)] = conn.execute(
            "SELECT array_agg(relname::text) FROM pg_class"
            " WHERE relnamespace = 'public'::regnamespace"
        ).fetchall()
    assert tables == ["machines"]


async def test_foreign_schema_migrations_table(
    postgres_server: LocalPostgres, empty_db: str
) -> None:
    # Another migration tool's bookkeeping (golang-migrate's shape), whose
    # versions are timestamps that must not read as ours.
    postgres_server.admin(
        "CREATE TABLE schema_migrations (version bigint PRIMARY KEY, dirty boolean NOT NULL);"
        " INSERT INTO schema_migrations VALUES (20240101120000, false)",
        db=empty_db,
    )
    for command in ("migrate", "machines"):
        line = one_error_line(*await cli("--url", postgres_server.url(empty_db), command))
        assert "table schema_migrations exists" in line, line
        assert "version bigint, dirty boolean" in line and "empty database" in line


async def test_role_without_create(
    postgres_server: LocalPostgres, empty_db: str, role: str
) -> None:
    url = url_as(postgres_server, empty_db, role)
    line = one_error_line(*await cli("--url", url, "migrate"))
    assert f"role {role} may not create tables in schema public" in line
    assert f"GRANT CREATE ON SCHEMA public TO {role}" in line
    # The advice is the cure.
    postgres_server.admin(f"GRANT CREATE ON SCHEMA public TO {role}", db=empty_db)
    code, out, err = await cli("--url", url, "migrate")
    assert (code, err) == (0, "") and "applied 0001_initial" in out


async def test_search_path_without_schema(postgres_server: LocalPostgres, empty_db: str) -> None:
    postgres_server.admin(f"ALTER DATABASE {empty_db} SET search_path = nowhere")
    line = one_error_line(*await cli("--url", postgres_server.url(empty_db), "migrate"))
    assert "no schema of search_path exists" in line and "fix search_path" in line


async def test_role_without_select(
    postgres_server: LocalPostgres, empty_db: str, role: str
) -> None:
    code, _, err = await cli("--url", postgres_server.url(empty_db), "migrate")
    assert (code, err) == (0, "")
    # Any read-only command: the schema check reads schema_migrations.
    line = one_error_line(*await cli("--url", url_as(postgres_server, empty_db, role), "sessions"))
    assert "permission denied for table schema_migrations" in line
    assert f"grant role {role} that privilege" in line


async def test_schema_newer_than_this_code(postgres_server: LocalPostgres, empty_db: str) -> None:
    url = postgres_server.url(empty_db)
    assert (await cli("--url", url, "migrate"))[0] == 0
    postgres_server.admin(
        "INSERT INTO schema_migrations (version, name) VALUES (9999, 'future')", db=empty_db
    )
    for command in ("migrate", "machines"):
        line = one_error_line(*await cli("--url", url, command))
        assert "[9999]" in line and "upgrade this program" in line


async def test_read_only_command_on_unmigrated_database(
    postgres_server: LocalPostgres, empty_db: str
) -> None:
    postgres_server.admin("CREATE TABLE machines (hostname text)", db=empty_db)
    line = one_error_line(*await cli("--url", postgres_server.url(empty_db), "machines"))
    assert "lacks migrations" in line and "run `python -m bmdb migrate`" in line


async def test_missing_database_and_role(postgres_server: LocalPostgres) -> None:
    line = one_error_line(*await cli("--url", postgres_server.url("no_such_db"), "migrate"))
    assert 'database "no_such_db" does not exist' in line
    url = url_as(postgres_server, "postgres", "no_such_role")
    line = one_error_line(*await cli("--url", url, "machines"))
    assert 'role "no_such_role" does not exist' in line


@pytest.mark.parametrize(
    ("sqlstate", "kind", "advice"),
    [
        ("42P07", errors.SchemaConflict, "bmdb migrations did not create it"),
        ("42710", errors.SchemaConflict, "bmdb migrations did not create it"),
        ("42501", errors.PermissionDenied, "grant role postgres that privilege"),
        ("3D000", errors.DatabaseUnavailable, "create the database"),
        ("28P01", errors.DatabaseUnavailable, "check the user name and password"),
        ("57P01", errors.DatabaseUnavailable, "shutting down or restarting"),
        ("53100", errors.BMDBError, "out of disk, memory or connections"),
        ("25006", errors.BMDBError, "use the primary"),
        ("55P03", errors.BMDBError, "another transaction holds the lock"),
        ("42P01", errors.SchemaNotMigrated, "run `python -m bmdb migrate`"),
        ("23505", errors.InvalidArgument, ""),
        ("XX000", errors.BMDBError, "(SQLSTATE XX000)"),
    ],
)
async def test_server_errors_by_sqlstate(
    bmdb_url: str, sqlstate: str, kind: type[errors.BMDBError], advice: str
) -> None:
    """Each SQLSTATE raised by the server itself (plpgsql's RAISE), with a
    message that tries to break the line and drive the terminal."""
    pg = await PgConnection.connect(bmdb_url)
    try:
        with pytest.raises(psycopg.Error) as caught:
            await pg.execute(
                f"DO $$ BEGIN RAISE EXCEPTION USING ERRCODE = '{sqlstate}',"
                " MESSAGE = E'object \"x\"\\n\\x1b[2Jforged'; END $$"
            )
        translated = as_bmdb_error(caught.value, role=pg.user, doing="step 7")
    finally:
        await pg.close()
    assert type(translated) is kind
    message = str(translated)
    assert message.startswith("step 7: ") and 'object "x"\\n\\x1b[2Jforged' in message
    assert "\n" not in message and "\x1b" not in message
    assert advice in message
