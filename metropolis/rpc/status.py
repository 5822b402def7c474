"""gRPC status codes and the one error an RPC ends with.

The numbers are gRPC's (``google.rpc.Code``); a Go or C++ client reads them
from the ``grpc-status`` trailer exactly as it would from a Go server.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from metropolis.errors import MetropolisError

__all__ = ["LEADER_ADDRESS_HEADER", "LEADER_NODE_HEADER", "LeaderHint", "RPCError", "Status"]


class Status(enum.IntEnum):
    """gRPC status codes (https://grpc.github.io/grpc/core/md_doc_statuscodes.html)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


@dataclass(frozen=True)
class LeaderHint:
    """Who a follower believes leads: sent with UNAVAILABLE so a client can go there.

    ``node_id`` is the leader's node ID; ``address`` its curator's
    ``host:port`` when the follower knows it (empty otherwise).
    """

    node_id: str
    address: str = ""


#: The trailers a follower names the leader in (:class:`LeaderHint`).
LEADER_NODE_HEADER = "metropolis-leader-node-id"
LEADER_ADDRESS_HEADER = "metropolis-leader-address"


class RPCError(MetropolisError):
    """An RPC ended with a non-OK status.

    Raised by handlers to answer with that status (any other exception a
    handler raises is answered as INTERNAL and logged), and raised by the
    client for every non-OK answer, and for transport failures (UNAVAILABLE)
    and refused TLS handshakes (UNAUTHENTICATED). ``leader`` is set on
    UNAVAILABLE answers from a curator that is not the leader.
    """

    def __init__(self, code: Status, message: str = "", *, leader: LeaderHint | None = None):
        super().__init__(f"{code.name}: {message}" if message else code.name)
        self.code = code
        self.message = message
        self.leader = leader
