"""The consensus peer PKI, kept in etcd itself.

etcd members authenticate each other with certificates from one CA. That
CA must outlive any single node, so its key and certificate, the CRL and
every issued peer certificate live in the cluster they protect, under the
``namespaced/etcd-pki/`` prefix::

    ca/certificate          DER   created once, by the bootstrapping node
    ca/key                  DER   PKCS#8; any member can issue peer certificates
    crl                     DER   rewritten on each revocation (compare-and-swap)
    certificates/<node-id>  DER   the peer certificate issued to that node

Creation is a create-if-absent transaction, so concurrent or repeated
bootstraps agree on one CA; revocation is compare-and-swap on the CRL's mod
revision, so concurrent revocations never lose each other.

Anyone with access to the etcd client socket can read the CA key. That is
the same trust boundary as etcd's data itself: the socket is root-only.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from metropolis import identity, pki
from metropolis.consensus.client import KV, Compare, Get, Put, RangeResult
from metropolis.errors import ConsensusError

__all__ = [
    "NAMESPACE",
    "NodePKI",
    "PeerCA",
    "PeerPKIError",
    "ensure_ca",
    "get_crl",
    "issue_peer_certificate",
    "load_ca",
    "load_for_node",
    "new_ca",
    "reuse_or_issue",
    "revoke_peer_certificate",
    "store_bootstrap",
]

#: Prefix of the PKI keys in etcd (relative to the root of the keyspace).
NAMESPACE = b"namespaced/etcd-pki/"

KEY_CA_CERTIFICATE = b"ca/certificate"
KEY_CA_KEY = b"ca/key"
KEY_CRL = b"crl"
KEY_CERTIFICATES = b"certificates/"

CA_NAME = "Metropolis etcd peer CA"


class PeerPKIError(ConsensusError):
    """The peer PKI in etcd is missing, damaged, or refuses the request."""


@dataclass(frozen=True)
class PeerCA:
    key: Ed25519PrivateKey
    certificate: x509.Certificate


def _parse_ca(key: bytes, certificate: bytes) -> PeerCA:
    try:
        ca = PeerCA(pki.decode_private_key(key), pki.decode_certificate(certificate))
    except pki.PKIError as e:
        raise PeerPKIError(f"peer CA in etcd is damaged: {e}") from e
    if pki.public_key_bytes(ca.key) != pki.public_key_bytes(
        pki.certificate_public_key(ca.certificate)
    ):
        raise PeerPKIError("peer CA in etcd: key does not match certificate")
    return ca


def new_ca() -> tuple[PeerCA, x509.CertificateRevocationList]:
    """A fresh peer CA and its empty CRL, made locally (no etcd needed)."""
    key = pki.generate_key()
    certificate = pki.new_ca(key, CA_NAME)
    return PeerCA(key, certificate), pki.new_crl(key, certificate)


def issue_local_certificate(
    ca: PeerCA, public_key: bytes, hosts: Sequence[str]
) -> x509.Certificate:
    """A peer certificate for ``public_key``, made locally (see :func:`issue_peer_certificate`)."""
    node = identity.node_id(public_key)
    ips: list[str] = []
    names: list[str] = [node]
    for host in hosts:
        try:
            ips.append(str(ipaddress.ip_address(host)))
        except ValueError:
            if host not in names:  # the default peer URL's host is the node ID itself
                names.append(host)
    return pki.issue_certificate(
        ca.key,
        ca.certificate,
        pki.decode_public_key(public_key),
        node,
        pki.Usage.PEER,
        dns_names=names,
        ip_addresses=ips,
    )


async def store_bootstrap(
    kv: KV,
    ca: PeerCA,
    crl: x509.CertificateRevocationList,
    certificate: x509.Certificate,
) -> None:
    """Store a PKI made by :func:`new_ca` before etcd ran, in one create-if-absent txn.

    Lets bootstrap start etcd once, with peer TLS from the start. Idempotent:
    if the same CA is stored already (a bootstrap that crashed after this
    step), nothing changes; a *different* CA raises :class:`PeerPKIError`.
    """
    der = pki.Encoding.DER
    node = identity.node_id(pki.public_key_bytes(pki.certificate_public_key(certificate)))
    result = await kv.txn(
        [Compare.absent(KEY_CA_CERTIFICATE)],
        [
            Put(KEY_CA_CERTIFICATE, pki.encode_certificate(ca.certificate, der)),
            Put(KEY_CA_KEY, pki.encode_private_key(ca.key, der)),
            Put(KEY_CRL, pki.encode_crl(crl, der)),
            Put(KEY_CERTIFICATES + node.encode(), pki.encode_certificate(certificate, der)),
        ],
        [Get(KEY_CA_CERTIFICATE)],
    )
    if result.succeeded:
        return
    [stored] = result.responses
    assert isinstance(stored, RangeResult)
    if stored.kvs[0].value != pki.encode_certificate(ca.certificate, der):
        raise PeerPKIError("etcd holds a different peer CA than the one this node bootstrapped")


async def ensure_ca(kv: KV) -> PeerCA:
    """Return the peer CA, creating it (and an empty CRL) if there is none.

    Idempotent and safe to race: the first writer wins and everyone gets
    its CA. ``kv`` is the PKI namespace (``client.namespaced(NAMESPACE)``).
    """
    key = pki.generate_key()
    certificate = pki.new_ca(key, CA_NAME)
    crl = pki.new_crl(key, certificate)
    der = pki.Encoding.DER
    result = await kv.txn(
        [Compare.absent(KEY_CA_CERTIFICATE)],
        [
            Put(KEY_CA_CERTIFICATE, pki.encode_certificate(certificate, der)),
            Put(KEY_CA_KEY, pki.encode_private_key(key, der)),
            Put(KEY_CRL, pki.encode_crl(crl, der)),
        ],
        [Get(KEY_CA_CERTIFICATE), Get(KEY_CA_KEY)],
    )
    if result.succeeded:
        return PeerCA(key, certificate)
    cert_range, key_range = result.responses
    assert isinstance(cert_range, RangeResult) and isinstance(key_range, RangeResult)
    if not key_range.kvs:
        raise PeerPKIError("peer CA certificate in etcd has no key")
    return _parse_ca(key_range.kvs[0].value, cert_range.kvs[0].value)


async def load_ca(kv: KV) -> PeerCA:
    """Return the existing peer CA. :class:`PeerPKIError` if there is none."""
    result = await kv.txn([], [Get(KEY_CA_CERTIFICATE), Get(KEY_CA_KEY)])
    cert_range, key_range = result.responses
    assert isinstance(cert_range, RangeResult) and isinstance(key_range, RangeResult)
    if not cert_range.kvs or not key_range.kvs:
        raise PeerPKIError("no peer CA in etcd (cluster not bootstrapped?)")
    return _parse_ca(key_range.kvs[0].value, cert_range.kvs[0].value)


def _covers(certificate: x509.Certificate, hosts: Sequence[str]) -> bool:
    try:
        sans = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return not hosts
    names = set(sans.get_values_for_type(x509.DNSName))
    names |= {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}
    return set(hosts) <= names


@dataclass(frozen=True)
class NodePKI:
    """What issuing a node's peer certificate needs, read in one round trip."""

    ca: PeerCA
    crl: x509.CertificateRevocationList
    #: The peer certificate stored for the node (DER), None if none was issued.
    stored_certificate: bytes | None


