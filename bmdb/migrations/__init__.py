"""Versioned schema migrations, and the code that applies them.

Migrations are the ``NNNN_name.sql`` files in this folder, applied in order
of ``NNNN``, each in its own transaction together with its row in
``schema_migrations``. Re-running is a no-op. Concurrent migrators serialize
on an advisory lock, so two processes starting at once apply each file once.

A database with a migration newer than the newest file here was migrated by
a newer release: `check_schema` and `migrate` refuse it with `SchemaTooNew`
rather than guess what the newer schema means.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from importlib import resources
from typing import Protocol

from bmdb._pg import Params, Row
from bmdb.errors import SchemaNotMigrated, SchemaTooNew

logger = logging.getLogger("bmdb.migrations")

# An arbitrary constant shared by every BMDB migrator (pg_advisory_xact_lock key).
_LOCK_KEY = 0x626D_6462  # "bmdb"

_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")

_CREATE_TABLE = """
    CREATE TABLE IF NOT EXISTS schema_migrations (
        version integer PRIMARY KEY,
        name text NOT NULL,
        applied_at timestamptz NOT NULL DEFAULT now()
    )
"""


class Connection(Protocol):
    """What migrating needs of a database connection in autocommit mode: run
    statements (its own BEGIN/COMMIT among them), and roll back whatever is
    open while unwinding from an error (shielded, never raising)."""

    async def execute(self, query: str, params: Params | None = None) -> list[Row]: ...

    async def rollback_quietly(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Migration:
    """One SQL file: its version, name and text."""

    version: int
    name: str
    sql: str


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
    """Versions recorded in the database (empty for a fresh database)."""
    rows = await pg.execute("SELECT to_regclass('schema_migrations') IS NOT NULL")
    if not rows[0][0]:
        return []
    return [r[0] for r in await pg.execute("SELECT version FROM schema_migrations ORDER BY 1")]


async def migrate(pg: Connection) -> list[Migration]:
    """Apply every migration the database lacks; return those applied.

    Raises `SchemaTooNew` if the database knows a newer version than this
    code. A failing migration is rolled back entirely and its error raised;
    earlier ones stay applied.
    """
    await pg.execute(_CREATE_TABLE)
    applied = []
    for migration in available():
        await pg.execute("BEGIN")
        try:
            await pg.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_KEY,))
            done = set(await applied_versions(pg))
            _refuse_newer(done)
            if migration.version in done:
                await pg.execute("ROLLBACK")
                continue
            logger.info("applying migration %04d_%s", migration.version, migration.name)
            await pg.execute(migration.sql)
            await pg.execute(
                "INSERT INTO schema_migrations (version, name) VALUES (%s, %s)",
                (migration.version, migration.name),
            )
            await pg.execute("COMMIT")
        except BaseException:
            await pg.rollback_quietly()
            raise
        applied.append(migration)
    return applied


async def check_schema(pg: Connection) -> None:
    """Raise `SchemaTooNew` or `SchemaNotMigrated` unless the database has
    exactly the migrations this code ships."""
    done = set(await applied_versions(pg))
    _refuse_newer(done)
    missing = [m.version for m in available() if m.version not in done]
    if missing:
        raise SchemaNotMigrated(
            f"the BMDB lacks migrations {missing}: run `python -m bmdb migrate`"
        )


def _refuse_newer(done: set[int]) -> None:
    newest = latest_version()
    newer = sorted(v for v in done if v > newest)
    if newer:
        raise SchemaTooNew(
            f"the BMDB schema has migrations {newer}, newer than this code knows"
            f" (up to {newest}); upgrade this program"
        )
