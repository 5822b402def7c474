"""A throwaway, private PostgreSQL 15, for the demo, tests and benchmarks.

``LocalPostgres(root)`` creates a cluster in ``root/data`` with ``initdb``
and runs ``postgres`` listening only on a Unix socket in its own socket
folder (mode 0700, owned by the server's user), so it never touches a system
cluster and no other local user can reach it: it accepts its superuser
without a password, which must not be open to everyone on 127.0.0.1. TCP is
off (``listen_addresses=''``) and ``pg_hba.conf`` rejects every host
connection in case it is turned on. ``url()`` names the socket folder as the
host, with a port number that only tells the socket file's name.

PostgreSQL refuses to run as root, so when we are root the server runs as
the ``postgres`` user (which Debian's package creates), on folders chowned
to it. We switch user in ``subprocess``
itself rather than through ``runuser``, so that our signals reach the
postmaster directly.

It trades durability for speed (``fsync=off``): a SIGKILL of the server
loses nothing, because the operating system keeps the files, but a power
cut would. Never point it at data you care about.

The calls are synchronous (start-up takes about a second): run them before
``trio.run``, or through ``trio.to_thread.run_sync``.
"""

from __future__ import annotations

import os
import pwd
import signal
import stat
import subprocess
import time
import urllib.parse
from pathlib import Path
from typing import Protocol

import psycopg
import trio

from bmdb.connection import migrate
from bmdb.errors import BMDBError
from common.net import free_loopback_port

__all__ = [
    "TEMPLATE_DB",
    "LocalPostgres",
    "LocalPostgresError",
    "find_postgres_bin",
    "start_with_template",
]

#: Where Debian's postgresql-15 package puts the server binaries.
DEFAULT_BIN = Path("/usr/lib/postgresql/15/bin")
_START_TIMEOUT = 30.0

#: The migrated database `start_with_template` leaves to copy BMDBs from.
TEMPLATE_DB = "bmdb_template"


class LocalPostgresError(BMDBError):
    """The local server could not be created or started; the message says why."""


def find_postgres_bin() -> Path:
    """The folder holding ``initdb`` and ``postgres`` (``$BMDB_PG_BIN`` overrides)."""
    folder = Path(os.environ.get("BMDB_PG_BIN", DEFAULT_BIN))
    if not (folder / "postgres").exists() or not (folder / "initdb").exists():
        raise LocalPostgresError(
            f"PostgreSQL server binaries not found in {folder}: install Debian's "
            "'postgresql' package (15), or set BMDB_PG_BIN to their folder"
        )
    return folder


class LocalPostgres:
    """A private PostgreSQL server whose files live in ``root``.

    ``create()`` once, then ``start()`` / ``stop()`` / ``kill()`` as often as
    needed (a restart keeps the port). ``url(db)`` gives a libpq URL; the
    superuser is ``postgres`` with trust authentication on the private
    socket only.
    """

    def __init__(self, root: Path, *, port: int | None = None) -> None:
        self.root = root
        self.data = root / "data"
        self.socket_dir = root / "socket"
        self.log_path = root / "postgres.log"
        # Only names the socket file (.s.PGSQL.<port>): TCP is off. A free
        # loopback port keeps it unique and easy to recognise.
        self.port = port or free_loopback_port()
        self._bin = find_postgres_bin()
        self._proc: subprocess.Popen[bytes] | None = None
        self._user = "postgres" if os.geteuid() == 0 else None

    def url(self, dbname: str = "postgres") -> str:
        """libpq URL of ``dbname`` on this server (over its private Unix socket)."""
        host = urllib.parse.quote(str(self.socket_dir), safe="")
        return f"postgresql://postgres@{host}:{self.port}/{dbname}"

    @property
    def running(self) -> bool:
        return self._proc is not None

    def create(self) -> None:
        """``initdb`` a new cluster (trust auth, superuser ``postgres``)."""
        socket_file = self.socket_dir / f".s.PGSQL.{self.port}"
        if len(os.fsencode(socket_file)) > _MAX_SOCKET_PATH:
            raise LocalPostgresError(
                f"socket path {socket_file} is longer than {_MAX_SOCKET_PATH} bytes, which "
                "Unix sockets cannot be; use a shorter folder"
            )
        self.root.mkdir(parents=True, exist_ok=True)
        self.socket_dir.mkdir(exist_ok=True)
        # The socket folder is the only gate in front of a password-less
        # superuser: nobody but the server's user (and root) may enter it.
        os.chmod(self.socket_dir, 0o700)
        if self._user:
            entry = server_user(self._user, self.root)
            for path in (self.root, self.socket_dir):
                os.chown(path, entry.pw_uid, entry.pw_gid)
        result = subprocess.run(
            [
                str(self._bin / "initdb"),
                "-D", str(self.data),
                "-U", "postgres",
                # Trust only the private socket; no host (TCP) connection
                # is accepted, even if someone turns TCP on.
                "--auth-local=trust",
                "--auth-host=reject",
                "--no-sync",
                "-E", "UTF8",
                "--locale=C",
            ],
            user=self._user,
            group=self._user,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        if result.returncode != 0:
            raise LocalPostgresError(f"initdb failed: {result.stderr.decode().strip()}")

    def start(self) -> None:
        """Start the server and wait until it accepts connections."""
        if self._proc is not None:
            raise LocalPostgresError("already running")
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                [
                    str(self._bin / "postgres"),
                    "-D", str(self.data),
                    "-p", str(self.port),
                    "-k", str(self.socket_dir),
                    "-c", "listen_addresses=",
                    "-c", "unix_socket_permissions=0700",
                    "-c", "fsync=off",
                    "-c", "synchronous_commit=off",
                    "-c", "full_page_writes=off",
                    "-c", "max_connections=300",
                    "-c", "shared_buffers=128MB",
                ],
                user=self._user,
                group=self._user,
                # Its own process group: a Ctrl-C at the terminal goes to the
                # foreground group, and must reach only our process, which
                # then stops the server last, after its clients have closed
                # their sessions; a SIGINT to postgres itself is a fast
                # shutdown that would cut those clients off mid-cleanup.
                process_group=0,
                stdout=log,
                stderr=log,
            )  # fmt: skip
        deadline = time.monotonic() + _START_TIMEOUT
        while True:
            try:
                with psycopg.connect(self.url(), connect_timeout=2):
                    return
            except psycopg.OperationalError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    self._proc.kill()
                    self._proc.wait()
                    self._proc = None
                    raise LocalPostgresError(
                        f"postgres did not start; see {self.log_path}"
                    ) from None
                time.sleep(0.05)

    def stop(self) -> None:
        """Fast shutdown: abort transactions, disconnect clients, wait."""
        self._signal(signal.SIGINT)

    def kill(self) -> None:
        """Crash the server (SIGKILL of the postmaster; its backends follow)."""
        self._signal(signal.SIGKILL)

    def create_database(self, name: str, *, template: str | None = None) -> str:
        """Create database ``name`` (optionally from ``template``); return its URL."""
        self.admin(create_database_sql(name, template))
        return self.url(name)

    def admin(self, sql: str, db: str = "postgres") -> None:
        """Run one statement outside a transaction (CREATE/DROP DATABASE)."""
        with psycopg.connect(self.url(db), autocommit=True) as conn:
            conn.execute(sql.encode())

    def _signal(self, sig: signal.Signals) -> None:
        if self._proc is None:
            return
        self._proc.send_signal(sig)
        try:
            self._proc.wait(timeout=_START_TIMEOUT)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc = None
        if sig == signal.SIGKILL:
            # Orphaned backends keep the shared memory busy; wait for them.
            _wait_for_no_backends(self.data)


