"""Local storage: layout permissions, atomic writes, insecure sealing."""

from __future__ import annotations

import logging
import os
import pwd
import stat
from pathlib import Path

import pytest

from common.durable import atomic_write
from metropolis.localstorage import (
    CorruptFile,
    InsecureSealError,
    LocalStorageError,
    Root,
    write_checked,
)
from metropolis.proto.common import (
    ClusterDirectory,
    ClusterDirectoryNode,
    ClusterDirectoryNodeAddress,
)
from metropolis.proto.private import SealedConfiguration


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_layout_created_private(tmp_path: Path) -> None:
    root = Root(tmp_path / "node")
    # A pre-existing, too-open directory is tightened, not trusted.
    (tmp_path / "node" / "data").mkdir(parents=True, mode=0o755)
    os.chmod(tmp_path / "node" / "data", 0o755)
    root.create()
    root.create()  # idempotent

    for private in (
        root.data.path,
        root.data.etcd.path,
        root.data.etcd.peer_pki.path,
        root.data.node_credentials.path,
        root.ephemeral.path,
        root.ephemeral.consensus,
    ):
        assert _mode(private) == 0o700, private
    assert root.esp.path.is_dir()
    assert root.data.node_credentials.path == tmp_path / "node/data/node/credentials"
    assert root.esp.cluster_directory == tmp_path / "node/esp/cluster_directory.pb"


def test_atomic_write_replaces_with_mode(tmp_path: Path) -> None:
    target = tmp_path / "f"
    target.write_bytes(b"old")
    os.chmod(target, 0o644)
    atomic_write(target, b"new")
    assert target.read_bytes() == b"new"
    assert _mode(target) == 0o600
    atomic_write(target, b"public", mode=0o644)
    assert _mode(target) == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["f"]


def test_atomic_write_failure_keeps_old_content(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "f"
    target.write_bytes(b"old")

    def full_disk(fd: int) -> None:
        raise OSError(28, "No space left on device")

    # fsync is where a full or failing disk reports lost data.
    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space"):
        atomic_write(target, b"new")
    monkeypatch.undo()
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f"]


def test_atomic_write_syncs_data_before_rename_and_directory_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the file fsync a crash can leave an empty file under the new
    name; without the directory fsync it can undo the rename."""
    target = tmp_path / "f"
    steps: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
        steps.append("fsync dir" if is_dir else "fsync file")
        real_fsync(fd)

    def replace(src: str | Path, dst: str | Path) -> None:
        steps.append("rename")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    atomic_write(target, b"data")
    assert steps == ["fsync file", "rename", "fsync dir"]
    assert target.read_bytes() == b"data"


def test_atomic_write_into_missing_directory_fails_cleanly(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        atomic_write(tmp_path / "missing" / "f", b"x")


def test_seal_requires_explicit_insecure_mode(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = Root(tmp_path)
    root.create()
    sealed = root.esp.sealed_configuration
    config = SealedConfiguration(node_unlock_key=b"u" * 32, join_key=b"j" * 32, cluster_ca=b"ca")

    with pytest.raises(InsecureSealError):
        sealed.seal(config, insecure=False)
    assert not sealed.path.exists()

    with caplog.at_level(logging.WARNING, logger="metropolis.localstorage"):
        sealed.seal(config, insecure=True)
    assert "INSECURELY" in caplog.text
    assert _mode(sealed.path) == 0o600

    with pytest.raises(InsecureSealError):
        sealed.unseal(insecure=False)
    assert sealed.unseal(insecure=True) == config


def test_unseal_rejects_foreign_file(tmp_path: Path) -> None:
    root = Root(tmp_path)
    root.create()
    sealed = root.esp.sealed_configuration
    with pytest.raises(LocalStorageError, match="cannot read"):
        sealed.unseal(insecure=True)
    sealed.path.write_bytes(b"\x0a\x01a")
    with pytest.raises(CorruptFile, match="no METROPOLIS-FILE header"):
        sealed.unseal(insecure=True)
    write_checked(sealed.path, sealed.KIND, b"\x0a\x01a")
    with pytest.raises(LocalStorageError, match="not an insecurely sealed"):
        sealed.unseal(insecure=True)


def test_cluster_directory_round_trip(tmp_path: Path) -> None:
    root = Root(tmp_path)
    root.create()
    with pytest.raises(LocalStorageError, match="cannot read"):
        root.esp.read_cluster_directory()
    directory = ClusterDirectory(
        nodes=[
            ClusterDirectoryNode(
                public_key=b"k" * 32, addresses=[ClusterDirectoryNodeAddress(host="10.0.0.1")]
            )
        ]
    )
    root.esp.write_cluster_directory(directory)
    assert _mode(root.esp.cluster_directory) == 0o644
    assert root.esp.read_cluster_directory() == directory


def _nobody() -> pwd.struct_passwd:
    if os.geteuid() != 0:
        pytest.skip("needs root to give files to another user")
    return pwd.getpwnam("nobody")


def test_root_writable_by_others_is_refused(tmp_path: Path) -> None:
    root = Root(tmp_path / "node")
    root.path.mkdir()
    for mode in (0o777, 0o775, 0o1777):
        os.chmod(root.path, mode)
        with pytest.raises(LocalStorageError, match="writable by group or others"):
            root.create()
    assert list(root.path.iterdir()) == []


def test_symlinks_under_the_root_are_refused_and_not_followed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o755)
    os.chmod(elsewhere, 0o755)
    root = Root(tmp_path / "node")
    root.path.mkdir()
    (root.path / "data").symlink_to(elsewhere)
    with pytest.raises(LocalStorageError, match="data is a symbolic link"):
        root.create()
    assert _mode(elsewhere) == 0o755 and list(elsewhere.iterdir()) == []

    # Deeper down, and a file rather than a folder.
    (root.path / "data").unlink()
    root.create()
    (root.esp.path / "cluster_directory.pb").symlink_to(elsewhere / "secret")
    with pytest.raises(LocalStorageError, match=r"cluster_directory\.pb is a symbolic link"):
        root.create()
    with pytest.raises(LocalStorageError, match="symbolic link"):
        root.esp.read_cluster_directory()


def test_root_or_folder_of_another_user_is_refused(tmp_path: Path) -> None:
    nobody = _nobody()
    root = Root(tmp_path / "node")
    root.create()
    os.chown(root.data.etcd.path, nobody.pw_uid, nobody.pw_gid)
    with pytest.raises(LocalStorageError, match=f"etcd is owned by uid {nobody.pw_uid}"):
        root.create()
    os.chown(root.data.etcd.path, 0, 0)
    root.create()
    os.chown(root.path, nobody.pw_uid, nobody.pw_gid)
    with pytest.raises(LocalStorageError, match=f"node is owned by uid {nobody.pw_uid}"):
        root.create()


def test_sealed_configuration_is_not_read_through_a_symlink(tmp_path: Path) -> None:
    root = Root(tmp_path / "node")
    root.create()
    target = tmp_path / "planted"
    target.write_bytes(b"METROPOLIS-INSECURE-SEAL-V1\n")
    root.esp.sealed_configuration.path.symlink_to(target)
    with pytest.raises(LocalStorageError, match="symbolic link"):
        root.esp.sealed_configuration.unseal(insecure=True)
