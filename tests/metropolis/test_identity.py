"""Node identity: node IDs, credential validation, save and load."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from metropolis import pki
from metropolis.identity import CredentialsError, NodeCredentials, node_id
from metropolis.localstorage import PKIDirectory


def _credentials(
    key: Ed25519PrivateKey | None = None,
) -> tuple[NodeCredentials, Ed25519PrivateKey]:
    ca_key = pki.generate_key()
    ca = pki.new_ca(ca_key, "cluster CA")
    key = key or pki.generate_key()
    cert = pki.issue_certificate(
        ca_key, ca, key.public_key(), node_id(key.public_key()), pki.Usage.PEER
    )
    return NodeCredentials(key, cert, ca), ca_key


def test_node_id_is_prefix_and_hex_of_first_16_bytes() -> None:
    raw = bytes(range(32))
    assert node_id(raw) == "metropolis-000102030405060708090a0b0c0d0e0f"
    key = pki.generate_key()
    assert node_id(key.public_key()) == "metropolis-" + pki.public_key_bytes(key)[:16].hex()
    with pytest.raises(ValueError, match="32 bytes"):
        node_id(b"\x00" * 31)


def test_save_and_load_owner_only(tmp_path: Path) -> None:
    creds, _ = _credentials()
    directory = PKIDirectory(tmp_path / "credentials")
    creds.save(directory)

    assert stat.S_IMODE(directory.path.stat().st_mode) == 0o700
    for path in directory.files():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    loaded = NodeCredentials.load(directory)
    assert loaded.certificate == creds.certificate
    assert loaded.ca_certificate == creds.ca_certificate
    assert loaded.public_key == creds.public_key
    assert loaded.node_id == creds.node_id
    # No temp files are left behind by the atomic writes.
    assert sorted(p.name for p in directory.path.iterdir()) == ["ca.pem", "cert.pem", "key.pem"]


def test_key_must_match_certificate() -> None:
    creds, _ = _credentials()
    with pytest.raises(CredentialsError, match="does not match"):
        NodeCredentials(pki.generate_key(), creds.certificate, creds.ca_certificate)


def test_certificate_must_be_from_the_ca() -> None:
    creds, _ = _credentials()
    other_ca_key = pki.generate_key()
    with pytest.raises(CredentialsError, match="does not chain"):
        NodeCredentials(
            creds.private_key, creds.certificate, pki.new_ca(other_ca_key, "cluster CA")
        )


def test_certificate_must_name_the_node() -> None:
    creds, ca_key = _credentials()
    wrong_name = pki.issue_certificate(
        ca_key, creds.ca_certificate, creds.private_key.public_key(), "someone", pki.Usage.PEER
    )
    with pytest.raises(CredentialsError, match="expected CN=metropolis-"):
        NodeCredentials(creds.private_key, wrong_name, creds.ca_certificate)


def _snapshot(directory: PKIDirectory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.path.iterdir()}


@pytest.mark.parametrize(
    ("victim", "content", "message"),
    [
        ("key", b"not a key", "private key: not a valid"),
        ("certificate", b"\x30\x03\x02\x01\x00", "node certificate: not a valid"),
        ("ca_certificate", b"", "CA certificate: not a valid"),
    ],
)
def test_load_corrupt_file_is_clear_and_touches_nothing(
    tmp_path: Path, victim: str, content: bytes, message: str
) -> None:
    creds, _ = _credentials()
    directory = PKIDirectory(tmp_path)
    creds.save(directory)
    path: Path = getattr(directory, victim)
    path.write_bytes(content)
    before = _snapshot(directory)

    with pytest.raises(CredentialsError, match=message):
        NodeCredentials.load(directory)
    assert _snapshot(directory) == before


def test_load_mismatched_key_or_wrong_ca(tmp_path: Path) -> None:
    creds, _ = _credentials()
    other, _ = _credentials()
    directory = PKIDirectory(tmp_path)
    creds.save(directory)

    directory.key.write_bytes(pki.encode_private_key(other.private_key))
    before = _snapshot(directory)
    with pytest.raises(CredentialsError, match="does not match"):
        NodeCredentials.load(directory)
    assert _snapshot(directory) == before

    creds.save(directory)
    directory.ca_certificate.write_bytes(pki.encode_certificate(other.ca_certificate))
    before = _snapshot(directory)
    with pytest.raises(CredentialsError, match="does not chain"):
        NodeCredentials.load(directory)
    assert _snapshot(directory) == before


def test_load_missing_file_names_it(tmp_path: Path) -> None:
    creds, _ = _credentials()
    directory = PKIDirectory(tmp_path)
    creds.save(directory)
    directory.certificate.unlink()
    with pytest.raises(CredentialsError, match=r"cert\.pem"):
        NodeCredentials.load(directory)


def test_der_and_pem_both_accepted() -> None:
    creds, _ = _credentials()
    loaded = NodeCredentials.from_bytes(
        pki.encode_private_key(creds.private_key, pki.Encoding.DER),
        pki.encode_certificate(creds.certificate, pki.Encoding.DER),
        pki.encode_certificate(creds.ca_certificate, pki.Encoding.PEM),
    )
    assert isinstance(loaded.certificate, x509.Certificate)
    assert loaded.node_id == creds.node_id
