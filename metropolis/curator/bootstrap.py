"""Making a new cluster out of its first node, in one idempotent step.

Monogon's seed does this in several calls (new node, add to consensus,
enable roles, ensure the CA, issue the node certificate, store node, owner
and join key) and leaves a TODO to collapse them. :func:`bootstrap_cluster`
is that collapse::

    consensus.add_node(own key)          -> ConsensusMember join data (idempotent)
    cluster CA + node certificate         made locally
    one txn: if node, owner, join key and CA are all absent
               then put CA, node certificate, node record, owner, join key
               else read what is there and return it if it is ours

(:func:`create_cluster` is that transaction alone, for a caller that has
its join data and the curator's view of etcd before consensus runs.)

A crash at any point leaves either nothing or everything in etcd, and
running it again returns the same cluster.
"""

from __future__ import annotations

from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from metropolis import identity, pki
from metropolis.consensus.client import KV, Compare, Get, Put, RangeResult
from metropolis.consensus.join import JoinCluster
from metropolis.consensus.membership import Status
from metropolis.curator.state import (
    CA_CERTIFICATE_KEY,
    CA_KEY_KEY,
    INITIAL_OWNER_KEY,
    CuratorError,
    issued_certificate_key,
    join_key_key,
    node_key,
    parse_node,
)
from metropolis.proto.common import (
    NodeRoles,
    NodeRolesKubernetesController,
    NodeState,
)
from metropolis.proto.curator import InitialOwner, Node

__all__ = [
    "CLUSTER_CA_NAME",
    "BootstrapResult",
    "bootstrap_cluster",
    "bootstrap_roles",
    "cluster_ca",
    "create_cluster",
    "node_certificate",
]

CLUSTER_CA_NAME = "Metropolis Cluster CA"


@dataclass(frozen=True)
class BootstrapResult:
    """What the first node needs from the new cluster."""

    ca_certificate: x509.Certificate
    #: The cluster CA's key (the bootstrap node issues the owner's certificate with it).
    ca_key: Ed25519PrivateKey
    node_certificate: x509.Certificate
    #: The node's record as stored (roles: ConsensusMember, KubernetesController).
    record: Node


def cluster_ca() -> tuple[Ed25519PrivateKey, x509.Certificate]:
    """A new cluster CA: its key and self-signed certificate."""
    key = pki.generate_key()
    return key, pki.new_ca(key, CLUSTER_CA_NAME)


def node_certificate(
    ca_key: Ed25519PrivateKey, ca: x509.Certificate, public_key: bytes
) -> x509.Certificate:
    """The node certificate for ``public_key``: CN and DNS name are its node ID."""
    node = identity.node_id(public_key)
    return pki.issue_certificate(
        ca_key, ca, pki.decode_public_key(public_key), node, pki.Usage.PEER, dns_names=[node]
    )


def bootstrap_roles(join: JoinCluster) -> NodeRoles:
    """The first node's roles: ConsensusMember (with ``join``) and KubernetesController."""
    return NodeRoles(
        consensus_member=join.to_proto(),
        kubernetes_controller=NodeRolesKubernetesController(),
    )


async def bootstrap_cluster(
    consensus: Status,
    *,
    node_public_key: bytes,
    join_public_key: bytes,
    cluster_unlock_key: bytes,
    owner_public_key: bytes,
    join: JoinCluster | None = None,
    ca: tuple[Ed25519PrivateKey, x509.Certificate] | None = None,
) -> BootstrapResult:
    """Create the cluster's curator state for its first node; idempotent.

    ``consensus`` must be running (on this node). ``join`` is this node's
    own join data, if the caller already asked ``consensus.add_node`` for
    it; ``ca`` the cluster CA (key, certificate: :func:`cluster_ca`) to use
    if none exists yet. Both let the caller start on what
    depends on them (writing them to disk) while this runs; when etcd
    already holds a cluster (a retry), what is stored wins and is returned.

    Returns the cluster CA,
    its key, the node's certificate and its record. Raises :class:`CuratorError` if
    etcd already holds a different cluster (another node, or partial state
    that no bootstrap writes), and the etcd client's errors as they come.
    Cancellation at any point leaves either nothing or everything written.
    """
    if join is None:
        join = await consensus.add_node(node_public_key)
    return await create_cluster(
        consensus.curator_client(),
        node_public_key=node_public_key,
        join_public_key=join_public_key,
        cluster_unlock_key=cluster_unlock_key,
        owner_public_key=owner_public_key,
        join=join,
        ca=ca,
    )