async def load_for_node(kv: KV, node_id: str) -> NodePKI:
    """The CA, the CRL and ``node_id``'s stored certificate, in one read-only txn.

    :class:`PeerPKIError` if the PKI is missing or damaged. Granting a role
    and bootstrapping wait on this, so it is one round trip, not four.
    """
    result = await kv.txn(
        [],
        [
            Get(KEY_CA_CERTIFICATE),
            Get(KEY_CA_KEY),
            Get(KEY_CRL),
            Get(KEY_CERTIFICATES + node_id.encode()),
        ],
    )
    cert_range, key_range, crl_range, issued = result.responses
    assert isinstance(cert_range, RangeResult) and isinstance(key_range, RangeResult)
    assert isinstance(crl_range, RangeResult) and isinstance(issued, RangeResult)
    if not cert_range.kvs or not key_range.kvs:
        raise PeerPKIError("no peer CA in etcd (cluster not bootstrapped?)")
    if not crl_range.kvs:
        raise PeerPKIError("no CRL in etcd (cluster not bootstrapped?)")
    ca = _parse_ca(key_range.kvs[0].value, cert_range.kvs[0].value)
    try:
        crl = pki.decode_crl(crl_range.kvs[0].value)
    except pki.PKIError as e:
        raise PeerPKIError(f"CRL in etcd is damaged: {e}") from e
    return NodePKI(ca, crl, issued.kvs[0].value if issued.kvs else None)


