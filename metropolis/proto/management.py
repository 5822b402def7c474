"""The owner's management API (``management.proto``): messages."""

from metropolis.proto.gen.metropolis.proto.api import (
    ApproveNodeRequest,
    ApproveNodeResponse,
    GetClusterInfoRequest,
    GetClusterInfoResponse,
    GetNodesRequest,
    GetRegisterTicketRequest,
    GetRegisterTicketResponse,
    Node,
    NodeHealth,
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
    "Node",
    "NodeHealth",
    "UpdateNodeRolesRequest",
    "UpdateNodeRolesResponse",
]
