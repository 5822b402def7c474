"""Joining a cluster as a new node: register with a ticket, wait for approval, commit.

Monogon's ``cluster_register.go``, on Trio::

    new node key, join key, unlock keys
    RegisterNode(ticket, join key)     proof of possession of the node key
    CommitNode(cluster unlock key)     repeated until the owner approved (FAILED_PRECONDITION)
    -> node certificate: saved with settings, directory, sealed configuration

The node has no cluster certificate yet, so it calls with a proof of
possession (:mod:`metropolis.rpc.auth`) instead of Monogon's self-signed
ephemeral certificate. The cluster's CA and directory come from the owner
(``owner info --out FILE``: a ``GetClusterInfoResponse``).

Cancellation: at any point before the save nothing is on disk; the keys are
lost and the cluster keeps a NEW or STANDBY record for them. Errors:
:class:`~metropolis.rpc.RPCError` other than "not approved yet",
:class:`~metropolis.roleserve.disk.NodeRootError` for a used root.
"""

from __future__ import annotations

import functools
import logging
import os

import trio

from metropolis import identity, pki
from metropolis.identity import NodeCredentials
from metropolis.localstorage import Root
from metropolis.proto import curator_api as c
from metropolis.proto.management import GetClusterInfoResponse
from metropolis.proto.private import SealedConfiguration
from metropolis.roleserve import disk
from metropolis.roleserve.values import join_key_bytes
from metropolis.rpc import RPCError, Status, client_context, endpoints_from_directory, open_client
from metropolis.rpc import api as methods

__all__ = ["register"]

_log = logging.getLogger("metropolis.roleserve.register")


async def register(
    root: Root,
    settings: disk.NodeSettings,
    cluster: GetClusterInfoResponse,
    ticket: bytes,
    *,
    poll: float = 1.0,
) -> NodeCredentials:
    """Register, wait for approval, commit, save the node in ``root``; return its credentials."""
    if cluster.cluster_directory is None:
        raise disk.NodeRootError("the cluster information holds no directory")
    ca = pki.decode_certificate(cluster.ca_certificate)
    node_key, join_key = pki.generate_key(), pki.generate_key()
    cluster_unlock_key, node_unlock_key = os.urandom(32), os.urandom(32)
    endpoints = endpoints_from_directory(cluster.cluster_directory, settings.curator_port)
    async with open_client(endpoints, client_context(ca), proof_key=node_key) as client:
        await client.unary(
            methods.REGISTER_NODE,
            c.RegisterNodeRequest(register_ticket=ticket, join_key=pki.public_key_bytes(join_key)),
        )
        _log.info(
            "registered; waiting for the owner to approve %s",
            identity.node_id(node_key.public_key()),
        )
        while True:
            try:
                committed = await client.unary(
                    methods.COMMIT_NODE, c.CommitNodeRequest(cluster_unlock_key=cluster_unlock_key)
                )
                break
            except RPCError as e:
                if e.code is not Status.FAILED_PRECONDITION:
                    raise
            await trio.sleep(poll)
    credentials = NodeCredentials(
        node_key,
        pki.decode_certificate(committed.node_certificate),
        pki.decode_certificate(committed.ca_certificate),
    )
    sealed = SealedConfiguration(
        node_unlock_key=node_unlock_key,
        join_key=join_key_bytes(join_key),
        cluster_ca=pki.encode_certificate(ca, pki.Encoding.DER),
    )
    await trio.to_thread.run_sync(
        functools.partial(
            disk.save_registered,
            root,
            settings,
            directory=cluster.cluster_directory,
            sealed=sealed,
            credentials=credentials,
        )
    )
    _log.info("committed: %s", credentials.node_id)
    return credentials
