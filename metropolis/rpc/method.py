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

__all__ = ["Access", "Message", "Method"]


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
    #: cluster certificate yet (register, join).
    PROOF = "proof"


@dataclass(frozen=True)
class Method(Generic[Req, Resp]):
    """One RPC method.

    ``path`` is gRPC's ``/package.Service/Method``. ``streaming`` means
    server-streaming (one request, many responses); client streaming is not
    supported. ``leader_only`` methods are answered UNAVAILABLE, naming the
    leader, by a curator that is not the leader.
    """

    path: str
    request_type: type[Req]
    response_type: type[Resp]
    access: Access
    streaming: bool = False
    leader_only: bool = True

    def __post_init__(self) -> None:
        parts = self.path.split("/")
        if len(parts) != 3 or parts[0] or not parts[1] or not parts[2]:
            raise ValueError(f"method path must be /package.Service/Method, got {self.path!r}")
