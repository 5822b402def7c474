"""The demo that the README runs: a real private Postgres, real SSH machines, the real agent."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


def run_demo(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shepherd.demo", *args],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture
def traversable_dir() -> Iterator[Path]:
    """A folder the postgres user can enter (pytest's tmp_path is 0700 when we are root)."""
    path = Path(tempfile.mkdtemp(prefix="demo-test-"))
    path.chmod(0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def wait_gone(pid: int) -> bool:
    """True once no process ``pid`` runs (it may take a moment to die)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists():
            return True
        time.sleep(0.05)
    return False


def test_demo_takes_over_good_machines_and_fails_broken_ones(traversable_dir: Path) -> None:
    workdir = traversable_dir / "demo"
    result = run_demo("--machines", "4", "--broken", "1", "--workdir", str(workdir), "--keep")
    assert result.returncode == 0, result.stderr
    table = result.stdout.splitlines()
    assert table[0].split() == ["MACHINE", "ADDRESS", "OUTCOME"]
    rows = {line.split()[0]: line for line in table[1:]}
    assert sorted(rows) == ["demo-000", "demo-001", "demo-002", "demo-003"]
    for good in ("demo-000", "demo-001", "demo-002"):
        assert "agent started, key" in rows[good]
        assert "heartbeat" in rows[good] and "hardware report stored" in rows[good]
    assert "failed, retrying after backoff" in rows["demo-003"]
    assert "refused our key" in rows["demo-003"]
    # --keep leaves the machines file, the key and the uploaded agents behind.
    listed = (workdir / "machines.toml").read_text()
    assert listed.count("[[machine]]") == 4 and "demo-003" in listed
    assert listed.count("# Machines of the demo fleet") == 1
    assert (workdir / "shepherd_ed25519").exists()
    assert len(list((workdir / "fleet").glob("*/root/agent"))) == 3
    # The agents the demo started are stopped with it.
    for target in (workdir / "fleet").glob("*/root/agent"):
        pid = int(target.with_name("agent.pid").read_text())
        assert wait_gone(pid), f"agent {pid} still runs after the demo"
    assert "progress:" in result.stderr


def test_demo_rejects_bad_flags() -> None:
    result = run_demo("--machines", "2", "--broken", "3")
    assert result.returncode == 2
    assert "--broken cannot exceed --machines" in result.stderr
    result = run_demo("--machines", "0")
    assert result.returncode == 2
    assert "must be at least 1" in result.stderr


def test_demo_without_postgres_binaries_says_what_to_install(tmp_path: Path) -> None:
    result = run_demo(env={"BMDB_PG_BIN": str(tmp_path / "nowhere")})
    assert result.returncode == 1
    assert "PostgreSQL server binaries not found" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="only root hands the server to another user")
def test_demo_in_a_folder_postgres_cannot_enter_is_a_clear_error(tmp_path: Path) -> None:
    tmp_path.chmod(0o700)
    result = run_demo("--workdir", str(tmp_path / "inner" / "demo"))
    assert result.returncode == 1
    assert "cannot enter" in result.stderr
    assert "Traceback" not in result.stderr


def test_demo_refuses_a_non_empty_workdir_and_leaves_it_alone(traversable_dir: Path) -> None:
    precious = traversable_dir / "precious.txt"
    precious.write_text("do not delete")
    traversable_dir.chmod(0o750)
    result = run_demo("--workdir", str(traversable_dir))
    assert result.returncode == 2
    assert "not empty" in result.stderr
    assert "Traceback" not in result.stderr
    assert precious.read_text() == "do not delete"
    assert sorted(p.name for p in traversable_dir.iterdir()) == ["precious.txt"]
    assert traversable_dir.stat().st_mode & 0o777 == 0o750


def test_demo_refuses_a_workdir_that_is_a_file(traversable_dir: Path) -> None:
    target = traversable_dir / "file"
    target.write_text("mine")
    result = run_demo("--workdir", str(target))
    assert result.returncode == 2
    assert "not a folder" in result.stderr
    assert target.read_text() == "mine"


def test_demo_in_an_empty_workdir_keeps_the_folder_and_its_mode(traversable_dir: Path) -> None:
    traversable_dir.chmod(0o755)
    result = run_demo("--machines", "1", "--broken", "0", "--workdir", str(traversable_dir))
    assert result.returncode == 0, result.stderr
    assert traversable_dir.is_dir()
    assert list(traversable_dir.iterdir()) == []
    assert traversable_dir.stat().st_mode & 0o777 == 0o755


def test_demo_removes_the_folders_it_created_and_no_more(traversable_dir: Path) -> None:
    workdir = traversable_dir / "new" / "demo"
    result = run_demo("--machines", "1", "--broken", "0", "--workdir", str(workdir))
    assert result.returncode == 0, result.stderr
    assert traversable_dir.is_dir()
    assert list(traversable_dir.iterdir()) == []


def test_ctrl_c_ends_the_demo_with_one_line_and_leaves_nothing_running(
    traversable_dir: Path,
) -> None:
    """A terminal's Ctrl-C signals the whole foreground process group, so the
    demo is started in a group of its own and the group is signalled, as a
    terminal would. PostgreSQL must not be part of that group: stopped
    there, it would cut the Shepherd off while it closes its sessions."""
    workdir = traversable_dir / "demo"
    demo = subprocess.Popen(
        [sys.executable, "-m", "shepherd.demo", "--machines", "40", "--workdir", str(workdir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        process_group=0,
    )
    try:
        assert demo.stderr is not None
        for line in demo.stderr:  # interrupt once the Shepherd is at work
            if "agent started" in line:
                break
        postmaster = workdir / "postgres" / "data" / "postmaster.pid"
        postgres_pid = int(postmaster.read_text().split()[0])
        os.killpg(demo.pid, 2)
        rest = demo.stderr.read()
        returncode = demo.wait(timeout=60)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    assert returncode == 130, rest
    assert "Traceback" not in rest and "KeyboardInterrupt" not in rest, rest
    assert "could not delete" not in rest, rest
    assert rest.strip().splitlines()[-1] == (
        "shepherd.demo: interrupted; the fleet, the Shepherd and PostgreSQL stopped"
    )
    assert wait_gone(postgres_pid), "PostgreSQL still runs after the demo"
    assert not workdir.exists()
