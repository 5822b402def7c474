"""A throwaway, highly available PostgreSQL 15: three members managed by Patroni.

``LocalPatroni(root)`` runs, all on 127.0.0.1:

- one ``etcd`` 3.4 member, Patroni's store (its leader lock and member keys),
  reached by Patroni's ``etcd3`` client on a private client port;
- three ``patroni`` processes (Debian's ``patroni`` package), each owning
  one PostgreSQL 15 member that it initialises (the first to take the
  lock runs ``initdb``, the others clone it with ``pg_basebackup``),
  starts, promotes, demotes and rewinds (``pg_rewind``) as the cluster
  needs;
- one ``haproxy`` (Debian's ``haproxy`` package), the only address clients
  are given: it routes a connection only to the member whose Patroni says,
  on its REST API, that it holds the leader lock (``GET /primary`` answers
  200), as Patroni's documentation recommends for clients.

Why the proxy (fencing)::

    client ──▶ haproxy :proxy ──▶ the member whose GET /primary is 200
                 │ health check every 0.3 s, on each member's REST port
                 │ 2 failed checks: marked down, its open sessions cut
                 ▼
    a postgres whose Patroni died answers no REST call: no route to it

A SIGKILL of the leader's Patroni leaves its PostgreSQL running as a
writable primary that Patroni no longer lists; after ``ttl`` another member
takes the lock and is promoted. A client that picks its server itself
(libpq's ``target_session_attrs=read-write`` over every member) connects
to the orphan whenever it stands first in the host list, and its commits
then wait forever for a synchronous standby that follows the new leader.
Through the proxy such a member is unreachable within a second of its
Patroni's death, and the sessions open on it are cut, so they fail as
``DatabaseUnavailable`` instead of hanging. Patroni's watchdog (``watchdog:
mode: automatic``) is asked for as well: where the host has
``/dev/watchdog`` it resets a machine whose Patroni stops feeding it, the
other half of the standard answer; this host has none, so it is the proxy
alone here. The bound on a commit that still waits (a network cut the proxy
cannot see) is the client's (`bmdb.pgbounds.COMMIT_TIMEOUT`).

Replication is synchronous (``synchronous_mode: true``): the primary
acknowledges a commit only once its synchronous standby has it, and Patroni
only ever promotes that standby, so a commit acknowledged by the primary
survives its loss. ``primary_start_timeout: 0`` makes Patroni fail over at
once when the primary's postgres crashes, rather than restart it in place.

Unlike `bmdb.localserver.LocalPostgres` the members listen on TCP (Patroni
and replication need it), so every role has a random password: the
superuser ``postgres`` (in `url`), ``replicator`` for streaming. They live
in ``root`` (mode 0700), never anywhere else. Like it, it trades durability
for speed (``fsync=off``): a SIGKILL of a member loses nothing the operating
system has, a power cut would.

`url` is the proxy's address (with ``target_session_attrs=read-write``, so
that libpq also refuses a member that does not accept writes): a client
that reconnects after a failover reaches the new primary by itself, once
Patroni has promoted it. ``url(target="prefer-standby")`` goes to a second
listener of the proxy that routes to replicas (``GET /replica``), and falls
back to the primary's listener when none runs. `member_url` reaches one
member directly, for tests and administration.

When we are root, Patroni (and so PostgreSQL) runs as the ``postgres`` user,
as in `bmdb.localserver`. The calls are synchronous (a start takes a few
seconds): run them before ``trio.run`` or through ``trio.to_thread``.
`stop` ends every process it started (Patroni stops its postgres; a postgres
left by a killed Patroni is ended through its ``postmaster.pid``).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psycopg
import trio

from bmdb.connection import migrate
from bmdb.localha_config import SCOPE, Member, haproxy_config, patroni_config
from bmdb.localserver import (
    LocalPostgresError,
    add_template,
    create_database_sql,
    find_postgres_bin,
    server_user,
)
from common.net import free_loopback_port
from common.text import printable

__all__ = ["LocalPatroni", "Member", "find_haproxy", "find_patroni", "main", "start_with_template"]

#: Seconds allowed for the cluster to come up (initdb, two base backups).
_START_TIMEOUT = 120.0
#: Seconds allowed for one process to exit after SIGTERM before SIGKILL.
_STOP_TIMEOUT = 30.0


def find_haproxy() -> str:
    """The ``haproxy`` executable, or `LocalPostgresError`."""
    haproxy = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/sbin")
    if haproxy is None:
        raise LocalPostgresError("haproxy not found: install Debian's 'haproxy' package")
    return haproxy


def find_patroni() -> tuple[str, str]:
    """The ``patroni`` and ``patronictl`` executables, or `LocalPostgresError`."""
    patroni = shutil.which("patroni")
    patronictl = shutil.which("patronictl")
    if patroni is None or patronictl is None:
        raise LocalPostgresError(
            "patroni not found: install Debian's 'patroni' and 'python3-etcd' packages"
        )
    return patroni, patronictl


class LocalPatroni:
    """A private three-member Patroni cluster whose files live in ``root``.

    ``create()`` once, then ``start()`` / ``stop()``. While it runs,
    `kill_primary` crashes the primary's postgres (Patroni fails over) and
    `switchover` moves the primary in a planned way. ``url(db)`` is the
    multi-host URL clients use.

    ``ttl``, ``loop_wait`` and ``retry_timeout`` are Patroni's own timings
    (seconds): the leader lock's lifetime, the pause between two runs of
    Patroni's loop, and how long it retries etcd and PostgreSQL before
    demoting. Patroni asks ``loop_wait + 2 * retry_timeout <= ttl``.
    """

    def __init__(
        self,
        root: Path,
        *,
        members: int = 3,
        ttl: int = 20,
        loop_wait: int = 1,
        retry_timeout: int = 6,
    ) -> None:
        if members < 2:
            raise ValueError("a synchronous cluster needs at least two members")
        if loop_wait + 2 * retry_timeout > ttl:
            raise ValueError("Patroni needs loop_wait + 2 * retry_timeout <= ttl")
        self.root = root
        self.ttl = ttl
        self.loop_wait = loop_wait
        self.retry_timeout = retry_timeout
        self._patroni, self._patronictl = find_patroni()
        self._haproxy = find_haproxy()
        self._bin = find_postgres_bin()
        self._user = "postgres" if os.geteuid() == 0 else None
        self.members = [
            Member(f"m{i}", free_loopback_port(), free_loopback_port(), root / f"m{i}")
            for i in range(members)
        ]
        self.etcd_port = free_loopback_port()
        self.etcd_peer_port = free_loopback_port()
        #: The proxy's listeners: to the primary, and to the replicas.
        self.proxy_port = free_loopback_port()
        self.standby_proxy_port = free_loopback_port()
        self._secrets = root / "secrets.json"
        self._etcd: subprocess.Popen[bytes] | None = None
        self._proxy: subprocess.Popen[bytes] | None = None
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        #: Members whose Patroni `kill_patroni` killed, until restarted.
        self._killed: set[str] = set()

    # -- addresses -----------------------------------------------------------

    def _password(self, role: str) -> str:
        value: str = json.loads(self._secrets.read_text())[role]
        return value

    def url(self, dbname: str = "postgres", *, target: str = "read-write") -> str:
        """libpq URL of ``dbname`` through the proxy, with
        ``target_session_attrs`` ``target``: ``read-write`` reaches the
        primary Patroni names (and only it); ``prefer-standby`` a replica
        if one runs, else the primary."""
        if target == "read-write":
            hosts = f"127.0.0.1:{self.proxy_port}"
        else:
            hosts = f"127.0.0.1:{self.standby_proxy_port},127.0.0.1:{self.proxy_port}"
        password = self._password("postgres")
        return f"postgresql://postgres:{password}@{hosts}/{dbname}?target_session_attrs={target}"

    def direct_url(self, dbname: str = "postgres") -> str:
        """The multi-host URL of ``dbname`` over every member directly, with
        ``target_session_attrs=read-write``: what clients used before the
        proxy, and what is unsafe when a Patroni dies (module docstring)."""
        hosts = ",".join(f"127.0.0.1:{m.pg_port}" for m in self.members)
        password = self._password("postgres")
        return f"postgresql://postgres:{password}@{hosts}/{dbname}?target_session_attrs=read-write"

    def member_url(self, name: str, dbname: str = "postgres") -> str:
        """URL of ``dbname`` on member ``name`` alone, whatever its role."""
        member = self._member(name)
        password = self._password("postgres")
        return f"postgresql://postgres:{password}@127.0.0.1:{member.pg_port}/{dbname}"

    @property
    def running(self) -> bool:
        return self._etcd is not None

    def _proxy_config(self) -> str:
        return haproxy_config(self.proxy_port, self.standby_proxy_port, self.members)

    def _config(self, member: Member) -> dict[str, Any]:
        passwords = {role: self._password(role) for role in ("postgres", "replicator")}
        return patroni_config(
            member,
            etcd_port=self.etcd_port,
            ttl=self.ttl,
            loop_wait=self.loop_wait,
            retry_timeout=self.retry_timeout,
            bin_dir=self._bin,
            passwords=passwords,
        )

    # -- lifetime ------------------------------------------------------------

    def create(self) -> None:
        """Write the members' folders and Patroni configurations."""
        entry = server_user(self._user, self.root) if self._user else None
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700 if entry is None else 0o711)
        (self.root / "etcd").mkdir(mode=0o700, exist_ok=True)
        self._secrets.write_text(
            json.dumps({r: secrets.token_hex(16) for r in ("postgres", "replicator")})
        )
        os.chmod(self._secrets, 0o600)
        for member in self.members:
            member.root.mkdir(mode=0o700, exist_ok=True)
            member.config.write_text(json.dumps(self._config(member), indent=2))
            os.chmod(member.config, 0o600)
            if entry is not None:
                for path in (member.root, member.config):
                    os.chown(path, entry.pw_uid, entry.pw_gid)

    def start(self) -> None:
        """Start etcd and every member; wait until a primary runs with a
        synchronous standby and every member streams from it."""
        if self._etcd is not None:
            raise LocalPostgresError("already running")
        etcd_url = f"http://127.0.0.1:{self.etcd_port}"
        peer_url = f"http://127.0.0.1:{self.etcd_peer_port}"
        with open(self.root / "etcd.log", "ab") as log:
            self._etcd = subprocess.Popen(
                [
                    "etcd",
                    "--name=patroni-store",
                    f"--data-dir={self.root / 'etcd' / 'data'}",
                    f"--listen-client-urls={etcd_url}",
                    f"--advertise-client-urls={etcd_url}",
                    f"--listen-peer-urls={peer_url}",
                    f"--initial-advertise-peer-urls={peer_url}",
                    f"--initial-cluster=patroni-store={peer_url}",
                    "--initial-cluster-state=new",
                    "--unsafe-no-fsync",
                ],
                process_group=0,
                stdout=log,
                stderr=log,
            )
        try:
            proxy_config = self.root / "haproxy.cfg"
            proxy_config.write_text(self._proxy_config())
            with open(self.root / "haproxy.log", "ab") as log:
                # -db: in the foreground, ours to stop; -W off (no master).
                self._proxy = subprocess.Popen(
                    [self._haproxy, "-db", "-f", str(proxy_config)],
                    process_group=0,
                    stdout=log,
                    stderr=log,
                )
            for member in self.members:
                self._start_member(member)
            self.wait_healthy(_START_TIMEOUT)
        except BaseException:
            self.stop()
            raise

    def _start_member(self, member: Member) -> None:
        with open(member.root / "stdout.log", "ab") as log:
            self._procs[member.name] = subprocess.Popen(
                [self._patroni, str(member.config)],
                user=self._user,
                group=self._user,
                cwd=member.root,
                # Our signals only: a Ctrl-C at the terminal must reach the
                # caller, which then stops the cluster after its clients.
                process_group=0,
                stdout=log,
                stderr=log,
            )

    def stop(self) -> None:
        """Stop every member (Patroni stops its postgres), then etcd. Ends
        whatever is left of each with SIGKILL if it does not exit in time."""
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self._procs.values():
            _reap(proc)
        self._procs.clear()
        for member in self.members:
            _kill_postmaster(member.data)
        if self._proxy is not None:
            self._proxy.send_signal(signal.SIGTERM)
            _reap(self._proxy)
            self._proxy = None
        if self._etcd is not None:
            self._etcd.send_signal(signal.SIGTERM)
            _reap(self._etcd)
            self._etcd = None

    # -- state ---------------------------------------------------------------

    def cluster(self) -> list[dict[str, Any]]:
        """Patroni's view of the members (its REST API's ``/cluster``): one
        dict per member with ``name``, ``role`` (``leader``,
        ``sync_standby``, ``replica``), ``state``, ``timeline``..."""
        last: Exception | None = None
        for member in self.members:
            url = f"http://127.0.0.1:{member.api_port}/cluster"
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    members: list[dict[str, Any]] = json.load(response)["members"]
                    return members
            except (OSError, ValueError, KeyError) as e:
                last = e
        raise LocalPostgresError(f"no Patroni member answers: {last}")

    def primary(self) -> str | None:
        """The name of the running leader, or None while there is none."""
        try:
            members = self.cluster()
        except LocalPostgresError:
            return None
        for m in members:
            if m.get("role") == "leader" and m.get("state") == "running":
                name: str = m["name"]
                return name
        return None

    def wait_healthy(self, timeout: float = _START_TIMEOUT) -> str:
        """Wait until a leader runs and accepts writes (through the proxy),
        one member is its synchronous standby and every other member runs
        as a replica; return the leader's name. A member whose Patroni was
        killed (`kill_patroni`) and not restarted is not waited for: the
        others are healthy without it."""
        deadline = time.monotonic() + timeout
        while True:
            for name, proc in self._procs.items():
                if proc.poll() is not None and name not in self._killed:
                    member = self._member(name)
                    raise LocalPostgresError(
                        f"patroni member {name} exited; see {member.log_path}; "
                        f"its output ends: {_ending(member.root / 'stdout.log')}; "
                        f"its log ends: {_ending(member.log_path)}"
                    )
            try:
                members = self.cluster()
            except LocalPostgresError:
                members = []
            roles = sorted(m.get("role", "") for m in members)
            states = {m.get("state") for m in members if m.get("role") != "leader"}
            leader: list[str] = [m["name"] for m in members if m.get("role") == "leader"]
            if (
                len(members) == len(self.members) - len(self._killed)
                and roles.count("leader") == 1
                and roles.count("sync_standby") >= 1
                # "streaming" from Patroni 3.0.4 on, "running" before.
                and states <= {"running", "streaming"}
                and self._accepts_writes(leader[0])
                and self._proxy_reaches(leader[0])
            ):
                return leader[0]
            if time.monotonic() > deadline:
                raise LocalPostgresError(f"the Patroni cluster is not healthy: {members}")
            time.sleep(0.2)

    def wait_new_primary(self, old: str, timeout: float = _START_TIMEOUT) -> str:
        """Wait until a member other than ``old`` leads and accepts writes
        (Patroni names the leader before its promotion ends); return it."""
        deadline = time.monotonic() + timeout
        while True:
            name = self.primary()
            if (
                name is not None
                and name != old
                and self._accepts_writes(name)
                and self._proxy_reaches(name)
            ):
                return name
            if time.monotonic() > deadline:
                raise LocalPostgresError(f"no new primary after {old} within {timeout} s")
            time.sleep(0.1)

    def _accepts_writes(self, name: str) -> bool:
        try:
            with psycopg.connect(self.member_url(name), connect_timeout=2) as conn:
                row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
                return row is not None and not row[0]
        except psycopg.Error:
            return False

    def _proxy_reaches(self, name: str) -> bool:
        """True if a connection through the proxy lands on member ``name``."""
        try:
            with psycopg.connect(self.url(), connect_timeout=2) as conn:
                row = conn.execute("SELECT inet_server_port()").fetchone()
                return row is not None and row[0] == self._member(name).pg_port
        except psycopg.Error:
            return False

    def member(self, name: str) -> Member:
        """The member called ``name`` (`LocalPostgresError` if none is)."""
        return self._member(name)

    def _member(self, name: str) -> Member:
        for member in self.members:
            if member.name == name:
                return member
        raise LocalPostgresError(f"no member {name!r}")

    # -- faults --------------------------------------------------------------

    def kill_primary(self) -> str:
        """SIGKILL the primary's postmaster (its backends follow); return the
        member's name. Patroni notices within ``loop_wait`` and fails over
        to the synchronous standby."""
        name = self.primary()
        if name is None:
            raise LocalPostgresError("there is no primary to kill")
        pid = _postmaster_pid(self._member(name).data)
        if pid is None:
            raise LocalPostgresError(f"primary {name} has no postmaster.pid")
        os.kill(pid, signal.SIGKILL)
        return name

    def kill_patroni(self) -> str:
        """SIGKILL the primary's Patroni process alone; return the member's
        name. Its PostgreSQL goes on running, writable, while the leader
        lock expires (``ttl``) and another member is promoted: the proxy
        stops routing to it as soon as its REST API stops answering.
        `restart_member` starts its Patroni again (as a service manager
        would), which demotes and rewinds it."""
        name = self.primary()
        if name is None:
            raise LocalPostgresError("there is no primary whose Patroni to kill")
        proc = self._procs[name]
        proc.kill()
        proc.wait()
        self._killed.add(name)
        return name

    def restart_member(self, name: str) -> None:
        """Start member ``name``'s Patroni again after `kill_patroni` (a
        no-op if it runs)."""
        proc = self._procs.get(name)
        if proc is not None and proc.poll() is None:
            return
        self._start_member(self._member(name))
        self._killed.discard(name)

    def switchover(self, candidate: str | None = None) -> str:
        """A planned switchover (``patronictl switchover``) from the current
        leader to ``candidate`` (default: the synchronous standby); return
        the new leader's name once it runs."""
        leader = self.primary()
        if leader is None:
            raise LocalPostgresError("there is no primary to switch over from")
        if candidate is None:
            sync = [m["name"] for m in self.cluster() if m.get("role") == "sync_standby"]
            if not sync:
                raise LocalPostgresError("there is no synchronous standby")
            candidate = sync[0]
        config = self._member(leader).config
        result = subprocess.run(
            [self._patronictl, "-c", str(config), "switchover", SCOPE,
             "--leader", leader, "--candidate", candidate, "--force"],
            capture_output=True,
            text=True,
            timeout=_START_TIMEOUT,
        )  # fmt: skip
        if result.returncode != 0:
            raise LocalPostgresError(f"patronictl switchover failed: {result.stderr.strip()}")
        deadline = time.monotonic() + _START_TIMEOUT
        while self.primary() != candidate:
            if time.monotonic() > deadline:
                raise LocalPostgresError(f"{candidate} did not become the primary")
            time.sleep(0.1)
        return candidate

    # -- administration ------------------------------------------------------

    def admin(self, sql: str, db: str = "postgres") -> None:
        """Run one statement on the primary outside a transaction."""
        with psycopg.connect(self.url(db), autocommit=True, connect_timeout=5) as conn:
            conn.execute(sql.encode())

    def create_database(self, name: str, *, template: str | None = None) -> str:
        """Create database ``name`` (optionally from ``template``); return its URL."""
        self.admin(create_database_sql(name, template))
        return self.url(name)


