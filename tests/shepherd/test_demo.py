"""The demo that the README runs: a real private Postgres, real SSH machines, the
real agent, the real node image installed, a real cluster.

Most tests use ``--takeover-only`` (seconds); one runs the whole path and
checks the final table; the Ctrl-C tests interrupt the takeover and the
install. They use the fixed loopback addresses (127.0.0.2-N, 127.0.1.1).
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from shepherd.demo import (
    MACHINES_DIR,
    MAX_SOCKET_PATH,
    WorkdirError,
    check_workdir_length,
    longest_socket_path,
)
from tests.fixtures.image import IMAGE_CACHE
from tests.fixtures.install_rig import processes_under


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
    result = run_demo(
        *("--machines", "4", "--broken", "1", "--takeover-only"),
        *("--workdir", str(workdir), "--keep"),
    )
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
    assert len(list((workdir / MACHINES_DIR).glob("*/root/agent"))) == 3
    # The agents the demo started are stopped with it.
    for target in (workdir / MACHINES_DIR).glob("*/root/agent"):
        pid = int(target.with_name("agent.pid").read_text())
        assert wait_gone(pid), f"agent {pid} still runs after the demo"
    assert "progress:" in result.stderr


INTERRUPTED = (
    "shepherd.demo: interrupted; the nodes, the fleet, the Shepherd and PostgreSQL stopped"
)


def test_the_whole_path_ends_with_healthy_nodes_two_of_them_consensus_members(
    traversable_dir: Path, node_image: Path
) -> None:
    """Takeover (one machine refuses our key), a first node, the install on
    the three others, approval, ConsensusMember for two: the final table
    shows every node healthy; the web UI answered meanwhile; nothing of the
    demo runs afterwards, and its folder is gone."""
    workdir = traversable_dir / "demo"
    demo = subprocess.Popen(
        [
            *(sys.executable, "-m", "shepherd.demo", "--machines", "4", "--broken", "1"),
            *("--workdir", str(workdir), "--web", "127.0.0.1:0", "--exit"),
            # The session's image (tests/fixtures/image.py): no build here.
            *("--image-cache", str(IMAGE_CACHE)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert demo.stderr is not None and demo.stdout is not None
        log: list[str] = []
        page = None
        for line in demo.stderr:
            log.append(line)
            if "progress: web UI: http://" in line and page is None:
                url = line.split("progress: web UI: ", 1)[1].split()[0]
                page = httpx.get(url, timeout=30)
        out = demo.stdout.read()
        returncode = demo.wait(timeout=60)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    stderr = "".join(log)
    assert returncode == 0, stderr
    assert page is not None and page.status_code == 200, stderr
    assert "reusing the cached build" in stderr
    table = out.splitlines()
    assert table[0].split() == ["MACHINE", "ADDRESS", "NODE", "ROLES", "HEALTH"]
    rows = {line.split()[0]: line.split(maxsplit=4) for line in table[1:]}
    assert sorted(rows) == ["demo-000", "demo-001", "demo-002", "demo-003", "first-node"]
    first = rows["first-node"]
    assert first[1] == "127.0.1.1" and first[2].startswith("metropolis-")
    installed = [rows[m] for m in ("demo-000", "demo-001", "demo-002")]
    assert [r[1] for r in installed] == ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    ids = [r[2] for r in installed]
    assert all(i.startswith("metropolis-") for i in ids) and len(set(ids)) == 3
    assert all(r[4] == "HEALTHY" for r in installed), out
    assert [r[3] for r in installed] == ["ConsensusMember", "ConsensusMember", "-"], out
    assert "ConsensusMember" in first[3] and first[4] == "HEALTHY", out
    # Each node's id is the key its agent reported, as the install wrote it.
    assert f"node {ids[0]}" in stderr and "approved " + ids[0] in stderr
    broken = rows["demo-003"]
    assert broken[1:4] == ["127.0.0.5", "-", "-"]
    assert "no node: not taken over" in broken[4] and "refused our key" in broken[4]
    assert "progress: etcd member " + ids[1] + ": voter" in stderr
    assert not workdir.exists()
    assert processes_under(workdir) == []


def test_ctrl_c_during_the_install_stops_the_nodes_too(
    traversable_dir: Path, node_image: Path
) -> None:
    workdir = traversable_dir / "demo"
    demo = subprocess.Popen(
        [
            *(sys.executable, "-m", "shepherd.demo", "--machines", "2", "--broken", "0"),
            *("--workdir", str(workdir), "--image-cache", str(IMAGE_CACHE)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        process_group=0,
    )
    try:
        assert demo.stderr is not None
        for line in demo.stderr:  # interrupt once an agent installs
            if "installation 1 succeeded" in line:
                break
        postmaster = workdir / "postgres" / "data" / "postmaster.pid"
        postgres_pid = int(postmaster.read_text().split()[0])
        os.killpg(demo.pid, 2)
        rest = demo.stderr.read()
        returncode = demo.wait(timeout=90)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    assert returncode == 130, rest
    assert "Traceback" not in rest and "KeyboardInterrupt" not in rest, rest
    assert rest.strip().splitlines()[-1] == INTERRUPTED
    assert wait_gone(postgres_pid), "PostgreSQL still runs after the demo"
    assert processes_under(workdir) == []
    assert not workdir.exists()


def test_the_default_workdir_leaves_room_in_the_longest_socket_path() -> None:
    default = Path(tempfile.gettempdir(), "shepherd-demo-abcdefgh")  # as mkdtemp names it
    path = longest_socket_path(default, 5)
    assert path == (
        default
        / MACHINES_DIR
        / "0004/root/disks/disk0/metropolis/ephemeral/consensus"
        / "client.sock:0"
    )
    assert len(os.fsencode(path)) <= MAX_SOCKET_PATH - 10
    check_workdir_length(default, 5)


def test_a_workdir_at_the_limit_is_taken_and_one_byte_more_refused() -> None:
    base = Path("/tmp/x")
    spare = MAX_SOCKET_PATH - len(os.fsencode(longest_socket_path(base, 3)))
    check_workdir_length(Path("/tmp/x" + "y" * spare), 3)
    with pytest.raises(WorkdirError, match="too long by 1 bytes"):
        check_workdir_length(Path("/tmp/x" + "y" * (spare + 1)), 3)


def test_demo_refuses_a_too_long_workdir_before_creating_anything(traversable_dir: Path) -> None:
    workdir = traversable_dir / ("long-" * 12) / "demo"
    result = run_demo("--workdir", str(workdir))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "too long by" in lines[0] and "client.sock:0" in lines[0], lines
    assert list(traversable_dir.iterdir()) == []


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
    result = run_demo("--takeover-only", "--workdir", str(tmp_path / "inner" / "demo"))
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
    result = run_demo(
        "--machines", "1", "--broken", "0", "--takeover-only", "--workdir", str(traversable_dir)
    )
    assert result.returncode == 0, result.stderr
    assert traversable_dir.is_dir()
    assert list(traversable_dir.iterdir()) == []
    assert traversable_dir.stat().st_mode & 0o777 == 0o755


def test_demo_removes_the_folders_it_created_and_no_more(traversable_dir: Path) -> None:
    workdir = traversable_dir / "new" / "demo"
    result = run_demo(
        "--machines", "1", "--broken", "0", "--takeover-only", "--workdir", str(workdir)
    )
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
        [
            *(sys.executable, "-m", "shepherd.demo", "--machines", "40", "--takeover-only"),
            *("--workdir", str(workdir)),
        ],
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
    assert rest.strip().splitlines()[-1] == INTERRUPTED
    assert wait_gone(postgres_pid), "PostgreSQL still runs after the demo"
    assert not workdir.exists()
    assert processes_under(workdir) == []


def test_stay_keeps_the_servers_up_and_its_printed_commands_work_until_sigterm(
    traversable_dir: Path,
) -> None:
    """``--web`` implies ``--stay``: after the table the demo keeps running and
    prints commands; a hold and a decommission typed as printed show on the
    machine's page; SIGTERM then ends it with one line, nothing left behind."""
    workdir = traversable_dir / "demo"
    demo = subprocess.Popen(
        [
            *(sys.executable, "-m", "shepherd.demo", "--machines", "2", "--broken", "1"),
            *("--takeover-only", "--workdir", str(workdir), "--web", "127.0.0.1:0"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert demo.stdout is not None and demo.stderr is not None
        printed: list[str] = []
        for line in demo.stdout:
            printed.append(line)
            if "-m bmdb" in line and " decommission " in line:
                break
        commands = [shlex.split(line) for line in printed if "-m bmdb" in line]
        web = [line.split()[-1] for line in printed if line.strip().startswith("web UI:")]
        assert web and web[0].startswith("http://"), printed
        assert demo.poll() is None, "the demo ended instead of staying"
        by_name = {c[c.index("--url") + 2]: c for c in commands}
        assert set(by_name) >= {"machines", "machine", "hold", "release", "decommission"}
        machine = by_name["hold"][by_name["hold"].index("hold") + 1]
        listed = subprocess.run(by_name["machines"], capture_output=True, text=True, timeout=60)
        assert listed.returncode == 0 and machine in listed.stdout, listed.stderr
        for action in ("hold", "release", "decommission"):
            done = subprocess.run(by_name[action], capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr
            page = httpx.get(f"{web[0]}/machine/{machine}", timeout=30).text
            if action == "hold":
                assert "Held by" in page and "a look around" in page, page
        assert "Decommission:" in page and "end of the demo" in page, page
        postmaster = workdir / "postgres" / "data" / "postmaster.pid"
        postgres_pid = int(postmaster.read_text().split()[0])
        demo.send_signal(signal.SIGTERM)
        rest = demo.stderr.read()
        returncode = demo.wait(timeout=90)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    assert returncode == 130, rest
    assert "Traceback" not in rest, rest
    assert rest.strip().splitlines()[-1] == INTERRUPTED
    assert wait_gone(postgres_pid), "PostgreSQL still runs after the demo"
    assert processes_under(workdir) == []
    assert not workdir.exists()


def test_stay_after_the_whole_path_prints_owner_commands_that_work(
    traversable_dir: Path, node_image: Path
) -> None:
    """After the whole path, ``--stay``'s printed ``owner ... nodes`` lists the
    nodes of the table and its ``set-roles`` is accepted; Ctrl-C ends it."""
    workdir = traversable_dir / "demo"
    demo = subprocess.Popen(
        [
            *(sys.executable, "-m", "shepherd.demo", "--machines", "2", "--broken", "0"),
            *("--workdir", str(workdir), "--stay", "--image-cache", str(IMAGE_CACHE)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        process_group=0,
    )
    try:
        assert demo.stdout is not None and demo.stderr is not None
        printed: list[str] = []
        for line in demo.stdout:
            printed.append(line)
            if " set-roles " in line:
                break
        owner = [shlex.split(line) for line in printed if "-m metropolis owner" in line]
        nodes = next(c for c in owner if c[-1] == "nodes")
        listed = subprocess.run(nodes, capture_output=True, text=True, timeout=60)
        assert listed.returncode == 0, listed.stderr
        table_ids = {line.split()[2] for line in printed if line.startswith("demo-")}
        assert table_ids and all(i in listed.stdout for i in table_ids), listed.stdout
        roles = next(c for c in owner if "set-roles" in c)
        granted = subprocess.run(roles, capture_output=True, text=True, timeout=60)
        assert granted.returncode == 0, granted.stderr
        os.killpg(demo.pid, signal.SIGINT)
        rest = demo.stderr.read()
        returncode = demo.wait(timeout=90)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    assert returncode == 130, rest
    assert rest.strip().splitlines()[-1] == INTERRUPTED
    assert processes_under(workdir) == []
    assert not workdir.exists()
