"""Types shared between nodes and cluster services (``common.proto``)."""

from metropolis.proto.gen.metropolis.proto.common import (
    ClusterDirectory,
    ClusterDirectoryNode,
    ClusterDirectoryNodeAddress,
    ClusterState,
    NodeRoles,
    NodeRolesConsensusMember,
    NodeRolesConsensusMemberPeer,
    NodeRolesKubernetesController,
    NodeRolesKubernetesWorker,
    NodeState,
    NodeStatus,
    NodeStatusRunningCurator,
    NodeStatusRunningImage,
    NodeStatusRunningImageSlot,
)

__all__ = [
    "ClusterDirectory",
    "ClusterDirectoryNode",
    "ClusterDirectoryNodeAddress",
    "ClusterState",
    "NodeRoles",
    "NodeRolesConsensusMember",
    "NodeRolesConsensusMemberPeer",
    "NodeRolesKubernetesController",
    "NodeRolesKubernetesWorker",
    "NodeState",
    "NodeStatus",
    "NodeStatusRunningCurator",
    "NodeStatusRunningImage",
    "NodeStatusRunningImageSlot",
]
