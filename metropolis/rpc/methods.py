"""The curator's two services as :class:`~metropolis.rpc.method.Method` values.

Paths are the gRPC paths of Monogon's services (package, service and method
names from ``curator_api.proto`` and ``management.proto``), so a Go client
generated from those files reaches these methods. Who may call each method
replaces Monogon's per-method authorization option:

- ``Curator``: Watch and UpdateNodeStatus need a node certificate;
  RegisterNode, CommitNode and JoinNode are for nodes without one yet and
  need a proof of possession (:mod:`metropolis.rpc.auth`) of the node key
  (register, commit) or of the join key (join).
- ``Management``: every method needs the owner's certificate. GetNodes
  is ``stale_ok``: with that metadata a follower answers, for an owner
  who would otherwise wait out a failover.
- ``AAA``: Escrow, for the owner without a certificate: a proof of
  possession of the owner key buys one. Any curator answers (it reads the
  CA from its own etcd), so it works during a failover.
- ``NodeDebug`` (monotrio's): served by each node for itself, to the owner.

Every curator method is leader-only: a follower answers UNAVAILABLE naming the
leader (Monogon's followers forward instead; a client here goes to the
leader itself). Heartbeat is bidirectional (node certificate). Not here:
``CuratorLocal`` (node-local in Monogon).
"""

from __future__ import annotations

from metropolis.proto import aaa
from metropolis.proto import curator_api as c
from metropolis.proto import management as m
from metropolis.rpc.method import Access, Method

__all__ = [
    "APPROVE_NODE",
    "COMMIT_NODE",
    "DELETE_NODE",
    "ESCROW",
    "GET_CLUSTER_INFO",
    "GET_NODES",
    "GET_REGISTER_TICKET",
    "GET_SUPERVISION_TREE",
    "HEARTBEAT",
    "JOIN_NODE",
    "REGISTER_NODE",
    "UPDATE_NODE_ROLES",
    "UPDATE_NODE_STATUS",
    "WATCH",
]

_CURATOR = "/metropolis.node.core.curator.proto.api.Curator/"
_MANAGEMENT = "/metropolis.proto.api.Management/"
_NODE_DEBUG = "/metropolis.proto.api.NodeDebug/"
_AAA = "/metropolis.proto.api.AAA/"

WATCH = Method(_CURATOR + "Watch", c.WatchRequest, c.WatchEvent, Access.NODE, streaming=True)
HEARTBEAT = Method(
    _CURATOR + "Heartbeat",
    c.HeartbeatUpdateRequest,
    c.HeartbeatUpdateResponse,
    Access.NODE,
    streaming=True,
    client_streaming=True,
)
UPDATE_NODE_STATUS = Method(
    _CURATOR + "UpdateNodeStatus",
    c.UpdateNodeStatusRequest,
    c.UpdateNodeStatusResponse,
    Access.NODE,
)
REGISTER_NODE = Method(
    _CURATOR + "RegisterNode", c.RegisterNodeRequest, c.RegisterNodeResponse, Access.PROOF
)
COMMIT_NODE = Method(
    _CURATOR + "CommitNode", c.CommitNodeRequest, c.CommitNodeResponse, Access.PROOF
)
JOIN_NODE = Method(_CURATOR + "JoinNode", c.JoinNodeRequest, c.JoinNodeResponse, Access.PROOF)

GET_REGISTER_TICKET = Method(
    _MANAGEMENT + "GetRegisterTicket",
    m.GetRegisterTicketRequest,
    m.GetRegisterTicketResponse,
    Access.OWNER,
)
GET_CLUSTER_INFO = Method(
    _MANAGEMENT + "GetClusterInfo", m.GetClusterInfoRequest, m.GetClusterInfoResponse, Access.OWNER
)
GET_NODES = Method(
    _MANAGEMENT + "GetNodes",
    m.GetNodesRequest,
    m.Node,
    Access.OWNER,
    streaming=True,
    stale_ok=True,
)
APPROVE_NODE = Method(
    _MANAGEMENT + "ApproveNode", m.ApproveNodeRequest, m.ApproveNodeResponse, Access.OWNER
)
UPDATE_NODE_ROLES = Method(
    _MANAGEMENT + "UpdateNodeRoles",
    m.UpdateNodeRolesRequest,
    m.UpdateNodeRolesResponse,
    Access.OWNER,
)

DELETE_NODE = Method(
    _MANAGEMENT + "DeleteNode", m.DeleteNodeRequest, m.DeleteNodeResponse, Access.OWNER
)
ESCROW = Method(
    _AAA + "Escrow",
    aaa.EscrowFromClient,
    aaa.EscrowFromServer,
    Access.PROOF,
    streaming=True,
    client_streaming=True,
    leader_only=False,
)

#: Served by every node on its debug port (not by the curators): the node's
#: own supervision tree, for the owner. Not leader-only: each node answers
#: for itself (see :mod:`metropolis.roleserve.debugservice`).
GET_SUPERVISION_TREE = Method(
    _NODE_DEBUG + "GetSupervisionTree",
    m.GetSupervisionTreeRequest,
    m.GetSupervisionTreeResponse,
    Access.OWNER,
    leader_only=False,
)
