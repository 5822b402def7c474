"""Who is calling: peer identity from the TLS certificate, or a proof of possession.

**Identity is a public key.** A caller with a cluster-issued certificate is
the Ed25519 key that certificate certifies: a *node* when the certificate's
common name is the node ID of that key (as :mod:`metropolis.identity`
issues them), the *owner* when the key is the cluster's initial owner key.
The TLS layer has already checked that the certificate chains to the
cluster CA and is within its validity period (a certificate that does not is
refused in the handshake); :func:`authenticate` adds what TLS cannot know:
revocation (the curator's current CRL) and whose key it is.

**Callers without a cluster certificate prove possession instead.** Go's
curator accepts self-signed "ephemeral" client certificates for register
and join and reads the key from them. Python's ``ssl`` has no verify
callback, so a server that verifies against the cluster CA cannot also
accept arbitrary self-signed certificates. Such a caller connects without a
client certificate and sends, in the request's metadata::

    metropolis-pop-key-bin        raw 32-byte Ed25519 public key
    metropolis-pop-time           unix time in milliseconds, decimal
    metropolis-pop-signature-bin  Ed25519 signature over
        b"metropolis-rpc-pop-v1\\0" + method path + b"\\0" + time + b"\\0"
        + SHA-256(request message bytes)

The signature binds key, method and exact request. It is *fresh* when its
time is within :data:`PROOF_WINDOW` of the server's clock, and each
signature is accepted once (:class:`ReplayCache` remembers it for the
window), so a captured request cannot be replayed, on this curator. (A
capture replayed on *another* curator within the window is possible; the
calls that use proofs, register and join, are idempotent for one key.)
Any gRPC client can send this metadata, so Go compatibility is kept.
"""

from __future__ import annotations

import enum
import hashlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.x509.oid import NameOID

from common.numbers import parse_decimal
from metropolis import identity, pki
from metropolis.rpc import wire
from metropolis.rpc.method import Access
from metropolis.rpc.status import LeaderHint, RPCError, Status

__all__ = [
    "PROOF_WINDOW",
    "Leadership",
    "Peer",
    "PeerKind",
    "ReplayCache",
    "ServerSecurity",
    "authenticate",
    "sign_proof",
    "verify_proof",
]

#: How far (seconds) a proof's time may be from the server's clock, either way.
PROOF_WINDOW = 120.0

KEY_HEADER = "metropolis-pop-key-bin"
TIME_HEADER = "metropolis-pop-time"
SIGNATURE_HEADER = "metropolis-pop-signature-bin"
_DOMAIN = b"metropolis-rpc-pop-v1\0"


class PeerKind(enum.Enum):
    NODE = "node"
    OWNER = "owner"
    #: Proved possession of ``public_key`` but holds no cluster certificate.
    PROVEN = "proven"


@dataclass(frozen=True)
class Peer:
    """The authenticated caller a handler sees.

    ``public_key`` is the raw 32-byte Ed25519 key: certified (NODE, OWNER)
    or proven (PROVEN). ``certificate`` is the TLS client certificate, if any.
    """

    kind: PeerKind
    public_key: bytes
    certificate: x509.Certificate | None = None

    @property
    def node_id(self) -> str:
        """The node ID of the caller's key (meaningful for nodes and proven keys)."""
        return identity.node_id(self.public_key)


@dataclass(frozen=True)
class Leadership:
    """What a curator knows about leadership when a call arrives."""

    is_leader: bool
    #: The leader, when known and it is not us.
    leader: LeaderHint | None = None


@dataclass(frozen=True)
class ServerSecurity:
    """The curator's hooks into authentication, asked on every call.

    Each hook is a plain function: it must answer from memory (the curator
    keeps the owner key, CRL and election state cached from etcd watches),
    because it runs before every handler.

    - ``owner_key()``: the initial owner's raw public key, or None if unknown.
    - ``crl()``: the cluster CA's current CRL, or None if nothing is revoked.
    - ``leadership()``: whether we lead, and who does if not.

    ``owner_by_name``: for servers that cannot know the owner key (a node
    without a curator has no etcd to read it from): while ``owner_key()``
    is None, the owner is the caller whose certificate (chained to the
    cluster CA by the handshake) has the common name
    :data:`~metropolis.identity.OWNER_COMMON_NAME`. That is as strong as the
    key check today: the CA issues that name once, at bootstrap, for the
    initial owner key, and every other certificate it issues names a node ID.
    """

    owner_key: Callable[[], bytes | None]
    crl: Callable[[], x509.CertificateRevocationList | None]
    leadership: Callable[[], Leadership]
    owner_by_name: bool = False


