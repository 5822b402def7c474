"""Backing up and restoring a BMDB with PostgreSQL's own tools.

::

    python -m bmdb [--url URL] backup --out FILE
        pg_dump --format=custom into FILE.tmp, fsync, SHA-256 into
        FILE.sha256 (sha256sum's format), both renamed into place, folder fsynced
    python -m bmdb [--url URL] restore --from FILE [--allow-connections]
        refused, nothing changed: a missing or wrong FILE.sha256, a file
        pg_restore cannot read, a database that holds any table, other
        connections to it (a Shepherd still running)
        pg_restore --no-owner --no-acl (the tables become the restoring
        role's: restore as the role the Shepherd uses)
        | psql --single-transaction, then in
        that same transaction: every restored session deleted, its work
        recorded 'Canceled' in the history

**What a restored session means.** A backup holds the sessions that were
live when it was taken, with their deadlines, and their work rows: locks
on (machine, process). After a restore, none of those sessions has an
owner that knows the database it is now in: a process that held one has
died, or was cut off when the old database went, and whatever it did after
the backup is not in the restored one. Left alone, a restored session
whose deadline is still ahead would keep its machines locked until then
(a long interval: for hours), and an owner still running would poke it
back to life and hold work it no longer does. So the restore deletes
every session, in the transaction that restores the data (no client sees
the database in between), and the work they held is recorded as canceled
with the cause naming the restore; the next claim takes those machines as
if their worker had died. An owner still running finds its session gone
at its next poke (``SessionExpired``) and starts a new one, which is why
the restore refuses while other clients are connected: stop the Shepherd
first, so that no machine is worked on by a process of the old database
and by a new one at once.

A restore brings the database back to the moment of the backup: work done
after it (a machine taken over, an installation requested) is not in it
and is done again. Back up often; a backup takes one consistent snapshot
(pg_dump's) and does not stop the Shepherd.

The tools are taken from ``$BMDB_PG_BIN``, else PostgreSQL 15's folder
(``/usr/lib/postgresql/15/bin``, Debian's ``postgresql-client-15``), else
``PATH``; pg_dump must be at least as new as the server. They find the
database as ``python -m bmdb`` does: ``--url`` (a libpq URL), else the
``PG*`` environment variables.

Errors: :class:`BackupError` (one line, for the CLI), before anything is
written to the target database where the list above says "refused".
Cancellation: a cancelled backup removes ``FILE.tmp`` and leaves what was
at ``FILE`` before; a restore, once its tools run, is not interrupted
(cancelling waits for psql's transaction to commit or roll back).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import os
import shutil
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import trio

from bmdb.errors import BMDBError
from common.durable import publish_with_sidecar

__all__ = [
    "BackupError",
    "BackupResult",
    "RestoreResult",
    "backup",
    "restore",
    "run_command",
]

logger = logging.getLogger("bmdb.backup")

#: PostgreSQL's tools, when neither ``$BMDB_PG_BIN`` nor ``PATH`` says otherwise.
DEFAULT_BIN = Path("/usr/lib/postgresql/15/bin")
#: The cause recorded for the work of every session a restore drops.
RESTORE_CAUSE = "restored from a backup: the session belonged to the database before the restore"
_CHUNK = 1 << 20

# Run after the restored data, in its transaction. pg_restore's script sets
# search_path to '', hence the schema. One row: (sessions, work rows).
_DROP_RESTORED_SESSIONS = f"""
WITH dead AS (DELETE FROM public.sessions RETURNING session_id),
gone AS (DELETE FROM public.work WHERE session_id IN (SELECT session_id FROM dead)
         RETURNING machine_id, process, session_id),
logged AS (INSERT INTO public.work_history (machine_id, process, event, session_id, cause)
           SELECT machine_id, process, 'Canceled', session_id, '{RESTORE_CAUSE}' FROM gone
           RETURNING 1)
SELECT 'bmdb-restore', (SELECT count(*) FROM dead), (SELECT count(*) FROM logged);
"""


# What a restore refuses on: relations in the target, and other clients
# connected to it. Clients only: an autovacuum worker visits a database
# just created (one was counted once, right after the CREATE DATABASE a
# restore follows), and the server's own workers take nothing a restore
# needs. Both counts in one query, so in one connection: a connection of an
# earlier query of ours, closed on the client's side, can still be listed
# while its backend exits, and was once counted as another client.
_RELATIONS_AND_OTHERS = """SELECT
(SELECT count(*) FROM pg_catalog.pg_class c
 JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
 WHERE n.nspname NOT IN ('pg_catalog', 'information_schema') AND n.nspname NOT LIKE 'pg_toast%'
 AND n.nspname NOT LIKE 'pg_temp%'),
