"""Versioned schema migrations, and the code that applies them.

Migrations are the ``NNNN_name.sql`` files in this folder, applied in order
of ``NNNN``, each in its own transaction together with its row in
``schema_migrations``. Re-running is a no-op.

Concurrent migrators are safe: each transaction takes one advisory lock
(``pg_advisory_xact_lock``, per database) as its first statement, before it
reads or creates anything, ``schema_migrations`` included; the others wait
for it, then see what it committed. Creating outside the lock would not do:
PostgreSQL's ``CREATE TABLE IF NOT EXISTS`` is not atomic, and two creators
at once fail with a unique violation on ``pg_type``. The transactions run
READ COMMITTED whatever the database's default, so that a migrator that
waited reads what the one before it committed.

A database with a migration newer than the newest file here was migrated by
a newer release: `check_schema` and `migrate` refuse it with `SchemaTooNew`
rather than guess what the newer schema means. A database whose encoding
is not UTF8 is refused by `migrate` before anything is written (the client
always speaks UTF-8, see `bmdb._pg`). Every database error becomes
a one-line `BMDBError` (`bmdb.pgerrors.as_bmdb_error`) that names the migration
it came from: an object of ours that migrations did not create (another
application's ``machines`` table, or a ``schema_migrations`` of another
tool) is a `SchemaConflict`; a role that may not create in the schema is a
`PermissionDenied` saying what to grant, found before the first migration
is tried.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from typing import Protocol

from bmdb import pgerrors
from bmdb._pg import Params, Row
from bmdb.errors import (
    BMDBError,
    PermissionDenied,
    SchemaConflict,
    SchemaError,
    SchemaNotMigrated,
    SchemaTooNew,
)
from common.crashpoint import crash_point
from common.text import printable

logger = logging.getLogger("bmdb.migrations")

# An arbitrary constant shared by every BMDB migrator (pg_advisory_xact_lock key).
_LOCK_KEY = 0x626D_6462  # "bmdb"

_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")

_CREATE_TABLE = """
    CREATE TABLE schema_migrations (
        version integer PRIMARY KEY,
        name text NOT NULL,
        applied_at timestamptz NOT NULL DEFAULT now()
    )
"""

#: The columns of `_CREATE_TABLE`, as `_COLUMNS` lists them.
_OUR_COLUMNS = ["version integer", "name text", "applied_at timestamp with time zone"]

#: The columns of the ``schema_migrations`` that search_path finds; no row's
#: value (NULL) if there is none.
_COLUMNS = """
    SELECT (SELECT array_agg(attname::text || ' ' || format_type(atttypid, atttypmod)
                             ORDER BY attnum)
            FROM pg_attribute
            WHERE attrelid = t.oid AND attnum > 0 AND NOT attisdropped)
    FROM (SELECT to_regclass('schema_migrations') AS oid) AS t
"""

#: Whether the role may create in the schema that CREATE TABLE would use.
_MAY_CREATE = """
    SELECT current_user, current_schema(),
           current_schema() IS NOT NULL AND has_schema_privilege(current_schema(), 'CREATE')