def _classify(certificate: x509.Certificate, security: ServerSecurity) -> Peer:
    try:
        key = pki.public_key_bytes(pki.certificate_public_key(certificate))
    except pki.PKIError as e:
        raise RPCError(Status.UNAUTHENTICATED, str(e)) from None
    crl = security.crl()
    if crl is not None and pki.is_revoked(crl, certificate):
        raise RPCError(Status.UNAUTHENTICATED, "certificate revoked")
    owner_key = security.owner_key()
    if owner_key is not None and key == owner_key:
        return Peer(PeerKind.OWNER, key, certificate)
    names = [a.value for a in certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    if names == [identity.node_id(key)]:
        return Peer(PeerKind.NODE, key, certificate)
    if owner_key is None and security.owner_by_name and names == [identity.OWNER_COMMON_NAME]:
        return Peer(PeerKind.OWNER, key, certificate)
    raise RPCError(Status.UNAUTHENTICATED, "certificate is neither a node's nor the owner's")


def authenticate(
    access: Access,
    path: str,
    certificate: x509.Certificate | None,
    metadata: Mapping[str, str],
    request: bytes,
    security: ServerSecurity,
    replay: ReplayCache,
) -> Peer:
    """Return the caller of ``path`` if ``access`` admits it, else raise :class:`RPCError`.

    UNAUTHENTICATED: no or unusable identity (no certificate, revoked, not
    a node's nor the owner's, bad or stale proof). PERMISSION_DENIED: a
    valid identity of the wrong kind (a node calling an owner method).
    """
    if access is Access.PROOF:
        key = verify_proof(path, metadata, request, time.time())
        replay.check(wire.b64decode(metadata[SIGNATURE_HEADER]), time.monotonic())
        return Peer(PeerKind.PROVEN, key, certificate)
    if certificate is None:
        raise RPCError(Status.UNAUTHENTICATED, "no client certificate presented")
    peer = _classify(certificate, security)
    wanted = PeerKind.NODE if access is Access.NODE else PeerKind.OWNER
    if peer.kind is not wanted:
        raise RPCError(
            Status.PERMISSION_DENIED,
            f"{path} is for the {wanted.value}, caller is a {peer.kind.value}",
        )
    return peer


def _signed_bytes(path: str, millis: str, request: bytes) -> bytes:
    return (
        _DOMAIN + path.encode() + b"\0" + millis.encode() + b"\0" + hashlib.sha256(request).digest()
    )


def sign_proof(
    key: Ed25519PrivateKey, path: str, request: bytes, now: float | None = None
) -> dict[str, str]:
    """Metadata proving possession of ``key`` for this one request to ``path``."""
    millis = str(int((time.time() if now is None else now) * 1000))
    signature = key.sign(_signed_bytes(path, millis, request))
    return {
        KEY_HEADER: wire.b64encode(pki.public_key_bytes(key)),
        TIME_HEADER: millis,
        SIGNATURE_HEADER: wire.b64encode(signature),
    }


def verify_proof(path: str, metadata: Mapping[str, str], request: bytes, now: float) -> bytes:
    """Return the proven raw public key; :class:`RPCError` UNAUTHENTICATED otherwise."""
    try:
        raw_key = wire.b64decode(metadata[KEY_HEADER])
        millis = metadata[TIME_HEADER]
        signature = wire.b64decode(metadata[SIGNATURE_HEADER])
        key = pki.decode_public_key(raw_key)
        # Milliseconds since 1970 have 13 digits until the year 2286.
        sent = parse_decimal(millis, max_digits=16, what="proof time") / 1000
    except KeyError as e:
        raise RPCError(Status.UNAUTHENTICATED, f"proof of possession missing {e}") from None
    except (ValueError, pki.PKIError) as e:
        raise RPCError(Status.UNAUTHENTICATED, f"malformed proof of possession: {e}") from None
    if abs(now - sent) > PROOF_WINDOW:
        raise RPCError(Status.UNAUTHENTICATED, "proof of possession is not fresh")
    try:
        key.verify(signature, _signed_bytes(path, millis, request))
    except InvalidSignature:
        raise RPCError(Status.UNAUTHENTICATED, "proof of possession does not verify") from None
    return raw_key


class ReplayCache:
    """Signatures seen within the last two proof windows; each is accepted once.

    Two windows, because a proof dated up to one window in the future stays
    acceptable for two windows of server time.
    """

    def __init__(self) -> None:
        self._seen: dict[bytes, float] = {}

    def check(self, signature: bytes, now: float) -> None:
        """Raise UNAUTHENTICATED if ``signature`` was seen; otherwise remember it."""
        for sig, expiry in list(self._seen.items()):
            if expiry <= now:
                del self._seen[sig]
        if signature in self._seen:
            raise RPCError(Status.UNAUTHENTICATED, "proof of possession was already used")
        self._seen[signature] = now + 2 * PROOF_WINDOW
