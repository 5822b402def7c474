"""The role server's inputs and outputs, held in event values.

* :class:`BootstrapData`: set once on the first node of a new cluster.
* :class:`RegisterIntent`: what a joining node keeps until it is committed.
* :class:`ClusterMembership`: how this node reaches the cluster: its
  credentials, the cluster directory, and the local consensus and curator
  when it runs them. It is *home* once it has credentials and a directory.
* ``NodeRoles`` (``metropolis.proto.common``): what the cluster wants this
  node to run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from metropolis import pki
from metropolis.identity import NodeCredentials
from metropolis.proto.common import ClusterDirectory

if TYPE_CHECKING:
    # Only named in the role server's value (the running services): the
    # node's disk and the owner's commands read this module without them.
    # A register intent's cluster, likewise: its module (the management
    # API's messages) brings the gRPC stubs, which a node's disk need not
    # load (``node recover`` reads it before etcdctl starts).
    from metropolis.consensus.service import Service as ConsensusService
    from metropolis.curator.service import Curator
    from metropolis.proto.management import GetClusterInfoResponse

__all__ = [
    "BootstrapData",
    "ClusterMembership",
    "RegisterIntent",
    "join_key_bytes",
]


@dataclass(frozen=True)
class BootstrapData:
    """What the first node needs to create a cluster (from the bootstrap command)."""

    node_private_key: Ed25519PrivateKey
    #: The key the node later proves itself with when it rejoins.
    join_private_key: Ed25519PrivateKey
    #: The cluster's half of the node's data partition key (kept in etcd).
    cluster_unlock_key: bytes
    #: The node's half (kept in the sealed configuration).
    node_unlock_key: bytes
    #: Ed25519 public key of the cluster's owner.
    initial_owner_key: bytes

    @classmethod
    def generate(cls, initial_owner_key: bytes) -> BootstrapData:
        """Fresh node and join keys and random unlock keys, for the given owner."""
        return cls(
            node_private_key=pki.generate_key(),
            join_private_key=pki.generate_key(),
            cluster_unlock_key=os.urandom(32),
            node_unlock_key=os.urandom(32),
            initial_owner_key=initial_owner_key,
        )

    @property
    def node_public_key(self) -> bytes:
        return pki.public_key_bytes(self.node_private_key)

    @property
    def join_public_key(self) -> bytes:
        return pki.public_key_bytes(self.join_private_key)


@dataclass(frozen=True)
class RegisterIntent:
    """What a node joining a cluster needs until it is committed (``node register``).

    Saved before the first call to the cluster, so that a node that crashes
    anywhere in the registration comes back with the same keys: the
    cluster's record (NEW, STANDBY or UP) stays this node's, and register
    and commit are idempotent for the same keys.
    """

    node_private_key: Ed25519PrivateKey
    join_private_key: Ed25519PrivateKey
    cluster_unlock_key: bytes
    node_unlock_key: bytes
    #: The cluster's register ticket (from ``owner ticket``).
    ticket: bytes
    #: The cluster's CA and directory (from ``owner info --out``).
    cluster: GetClusterInfoResponse

    @classmethod
    def generate(cls, ticket: bytes, cluster: GetClusterInfoResponse) -> RegisterIntent:
        """Fresh node and join keys and random unlock keys."""
        return cls(
            node_private_key=pki.generate_key(),
            join_private_key=pki.generate_key(),
            cluster_unlock_key=os.urandom(32),
            node_unlock_key=os.urandom(32),
            ticket=ticket,
            cluster=cluster,
        )

    @property
    def node_public_key(self) -> bytes:
        return pki.public_key_bytes(self.node_private_key)


def join_key_bytes(key: Ed25519PrivateKey) -> bytes:
    """The join key as Go's ed25519 stores a private key: 64 bytes, seed + public key."""
    seed = key.private_bytes(
        serialization.Encoding.Raw,
        serialization.PrivateFormat.Raw,
        serialization.NoEncryption(),
    )
    return seed + pki.public_key_bytes(key)


@dataclass(frozen=True)
class ClusterMembership:
    """How this node belongs to the cluster. Compared by identity of its services."""

    public_key: bytes
    credentials: NodeCredentials | None = None
    #: Curators to reach (the cluster directory); this node's own included when local.
    remote_curators: ClusterDirectory | None = None
    local_consensus: ConsensusService | None = field(default=None, compare=False)
    local_curator: Curator | None = field(default=None, compare=False)

    @property
    def home(self) -> bool:
        """Whether the node can talk to its cluster: credentials and a directory."""
        return self.credentials is not None and self.remote_curators is not None