async def issue_peer_certificate(
    kv: KV,
    ca: PeerCA,
    public_key: bytes,
    hosts: Sequence[str],
    crl: x509.CertificateRevocationList | None = None,
) -> x509.Certificate:
    """Return a peer certificate for the node with ``public_key``, issuing one if needed.

    The certificate's common name and first DNS name are the node ID; each
    of ``hosts`` (IP addresses or names peers dial) becomes a SAN too, since
    etcd checks the address a peer connects from against them. An existing
    certificate for the same key that covers ``hosts`` is returned as is,
    unless ``crl`` revokes it (a member removed and now added again).
    """
    node = identity.node_id(public_key)
    existing = await kv.get(KEY_CERTIFICATES + node.encode())
    stored = existing.value if existing is not None else None
    return await reuse_or_issue(kv, ca, public_key, hosts, crl, stored)


async def reuse_or_issue(
    kv: KV,
    ca: PeerCA,
    public_key: bytes,
    hosts: Sequence[str],
    crl: x509.CertificateRevocationList | None,
    stored: bytes | None,
) -> x509.Certificate:
    """:func:`issue_peer_certificate` with the stored certificate already read (``stored``)."""
    node = identity.node_id(public_key)
    path = KEY_CERTIFICATES + node.encode()
    if stored is not None:
        try:
            certificate = pki.decode_certificate(stored)
        except pki.PKIError as e:
            raise PeerPKIError(f"stored peer certificate of {node} is damaged: {e}") from e
        same_key = pki.public_key_bytes(pki.certificate_public_key(certificate)) == public_key
        revoked = crl is not None and pki.is_revoked(crl, certificate)
        if same_key and _covers(certificate, hosts) and not revoked:
            return certificate
    certificate = issue_local_certificate(ca, public_key, hosts)
    await kv.put(path, pki.encode_certificate(certificate, pki.Encoding.DER))
    return certificate


async def get_crl(kv: KV) -> tuple[x509.CertificateRevocationList, int]:
    """Return the current CRL and the mod revision it was read at."""
    stored = await kv.get(KEY_CRL)
    if stored is None:
        raise PeerPKIError("no CRL in etcd (cluster not bootstrapped?)")
    try:
        return pki.decode_crl(stored.value), stored.mod_revision
    except pki.PKIError as e:
        raise PeerPKIError(f"CRL in etcd is damaged: {e}") from e


async def revoke_peer_certificate(
    kv: KV, ca: PeerCA, node_id: str
) -> x509.CertificateRevocationList:
    """Revoke the peer certificate issued to ``node_id``; return the new CRL.

    Members pick the new CRL up through their CRL watchers and refuse the
    node's new peer connections from then on. Raises :class:`PeerPKIError`
    if no certificate was issued to that node.
    """
    stored = await kv.get(KEY_CERTIFICATES + node_id.encode())
    if stored is None:
        raise PeerPKIError(f"no peer certificate was issued to {node_id}")
    serial = pki.decode_certificate(stored.value).serial_number
    while True:
        crl, revision = await get_crl(kv)
        new = pki.revoke(crl, ca.key, ca.certificate, [serial])
        result = await kv.txn(
            [Compare.mod_revision(KEY_CRL, "==", revision)],
            [Put(KEY_CRL, pki.encode_crl(new, pki.Encoding.DER))],
        )
        if result.succeeded:
            return new
        # Someone else revoked concurrently: build on their list instead.
