"""The owner's escrow (``AAA.Escrow``): a proof of the owner key buys an owner certificate.

With it the owner needs only its key and the cluster's CA and directory
(``owner info --out``), never a node's disk. The flow, Monogon's owner
escrow with this package's proof of possession::

    owner (no certificate; proof of possession of key K in the metadata)
      ─ EscrowFromClient{parameters: {requested_identity_name: "owner",
                                      public_key: K}} ─▶ any curator
      curator: K proven, K == the initial owner key (etcd)
      ◀─ EscrowFromServer{fulfilled: [REFRESH_CERTIFICATE],
                          emitted_certificate: PEM, CN "owner", key K}

Any curator answers (not only the leader): it reads the CA key from its
own etcd member and writes nothing, so escrow works while the curators
elect a new leader. Each call issues a new certificate; all of them
certify the same key, which is what the owner is recognised by.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable

import trio
from cryptography import x509

from metropolis import identity, pki
from metropolis.consensus.client import KV
from metropolis.curator.state import CA_KEY_KEY
from metropolis.proto import aaa
from metropolis.rpc import CallContext, RPCError, Server, methods
from metropolis.rpc.status import Status

__all__ = ["OWNER_IDENTITY", "Escrow"]

_log = logging.getLogger("metropolis.curator.aaa")

#: The one identity served (Monogon's MVP too).
OWNER_IDENTITY = "owner"

_REFRESH = aaa.EscrowFromServerProofRequestKind.REFRESH_CERTIFICATE


class Escrow:
    """The ``AAA`` service's handler; :meth:`register` it with a server."""

    def __init__(self, kv: KV, *, ca: x509.Certificate, owner_key: bytes) -> None:
        self._kv = kv
        self._ca = ca
        self._owner_key = owner_key

    def register(self, server: Server) -> None:
        server.bidi(methods.ESCROW, self.escrow)

    async def escrow(
        self,
        requests: trio.MemoryReceiveChannel[aaa.EscrowFromClient],
        ctx: CallContext,
        send: Callable[[aaa.EscrowFromServer], Awaitable[None]],
    ) -> None:
        """Answer the first message with an owner certificate, or refuse.

        INVALID_ARGUMENT: no parameters, or a public key that is not 32
        bytes. UNIMPLEMENTED: an identity other than ``owner``, or a key
        other than the proven one (as Monogon). PERMISSION_DENIED: the
        proven key is not the owner's. The proof itself was checked before
        this handler ran (UNAUTHENTICATED without one).
        """
        try:
            first = await requests.receive()
        except trio.EndOfChannel:
            raise RPCError(Status.INVALID_ARGUMENT, "no request sent") from None
        parameters = first.parameters
        if parameters is None:
            raise RPCError(Status.INVALID_ARGUMENT, "parameters must be set")
        if parameters.requested_identity_name != OWNER_IDENTITY:
            raise RPCError(Status.UNIMPLEMENTED, "only the owner identity is served")
        if len(parameters.public_key) != 32:
            raise RPCError(Status.INVALID_ARGUMENT, "public_key must be a raw Ed25519 key")
        if not hmac.compare_digest(parameters.public_key, ctx.peer.public_key):
            raise RPCError(
                Status.UNIMPLEMENTED, "a certificate for another key than the proven one"
            )
        if not hmac.compare_digest(ctx.peer.public_key, self._owner_key):
            raise RPCError(Status.PERMISSION_DENIED, "this key is not the cluster owner's")
        stored = await self._kv.get(CA_KEY_KEY)
        if stored is None:
            raise RPCError(Status.INTERNAL, "cluster CA key missing")
        certificate = pki.issue_certificate(
            pki.decode_private_key(stored.value),
            self._ca,
            pki.decode_public_key(parameters.public_key),
            identity.OWNER_COMMON_NAME,
            pki.Usage.CLIENT,
        )
        _log.info("issued an owner certificate (serial %d)", certificate.serial_number)
        await send(
            aaa.EscrowFromServer(
                fulfilled=[aaa.EscrowFromServerProofRequest(kind=_REFRESH)],
                emitted_certificate=pki.encode_certificate(certificate),
            )
        )