async def create_cluster(
    kv: KV,
    *,
    node_public_key: bytes,
    join_public_key: bytes,
    cluster_unlock_key: bytes,
    owner_public_key: bytes,
    join: JoinCluster,
    ca: tuple[Ed25519PrivateKey, x509.Certificate] | None = None,
    certificate: x509.Certificate | None = None,
) -> BootstrapResult:
    """:func:`bootstrap_cluster` on the curator's view of etcd, with the join data at hand.

    One transaction, no other round trip: usable before the consensus
    service says it runs (its ``on_bootstrap`` hook). Same results and errors.
    ``certificate``: this node's certificate from ``ca``
    (:func:`node_certificate`) if the caller made it already, to write it
    to disk while this runs; made here if None.
    """
    node = identity.node_id(node_public_key)
    ca_key, ca_certificate = ca if ca is not None else cluster_ca()
    if certificate is None:
        certificate = node_certificate(ca_key, ca_certificate, node_public_key)
    record = Node(
        public_key=node_public_key,
        cluster_unlock_key=cluster_unlock_key,
        fsm_state=NodeState.UP,
        roles=bootstrap_roles(join),
        join_key=join_public_key,
    )
    der = pki.Encoding.DER
    result = await kv.txn(
        [
            Compare.absent(node_key(node)),
            Compare.absent(INITIAL_OWNER_KEY),
            Compare.absent(join_key_key(join_public_key)),
            Compare.absent(CA_CERTIFICATE_KEY),
        ],
        [
            Put(CA_CERTIFICATE_KEY, pki.encode_certificate(ca_certificate, der)),
            Put(CA_KEY_KEY, pki.encode_private_key(ca_key, der)),
            Put(issued_certificate_key(node), pki.encode_certificate(certificate, der)),
            Put(node_key(node), bytes(record)),
            Put(INITIAL_OWNER_KEY, bytes(InitialOwner(public_key=owner_public_key))),
            Put(join_key_key(join_public_key), node),
        ],
        [
            Get(node_key(node)),
            Get(CA_CERTIFICATE_KEY),
            Get(issued_certificate_key(node)),
            Get(CA_KEY_KEY),
        ],
    )
    if result.succeeded:
        return BootstrapResult(ca_certificate, ca_key, certificate, record)

    # Already bootstrapped: by us (a retry), or something else is here.
    stored_node, stored_ca, stored_cert, stored_key = result.responses
    assert isinstance(stored_node, RangeResult) and isinstance(stored_key, RangeResult)
    assert isinstance(stored_ca, RangeResult) and isinstance(stored_cert, RangeResult)
    if not (stored_node.kvs and stored_ca.kvs and stored_cert.kvs and stored_key.kvs):
        raise CuratorError(
            "etcd already holds cluster state that is not this node's bootstrap; refusing"
        )
    existing = parse_node(stored_node.kvs[0].value, node)
    if existing.public_key != node_public_key or existing.join_key != join_public_key:
        raise CuratorError(f"etcd holds a different record for {node}; refusing")
    try:
        return BootstrapResult(
            pki.decode_certificate(stored_ca.kvs[0].value),
            pki.decode_private_key(stored_key.kvs[0].value),
            pki.decode_certificate(stored_cert.kvs[0].value),
            existing,
        )
    except pki.PKIError as e:
        raise CuratorError(f"cluster PKI in etcd is damaged: {e}") from e
