"""What every entry point refuses in a node root: tampering room and damaged files.

The CLI cases run ``python -m metropolis`` on a copy of one root that a
real node bootstrapped (and stopped) once per module; each checks that the
command exits non-zero with one error line naming the path, without a
traceback, and that nothing on disk changed.
"""

from __future__ import annotations

import hashlib
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from metropolis.localstorage import (
    CorruptFile,
    Root,
    UnsafeRootError,
    checked_content,
    read_checked,
    write_checked,
)
from metropolis.proto.common import NodeRoles, NodeRolesConsensusMember
from metropolis.roleserve import disk
from tests.metropolis.test_node_cli import BOUND, LEADS, bootstrap_args, node

#: Enough for a refusal, which comes before anything starts.
REFUSAL_BOUND = 60


@pytest.fixture(scope="module")
def bootstrapped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding ``n`` (a node root, bootstrapped and stopped) and ``owner.pem``."""
    base = tmp_path_factory.mktemp("bootstrapped")

    async def bootstrap() -> None:
        with trio.fail_after(BOUND):
            async with node(*bootstrap_args(base)) as proc:
                await proc.wait_for(LEADS)
                await proc.wait_for("status pushed")
                proc.process.send_signal(signal.SIGTERM)
        assert proc.process.returncode == 0

    trio.run(bootstrap)
    return base


def _sockets(directory: str, names: list[str]) -> list[str]:
    return [n for n in names if stat.S_ISSOCK(os.lstat(os.path.join(directory, n)).st_mode)]


@pytest.fixture
def root(bootstrapped: Path, tmp_path: Path) -> Root:
    """A private copy of the bootstrapped root (modes kept), in ``tmp_path / "n"``."""
    shutil.copytree(bootstrapped / "n", tmp_path / "n", symlinks=True, ignore=_sockets)
    shutil.copy2(bootstrapped / "owner.pem", tmp_path / "owner.pem")
    return Root(tmp_path / "n")


def _snapshot(top: Path) -> dict[str, tuple[object, ...]]:
    """Every path under ``top`` (itself included): type and mode, owner, and content."""
    seen: dict[str, tuple[object, ...]] = {}
    for directory, folders, files in os.walk(top):
        for name in [*folders, *files, *([""] if directory == str(top) else [])]:
            path = Path(directory, name)
            st = os.lstat(path)
            content: object = None
            if stat.S_ISREG(st.st_mode):
                content = hashlib.sha256(path.read_bytes()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                content = os.readlink(path)
            seen[str(path.relative_to(top))] = (st.st_mode, st.st_uid, content)
    return seen


def _metropolis(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "metropolis", *args],
        capture_output=True,
        text=True,
        timeout=REFUSAL_BOUND,
    )


def _assert_refused(result: subprocess.CompletedProcess[str], *words: str) -> str:
    """The one error line of a refused command, holding ``words``."""
    assert result.returncode != 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1, result.stderr
    for word in words:
        assert word in errors[0], errors[0]
    return errors[0]


def _run_refused(top: Path, root: Root, *words: str) -> str:
    """``node run --root`` on ``root`` refuses (``words``), changing nothing under ``top``."""
    before = _snapshot(top)
    line = _assert_refused(_metropolis("node", "run", "--root", str(root.path)), *words)
    assert _snapshot(top) == before
    return line


# -- finding 4: a root another local user could tamper with ------------------


@pytest.mark.parametrize(
    ("where", "mode", "fix"),
    [
        ("data", 0o777, "chmod 700"),
        ("data/node/credentials", 0o777, "chmod 700"),
        ("ephemeral", 0o770, "chmod 700"),
        ("esp", 0o777, "chmod go-w"),
        ("", 0o777, "chmod go-w"),
    ],
)
def test_run_refuses_a_folder_others_can_write(
    root: Root, tmp_path: Path, where: str, mode: int, fix: str
) -> None:
    path = root.path / where if where else root.path
    os.chmod(path, mode)
    _run_refused(
        tmp_path,
        root,
        f"{path} is writable by group or others",
        f"mode {mode:04o}",
        f"{fix} {path}",
    )


@pytest.mark.parametrize(
    ("where", "mode", "what"),
    [
        ("data/node/roles.pb", 0o666, "writable by group or others"),
        ("esp/cluster_directory.pb", 0o646, "writable by group or others"),
        ("esp/sealed_configuration.pb", 0o644, "readable by group or others"),
        ("data/node/credentials/key.pem", 0o640, "readable by group or others"),
    ],
)
def test_run_refuses_a_file_others_can_write_or_read(
    root: Root, tmp_path: Path, where: str, mode: int, what: str
) -> None:
    os.chmod(root.path / where, mode)
    _run_refused(tmp_path, root, f"{root.path / where} is {what}", f"mode {mode:04o}")


def test_run_refuses_symlinks_for_the_root_or_a_folder(root: Root, tmp_path: Path) -> None:
    os.rename(root.data.path, tmp_path / "data.real")
    root.data.path.symlink_to(tmp_path / "data.real")
    _run_refused(tmp_path, root, f"{root.data.path} is a symbolic link")
    root.data.path.unlink()
    os.rename(tmp_path / "data.real", root.data.path)

    link = tmp_path / "link"
    link.symlink_to(root.path)
    before = _snapshot(tmp_path)
    _assert_refused(_metropolis("node", "run", "--root", str(link)), f"{link} is a symbolic link")
    assert _snapshot(tmp_path) == before


def test_run_refuses_a_folder_of_another_user(root: Root, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give a folder to another user")
    nobody = pwd.getpwnam("nobody").pw_uid
    os.chown(root.data.path, nobody, -1)
    _run_refused(tmp_path, root, f"{root.data.path} is owned by uid {nobody}")


def test_run_refuses_a_root_in_a_folder_others_can_write(root: Root, tmp_path: Path) -> None:
    """Whoever can write the folder above can rename the root away and put theirs there."""
    shared = tmp_path / "shared"
    shared.mkdir()
    moved = Root(shared / "n")
    os.rename(root.path, moved.path)
    os.chmod(shared, 0o777)
    _run_refused(tmp_path, moved, f"{shared}, above the node root", "without the sticky bit")
    # The sticky bit (as /tmp has) keeps others from renaming what is ours.
    os.chmod(shared, 0o1777)
    moved.check()


def test_owner_refuses_a_root_others_can_write(root: Root, tmp_path: Path) -> None:
    """The owner trusts the CA it reads there: it refuses too, before any call."""
    os.chmod(root.data.path, 0o777)
    before = _snapshot(tmp_path)
    result = _metropolis(
        "owner", "--root", str(root.path), "--owner-key", str(tmp_path / "owner.pem"), "nodes"
    )
    _assert_refused(result, f"{root.data.path} is writable by group or others", "chmod 700")
    assert _snapshot(tmp_path) == before


def test_bootstrap_and_register_refuse_a_root_others_can_write(tmp_path: Path) -> None:
    bare = tmp_path / "n"
    bare.mkdir()
    os.chmod(bare, 0o777)
    before = _snapshot(tmp_path)
    _assert_refused(_metropolis("node", *bootstrap_args(tmp_path)), f"{bare} is writable")
    register = ["node", "register", "--root", str(bare), "--address", "127.0.0.1"]
    register += ["--ticket", "00", "--cluster", str(tmp_path / "cluster.pb"), "--insecure-seal"]
    _assert_refused(_metropolis(*register), f"{bare} is writable")
    assert _snapshot(tmp_path) == before  # no owner key written either


# -- finding 5: damaged files -------------------------------------------------


def _cut(path: Path, size: int) -> None:
    with path.open("r+b") as f:
        f.truncate(size)


def _flip(path: Path, at: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x20
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        ("roles cut to 1 byte", "cut short inside its header"),
        ("roles cut in half", "cut short"),
        ("roles with a flipped byte", "its content does not match its SHA-256"),
        ("directory cut to 3 bytes", "cut short inside its header"),
        ("directory with a flipped byte", "its content does not match its SHA-256"),
        ("settings with a flipped byte", "its content does not match its SHA-256"),
        ("sealed configuration with a flipped byte", "its content does not match its SHA-256"),
        ("node certificate with a flipped byte", ""),
    ],
)
def test_run_refuses_a_damaged_file(root: Root, tmp_path: Path, damage: str, reason: str) -> None:
    what = damage.split(" ")[0]
    path = {
        "roles": disk.roles_path(root),
        "directory": root.esp.cluster_directory,
        "settings": disk.settings_path(root),
        "sealed": root.esp.sealed_configuration.path,
        "node": root.data.node_credentials.certificate,
    }[what]
    size = path.stat().st_size
    if "cut to" in damage:
        _cut(path, int(damage.split(" ")[-2]))
    elif "half" in damage:
        _cut(path, size // 2)
    else:
        _flip(path, size - 40)  # in the payload; the header is checked below
    # The credentials (PEM) have no header: their folder is named.
    named = root.data.node_credentials.path if what == "node" else path
    _run_refused(tmp_path, root, f"{named} is damaged: {reason}")


def test_half_a_roles_file_is_not_taken_for_fewer_roles(tmp_path: Path) -> None:
    root = Root(tmp_path / "n")
    root.create()
    roles = NodeRoles(consensus_member=NodeRolesConsensusMember(ca_certificate=b"c" * 300))
    disk.save_roles(root, roles)
    path = disk.roles_path(root)
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CorruptFile, match=r"roles\.pb is damaged: cut short"):
        disk.read_roles(root)


def test_every_cut_and_every_changed_byte_of_a_checked_file_is_caught(tmp_path: Path) -> None:
    path = tmp_path / "f"
    payload = bytes(NodeRoles(consensus_member=NodeRolesConsensusMember(peer_certificate=b"p")))
    write_checked(path, "roles", payload)
    raw = path.read_bytes()
    assert raw == checked_content("roles", payload)
    assert read_checked(path, "roles") == payload
    for size in range(len(raw)):
        path.write_bytes(raw[:size])
        with pytest.raises(CorruptFile):
            read_checked(path, "roles")
    for at in range(len(raw)):
        for change in (0x01, 0x20, 0xFF):
            changed = bytearray(raw)
            changed[at] ^= change
            path.write_bytes(bytes(changed))
            with pytest.raises(CorruptFile, match=f"{path} is damaged: "):
                read_checked(path, "roles")
    path.write_bytes(raw + b"\x00")
    with pytest.raises(CorruptFile, match="1 bytes more"):
        read_checked(path, "roles")


def test_a_file_of_another_kind_or_without_header_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "roles.pb"
    write_checked(path, "cluster-directory", b"")
    with pytest.raises(CorruptFile, match="holds a 'cluster-directory' file, not 'roles'"):
        read_checked(path, "roles")
    # As the code before the header wrote it: refused, not read unchecked.
    path.write_bytes(b"")
    with pytest.raises(CorruptFile, match="empty"):
        read_checked(path, "roles")
    path.write_bytes(bytes(NodeRoles(consensus_member=NodeRolesConsensusMember())))
    with pytest.raises(CorruptFile, match="no METROPOLIS-FILE header"):
        read_checked(path, "roles")


def test_the_check_refuses_nothing_in_a_fresh_layout(tmp_path: Path) -> None:
    root = Root(tmp_path / "n")
    root.create()
    root.check()
    os.chmod(root.data.path, 0o777)
    with pytest.raises(UnsafeRootError, match="chmod 700"):
        root.check()
    # Refused by create as well, and left as it was: no mode is fixed silently.
    with pytest.raises(UnsafeRootError):
        root.create()
    assert stat.S_IMODE(root.data.path.stat().st_mode) == 0o777
