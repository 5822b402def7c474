"""Types shared between nodes and cluster services (``common.proto``)."""

from __future__ import annotations

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
    "role_names",
]


def role_names(roles: NodeRoles | None) -> tuple[str, ...]:
    """The roles a node has, by name (for tables, logs and errors: no key material)."""
    if roles is None:
        return ()
    names = []
    if roles.consensus_member is not None:
        names.append("ConsensusMember")
    if roles.kubernetes_controller is not None:
        names.append("KubernetesController")
    if roles.kubernetes_worker is not None:
        names.append("KubernetesWorker")
    return tuple(names)