def _postmaster_pid(data: Path) -> int | None:
    try:
        return int((data / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _kill_postmaster(data: Path) -> None:
    """End a postgres whose Patroni is gone (it would run on forever)."""
    pid = _postmaster_pid(data)
    if pid is None:
        return
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return
    if b"postgres" not in cmdline or str(data).encode() not in cmdline:
        return  # a stale file; the pid belongs to someone else now
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + _STOP_TIMEOUT
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _ending(path: Path) -> str:
    """The last lines of a log, escaped and bounded, for an error message
    (a CI run keeps the message, not the file)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 1500))
            text = f.read().decode("utf-8", errors="replace")
    except OSError as exc:
        return f"(unreadable: {exc.strerror})"
    lines = [printable(line, limit=300) for line in text.splitlines()[-6:] if line.strip()]
    return " | ".join(lines) or "(empty)"


def _reap(proc: subprocess.Popen[bytes]) -> None:
    try:
        proc.wait(timeout=_STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def start_with_template(root: Path, **timings: int) -> LocalPatroni:
    """A started cluster in ``root`` holding a migrated `TEMPLATE_DB` to copy
    fresh BMDBs from, as `bmdb.localserver.start_with_template` does for a
    single server. The caller stops it."""
    cluster = LocalPatroni(root, **timings)
    cluster.create()
    cluster.start()
    add_template(cluster)
    return cluster


def main(argv: list[str] | None = None) -> int:
    """``python -m bmdb.localha [--root DIR]``: run a local HA BMDB until
    Ctrl-C (or SIGTERM), printing its multi-host URL; then stop every
    process and, unless ``--root`` was given, remove its files."""
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(
        prog="python -m bmdb.localha",
        description="Run a throwaway three-member Patroni PostgreSQL 15 cluster, "
        "with a migrated BMDB, until interrupted.",
    )
    parser.add_argument("--root", type=Path, help="folder for its files (default: a temp dir)")
    parser.add_argument("--db", default="bmdb", help="name of the BMDB database")
    args = parser.parse_args(argv)
    root: Path = args.root or Path(tempfile.mkdtemp(prefix="bmdb-ha-"))
    # SIGTERM ends the run as Ctrl-C does, so the cluster is stopped; and
    # SIGINT does even if our parent (a shell's background job) ignored it.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.default_int_handler)
    cluster = LocalPatroni(root)
    try:
        cluster.create()
        cluster.start()
        try:
            cluster.admin(f'CREATE DATABASE "{args.db}"')
            trio.run(migrate, cluster.url(args.db))
            print(f"BMDB (Patroni, primary {cluster.primary()}): {cluster.url(args.db)}")
            print(f"read-only views: {cluster.url(args.db, target='prefer-standby')}")
            print("Ctrl-C stops it.", flush=True)
            while True:
                time.sleep(3600)
        finally:
            cluster.stop()
    except KeyboardInterrupt:
        return 0
    except LocalPostgresError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