(SELECT count(*) FROM pg_catalog.pg_stat_activity
 WHERE datname = current_database() AND pid <> pg_backend_pid()
 AND backend_type = 'client backend')"""


class BackupError(BMDBError):
    """A backup could not be made, or a restore was refused or failed (one line)."""


@dataclass(frozen=True)
class BackupResult:
    path: Path
    sha256: str
    size: int


@dataclass(frozen=True)
class RestoreResult:
    #: Sessions of the backup that the restore deleted, and the work rows they held.
    sessions_dropped: int
    work_canceled: int


def tool(name: str) -> str:
    """The path of PostgreSQL's ``name`` (see the module docstring); BackupError if none."""
    folders = [Path(os.environ["BMDB_PG_BIN"])] if os.environ.get("BMDB_PG_BIN") else []
    for folder in [*folders, DEFAULT_BIN]:
        if (folder / name).is_file():
            return str(folder / name)
    found = shutil.which(name)
    if found is None:
        raise BackupError(
            f"{name} not found: install PostgreSQL's client tools (Debian:"
            " postgresql-client-15) or set BMDB_PG_BIN to their folder"
        )
    return found


def checksum_path(path: Path) -> Path:
    """Where the SHA-256 of the backup ``path`` is kept."""
    return path.with_name(path.name + ".sha256")


def _target(url: str | None) -> list[str]:
    return [] if url is None else [f"--dbname={url}"]


