"""Records only the curator reads and writes, kept in etcd (``curator.proto``)."""

from metropolis.proto.gen.metropolis.node.core.curator.proto.private import (
    InitialOwner,
    LeaderElectionValue,
    Node,
    RegisterTicket,
)

__all__ = ["InitialOwner", "LeaderElectionValue", "Node", "RegisterTicket"]
