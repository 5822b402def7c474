"""Who a node is: its Ed25519 key, its node ID and its cluster-issued credentials.

A node *is* its key pair. The node ID is derived from the public key, so it
can be computed by anyone who has seen the key and cannot be claimed by
anyone who does not hold the private half::

    node_id = "metropolis-" + hex(public_key[:16])

Once the cluster accepts a node, the cluster CA issues it a certificate whose
common name is the node ID. :class:`NodeCredentials` bundles the private key,
that certificate and the CA certificate, and refuses to exist unless the three
fit together. That invariant is what lets the rest of the code trust a loaded
``NodeCredentials`` without re-checking it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.x509.oid import NameOID

from metropolis import pki
from metropolis.errors import MetropolisError
from metropolis.localstorage import PKIDirectory

__all__ = [
    "NODE_ID_PREFIX",
    "OWNER_COMMON_NAME",
    "CredentialsError",
    "NodeCredentials",
    "node_id",
]

NODE_ID_PREFIX = "metropolis-"
#: Common name of the owner's certificate. The cluster CA issues it once, for
#: the initial owner key, at bootstrap; every other certificate the CA issues
#: is a node's, named by its node ID.
OWNER_COMMON_NAME = "owner"


def node_id(public_key: Ed25519PublicKey | bytes) -> str:
    """Return the node ID for a public key (raw 32 bytes or a key object)."""
    raw = public_key if isinstance(public_key, bytes) else pki.public_key_bytes(public_key)
    if len(raw) != 32:
        raise ValueError(f"an Ed25519 public key is 32 bytes, got {len(raw)}")
    return NODE_ID_PREFIX + raw[:16].hex()


class CredentialsError(MetropolisError):
    """Node credentials are unreadable, malformed, or do not fit together."""


_T = TypeVar("_T")


def _decode(what: str, decode: Callable[[bytes], _T], data: bytes) -> _T:
    try:
        return decode(data)
    except pki.PKIError as e:
        raise CredentialsError(f"{what}: {e}") from e


@dataclass(frozen=True)
class NodeCredentials:
    """A node's private key, its certificate, and the cluster CA certificate.

    Invariant, checked on construction (:class:`CredentialsError` otherwise):
    the certificate certifies ``private_key``'s public key, its common name is
    that key's node ID, and it was signed by ``ca_certificate``, which is a CA.
    """

    private_key: Ed25519PrivateKey
    certificate: x509.Certificate
    ca_certificate: x509.Certificate

    def __post_init__(self) -> None:
        try:
            cert_key = pki.certificate_public_key(self.certificate)
        except pki.PKIError as e:
            raise CredentialsError(f"node certificate: {e}") from e
        if pki.public_key_bytes(cert_key) != pki.public_key_bytes(self.private_key):
            raise CredentialsError("private key does not match the node certificate")
        names = self.certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        expected = node_id(cert_key)
        if [n.value for n in names] != [expected]:
            raise CredentialsError(
                f"node certificate is for {self.certificate.subject.rfc4514_string()}, "
                f"expected CN={expected}"
            )
        try:
            pki.verify_signed_by(self.certificate, self.ca_certificate)
        except pki.PKIError as e:
            raise CredentialsError(f"node certificate does not chain to the CA: {e}") from e

    @property
    def public_key(self) -> bytes:
        """The node's raw 32-byte public key."""
        return pki.public_key_bytes(self.private_key)

    @property
    def node_id(self) -> str:
        return node_id(self.public_key)

    @classmethod
    def from_bytes(cls, key: bytes, certificate: bytes, ca_certificate: bytes) -> NodeCredentials:
        """Build credentials from encoded parts (PEM or DER each).

        Raises :class:`CredentialsError` naming the part that does not parse,
        or the check that failed.
        """
        return cls(
            private_key=_decode("private key", pki.decode_private_key, key),
            certificate=_decode("node certificate", pki.decode_certificate, certificate),
            ca_certificate=_decode("CA certificate", pki.decode_certificate, ca_certificate),
        )

    def save(self, directory: PKIDirectory, *, durable: bool = True) -> None:
        """Write the three PEM files into ``directory``, owner-only, each atomically.

        The credentials are valid by construction, so nothing invalid can be
        written; an I/O error leaves every file either old or new.
        """
        directory.write_all(
            ca_certificate=pki.encode_certificate(self.ca_certificate),
            certificate=pki.encode_certificate(self.certificate),
            key=pki.encode_private_key(self.private_key),
            durable=durable,
        )

    @classmethod
    def load(cls, directory: PKIDirectory) -> NodeCredentials:
        """Read and validate credentials saved by :meth:`save`.

        Raises :class:`CredentialsError` if a file is missing or unreadable
        (naming it), does not parse, or the three do not fit together. Never
        modifies the files.
        """
        raw: list[bytes] = []
        for path in (directory.key, directory.certificate, directory.ca_certificate):
            try:
                raw.append(path.read_bytes())
            except OSError as e:
                raise CredentialsError(f"cannot read {path}: {e}") from e
        try:
            return cls.from_bytes(*raw)
        except CredentialsError as e:
            raise CredentialsError(f"credentials in {directory.path}: {e}") from e
