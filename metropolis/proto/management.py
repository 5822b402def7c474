"""The owner's management API and the nodes' debug service (``management.proto``): messages."""

from metropolis.proto.gen.metropolis.proto.api import (
    ApproveNodeRequest,
    ApproveNodeResponse,
    GetClusterInfoRequest,
    GetClusterInfoResponse,
    GetNodesRequest,
    GetRegisterTicketRequest,
    GetRegisterTicketResponse,
    GetSupervisionTreeRequest,
    GetSupervisionTreeResponse,
    Node,
    NodeHealth,
    SupervisedRunnable,
    SupervisedRunnableState,
    UpdateNodeRolesRequest,
    UpdateNodeRolesResponse,
)

__all__ = [
    "ApproveNodeRequest",
    "ApproveNodeResponse",
    "GetClusterInfoRequest",
    "GetClusterInfoResponse",
    "GetNodesRequest",
    "GetRegisterTicketRequest",
    "GetRegisterTicketResponse",
    "GetSupervisionTreeRequest",
    "GetSupervisionTreeResponse",
    "Node",
    "NodeHealth",
    "SupervisedRunnable",
    "SupervisedRunnableState",
    "UpdateNodeRolesRequest",
    "UpdateNodeRolesResponse",
]
