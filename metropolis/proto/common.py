"""Types shared between nodes and cluster services (``common.proto``)."""

from metropolis.proto.gen.metropolis.proto.common import (
    ClusterDirectory,
    ClusterDirectoryNode,
    ClusterDirectoryNodeAddress,
    NodeRoles,
    NodeRolesConsensusMember,
    NodeRolesConsensusMemberPeer,
    NodeRolesKubernetesController,
    NodeRolesKubernetesWorker,
)

__all__ = [
    "ClusterDirectory",
    "ClusterDirectoryNode",
    "ClusterDirectoryNodeAddress",
    "NodeRoles",
    "NodeRolesConsensusMember",
    "NodeRolesConsensusMemberPeer",
    "NodeRolesKubernetesController",
    "NodeRolesKubernetesWorker",
]
