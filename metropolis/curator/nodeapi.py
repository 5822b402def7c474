"""The curator's API for nodes (the ``Curator`` service): what nodes call.

``Watch`` of the caller's own record or of every node, ``UpdateNodeStatus``
(each one a heartbeat), ``RegisterNode`` (a register ticket, with a proof
of possession of the node key) and ``CommitNode``. Who may call what is
declared in :mod:`metropolis.rpc.methods` and checked before a handler runs.
The node's side of the lifecycle follows Monogon's::

    RegisterNode (ticket)  -> NEW       record with the node key and join key
    ApproveNode (owner)    -> STANDBY   (:mod:`.managementapi`)
    CommitNode (node)      -> UP        node certificate issued, unlock key kept

Heartbeats: every accepted ``UpdateNodeStatus`` is one (the status push
repeats itself periodically). The leader stores its own wall-clock time of
it under ``/heartbeats/<id>`` (a small key apart from the record, so that
a repeated status does not wake every Watch of the record); ``GetNodes``
reads them (:mod:`.managementapi`).

``Watch`` computes a ConsensusMember's peer list when it sends the role
(from etcd's member list then), so a node that (re)starts its etcd later
joins the members of that moment, not those of the grant.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Awaitable, Callable

from cryptography import x509

from metropolis import pki
from metropolis.consensus import Status as ConsensusStatus
from metropolis.consensus.client import Compare, Put
from metropolis.curator.bootstrap import node_certificate
from metropolis.curator.membership import members, peer_url
from metropolis.curator.records import Records
from metropolis.curator.state import (
    CA_KEY_KEY,
    NODES,
    REGISTER_TICKET_KEY,
    CuratorError,
    heartbeat_key,
    issued_certificate_key,
    join_key_key,
    node_key,
    parse_node,
    watch_node,
)
from metropolis.proto import curator_api as c
from metropolis.proto.common import (
    NodeRoles,
    NodeRolesConsensusMember,
    NodeRolesConsensusMemberPeer,
    NodeState,
)
from metropolis.proto.curator import Node, RegisterTicket
from metropolis.rpc import CallContext, RPCError, Server, methods
from metropolis.rpc.status import Status

__all__ = ["BACKLOG_CHUNK", "NodeAPI"]

_log = logging.getLogger("metropolis.curator.nodeapi")

#: Nodes per event of a ``nodes_in_cluster`` watch's backlog. A cluster's
#: whole directory in one message would grow with the cluster, towards
#: gRPC's 4 MiB message limit (some tens of thousands of nodes), and its
#: decoding and encoding would hold the curator's event loop all that
#: while: a node that starts (its own directory watch on its own curator)
#: would keep every other call waiting for a thousand nodes' worth of it.
BACKLOG_CHUNK = 100


class NodeAPI:
    """Handlers of the ``Curator`` service; :meth:`register` them with a server."""

    def __init__(
        self, records: Records, consensus: ConsensusStatus, *, ca: x509.Certificate, peer_port: int
    ) -> None:
        self._records = records
        self._kv = records.kv
        self._consensus = consensus
        self._ca = ca
        self._peer_port = peer_port

    def register(self, server: Server) -> None:
        """Register every handler with ``server``."""
        server.stream(methods.WATCH, self.watch)
        server.unary(methods.UPDATE_NODE_STATUS, self.update_node_status)
        server.unary(methods.REGISTER_NODE, self.register_node)
        server.unary(methods.COMMIT_NODE, self.commit_node)

    async def watch(
        self,
        request: c.WatchRequest,
        ctx: CallContext,
        send: Callable[[c.WatchEvent], Awaitable[None]],
    ) -> None:
        """Send the watched records, then each change; until the caller leaves.

        ``node_in_cluster``: the caller's own record (another node's is
        PERMISSION_DENIED), its ConsensusMember peers computed at each send
        (:meth:`_current_roles`). ``nodes_in_cluster``: every node's ID,
        status and role names (no join data), all current ones in the first
        event (``LAST_BACKLOGGED``), then each change; nodes keep their
        cluster directory current with it. UNAVAILABLE when etcd's member
        list cannot be read.
        """
        if request.nodes_in_cluster is not None:
            await self._watch_all(send)
            return
        wanted = request.node_in_cluster.node_id if request.node_in_cluster else ""
        if wanted != ctx.peer.node_id:
            raise RPCError(Status.PERMISSION_DENIED, "a node may only watch its own record")
        async with watch_node(self._kv, wanted) as records:
            async for record in records:
                if record is None:
                    await send(c.WatchEvent(node_tombstones=[c.WatchEventNodeTombstone(wanted)]))
                    continue
                roles = await self._current_roles(wanted, record)
                await send(
                    c.WatchEvent(
                        nodes=[c.Node(id=wanted, roles=roles, status=record.status)],
                        progress=c.WatchEventProgress.LAST_BACKLOGGED,
                    )
                )

    async def _current_roles(self, node_id: str, record: Node) -> NodeRoles:
        """The record's roles, a ConsensusMember's peers being etcd's members now.

        The join data stored at grant names the members of that moment; a
        node that starts its etcd later (a restart from wiped data, a slow
        start) must be told the current ones, or it would dial members that
        are gone and miss those added since. Every member but the node's own
        (by name, or by peer URL while it is an unstarted learner) is a peer.
        """
        roles = record.roles or NodeRoles()
        role = roles.consensus_member
        if role is None:
            return roles
        current = await members(self._consensus)
        own_url = peer_url(record, self._peer_port)
        peers = [
            NodeRolesConsensusMemberPeer(name=m.name or f"unstarted-{m.id:x}", url=m.peer_urls[0])
            for m in current
            if m.peer_urls and m.name != node_id and own_url not in m.peer_urls
        ]
        return NodeRoles(
            consensus_member=NodeRolesConsensusMember(
                ca_certificate=role.ca_certificate,
                peer_certificate=role.peer_certificate,
                initial_crl=role.initial_crl,
                peers=peers,
            ),
            kubernetes_controller=roles.kubernetes_controller,
            kubernetes_worker=roles.kubernetes_worker,
        )

    async def _watch_all(self, send: Callable[[c.WatchEvent], Awaitable[None]]) -> None:
        """Every node (ID, status, role names), then each change; until cancelled.

        The nodes there are when the watch begins go in events of at most
        :data:`BACKLOG_CHUNK` nodes, the last one (only) marked
        ``LAST_BACKLOGGED``, as Monogon's curator chunks them.
        """
        first = await self._kv.range(NODES, prefix=True)
        # The backlog in chunks (at least one event, the last one marked).
        for start in range(0, max(len(first.kvs), 1), BACKLOG_CHUNK):
            chunk = first.kvs[start : start + BACKLOG_CHUNK]
            last = start + BACKLOG_CHUNK >= len(first.kvs)
            await send(
                c.WatchEvent(
                    nodes=[
                        n for kv in chunk if (n := _directory_node(kv.key, kv.value)) is not None
                    ],
                    progress=(
                        c.WatchEventProgress.LAST_BACKLOGGED
                        if last
                        else c.WatchEventProgress.UNSPECIFIED
                    ),
                )
            )
        async with self._kv.watch(NODES, prefix=True, start_revision=first.revision + 1) as w:
            async for response in w:
                event = c.WatchEvent()
                for change in response.events:
                    if change.type == "DELETE":
                        node_id = change.kv.key.removeprefix(NODES).decode()
                        event.node_tombstones.append(c.WatchEventNodeTombstone(node_id))
                    elif (n := _directory_node(change.kv.key, change.kv.value)) is not None:
                        event.nodes.append(n)
                if event.nodes or event.node_tombstones:
                    await send(event)

    async def update_node_status(
        self, request: c.UpdateNodeStatusRequest, ctx: CallContext
    ) -> c.UpdateNodeStatusResponse:
        if request.node_id != ctx.peer.node_id:
            raise RPCError(Status.PERMISSION_DENIED, "a node may only update its own status")
        if request.status is None:
            raise RPCError(Status.INVALID_ARGUMENT, "status missing")
        status = request.status
        key = node_key(request.node_id)
        while True:
            found = await self._records.read(request.node_id)
            if found is None:
                raise RPCError(Status.NOT_FOUND, f"no node {request.node_id}")
            record, revision = found
            # The heartbeat always; the record only when the status changed.
            writes = [Put(heartbeat_key(request.node_id), str(time.time_ns()).encode())]
            if record.status != status:
                record.status = status
                writes.append(Put(key, bytes(record)))
            if await self._records.txn([Compare.mod_revision(key, "==", revision)], writes):
                return c.UpdateNodeStatusResponse()

    async def register_node(
        self, request: c.RegisterNodeRequest, ctx: CallContext
    ) -> c.RegisterNodeResponse:
        """Create a NEW record for the proven key; idempotent for the same key and join key."""
        stored = await self._kv.get(REGISTER_TICKET_KEY)
        if stored is None or not secrets.compare_digest(
            RegisterTicket.parse(stored.value).opaque, request.register_ticket
        ):
            raise RPCError(Status.PERMISSION_DENIED, "wrong register ticket")
        if len(request.join_key) != 32:
            raise RPCError(Status.INVALID_ARGUMENT, "join key must be a raw Ed25519 key")
        node_id = ctx.peer.node_id
        record = Node(
            public_key=ctx.peer.public_key, fsm_state=NodeState.NEW, join_key=request.join_key
        )
        key = node_key(node_id)
        if await self._records.txn(
            [Compare.absent(key), Compare.absent(join_key_key(request.join_key))],
            [Put(key, bytes(record)), Put(join_key_key(request.join_key), node_id.encode())],
        ):
            _log.info("registered %s", node_id)
            return c.RegisterNodeResponse()
        found = await self._records.read(node_id)
        if found is None or found[0].join_key != request.join_key:
            raise RPCError(Status.ALREADY_EXISTS, "node or join key registered differently")
        return c.RegisterNodeResponse()

    async def commit_node(
        self, request: c.CommitNodeRequest, ctx: CallContext
    ) -> c.CommitNodeResponse:
        """Move an approved (STANDBY) node to UP and issue its certificate; idempotent."""
        if len(request.cluster_unlock_key) != 32:
            raise RPCError(Status.INVALID_ARGUMENT, "cluster unlock key must be 32 bytes")
        node_id = ctx.peer.node_id
        found = await self._records.read(node_id)
        if found is None:
            raise RPCError(Status.NOT_FOUND, f"no node {node_id}")
        record, revision = found
        issued = await self._kv.get(issued_certificate_key(node_id))
        if record.fsm_state == NodeState.UP and issued is not None:
            if record.cluster_unlock_key != request.cluster_unlock_key:
                raise RPCError(Status.FAILED_PRECONDITION, "committed with another unlock key")
            return c.CommitNodeResponse(
                ca_certificate=pki.encode_certificate(self._ca, pki.Encoding.DER),
                node_certificate=issued.value,
            )
        if record.fsm_state != NodeState.STANDBY:
            raise RPCError(Status.FAILED_PRECONDITION, "node is not approved")
        ca_key_stored = await self._kv.get(CA_KEY_KEY)
        if ca_key_stored is None:
            raise RPCError(Status.INTERNAL, "cluster CA key missing")
        certificate = node_certificate(
            pki.decode_private_key(ca_key_stored.value), self._ca, ctx.peer.public_key
        )
        der = pki.encode_certificate(certificate, pki.Encoding.DER)
        record.fsm_state = NodeState.UP
        record.cluster_unlock_key = request.cluster_unlock_key
        key = node_key(node_id)
        if not await self._records.txn(
            [Compare.mod_revision(key, "==", revision)],
            [Put(key, bytes(record)), Put(issued_certificate_key(node_id), der)],
        ):
            raise RPCError(Status.ABORTED, "node record changed; retry")
        _log.info("committed %s", node_id)
        return c.CommitNodeResponse(
            ca_certificate=pki.encode_certificate(self._ca, pki.Encoding.DER),
            node_certificate=der,
        )


def _directory_node(key: bytes, raw: bytes) -> c.Node | None:
    """A record as ``nodes_in_cluster`` sends it: ID, status, role names only.

    The ConsensusMember join data is the node's own business (peer
    certificates); others learn only that it has the role.
    """
    node_id = key.removeprefix(NODES).decode()
    try:
        record = parse_node(raw, node_id)
    except CuratorError as e:
        _log.error("skipping a record: %s", e)
        return None
    # Presence, not betterproto2's truth (which compares every field with
    # its default): this runs for every node of a watch's backlog.
    roles = record.roles if record.roles is not None else NodeRoles()
    return c.Node(
        id=node_id,
        status=record.status,
        roles=NodeRoles(
            consensus_member=NodeRolesConsensusMember() if roles.consensus_member else None,
            kubernetes_controller=roles.kubernetes_controller,
            kubernetes_worker=roles.kubernetes_worker,
        ),
    )
