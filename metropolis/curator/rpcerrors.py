"""What the curator's callers are told when its etcd cannot answer.

A curator's handlers read and write etcd. While etcd elects a new leader
(its old one died) or cannot be reached, a call fails through no fault of
the caller's and may succeed a moment later: that is gRPC's UNAVAILABLE,
which callers (the owner CLI, nodes) retry, not INTERNAL.
"""

from __future__ import annotations

from metropolis.consensus.client import GRPC_UNAVAILABLE, EtcdAPIError, EtcdUnavailable
from metropolis.rpc import RPCError, Status


def unavailable_consensus(error: Exception) -> RPCError | None:
    """UNAVAILABLE for an etcd that cannot answer now (unreachable, or
    answering UNAVAILABLE itself, as "leader changed"); None for anything
    else (the server answers INTERNAL and logs it)."""
    if isinstance(error, EtcdUnavailable) or (
        isinstance(error, EtcdAPIError) and error.code == GRPC_UNAVAILABLE
    ):
        return RPCError(Status.UNAVAILABLE, f"the cluster's consensus cannot answer now: {error}")
    return None
