"""Joining a cluster as a new node: register with a ticket, wait for approval, commit.

Monogon's ``cluster_register.go``, on Trio::

    intent saved: node key, join key, unlock keys, ticket, cluster (disk)
    RegisterNode(ticket, join key)     proof of possession of the node key
    CommitNode(cluster unlock key)     repeated until the owner approved (FAILED_PRECONDITION)
    -> node certificate: saved with directory, sealed configuration; intent removed

The node has no cluster certificate yet, so it calls with a proof of
possession (:mod:`metropolis.rpc.auth`) instead of Monogon's self-signed
ephemeral certificate. The cluster's CA and directory come from the owner
(``owner info --out FILE``: a ``GetClusterInfoResponse``).

Crash safety: the keys are on disk (:func:`~.disk.save_register_intent`)
before the cluster hears of them, and RegisterNode and CommitNode are
idempotent for the same keys, so :func:`register` simply runs again from
the saved intent after a crash or a cancellation at any point; the node
keeps the identity the cluster knows it by. Errors:
:class:`~metropolis.rpc.RPCError` other than "not approved yet",
:class:`~metropolis.roleserve.disk.NodeRootError` for a bad cluster file.
"""

from __future__ import annotations

import functools
import logging

import trio

from metropolis import identity, pki
from metropolis.crashpoint import crash_point
from metropolis.identity import NodeCredentials
from metropolis.localstorage import Root
from metropolis.proto import curator_api as c
from metropolis.proto.common import NodeRoles
from metropolis.proto.private import SealedConfiguration
from metropolis.roleserve import disk
from metropolis.roleserve.values import RegisterIntent, join_key_bytes
from metropolis.rpc import (
    RPCError,
    Status,
    client_context,
    endpoints_from_directory,
    methods,
    open_client,
)

__all__ = ["register"]

_log = logging.getLogger("metropolis.roleserve.register")


async def register(
    root: Root,
    settings: disk.NodeSettings,
    intent: RegisterIntent,
    *,
    poll: float = 1.0,
) -> NodeCredentials:
    """Register, wait for approval, commit, save the node in ``root``; return its credentials.

    ``intent`` must already be saved in ``root`` (:func:`~.disk.save_register_intent`).
    """
    cluster = intent.cluster
    if cluster.cluster_directory is None:
        raise disk.NodeRootError("the cluster information holds no directory")
    ca = pki.decode_certificate(cluster.ca_certificate)
    node_key, join_key = intent.node_private_key, intent.join_private_key
    endpoints = endpoints_from_directory(cluster.cluster_directory, settings.curator_port)
    async with open_client(endpoints, client_context(ca), proof_key=node_key) as client:
        await client.unary(
            methods.REGISTER_NODE,
            c.RegisterNodeRequest(
                register_ticket=intent.ticket, join_key=pki.public_key_bytes(join_key)
            ),
        )
        crash_point("register-after-register-rpc")
        _log.info(
            "registered; waiting for the owner to approve %s",
            identity.node_id(node_key.public_key()),
        )
        while True:
            try:
                committed = await client.unary(
                    methods.COMMIT_NODE,
                    c.CommitNodeRequest(cluster_unlock_key=intent.cluster_unlock_key),
                )
                break
            except RPCError as e:
                if e.code is not Status.FAILED_PRECONDITION:
                    raise
            await trio.sleep(poll)
    crash_point("register-after-commit")
    credentials = NodeCredentials(
        node_key,
        pki.decode_certificate(committed.node_certificate),
        pki.decode_certificate(committed.ca_certificate),
    )
    sealed = SealedConfiguration(
        node_unlock_key=intent.node_unlock_key,
        join_key=join_key_bytes(join_key),
        cluster_ca=pki.encode_certificate(ca, pki.Encoding.DER),
    )
    await trio.to_thread.run_sync(
        functools.partial(
            disk.finish_bootstrap,
            root,
            settings,
            roles=NodeRoles(),
            directory=cluster.cluster_directory,
            sealed=sealed,
            credentials=credentials,
        )
    )
    _log.info("committed: %s", credentials.node_id)
    return credentials
