"""``python -m bmdb``: migrate, listings, and clear errors."""

from __future__ import annotations

import os
import socket
import sys
import uuid
from collections.abc import Iterator

import pytest
import trio

import bmdb
from bmdb import Process
from bmdb.localserver import LocalPostgres
from tests.bmdb.helpers import add_provided_machines


async def cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    result = await trio.run_process(
        [sys.executable, "-m", "bmdb", *args],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        env=env,
    )
    return result.returncode, result.stdout.decode(), result.stderr.decode()


@pytest.fixture
def fresh_db(postgres_server: LocalPostgres) -> Iterator[str]:
    postgres_server.admin("CREATE DATABASE bmdb_cli")
    yield "bmdb_cli"
    postgres_server.admin("DROP DATABASE bmdb_cli WITH (FORCE)")


async def test_migrate_with_pg_environment(postgres_server: LocalPostgres, fresh_db: str) -> None:
    env = dict(
        os.environ,
        PGHOST=str(postgres_server.socket_dir),
        PGPORT=str(postgres_server.port),
        PGUSER="postgres",
        PGDATABASE=fresh_db,
    )
    code, out, err = await cli("migrate", env=env)
    assert (code, err) == (0, "")
    assert "applied 0001_initial" in out
    code, out, _ = await cli("migrate", env=env)
    assert code == 0 and "up to date" in out
    code, out, _ = await cli("sessions", env=env)
    assert code == 0 and out.split() == [
        "SESSION", "COMPONENT", "RUNTIME", "CREATED", "INTERVAL", "DEADLINE", "STATE"
    ]  # fmt: skip


async def test_listings(bmdb_conn: bmdb.Connection, bmdb_url: str) -> None:
    [machine_id, _] = await add_provided_machines(bmdb_conn, 2)
    async with bmdb_conn.session("shepherd-initializer", "host:42") as sess:

        async def first(q: bmdb.Queries) -> list[uuid.UUID]:
            return [machine_id]

        work = await sess.work(Process.SHEPHERD_AGENT_START, first)
        await work.fail("no route to host")
        held = await sess.work(Process.SHEPHERD_AGENT_START, first)

        code, out, _ = await cli("--url", bmdb_url, "machines")
        assert code == 0
        lines = out.splitlines()
        assert lines[0].split()[:6] == [
            "MACHINE", "STATE", "INSTALL", "NODE", "PROVIDED", "ADDRESS"
        ]  # fmt: skip
        assert len(lines) == 3
        cells = lines[1].split()
        assert cells[:6] == [
            str(machine_id),
            "needs-agent-start",
            "-",
            "-",
            "Static:static-0",
            "10.0.0.0",
        ]
        assert "ShepherdAgentStart" in lines[1]  # held work
        assert lines[1].endswith("no route to host")  # the last failure's cause

        code, out, _ = await cli("--url", bmdb_url, "sessions")
        assert code == 0 and "shepherd-initializer" in out and "host:42" in out and "live" in out
        await held.cancel()

    code, out, _ = await cli("--url", bmdb_url, "history", str(machine_id))
    assert code == 0
    rows = [line.split(None, 4) for line in out.splitlines()[1:]]
    assert [(r[1], r[2]) for r in rows] == [
        ("ShepherdAgentStart", "Started"),
        ("ShepherdAgentStart", "Failed"),
        ("ShepherdAgentStart", "Started"),
        ("ShepherdAgentStart", "Canceled"),
    ]
    assert rows[1][4] == "no route to host"


async def test_clear_errors(bmdb_url: str, postgres_server: LocalPostgres) -> None:
    code, out, err = await cli("--url", bmdb_url, "history", "not-a-uuid")
    assert (code, out) == (1, "")
    assert err.startswith("bmdb: error: not a machine id")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"postgresql://postgres@127.0.0.1:{s.getsockname()[1]}/x"
    code, _, err = await cli("--url", dead, "machines")
    assert code == 1 and err.startswith("bmdb: error: cannot connect to the BMDB")

    postgres_server.admin(
        "INSERT INTO schema_migrations (version, name) VALUES (42, 'from_the_future')",
        db=bmdb_url.rsplit("/", 1)[1],
    )
    for command in ("machines", "migrate"):
        code, _, err = await cli("--url", bmdb_url, command)
        assert code == 1 and "newer than this code" in err, err

    code, _, err = await cli("--url", bmdb_url, "history", str(uuid.uuid4()))
    assert code == 1  # the schema check comes first


async def test_closed_stdout_ends_quietly(bmdb_conn: bmdb.Connection, bmdb_url: str) -> None:
    # `bmdb history ... | head` where head has already gone: our stdout is a
    # pipe without a reader. Closing the read end before the command writes
    # makes the write fail every time (no race with a reader's pace).
    [machine_id] = await add_provided_machines(bmdb_conn, 1)
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = await trio.run_process(
            [sys.executable, "-m", "bmdb", "--url", bmdb_url, "history", str(machine_id)],
            stdout=write_end,
            capture_stderr=True,
            check=False,
        )
    finally:
        os.close(write_end)
    assert result.stderr.decode() == ""
    assert result.returncode == 141


async def test_history_escapes_machine_text(bmdb_conn: bmdb.Connection, bmdb_url: str) -> None:
    # A cause written raw (by an older Shepherd, or another writer) must not
    # reach the terminal raw: no escape sequences, no forged rows.
    [machine_id] = await add_provided_machines(bmdb_conn, 1)
    async with bmdb_conn.session("shepherd-initializer", "host:42") as sess:

        async def first(q: bmdb.Queries) -> list[uuid.UUID]:
            return [machine_id]

        work = await sess.work(Process.SHEPHERD_AGENT_START, first)
        await work.fail("\x1b[2Jcleared\n2099-01-01T00:00:00  forged  row")
    code, out, _ = await cli("--url", bmdb_url, "history", str(machine_id))
    assert code == 0
    assert "\x1b" not in out and len(out.splitlines()) == 3
    assert "\\x1b[2Jcleared\\n2099-01-01T00:00:00  forged  row" in out