def _last_line(stderr: bytes) -> str:
    lines = [line for line in stderr.decode(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no message"


async def _run(argv: list[str], what: str) -> bytes:
    """Run a tool to its end; its stdout, or BackupError with the last line it wrote."""
    try:
        done = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
    except OSError as e:
        raise BackupError(f"{what}: cannot run {argv[0]}: {e.strerror or e}") from e
    if done.returncode != 0:
        raise BackupError(f"{what}: {_last_line(done.stderr)}")
    return done.stdout


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _publish(tmp: Path, out: Path, digest: str) -> None:
    """Make the archive and its checksum durable under their names."""
    sums = f"{digest}  {out.name}\n".encode()
    publish_with_sidecar(tmp, out, checksum_path(out), sums, 0o644)


async def backup(url: str | None, out: Path) -> BackupResult:
    """Dump the BMDB at ``url`` into ``out`` (and ``out.sha256``); see the module docstring.

    Nothing is at ``out`` until the whole dump is durable there.
    """
    out = Path(await trio.Path(out).absolute())
    if not out.parent.is_dir():
        raise BackupError(f"{out.parent}: no such folder")
    tmp = out.with_name(out.name + ".tmp")
    try:
        await _run([tool("pg_dump"), "--format=custom", f"--file={tmp}", *_target(url)], "pg_dump")
        digest = await trio.to_thread.run_sync(_sha256, tmp)
        await trio.to_thread.run_sync(_publish, tmp, out, digest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    size = out.stat().st_size
    logger.info("backup %s: %d bytes, sha256 %s", out, size, digest)
    return BackupResult(out, digest, size)


def _verify(path: Path) -> None:
    """BackupError unless ``path`` and its checksum file exist and agree."""
    if not path.is_file():
        raise BackupError(f"{path}: no such backup file")
    sums = checksum_path(path)
    try:
        recorded = sums.read_text().split()[0]
    except (OSError, IndexError) as e:
        raise BackupError(
            f"{sums}: cannot read the backup's checksum ({e}); refusing an unverified restore"
        ) from None
    actual = _sha256(path)
    if actual != recorded:
        raise BackupError(
            f"{path}: SHA-256 {actual} differs from {recorded} in {sums}: damaged or"
            " not that backup; nothing restored"
        )


async def _scalars(url: str | None, sql: str) -> list[int]:
    """The integers of the one row ``sql`` returns, through psql."""
    out = await _run(
        [tool("psql"), "-X", "-A", "-t", "-q", "-v", "ON_ERROR_STOP=1", "-c", sql, *_target(url)],
        "psql",
    )
    return [int(n) for n in out.decode().strip().split("|")]


def _drain(stream: IO[bytes], into: list[bytes]) -> threading.Thread:
    """Read ``stream`` to its end into ``into``, in a thread of its own (started)."""
    reader = threading.Thread(target=lambda: into.append(stream.read()), daemon=True)
    reader.start()
    return reader


def _pipe(restore_argv: list[str], psql_argv: list[str]) -> tuple[str | None, bytes, str | None]:
    """pg_restore's script, then the session drop, into psql's one transaction.

    Blocking: run in a worker thread. Returns pg_restore's error (None if
    it succeeded), psql's output and psql's error (None if it committed).
    psql reads pg_restore's output through this thread, which appends our
    statement before closing psql's input. If pg_restore fails, psql is
    killed before its input ends, so its connection closes inside the
    transaction and the server rolls it back.
    """
    out: list[bytes] = []
    err: list[bytes] = []
    restore_err: list[bytes] = []
    with subprocess.Popen(
        psql_argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    ) as psql:
        assert psql.stdin is not None and psql.stdout is not None and psql.stderr is not None
        readers = [_drain(psql.stdout, out), _drain(psql.stderr, err)]
        with subprocess.Popen(
            restore_argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        ) as pg_restore:
            assert pg_restore.stdout is not None and pg_restore.stderr is not None
            readers.append(_drain(pg_restore.stderr, restore_err))
            try:
                while chunk := pg_restore.stdout.read(_CHUNK):
                    psql.stdin.write(chunk)
            except BrokenPipeError:
                pass  # psql stopped on an error: it says which
            restore_failed = pg_restore.wait() != 0
        if restore_failed:
            psql.kill()
        else:
            with contextlib.suppress(BrokenPipeError):
                psql.stdin.write(_DROP_RESTORED_SESSIONS.encode())
        with contextlib.suppress(BrokenPipeError):
            psql.stdin.close()
        psql_failed = psql.wait() != 0
        for reader in readers:
            reader.join()
    return (
        _last_line(b"".join(restore_err)) if restore_failed else None,
        b"".join(out),
        _last_line(b"".join(err)) if psql_failed else None,
    )


async def restore(url: str | None, path: Path, *, allow_connections: bool = False) -> RestoreResult:
    """Restore the backup at ``path`` into the empty database at ``url``.

    See the module docstring for what is refused (before anything is
    written) and what happens to the sessions of the backup.
    ``allow_connections``: restore although other clients are connected.
    """
    path = Path(await trio.Path(path).absolute())
    await trio.to_thread.run_sync(_verify, path)
    await _run([tool("pg_restore"), "--list", str(path)], f"{path}: not a readable backup")
    relations, others = await _scalars(url, _RELATIONS_AND_OTHERS)
    if relations:
        raise BackupError(
            f"the target database holds {relations} tables, sequences or other relations:"
            " restore into an empty database (dropdb, createdb)"
        )
    if others and not allow_connections:
        raise BackupError(
            f"{others} other connections to the target database: stop the Shepherd and"
            " other BMDB clients first (or pass --allow-connections)"
        )
    restore_argv = [tool("pg_restore"), "--no-owner", "--no-acl", "--file=-", str(path)]
    psql_argv = [
        tool("psql"), "-X", "-A", "-t", "-q", "--single-transaction",
        "-v", "ON_ERROR_STOP=1", *_target(url),
    ]  # fmt: skip
    restore_err, out, psql_err = await trio.to_thread.run_sync(_pipe, restore_argv, psql_argv)
    if restore_err is not None:
        raise BackupError(f"pg_restore: {restore_err}; nothing restored")
    if psql_err is not None:
        raise BackupError(f"psql: {psql_err}; nothing restored")
    for line in reversed(out.decode(errors="replace").splitlines()):
        tag, _, counts = line.partition("|")
        if tag == "bmdb-restore":
            sessions, work = (int(n) for n in counts.split("|"))
            logger.info(
                "restored %s: %d sessions of the backup dropped, %d work rows canceled",
                path,
                sessions,
                work,
            )
            return RestoreResult(sessions, work)
    raise BackupError("psql finished without the restore's last statement; check the database")


#: The subcommands :func:`run_command` runs (``python -m bmdb``'s parser adds them).
COMMANDS = ("backup", "restore")


async def run_command(args: argparse.Namespace) -> str:
    """Run ``backup`` or ``restore`` from parsed arguments; what to print."""
    if args.command == "backup":
        made = await backup(args.url, args.out)
        return f"backup {made.path}: {made.size} bytes, sha256 {made.sha256}"
    done = await restore(args.url, args.source, allow_connections=args.allow_connections)
    return (
        f"restored {args.source}: {done.sessions_dropped} sessions of the backup dropped,"
        f" {done.work_canceled} work locks canceled"
    )
