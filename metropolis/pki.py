"""Ed25519 certificate authorities, leaf certificates and revocation lists.

Everything in the cluster that speaks TLS (etcd peers, the curator's RPC
API, node credentials) uses certificates made here. All keys are Ed25519, so
signatures use no separate hash algorithm (``cryptography`` wants ``None``).

Certificates do not expire in practice: they are valid until the end of
9999, the RFC 5280 value for "no well-defined expiration date". Revocation
is what ends a certificate's life, through a CRL signed by the issuing CA.

Serial numbers are random (159 bits, positive) so that two CAs, or two runs
of one CA, never hand out colliding serials; a CRL names certificates only by
serial, so a collision would revoke an innocent certificate.

All functions are pure (no I/O). Bad input raises :class:`PKIError` with a
message saying what is wrong; nothing here retries or logs.
"""

from __future__ import annotations

import datetime
import enum
import ipaddress
from collections.abc import Callable, Iterable
from typing import TypeVar

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from metropolis.errors import MetropolisError

_T = TypeVar("_T")

__all__ = [
    "UNKNOWN_NOT_AFTER",
    "Encoding",
    "PKIError",
    "Usage",
    "certificate_public_key",
    "crl_number",
    "decode_certificate",
    "decode_crl",
    "decode_private_key",
    "decode_public_key",
    "encode_certificate",
    "encode_crl",
    "encode_private_key",
    "generate_key",
    "is_revoked",
    "issue_certificate",
    "new_ca",
    "new_crl",
    "public_key_bytes",
    "revoke",
    "verify_crl",
    "verify_signed_by",
]

#: Re-exported so callers choose ``Encoding.PEM`` / ``Encoding.DER`` without
#: importing ``cryptography`` themselves.
Encoding = serialization.Encoding

#: RFC 5280 4.1.2.5: "no well-defined expiration date".
UNKNOWN_NOT_AFTER = datetime.datetime(9999, 12, 31, 23, 59, 59, tzinfo=datetime.UTC)

# Clocks of freshly booted machines are often a little behind; a certificate
# issued "now" by one node must already be valid on another.
_BACKDATE = datetime.timedelta(minutes=5)


class PKIError(MetropolisError):
    """Certificate material is malformed, of the wrong kind, or does not verify."""


class Usage(enum.Enum):
    """What a certificate is for. Decides its key usage extensions."""

    CA = "ca"
    #: TLS server only.
    SERVER = "server"
    #: TLS client only.
    CLIENT = "client"
    #: Both ends of a mutual-TLS link (etcd peers dial each other).
    PEER = "peer"


def generate_key() -> Ed25519PrivateKey:
    """Return a new random Ed25519 private key."""
    return Ed25519PrivateKey.generate()


def public_key_bytes(key: Ed25519PublicKey | Ed25519PrivateKey) -> bytes:
    """Return the raw 32-byte form of an Ed25519 public key (or a private key's public half)."""
    if isinstance(key, Ed25519PrivateKey):
        key = key.public_key()
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def decode_public_key(raw: bytes) -> Ed25519PublicKey:
    """Parse a raw 32-byte Ed25519 public key."""
    if len(raw) != 32:
        raise PKIError(f"an Ed25519 public key is 32 bytes, got {len(raw)}")
    return Ed25519PublicKey.from_public_bytes(raw)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _random_serial() -> int:
    # x509.random_serial_number() gives 159 random bits, always positive.
    return x509.random_serial_number()


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key: Ed25519PublicKey, usage: Usage
) -> x509.CertificateBuilder:
    """What every certificate we issue has in common: a random serial,
    backdated validity without end, basic constraints and key usage."""
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(_random_serial())
        .not_valid_before(_now() - _BACKDATE)
        .not_valid_after(UNKNOWN_NOT_AFTER)
        .add_extension(x509.BasicConstraints(ca=usage is Usage.CA, path_length=None), critical=True)
        .add_extension(_key_usage(usage), critical=True)
    )


def new_ca(key: Ed25519PrivateKey, common_name: str) -> x509.Certificate:
    """Return a self-signed CA certificate for ``key``."""
    public = key.public_key()
    builder = _builder(_name(common_name), _name(common_name), public, Usage.CA).add_extension(
        x509.SubjectKeyIdentifier.from_public_key(public), critical=False
    )
    return builder.sign(key, None)


