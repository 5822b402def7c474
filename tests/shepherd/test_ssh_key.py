"""The Shepherd's SSH key: generated once, persisted 0600, reused, bad files refused."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from shepherd.ssh_key import SSHKeyError, load_or_create_ssh_key, load_ssh_key


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
    path.write_bytes(
        original.private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    assert load_ssh_key(path).authorized_key == original.authorized_key


def test_garbage_file_is_refused_and_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "id_ed25519"
    path.write_bytes(b"this is not a key\n")
    with pytest.raises(SSHKeyError, match=rf"{path}: not a valid unencrypted private key"):
        load_or_create_ssh_key(path)
    assert path.read_bytes() == b"this is not a key\n"


def test_non_ed25519_key_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "id_rsa"
    key = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        )
    )
    with pytest.raises(SSHKeyError, match="want Ed25519"):
        load_ssh_key(path)


def test_unwritable_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SSHKeyError, match="cannot create SSH key"):
        load_or_create_ssh_key(tmp_path / "missing-dir" / "id_ed25519")
