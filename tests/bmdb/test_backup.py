"""``python -m bmdb backup`` / ``restore`` on a real PostgreSQL.

A backup taken while a session holds work restores with that session gone
and its work recorded as canceled, so the machine can be claimed at once
(with pg_restore alone, the restored session would hold it until its
deadline). Damaged or unverifiable backups, a database that is not empty
and one with other clients are refused, leaving the database as it was.
"""

from __future__ import annotations

import datetime
import functools
import subprocess
import sys
import urllib.parse
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

import bmdb
from bmdb import Process
from bmdb.backup import RESTORE_CAUSE, checksum_path, tool
from bmdb.errors import NothingToDo
from bmdb.localserver import LocalPostgres
from bmdb.model import Queries
from tests.bmdb.helpers import add_provided_machines, agent_start_source

#: Longer than any test: a restored session of this interval would still look alive.
HOUR = 3600.0


@dataclass(frozen=True)
class _Done:
    returncode: int
    stdout: str
    stderr: str


async def _cli(url: str, *args: str) -> _Done:
    with trio.fail_after(120):
        done = await trio.run_process(
            [sys.executable, "-m", "bmdb", "--url", url, *args],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    return _Done(done.returncode, done.stdout.decode(), done.stderr.decode())


def _dbname(url: str) -> str:
    return urllib.parse.urlsplit(url).path.lstrip("/")


def _recreate_empty(server: LocalPostgres, url: str) -> None:
    name = _dbname(url)
    server.admin(f'DROP DATABASE "{name}" WITH (FORCE)')
    server.admin(f'CREATE DATABASE "{name}"')


_TABLES = "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'"


async def _relations(url: str) -> int:
    out = await trio.run_process(
        [tool("psql"), "-XAtq", "-c", _TABLES, f"--dbname={url}"],
        capture_stdout=True,
    )
    return int(out.stdout.decode())


async def _started(q: Queries, *, machine: uuid.UUID) -> None:
    await q.set_agent_started(machine, datetime.datetime.now(datetime.UTC), b"k" * 32)


async def _backup_with_a_held_machine(url: str, out: Path) -> tuple[list[uuid.UUID], uuid.UUID]:
    """Three provided machines, one of them claimed by a session of an hour; the backup."""
    async with bmdb.open_connection(url) as conn:
        machines = await add_provided_machines(conn, 3)
        async with conn.session("holder", interval=HOUR) as session:
            work = await session.work(Process.SHEPHERD_AGENT_START, agent_start_source)
            done = await _cli(url, "backup", "--out", str(out))
            assert done.returncode == 0, done.stderr
            assert "sha256" in done.stdout
            await work.cancel()
    return machines, work.machine_id


async def test_restore_drops_the_sessions_of_the_backup_and_frees_their_work(
    bmdb_url: str, postgres_server: LocalPostgres, tmp_path: Path
) -> None:
    out = tmp_path / "bmdb.dump"
    machines, held = await _backup_with_a_held_machine(bmdb_url, out)
    digest = checksum_path(out).read_text().split()
    assert digest[1] == out.name and len(digest[0]) == 64
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bmdb.dump", "bmdb.dump.sha256"]  # noqa: ASYNC240

    # Without the restore's care, the restored session holds the machine.
    plain = postgres_server.create_database(f"{_dbname(bmdb_url)}_plain")
    try:
        await trio.run_process([tool("pg_restore"), "--no-owner", f"--dbname={plain}", str(out)])
        async with (
            bmdb.open_connection(plain) as conn,
            conn.session("after-plain-restore") as session,
        ):
            claimed = []
            for _ in range(3):
                try:
                    w = await session.work(Process.SHEPHERD_AGENT_START, agent_start_source)
                except NothingToDo:
                    break
                claimed.append(w.machine_id)
                await w.cancel()
            assert held not in claimed
    finally:
        postgres_server.admin(f'DROP DATABASE "{_dbname(plain)}" WITH (FORCE)')

    _recreate_empty(postgres_server, bmdb_url)
    done = await _cli(bmdb_url, "restore", "--from", str(out))
    assert done.returncode == 0, done.stderr
    assert "1 sessions of the backup dropped, 1 work locks canceled" in done.stdout

    async with bmdb.open_connection(bmdb_url) as conn:

        async def state(q: Queries) -> tuple[int, int, list[tuple[object, ...]]]:
            sessions = await q.execute("SELECT count(*) FROM sessions")
            work = await q.execute("SELECT count(*) FROM work")
            history = await q.execute(
                "SELECT machine_id, event::text, cause FROM work_history ORDER BY id"
            )
            return int(sessions[0][0]), int(work[0][0]), history

        sessions, work, history = await conn.transact(state)
        assert (sessions, work) == (0, 0)
        assert history == [
            (held, "Started", None),
            (held, "Canceled", RESTORE_CAUSE),
        ]
        provided = await conn.transact(
            lambda q: q.execute("SELECT machine_id FROM machine_provided ORDER BY machine_id")
        )
        assert sorted(r[0] for r in provided) == sorted(machines)
        # The machine is free at once, for a new session.
        async with conn.session("after-restore") as session:
            freed: set[uuid.UUID] = set()
            for _ in range(3):
                w = await session.work(Process.SHEPHERD_AGENT_START, agent_start_source)
                freed.add(w.machine_id)
                await w.finish(functools.partial(_started, machine=w.machine_id))
            assert freed == set(machines)


async def test_damaged_backups_are_refused_and_nothing_is_restored(
    bmdb_url: str, postgres_server: LocalPostgres, tmp_path: Path
) -> None:
    out = tmp_path / "bmdb.dump"
    await _backup_with_a_held_machine(bmdb_url, out)
    _recreate_empty(postgres_server, bmdb_url)
    data = out.read_bytes()

    cut = tmp_path / "cut.dump"
    cut.write_bytes(data[: len(data) // 2])
    checksum_path(cut).write_text(checksum_path(out).read_text().replace(out.name, cut.name))
    done = await _cli(bmdb_url, "restore", "--from", str(cut))
    assert done.returncode == 1
    assert "differs from" in done.stderr and "nothing restored" in done.stderr

    unsummed = tmp_path / "unsummed.dump"
    unsummed.write_bytes(data)
    done = await _cli(bmdb_url, "restore", "--from", str(unsummed))
    assert done.returncode == 1 and "checksum" in done.stderr

    # Damaged before it was checksummed: pg_restore cannot read it.
    garbage = tmp_path / "garbage.dump"
    garbage.write_bytes(b"PGDMP" + bytes(range(256)) * 8)
    sums = await trio.run_process(["sha256sum", garbage.name], cwd=tmp_path, capture_stdout=True)
    checksum_path(garbage).write_bytes(sums.stdout)
    done = await _cli(bmdb_url, "restore", "--from", str(garbage))
    assert done.returncode == 1 and "not a readable backup" in done.stderr

    assert await _relations(bmdb_url) == 0
    # The intact one still restores, into the database left empty.
    done = await _cli(bmdb_url, "restore", "--from", str(out))
    assert done.returncode == 0, done.stderr
    assert await _relations(bmdb_url) > 0


_CONNECTIONS = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"


async def test_restore_refuses_a_database_in_use_or_not_empty(
    bmdb_url: str, postgres_server: LocalPostgres, tmp_path: Path
) -> None:
    out = tmp_path / "bmdb.dump"
    await _backup_with_a_held_machine(bmdb_url, out)
    async with bmdb.open_connection(bmdb_url) as conn:
        before = await conn.transact(lambda q: q.execute("SELECT count(*) FROM work_history"))
    done = await _cli(bmdb_url, "restore", "--from", str(out))
    assert done.returncode == 1 and "restore into an empty database" in done.stderr
    async with bmdb.open_connection(bmdb_url) as conn:
        after = await conn.transact(lambda q: q.execute("SELECT count(*) FROM work_history"))
    assert after == before

    _recreate_empty(postgres_server, bmdb_url)
    # A client still connected (as a Shepherd would be, retrying).
    other = await trio.lowlevel.open_process(
        [tool("psql"), "-XAtq", f"--dbname={bmdb_url}"], stdin=subprocess.PIPE
    )
    try:

        async def connected() -> bool:
            done = await trio.run_process(
                [tool("psql"), "-XAtq", f"--dbname={bmdb_url}", "-c", _CONNECTIONS],
                capture_stdout=True,
            )
            return int(done.stdout) >= 2

        with trio.fail_after(20):
            while not await connected():  # noqa: ASYNC110
                await trio.sleep(0.1)
        done = await _cli(bmdb_url, "restore", "--from", str(out))
        assert done.returncode == 1 and "other connections" in done.stderr
        assert await _relations(bmdb_url) == 0
        done = await _cli(bmdb_url, "restore", "--from", str(out), "--allow-connections")
        assert done.returncode == 0, done.stderr
    finally:
        assert other.stdin is not None
        await other.stdin.aclose()
        with trio.fail_after(10):
            await other.wait()


async def test_backup_into_a_missing_folder_is_refused(bmdb_url: str, tmp_path: Path) -> None:
    done = await _cli(bmdb_url, "backup", "--out", str(tmp_path / "no" / "such.dump"))
    assert done.returncode == 1 and "no such folder" in done.stderr


@pytest.mark.parametrize("name", ["pg_dump", "pg_restore", "psql"])
def test_the_tools_are_found(name: str) -> None:
    assert Path(tool(name)).is_file()
