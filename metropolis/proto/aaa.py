"""The owner's escrow of an owner certificate (``aaa.proto``, Monogon's AAA): messages."""

from metropolis.proto.gen.metropolis.proto.api import (
    EscrowFromClient,
    EscrowFromClientParameters,
    EscrowFromServer,
    EscrowFromServerProofRequest,
    EscrowFromServerProofRequestKind,
)

__all__ = [
    "EscrowFromClient",
    "EscrowFromClientParameters",
    "EscrowFromServer",
    "EscrowFromServerProofRequest",
    "EscrowFromServerProofRequestKind",
]
