"""Migrations and opening: idempotence, schema checks, unreachable servers."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

import bmdb
from bmdb import migrations
from bmdb._pg import PgConnection
from bmdb.errors import DatabaseUnavailable, SchemaNotMigrated, SchemaTooNew
from bmdb.localserver import LocalPostgres


@pytest.fixture
def empty_url(postgres_server: LocalPostgres) -> Iterator[str]:
    """A database without any schema."""
    postgres_server.admin("CREATE DATABASE bmdb_empty")
    yield postgres_server.url("bmdb_empty")
    postgres_server.admin("DROP DATABASE bmdb_empty WITH (FORCE)")


async def test_migrate_fresh_database_once(empty_url: str) -> None:
    with pytest.raises(SchemaNotMigrated, match="python -m bmdb migrate"):
        async with bmdb.open_connection(empty_url):
            pass
    async with bmdb.open_connection(empty_url, migrate=True):
        pass
    pg = await PgConnection.connect(empty_url)
    try:
        assert await migrations.applied_versions(pg) == [m.version for m in migrations.available()]
        # Re-running applies nothing and changes nothing.
        assert await migrations.migrate(pg) == []
        await migrations.check_schema(pg)
    finally:
        await pg.close()


async def test_schema_too_new_is_refused(bmdb_url: str) -> None:
    pg = await PgConnection.connect(bmdb_url)
    try:
        await pg.execute("INSERT INTO schema_migrations (version, name) VALUES (9999, 'future')")
    finally:
        await pg.close()
    for migrate in (False, True):
        with pytest.raises(SchemaTooNew, match="9999"):
            async with bmdb.open_connection(bmdb_url, migrate=migrate):
                pass


async def test_unreachable_database() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here
    with pytest.raises(DatabaseUnavailable, match="cannot connect"):
        async with bmdb.open_connection(f"postgresql://postgres@127.0.0.1:{port}/bmdb"):
            pass


def test_migrations_are_ordered_and_named() -> None:
    found = migrations.available()
    assert [m.version for m in found] == sorted({m.version for m in found})
    assert found[0].version == 1 and "CREATE TABLE machines" in found[0].sql
