"""What an RPC method is: its path, message types, shape and who may call it.

One :class:`Method` value describes a method for both ends: the server maps
it to a handler, the client calls it. Declaring access next to the method
(instead of inside each handler) is what guarantees that a refused caller
never reaches handler code.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Generic, Protocol, Self, TypeVar

__all__ = ["STALE_OK_HEADER", "UNKNOWN_METHOD", "Access", "Message", "Method"]

#: Request metadata by which a caller of a ``stale_ok`` method accepts a
#: follower's answer (value ``1``), for when no curator leads.
STALE_OK_HEADER = "metropolis-stale-ok"

#: The method name of a call to a path that no handler serves (its label
#: in :mod:`metropolis.rpc.metrics`).
UNKNOWN_METHOD = "unknown"


class Message(Protocol):
    """A protobuf message class as betterproto2 generates it."""

    def __bytes__(self) -> bytes: ...

    @classmethod
    def parse(cls, data: bytes) -> Self: ...


Req = TypeVar("Req", bound=Message)
Resp = TypeVar("Resp", bound=Message)


class Access(enum.Enum):
    """Who may call a method; checked by the server before the handler runs."""

    #: A node, by its cluster-issued node certificate.
    NODE = "node"
    #: The cluster owner, by a cluster-issued certificate for the owner key.
    OWNER = "owner"
    #: Anyone who proves possession of an Ed25519 key by a fresh signature
    #: over the request (see :mod:`metropolis.rpc.auth`): a node that has no
    #: cluster certificate yet (register, join). For client-streaming
    #: methods the signature covers an empty request: the proof is checked
    #: before any message arrives.
    PROOF = "proof"


@dataclass(frozen=True)
class Method(Generic[Req, Resp]):
    """One RPC method.

    ``path`` is gRPC's ``/package.Service/Method``. ``streaming`` means
    the server sends a stream of responses; ``client_streaming`` that the
    client sends a stream of requests (both: bidirectional, as Monogon's
    Heartbeat and Escrow). ``leader_only`` methods are answered UNAVAILABLE, naming the
    leader, by a curator that is not the leader.
    """

    path: str
    request_type: type[Req]
    response_type: type[Resp]
    access: Access
    streaming: bool = False
    leader_only: bool = True
    client_streaming: bool = False
    stale_ok: bool = False

    def __post_init__(self) -> None:
        if self.client_streaming and not self.streaming:
            raise ValueError(f"{self.path}: client streaming needs a streamed response too")
        parts = self.path.split("/")
        if len(parts) != 3 or parts[0] or not parts[1] or not parts[2]:
            raise ValueError(f"method path must be /package.Service/Method, got {self.path!r}")