def issue_certificate(
    ca_key: Ed25519PrivateKey,
    ca_certificate: x509.Certificate,
    public_key: Ed25519PublicKey,
    common_name: str,
    usage: Usage,
    *,
    dns_names: Iterable[str] = (),
    ip_addresses: Iterable[str] = (),
) -> x509.Certificate:
    """Issue a leaf certificate for ``public_key``, signed by the CA.

    ``dns_names`` and ``ip_addresses`` become subject alternative names; TLS
    peers match the address they dialled against them (etcd also checks the
    address a peer connects *from* against the client certificate's SANs).

    Raises :class:`PKIError` if ``ca_key`` is not the key of
    ``ca_certificate``, if that certificate is not a CA, or if an IP address
    does not parse. Issuing a CA this way is refused: use :func:`new_ca`.
    """
    if usage is Usage.CA:
        raise PKIError("issue_certificate makes leaf certificates; use new_ca for a CA")
    _check_is_ca(ca_certificate)
    if public_key_bytes(ca_key) != public_key_bytes(certificate_public_key(ca_certificate)):
        raise PKIError("CA private key does not match the CA certificate")
    try:
        ips = [ipaddress.ip_address(ip) for ip in ip_addresses]
    except ValueError as e:
        raise PKIError(f"bad IP address for certificate: {e}") from e
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
    sans += [x509.IPAddress(ip) for ip in ips]

    builder = (
        _builder(_name(common_name), ca_certificate.subject, public_key, usage)
        .add_extension(_extended_key_usage(usage), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(ca_key, None)


def _key_usage(usage: Usage) -> x509.KeyUsage:
    is_ca = usage is Usage.CA
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,  # meaningless for Ed25519, which only signs
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=is_ca,
        crl_sign=is_ca,
        encipher_only=False,
        decipher_only=False,
    )


def _extended_key_usage(usage: Usage) -> x509.ExtendedKeyUsage:
    oids = {
        Usage.SERVER: [ExtendedKeyUsageOID.SERVER_AUTH],
        Usage.CLIENT: [ExtendedKeyUsageOID.CLIENT_AUTH],
        Usage.PEER: [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
    }[usage]
    return x509.ExtendedKeyUsage(oids)


def certificate_public_key(certificate: x509.Certificate) -> Ed25519PublicKey:
    """Return the Ed25519 key a certificate certifies; :class:`PKIError` for any other kind."""
    key = certificate.public_key()
    if not isinstance(key, Ed25519PublicKey):
        raise PKIError(f"certificate {certificate.subject.rfc4514_string()} has a non-Ed25519 key")
    return key


def _check_is_ca(certificate: x509.Certificate) -> None:
    try:
        constraints = certificate.extensions.get_extension_for_class(x509.BasicConstraints)
    except x509.ExtensionNotFound:
        raise PKIError(
            f"{certificate.subject.rfc4514_string()} is not a CA (no basic constraints)"
        ) from None
    if not constraints.value.ca:
        raise PKIError(f"{certificate.subject.rfc4514_string()} is not a CA certificate")


def verify_signed_by(certificate: x509.Certificate, ca_certificate: x509.Certificate) -> None:
    """Check that ``ca_certificate`` is a CA and directly issued ``certificate``.

    Raises :class:`PKIError` naming what failed: issuer name, signature or
    the CA's own constraints.
    """
    _check_is_ca(ca_certificate)
    try:
        certificate.verify_directly_issued_by(ca_certificate)
    except (ValueError, TypeError, InvalidSignature) as e:
        detail = str(e) or "signature does not verify"
        raise PKIError(
            f"{certificate.subject.rfc4514_string()} was not issued by "
            f"{ca_certificate.subject.rfc4514_string()}: {detail}"
        ) from e


# --- revocation ---------------------------------------------------------------


def new_crl(
    ca_key: Ed25519PrivateKey,
    ca_certificate: x509.Certificate,
    revoked_serials: Iterable[int] = (),
    *,
    number: int = 1,
) -> x509.CertificateRevocationList:
    """Return a CRL signed by the CA listing ``revoked_serials``.

    ``number`` is the CRL number extension; :func:`revoke` increments it so a
    reader can tell a newer list from an older one.
    """
    _check_is_ca(ca_certificate)
    now = _now()
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca_certificate.subject)
        .last_update(now - _BACKDATE)
        .next_update(UNKNOWN_NOT_AFTER)
        .add_extension(x509.CRLNumber(number), critical=False)
    )
    for serial in sorted(set(revoked_serials)):
        entry = x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(now).build()
        builder = builder.add_revoked_certificate(entry)
    return builder.sign(ca_key, None)


