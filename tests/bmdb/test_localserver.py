"""The private PostgreSQL of the demo, tests and benchmarks is not open to other local users."""

from __future__ import annotations

import os
import pwd
import stat
import subprocess

import psycopg
import pytest

from bmdb.localserver import LocalPostgres


def test_no_tcp_listener(postgres_server: LocalPostgres) -> None:
    """Loopback TCP would let any local user in as a password-less superuser."""
    if not postgres_server.running:
        postgres_server.start()
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(
            f"postgresql://postgres@127.0.0.1:{postgres_server.port}/postgres", connect_timeout=5
        )
    hba = (postgres_server.data / "pg_hba.conf").read_text()
    rules = [line.split() for line in hba.splitlines() if line and not line.startswith("#")]
    assert all(rule[-1] == "reject" for rule in rules if rule[0].startswith("host")), rules
    # Its own URL still works, over the socket.
    with psycopg.connect(postgres_server.url(), connect_timeout=5) as conn:
        assert conn.execute("SELECT current_user").fetchone() == ("postgres",)


def test_other_users_cannot_reach_the_socket(postgres_server: LocalPostgres) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another user")
    if not postgres_server.running:
        postgres_server.start()
    assert stat.S_IMODE(postgres_server.socket_dir.stat().st_mode) == 0o700
    socket_file = postgres_server.socket_dir / f".s.PGSQL.{postgres_server.port}"
    assert socket_file.exists()
    nobody = pwd.getpwnam("nobody")
    probe = subprocess.run(
        [
            "/usr/bin/python3",
            "-c",
            "import socket, sys\n"
            "s = socket.socket(socket.AF_UNIX)\n"
            "try:\n"
            "    s.connect(sys.argv[1])\n"
            "except PermissionError:\n"
            "    sys.exit(3)\n",
            str(socket_file),
        ],
        user=nobody.pw_uid,
        group=nobody.pw_gid,
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert probe.returncode == 3, probe.stderr
