"""Join data: what a node needs to become a member of an existing consensus cluster.

:class:`JoinCluster` is a record. ``Status.add_node`` makes it on a member,
the curator hands it out inside the node's ConsensusMember role, and the
joining node's role server checks it (:meth:`JoinCluster.check`) before its
consensus service writes it to disk and starts etcd with it. Pure: nothing
here talks to etcd, so the role server's reducer can use it.
"""

from __future__ import annotations

from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from metropolis import pki
from metropolis.errors import ConsensusError
from metropolis.proto.common import NodeRolesConsensusMember, NodeRolesConsensusMemberPeer

__all__ = ["ExistingNode", "JoinCluster"]


@dataclass(frozen=True)
class ExistingNode:
    """A member of the cluster a node is joining: its etcd name and peer URL."""

    name: str
    url: str


@dataclass(frozen=True)
class JoinCluster:
    """What a node needs to join an existing consensus cluster (from ``add_node``)."""

    ca_certificate: x509.Certificate
    #: The joining node's peer certificate, for its own key.
    node_certificate: x509.Certificate
    initial_crl: x509.CertificateRevocationList
    #: Every current member (including not-yet-started learners) except the joiner.
    existing_nodes: tuple[ExistingNode, ...]

    def to_proto(self) -> NodeRolesConsensusMember:
        """The ConsensusMember role that carries this join data (DER encodings)."""
        der = pki.Encoding.DER
        return NodeRolesConsensusMember(
            ca_certificate=pki.encode_certificate(self.ca_certificate, der),
            peer_certificate=pki.encode_certificate(self.node_certificate, der),
            initial_crl=pki.encode_crl(self.initial_crl, der),
            peers=[
                NodeRolesConsensusMemberPeer(name=n.name, url=n.url) for n in self.existing_nodes
            ],
        )

    def check(self, node_private_key: Ed25519PrivateKey) -> None:
        """Raise :class:`ConsensusError` unless this join data is for that node's key.

        Checks that the peer certificate certifies the key and is signed by
        the CA, and that the CRL is the CA's. Pure; usable before etcd starts
        (the role server uses it to skip bad roles instead of failing later).
        """
        own_key = pki.public_key_bytes(node_private_key)
        try:
            cert_key = pki.public_key_bytes(pki.certificate_public_key(self.node_certificate))
            pki.verify_signed_by(self.node_certificate, self.ca_certificate)
            pki.verify_crl(self.initial_crl, self.ca_certificate)
        except pki.PKIError as e:
            raise ConsensusError(f"join data does not verify: {e}") from e
        if cert_key != own_key:
            raise ConsensusError("join data: peer certificate is not for this node's key")

    @classmethod
    def from_proto(cls, role: NodeRolesConsensusMember) -> JoinCluster:
        """Parse a ConsensusMember role. :class:`ConsensusError` says which part is bad.

        Only parses: whether the parts fit this node's key is checked when
        the service starts with them.
        """
        try:
            ca = pki.decode_certificate(role.ca_certificate)
        except pki.PKIError as e:
            raise ConsensusError(f"ConsensusMember role: CA certificate: {e}") from e
        try:
            certificate = pki.decode_certificate(role.peer_certificate)
        except pki.PKIError as e:
            raise ConsensusError(f"ConsensusMember role: peer certificate: {e}") from e
        try:
            crl = pki.decode_crl(role.initial_crl)
        except pki.PKIError as e:
            raise ConsensusError(f"ConsensusMember role: initial CRL: {e}") from e
        peers = tuple(ExistingNode(p.name, p.url) for p in role.peers)
        return cls(ca, certificate, crl, peers)
