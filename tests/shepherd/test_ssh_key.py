"""The Shepherd's SSH key: generated once, persisted 0600, reused, bad files refused."""

from __future__ import annotations

import os
import pwd
import stat
import threading
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from shepherd.ssh_key import SSHKeyError, load_or_create_ssh_key, load_ssh_key


def _write_private(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    path.chmod(0o600)


def test_generated_once_then_reused(tmp_path: Path) -> None:
    path = tmp_path / "id_ed25519"
    first = load_or_create_ssh_key(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_bytes().startswith(b"-----BEGIN OPENSSH PRIVATE KEY-----")
    second = load_or_create_ssh_key(path)
    assert second.authorized_key == first.authorized_key
    assert first.authorized_key.startswith("ssh-ed25519 ")
    assert [p.name for p in tmp_path.iterdir()] == ["id_ed25519"]


def test_pkcs8_pem_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "key.pem"
    original = load_or_create_ssh_key(tmp_path / "k")
    _write_private(
        path,
        original.private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )
    assert load_ssh_key(path).authorized_key == original.authorized_key


def test_garbage_file_is_refused_and_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "id_ed25519"
    _write_private(path, b"this is not a key\n")
    with pytest.raises(SSHKeyError, match=rf"{path}: not a valid unencrypted private key"):
        load_or_create_ssh_key(path)
    assert path.read_bytes() == b"this is not a key\n"


def test_non_ed25519_key_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "id_rsa"
    key = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    _write_private(
        path,
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        ),
    )
    with pytest.raises(SSHKeyError, match="want Ed25519"):
        load_ssh_key(path)


def test_unwritable_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SSHKeyError, match="cannot create SSH key"):
        load_or_create_ssh_key(tmp_path / "missing-dir" / "id_ed25519")


def test_symlink_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    load_or_create_ssh_key(real)
    link = tmp_path / "id_ed25519"
    link.symlink_to(real)
    with pytest.raises(SSHKeyError, match="symbolic link"):
        load_or_create_ssh_key(link)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    with pytest.raises(SSHKeyError, match="symbolic link"):
        load_or_create_ssh_key(dangling)
    assert not (tmp_path / "nowhere").exists()  # not created through the link


def test_file_of_another_user_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give a file to another user")
    nobody = pwd.getpwnam("nobody")
    path = tmp_path / "id_ed25519"
    load_or_create_ssh_key(path)
    os.chown(path, nobody.pw_uid, nobody.pw_gid)
    with pytest.raises(SSHKeyError, match=f"owned by uid {nobody.pw_uid}, not by us"):
        load_or_create_ssh_key(path)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o700])
def test_loose_mode_is_refused(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "id_ed25519"
    load_or_create_ssh_key(path)
    path.chmod(mode)
    if mode & 0o077:
        with pytest.raises(SSHKeyError, match=f"mode {mode:04o}"):
            load_ssh_key(path)
    else:
        load_ssh_key(path)


def test_concurrent_creation_ends_with_one_key(tmp_path: Path) -> None:
    """Processes starting at once must agree on one key (no last-writer-wins)."""
    for attempt in range(20):
        path = tmp_path / f"id_{attempt}"
        barrier = threading.Barrier(6)
        keys: list[str] = []

        def create(path: Path, barrier: threading.Barrier, keys: list[str]) -> None:
            barrier.wait()
            keys.append(load_or_create_ssh_key(path).authorized_key)

        threads = [threading.Thread(target=create, args=(path, barrier, keys)) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(set(keys)) == 1, attempt
        assert load_ssh_key(path).authorized_key == keys[0]
    assert all(not p.name.startswith(".") for p in tmp_path.iterdir())  # no temp files left
