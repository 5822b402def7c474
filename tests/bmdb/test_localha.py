"""``python -m bmdb.localha``: one command starts the Patroni cluster with a
migrated BMDB, prints its URLs, and on Ctrl-C stops every process it
started (etcd, Patroni, PostgreSQL) and removes nothing it was not asked to."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from bmdb.localha import LocalPatroni
from bmdb.localserver import LocalPostgresError


def _processes_under(root: Path) -> list[str]:
    """Command lines of the running processes that name ``root``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(root) in cmdline:
            found.append(cmdline)
    return found


@pytest.fixture
def traversable_dir() -> Iterator[Path]:
    """A temp folder that user postgres may enter (pytest's own may not be)."""
    folder = Path(tempfile.mkdtemp(prefix="bmdb-ha-cmd-"))
    os.chmod(folder, 0o711)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_the_command_serves_a_bmdb_and_ctrl_c_leaves_no_process(traversable_dir: Path) -> None:
    root = traversable_dir / "ha"
    proc = subprocess.Popen(
        [sys.executable, "-m", "bmdb.localha", "--root", str(root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "Ctrl-C stops it." in line:
                break
        urls = [line.split(": ", 1)[1].strip() for line in lines if line.startswith("BMDB")]
        assert len(urls) == 1, "".join(lines)
        url = urls[0]
        assert "target_session_attrs=read-write" in url
        with psycopg.connect(url, connect_timeout=5) as conn:
            row = conn.execute("SELECT count(*) FROM machines").fetchone()
            assert row == (0,)
        assert _processes_under(root)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert _processes_under(root) == []


def test_timings_patroni_refuses_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="loop_wait"):
        LocalPatroni(tmp_path, ttl=10, loop_wait=5, retry_timeout=5)
    with pytest.raises(ValueError, match="two members"):
        LocalPatroni(tmp_path, members=1)


def test_a_root_postgres_cannot_enter_is_refused_clearly(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("only root runs the servers as user postgres")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o700)
    with pytest.raises(LocalPostgresError, match="cannot enter"):
        LocalPatroni(locked / "ha").create()


def test_a_member_that_exits_at_start_is_reported_with_its_output(traversable_dir: Path) -> None:
    """A CI run keeps the error message, not the member's files: the message
    itself says why Patroni exited (here: its REST port was taken)."""
    cluster = LocalPatroni(traversable_dir / "ha")
    cluster.create()
    with socket.socket() as held:
        held.bind(("127.0.0.1", cluster.members[0].api_port))
        held.listen()
        with pytest.raises(LocalPostgresError) as raised:
            cluster.start()
    message = str(raised.value)
    assert "patroni member m0 exited" in message
    assert "Address already in use" in message, message  # its stderr
    assert "Couldn't start a service" in message, message  # its log
    assert _processes_under(traversable_dir) == []