def server_user(name: str, root: Path) -> pwd.struct_passwd:
    """The user ``name`` that a server run as root runs as, once it is
    sure that user can reach ``root`` (its data lies there).

    Raises `LocalPostgresError` if there is no such user, or if it may not
    enter ``root``'s folder or one of its ancestors (say which, and how to
    mend it).
    """
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise LocalPostgresError(
            f"running as root, but there is no {name!r} user to run the server as"
        ) from None
    blocked = _first_untraversable(root.parent.resolve(), entry)
    if blocked is not None:
        raise LocalPostgresError(
            f"the server runs as user {name!r}, which cannot enter {blocked}"
            f" (mode {blocked.stat().st_mode & 0o777:o}); put {root} in a folder"
            " that user can traverse (e.g. chmod o+x on it)"
        )
    return entry


def _first_untraversable(folder: Path, user: pwd.struct_passwd) -> Path | None:
    """The first of ``folder`` and its ancestors that ``user`` may not enter."""
    for path in (*reversed(folder.parents), folder):
        st = path.stat()
        if st.st_uid == user.pw_uid:
            allowed = st.st_mode & stat.S_IXUSR
        elif st.st_gid == user.pw_gid:
            allowed = st.st_mode & stat.S_IXGRP
        else:
            allowed = st.st_mode & stat.S_IXOTH
        if not allowed:
            return path
    return None


def _wait_for_no_backends(data: Path) -> None:
    pid_file = data / "postmaster.pid"
    deadline = time.monotonic() + _START_TIMEOUT
    while pid_file.exists() and time.monotonic() < deadline:
        pid = int(pid_file.read_text().split()[0])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


# sun_path is 108 bytes on Linux, NUL included.
_MAX_SOCKET_PATH = 107


def start_with_template(root: Path) -> LocalPostgres:
    """A started server in ``root`` holding a migrated `TEMPLATE_DB` to copy
    fresh BMDBs from (``CREATE DATABASE ... TEMPLATE``), as the tests'
    fixtures and the benchmarks do. The caller stops it. Raises
    `LocalPostgresError`, or what migrating raises (the server is then
    stopped)."""
    server = LocalPostgres(root)
    server.create()
    server.start()
    add_template(server)
    return server


def create_database_sql(name: str, template: str | None = None) -> str:
    """``CREATE DATABASE`` of ``name``, copied from ``template`` if given."""
    sql = f'CREATE DATABASE "{name}"'
    if template:
        sql += f' TEMPLATE "{template}"'
    return sql


class _Server(Protocol):
    def admin(self, sql: str) -> None: ...
    def url(self, dbname: str) -> str: ...
    def stop(self) -> None: ...


def add_template(server: _Server) -> None:
    """Create and migrate `TEMPLATE_DB` on a started ``server`` (a single
    server or a Patroni cluster); on any failure stop the server and raise."""
    try:
        server.admin(f"CREATE DATABASE {TEMPLATE_DB}")
        trio.run(migrate, server.url(TEMPLATE_DB))
    except BaseException:
        server.stop()
        raise