def revoke(
    crl: x509.CertificateRevocationList,
    ca_key: Ed25519PrivateKey,
    ca_certificate: x509.Certificate,
    serials: Iterable[int],
) -> x509.CertificateRevocationList:
    """Return a new CRL: everything ``crl`` revoked, plus ``serials``, with the next number.

    Raises :class:`PKIError` if ``crl`` was not signed by this CA (extending
    a forged list would launder it).
    """
    verify_crl(crl, ca_certificate)
    serials = set(serials) | {entry.serial_number for entry in crl}
    return new_crl(ca_key, ca_certificate, serials, number=crl_number(crl) + 1)


def crl_number(crl: x509.CertificateRevocationList) -> int:
    """The CRL number extension (0 if absent): higher means newer, for one CA."""
    try:
        return crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number
    except x509.ExtensionNotFound:
        return 0


def verify_crl(crl: x509.CertificateRevocationList, ca_certificate: x509.Certificate) -> None:
    """Raise :class:`PKIError` unless ``crl`` is signed by ``ca_certificate``."""
    if crl.issuer != ca_certificate.subject or not crl.is_signature_valid(
        certificate_public_key(ca_certificate)
    ):
        raise PKIError(f"CRL is not signed by {ca_certificate.subject.rfc4514_string()}")


def is_revoked(crl: x509.CertificateRevocationList, certificate: x509.Certificate) -> bool:
    """Whether ``crl`` lists ``certificate``'s serial. Does not check the CRL's signature."""
    return crl.get_revoked_certificate_by_serial_number(certificate.serial_number) is not None


# --- encoding -----------------------------------------------------------------
#
# Decoders accept PEM or DER and tell them apart by the PEM armour, so callers
# never have to know which form a file or an etcd value holds.


def _is_pem(data: bytes) -> bool:
    return data.lstrip().startswith(b"-----BEGIN ")


def encode_certificate(certificate: x509.Certificate, encoding: Encoding = Encoding.PEM) -> bytes:
    """Serialise a certificate as PEM (default) or DER."""
    return certificate.public_bytes(encoding)


def _decode(data: bytes, pem: Callable[[bytes], _T], der: Callable[[bytes], _T], what: str) -> _T:
    try:
        return pem(data) if _is_pem(data) else der(data)
    except ValueError as e:
        raise PKIError(f"not a valid {what}: {e}") from e


def decode_certificate(data: bytes) -> x509.Certificate:
    """Parse a PEM or DER certificate. Raises :class:`PKIError` on garbage."""
    return _decode(
        data, x509.load_pem_x509_certificate, x509.load_der_x509_certificate, "certificate"
    )


def encode_crl(crl: x509.CertificateRevocationList, encoding: Encoding = Encoding.PEM) -> bytes:
    """Serialise a CRL as PEM (default) or DER."""
    return crl.public_bytes(encoding)


def decode_crl(data: bytes) -> x509.CertificateRevocationList:
    """Parse a PEM or DER CRL. Raises :class:`PKIError` on garbage."""
    return _decode(data, x509.load_pem_x509_crl, x509.load_der_x509_crl, "CRL")


def encode_private_key(key: Ed25519PrivateKey, encoding: Encoding = Encoding.PEM) -> bytes:
    """Serialise a private key as unencrypted PKCS#8, PEM (default) or DER."""
    return key.private_bytes(
        encoding, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def decode_private_key(data: bytes) -> Ed25519PrivateKey:
    """Parse an unencrypted PKCS#8 Ed25519 key, PEM or DER.

    Raises :class:`PKIError` on garbage, encrypted keys and non-Ed25519 keys.
    """
    try:
        if _is_pem(data):
            key = serialization.load_pem_private_key(data, password=None)
        else:
            key = serialization.load_der_private_key(data, password=None)
    except (ValueError, TypeError) as e:
        raise PKIError(f"not a valid private key: {e}") from e
    if not isinstance(key, Ed25519PrivateKey):
        raise PKIError(f"expected an Ed25519 private key, got {type(key).__name__}")
    return key
