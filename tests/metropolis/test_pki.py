"""PKI: CA and leaf issuance, verification, CRLs and encodings."""

from __future__ import annotations

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.x509.oid import ExtendedKeyUsageOID

from metropolis import pki

#: A CA key and its self-signed certificate.
CA = tuple[Ed25519PrivateKey, x509.Certificate]


@pytest.fixture
def ca() -> CA:
    key = pki.generate_key()
    return key, pki.new_ca(key, "Test CA")


def test_ca_is_self_signed_ca(ca: CA) -> None:
    _, cert = ca
    pki.verify_signed_by(cert, cert)
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    usage = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.key_cert_sign and usage.crl_sign
    assert cert.not_valid_after_utc == pki.UNKNOWN_NOT_AFTER


@pytest.mark.parametrize(
    ("usage", "ekus"),
    [
        (pki.Usage.SERVER, {ExtendedKeyUsageOID.SERVER_AUTH}),
        (pki.Usage.CLIENT, {ExtendedKeyUsageOID.CLIENT_AUTH}),
        (pki.Usage.PEER, {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}),
    ],
)
def test_leaf_usages_and_sans(
    ca: CA,
    usage: pki.Usage,
    ekus: set[x509.ObjectIdentifier],
) -> None:
    ca_key, ca_cert = ca
    leaf_key = pki.generate_key()
    cert = pki.issue_certificate(
        ca_key,
        ca_cert,
        leaf_key.public_key(),
        "leaf",
        usage,
        dns_names=["node.example"],
        ip_addresses=["127.0.0.1"],
    )
    pki.verify_signed_by(cert, ca_cert)
    assert set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == ekus
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["node.example"]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert pki.public_key_bytes(pki.certificate_public_key(cert)) == pki.public_key_bytes(leaf_key)


def test_serials_are_random(ca: CA) -> None:
    ca_key, ca_cert = ca
    pub = pki.generate_key().public_key()
    serials = {
        pki.issue_certificate(ca_key, ca_cert, pub, "x", pki.Usage.PEER).serial_number
        for _ in range(20)
    }
    assert len(serials) == 20


def test_foreign_ca_does_not_verify(ca: CA) -> None:
    ca_key, ca_cert = ca
    cert = pki.issue_certificate(
        ca_key, ca_cert, pki.generate_key().public_key(), "x", pki.Usage.CLIENT
    )
    other_key = pki.generate_key()
    # Same subject name, different key: only the signature check can tell.
    impostor = pki.new_ca(other_key, "Test CA")
    with pytest.raises(pki.PKIError, match="not issued by"):
        pki.verify_signed_by(cert, impostor)


def test_leaf_is_not_a_ca(ca: CA) -> None:
    ca_key, ca_cert = ca
    leaf_key = pki.generate_key()
    leaf = pki.issue_certificate(ca_key, ca_cert, leaf_key.public_key(), "x", pki.Usage.SERVER)
    with pytest.raises(pki.PKIError, match="not a CA"):
        pki.issue_certificate(leaf_key, leaf, leaf_key.public_key(), "y", pki.Usage.SERVER)


def test_issue_rejects_mismatched_ca_key(
    ca: CA,
) -> None:
    _, ca_cert = ca
    with pytest.raises(pki.PKIError, match="does not match"):
        pki.issue_certificate(
            pki.generate_key(), ca_cert, pki.generate_key().public_key(), "x", pki.Usage.PEER
        )


def test_bad_ip_address_is_rejected(ca: CA) -> None:
    ca_key, ca_cert = ca
    with pytest.raises(pki.PKIError, match="bad IP"):
        pki.issue_certificate(
            ca_key,
            ca_cert,
            pki.generate_key().public_key(),
            "x",
            pki.Usage.PEER,
            ip_addresses=["not-an-ip"],
        )


def test_crl_revoke_accumulates_and_numbers(
    ca: CA,
) -> None:
    ca_key, ca_cert = ca
    certs = [
        pki.issue_certificate(
            ca_key, ca_cert, pki.generate_key().public_key(), f"n{i}", pki.Usage.PEER
        )
        for i in range(3)
    ]
    crl = pki.new_crl(ca_key, ca_cert)
    pki.verify_crl(crl, ca_cert)
    assert not any(pki.is_revoked(crl, c) for c in certs)

    crl = pki.revoke(crl, ca_key, ca_cert, [certs[0].serial_number])
    crl = pki.revoke(crl, ca_key, ca_cert, [certs[1].serial_number])
    pki.verify_crl(crl, ca_cert)
    assert [pki.is_revoked(crl, c) for c in certs] == [True, True, False]
    assert crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number == 3


def test_revoke_refuses_foreign_crl(ca: CA) -> None:
    ca_key, ca_cert = ca
    other_key = pki.generate_key()
    foreign = pki.new_crl(other_key, pki.new_ca(other_key, "Test CA"))
    with pytest.raises(pki.PKIError, match="not signed"):
        pki.revoke(foreign, ca_key, ca_cert, [1])


@pytest.mark.parametrize("encoding", [pki.Encoding.PEM, pki.Encoding.DER])
def test_round_trips(ca: CA, encoding: pki.Encoding) -> None:
    ca_key, ca_cert = ca
    crl = pki.new_crl(ca_key, ca_cert, [42])
    assert pki.decode_certificate(pki.encode_certificate(ca_cert, encoding)) == ca_cert
    assert pki.decode_crl(pki.encode_crl(crl, encoding)) == crl
    decoded = pki.decode_private_key(pki.encode_private_key(ca_key, encoding))
    assert pki.public_key_bytes(decoded) == pki.public_key_bytes(ca_key)


@pytest.mark.parametrize("decode", [pki.decode_certificate, pki.decode_crl, pki.decode_private_key])
@pytest.mark.parametrize("data", [b"", b"garbage", b"-----BEGIN CERTIFICATE-----\nnope\n"])
def test_decoders_reject_garbage(decode: object, data: bytes) -> None:
    assert callable(decode)
    with pytest.raises(pki.PKIError):
        decode(data)


def test_decode_public_key_length() -> None:
    with pytest.raises(pki.PKIError, match="32 bytes"):
        pki.decode_public_key(b"short")
    raw = pki.public_key_bytes(pki.generate_key())
    assert pki.public_key_bytes(pki.decode_public_key(raw)) == raw