"""


class Connection(Protocol):
    """What migrating needs of a database connection in autocommit mode: run
    statements (its own BEGIN/COMMIT among them), roll back whatever is
    open while unwinding from an error (shielded, never raising), and say
    which role it is (for error messages)."""

    async def execute(self, query: str, params: Params | None = None) -> list[Row]: ...

    async def rollback_quietly(self) -> None: ...

    @property
    def user(self) -> str: ...


@dataclass(frozen=True, slots=True)
class Migration:
    """One SQL file: its version, name and text."""

    version: int
    name: str
    sql: str

    @property
    def label(self) -> str:
        """``NNNN_name``, as the file is called (without ``.sql``)."""
        return f"{self.version:04d}_{self.name}"


def available() -> list[Migration]:
    """The migrations shipped with this code, oldest first."""
    found = []
    for entry in resources.files(__name__).iterdir():
        match = _NAME.match(entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text(encoding="utf-8")))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise RuntimeError(f"duplicate migration versions in {versions}")
    return found


def latest_version() -> int:
    """The version of the newest migration shipped with this code."""
    return available()[-1].version


async def applied_versions(pg: Connection) -> list[int]:
    """Versions recorded in the database (empty for a fresh database).

    Raises `SchemaConflict` if ``schema_migrations`` is not the table our
    migrations create (another tool's of that name), and database errors
    as `BMDBError`s.
    """
    with _translated(pg):
        return await _applied_versions(pg)


async def migrate(pg: Connection) -> list[Migration]:
    """Apply every migration the database lacks; return those applied.

    Safe to run concurrently with other migrators of the same database
    (see the module docstring): each migration is applied by one of them.
    Raises `SchemaTooNew` if the database knows a newer version than this
    code, `SchemaConflict` if it holds an object of ours that migrations did
    not create, `PermissionDenied` if the role may not create objects,
    `SchemaError` if the database's encoding is not UTF8 (before anything is
    written), and other database errors as `BMDBError`s naming the
    migration. A failing migration, or one whose process dies halfway, is
    rolled back entirely with its ``schema_migrations`` row; earlier ones
    stay applied.
    """
    with _translated(pg):
        await _refuse_encoding(pg)
    applied = []
    for migration in available():
        with _translated(pg, doing=f"migration {migration.label}"):
            if await _apply(pg, migration):
                applied.append(migration)
    return applied


async def check_schema(pg: Connection) -> None:
    """Raise `SchemaTooNew` or `SchemaNotMigrated` unless the database has
    exactly the migrations this code ships (database errors as
    `BMDBError`s)."""
    done = set(await applied_versions(pg))
    _refuse_newer(done)
    missing = [m.version for m in available() if m.version not in done]
    if missing:
        raise SchemaNotMigrated(
            f"the BMDB lacks migrations {missing}: run `python -m bmdb migrate`"
        )


async def _apply(pg: Connection, migration: Migration) -> bool:
    """Apply ``migration`` in a transaction of its own unless the database
    has it; True if it was applied here."""
    await pg.execute("BEGIN ISOLATION LEVEL READ COMMITTED")
    try:
        # First: nothing is read or created before the lock is held.
        await pg.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_KEY,))
        done = await _applied_versions(pg, create=True)
        _refuse_newer(set(done))
        if migration.version in done:
            await pg.execute("ROLLBACK")
            return False
        logger.info("applying migration %s", migration.label)
        await pg.execute(migration.sql)
        # Test hook: a migrator killed between its migration and the row
        # that records it leaves neither (the transaction never commits).
        crash_point("bmdb-migration-applied")
        await pg.execute(
            "INSERT INTO schema_migrations (version, name) VALUES (%s, %s)",
            (migration.version, migration.name),
        )
        await pg.execute("COMMIT")
    except BaseException:
        await pg.rollback_quietly()
        raise
    return True


async def _applied_versions(pg: Connection, *, create: bool = False) -> list[int]:
    """The versions recorded; with ``create`` (in a transaction that holds
    the lock), ``schema_migrations`` is created first if there is none."""
    [(columns,)] = await pg.execute(_COLUMNS)
    if columns is None:
        if not create:
            return []
        await _check_may_create(pg)
        await pg.execute(_CREATE_TABLE)
        return []
    if columns != _OUR_COLUMNS:
        raise SchemaConflict(
            "table schema_migrations exists, and bmdb migrations did not create it"
            f" (its columns: {printable(', '.join(columns))}):"
            " use an empty database or schema for the BMDB"
        )
    return [r[0] for r in await pg.execute("SELECT version FROM schema_migrations ORDER BY 1")]


#: The encoding of the current database, as PostgreSQL names it.
_ENCODING = """
    SELECT pg_encoding_to_char(encoding) FROM pg_database WHERE datname = current_database()
"""


async def _refuse_encoding(pg: Connection) -> None:
    """Raise `SchemaError` unless the database stores UTF-8 text: in any
    other (SQL_ASCII from an ``initdb`` under the C locale, LATIN1, ...)
    machine names, labels and messages would be stored unchecked or
    refused one by one, long after migrating seemed to work."""
    [(encoding,)] = await pg.execute(_ENCODING)
    if encoding != "UTF8":
        raise SchemaError(
            f"the BMDB's database has encoding {printable(encoding)}, which cannot store"
            " UTF-8 text: create the database with ENCODING 'UTF8' (a cluster with"
            " initdb --encoding=UTF8)"
        )


async def _check_may_create(pg: Connection) -> None:
    """Raise `PermissionDenied` (or `SchemaError` if search_path names no
    schema that exists) unless the role may create objects where the
    migrations will: said plainly before anything fails halfway."""
    [(role, schema, may)] = await pg.execute(_MAY_CREATE)
    if schema is None:
        raise SchemaError(
            "no schema of search_path exists, so there is nowhere to create the BMDB's"
            " tables: create one, or fix search_path"
        )
    if not may:
        role, schema = _ident(role), _ident(schema)
        raise PermissionDenied(
            f"role {role} may not create tables in schema {schema}, which migrating"
            f" needs: GRANT CREATE ON SCHEMA {schema} TO {role} (as the schema's owner),"
            " or migrate as the database owner"
        )


def _ident(name: str) -> str:
    """``name`` as SQL spells an identifier (quoted if need be), escaped."""
    plain = re.fullmatch(r"[a-z_][a-z0-9_$]*", name) is not None
    return printable(name if plain else '"' + name.replace('"', '""') + '"')


@contextmanager
def _translated(pg: Connection, doing: str | None = None) -> Iterator[None]:
    """Raise database errors from the block as `BMDBError`s (see
    `bmdb.pgerrors.as_bmdb_error`), saying what was being done."""
    try:
        yield
    except Exception as e:
        if pgerrors.is_retryable(e):
            # Migrations run outside the retrying transaction layer: a
            # deadlock with another client (an ALTER TABLE waiting on its
            # rows, say) ends the run, which can simply be started again.
            prefix = f"{doing}: " if doing else ""
            raise BMDBError(
                f"{prefix}{printable(pgerrors.error_message(e))}: "
                "run `python -m bmdb migrate` again"
            ) from e
        translated = pgerrors.as_bmdb_error(e, role=pg.user, doing=doing)
        if translated is None or translated is e:
            raise
        raise translated from e


def _refuse_newer(done: set[int]) -> None:
    newest = latest_version()
    newer = sorted(v for v in done if v > newest)
    if newer:
        raise SchemaTooNew(
            f"the BMDB schema has migrations {newer}, newer than this code knows"
            f" (up to {newest}); upgrade this program"
        )
