"""The curator's API for the owner (the ``Management`` service).

``GetRegisterTicket``, ``GetClusterInfo``, ``GetNodes`` (with each node's
health and etcd membership), ``ApproveNode`` (NEW -> STANDBY),
``UpdateNodeRoles``, whose ConsensusMember changes go through
:mod:`.membership`, and ``DeleteNode`` (:mod:`.deletion`). Every method
needs the owner's certificate (:mod:`metropolis.rpc.methods`). GetNodes
only reads etcd, so a follower may serve it (``stale_ok``): its answer is
as current as its etcd member, but while no curator leads nobody records
heartbeats, so health may show timeouts that are the failover's.

Health: ``GetNodes`` reports HEALTHY within ``heartbeat_timeout`` of a
node's last heartbeat (the leader's time of its last status, stored by
:mod:`.nodeapi`), HEARTBEAT_TIMEOUT after, UNKNOWN if the node never
reported or is not UP. Kept in etcd, the times survive a change of leader
(on another machine its clock may differ a little: ages are clamped at
zero).
"""

from __future__ import annotations

import datetime
import logging
import secrets
import time
from collections.abc import Awaitable, Callable

from cryptography import x509

from metropolis import identity, pki
from metropolis.consensus import Status as ConsensusStatus
from metropolis.consensus.client import Compare, Member, Op, Put
from metropolis.curator.deletion import Deletion
from metropolis.curator.membership import Membership, members, peer_url
from metropolis.curator.records import Records
from metropolis.curator.state import HEARTBEATS, REGISTER_TICKET_KEY
from metropolis.proto import management as m
from metropolis.proto.common import (
    ClusterDirectory,
    ClusterDirectoryNode,
    ClusterDirectoryNodeAddress,
    NodeRoles,
    NodeRolesKubernetesController,
    NodeRolesKubernetesWorker,
    NodeState,
)
from metropolis.proto.curator import Node, RegisterTicket
from metropolis.rpc import CallContext, RPCError, Server, methods
from metropolis.rpc.status import Status

__all__ = ["HEARTBEAT_TIMEOUT", "ManagementAPI"]

_log = logging.getLogger("metropolis.curator.managementapi")

#: Seconds without a status update after which a node is HEARTBEAT_TIMEOUT
#: (Monogon's: twice its 5 s heartbeat interval).
HEARTBEAT_TIMEOUT = 10.0


class ManagementAPI:
    """Handlers of the ``Management`` service; :meth:`register` them with a server."""

    def __init__(
        self,
        records: Records,
        membership: Membership,
        deletion: Deletion,
        consensus: ConsensusStatus,
        *,
        ca: x509.Certificate,
        peer_port: int,
        heartbeat_timeout: float = HEARTBEAT_TIMEOUT,
    ) -> None:
        self._records = records
        self._kv = records.kv
        self._membership = membership
        self._deletion = deletion
        self._consensus = consensus
        self._ca = ca
        self._peer_port = peer_port
        self._heartbeat_timeout = heartbeat_timeout

    def register(self, server: Server) -> None:
        """Register every handler with ``server``."""
        server.unary(methods.GET_REGISTER_TICKET, self.get_register_ticket)
        server.unary(methods.GET_CLUSTER_INFO, self.get_cluster_info)
        server.stream(methods.GET_NODES, self.get_nodes)
        server.unary(methods.APPROVE_NODE, self.approve_node)
        server.unary(methods.UPDATE_NODE_ROLES, self.update_node_roles)
        server.unary(methods.DELETE_NODE, self.delete_node)

    async def get_register_ticket(
        self, request: m.GetRegisterTicketRequest, ctx: CallContext
    ) -> m.GetRegisterTicketResponse:
        """The cluster's register ticket, made (at random) on the first request."""
        stored = await self._kv.get(REGISTER_TICKET_KEY)
        if stored is None:
            await self._records.txn(
                [Compare.absent(REGISTER_TICKET_KEY)],
                [Put(REGISTER_TICKET_KEY, bytes(RegisterTicket(opaque=secrets.token_bytes(32))))],
            )
            # Ours, or one a racing request wrote first.
            stored = await self._kv.get(REGISTER_TICKET_KEY)
            assert stored is not None
        return m.GetRegisterTicketResponse(ticket=RegisterTicket.parse(stored.value).opaque)

    async def get_cluster_info(
        self, request: m.GetClusterInfoRequest, ctx: CallContext
    ) -> m.GetClusterInfoResponse:
        """The directory: every node with a running curator and a reported address."""
        nodes = [
            ClusterDirectoryNode(
                public_key=r.public_key,
                addresses=[ClusterDirectoryNodeAddress(host=r.status.external_address)],
            )
            for r in await self._records.all()
            if r.status is not None and r.status.external_address and r.status.running_curator
        ]
        return m.GetClusterInfoResponse(
            cluster_directory=ClusterDirectory(nodes=nodes),
            ca_certificate=pki.encode_certificate(self._ca, pki.Encoding.DER),
        )

    async def get_nodes(
        self,
        request: m.GetNodesRequest,
        ctx: CallContext,
        send: Callable[[m.Node], Awaitable[None]],
    ) -> None:
        if request.filter:
            raise RPCError(Status.UNIMPLEMENTED, "filters are not supported")
        heard = await self._heartbeats()
        now = time.time_ns()
        try:
            current: list[Member] | None = await members(self._consensus)
        except RPCError as e:
            _log.info("etcd membership unknown: %s", e)
            current = None
        for record in await self._records.all():
            health, since = self._health(record, heard, now)
            await send(
                m.Node(
                    pubkey=record.public_key,
                    state=record.fsm_state,
                    status=record.status,
                    roles=record.roles or NodeRoles(),
                    health=health,
                    time_since_heartbeat=since,
                    etcd_membership=self._etcd_membership(record, current),
                )
            )

    async def _heartbeats(self) -> dict[str, bytes]:
        beats = await self._kv.range(HEARTBEATS, prefix=True)
        return {kv.key.removeprefix(HEARTBEATS).decode(): kv.value for kv in beats.kvs}

    def _etcd_membership(self, record: Node, current: list[Member] | None) -> m.NodeEtcdMembership:
        """The node's member in ``current`` (by name, or peer URL while unstarted)."""
        if current is None:
            return m.NodeEtcdMembership.UNKNOWN
        node_id = identity.node_id(record.public_key)
        url = peer_url(record, self._peer_port)
        for member in current:
            if member.name == node_id or (url is not None and url in member.peer_urls):
                if member.is_learner:
                    return m.NodeEtcdMembership.LEARNER
                return m.NodeEtcdMembership.VOTER
        return m.NodeEtcdMembership.NONE

    def _health(
        self, record: Node, heard: dict[str, bytes], now: int
    ) -> tuple[m.NodeHealth, datetime.timedelta | None]:
        """Health and time since the last heartbeat (None: never, or not UP)."""
        raw = heard.get(identity.node_id(record.public_key))
        if record.fsm_state != NodeState.UP or raw is None:
            return m.NodeHealth.UNKNOWN, None
        try:
            age = max(0, now - int(raw)) / 1e9
        except ValueError:
            _log.error("damaged heartbeat of %s", identity.node_id(record.public_key))
            return m.NodeHealth.UNKNOWN, None
        since = datetime.timedelta(seconds=age)
        if age > self._heartbeat_timeout:
            return m.NodeHealth.HEARTBEAT_TIMEOUT, since
        return m.NodeHealth.HEALTHY, since

    async def approve_node(
        self, request: m.ApproveNodeRequest, ctx: CallContext
    ) -> m.ApproveNodeResponse:
        """NEW -> STANDBY; approving a STANDBY or UP node again is a no-op."""
        node_id = _node_id(request.pubkey)

        def change(record: Node) -> Node | None:
            if record.fsm_state in (NodeState.STANDBY, NodeState.UP):
                return None
            if record.fsm_state != NodeState.NEW:
                raise RPCError(Status.FAILED_PRECONDITION, f"node is {record.fsm_state.name}")
            record.fsm_state = NodeState.STANDBY
            return record

        await self._records.update(node_id, change)
        _log.info("approved %s", node_id)
        return m.ApproveNodeResponse()

    async def update_node_roles(
        self, request: m.UpdateNodeRolesRequest, ctx: CallContext
    ) -> m.UpdateNodeRolesResponse:
        """Set roles of an UP node; ConsensusMember changes the etcd membership.

        Granting ConsensusMember adds the node as a learner at its reported
        address (FAILED_PRECONDITION if it reported none) and stores its join
        data; its role fetch then starts etcd. Revoking it is refused for the
        last consensus member; otherwise the etcd member is removed, its peer
        certificate revoked on the etcd peer CRL, and the role dropped, which
        stops the node's control plane. For the node this curator runs on,
        the removal is left to the next leader (:mod:`.removal`): a removal
        mark is written, this curator resigns once it has answered, and the
        next leader removes the member, then the role.
        """
        node_id = _requested_id(request.id, request.pubkey)
        worker, controller = request.kubernetes_worker, request.kubernetes_controller
        consensus = request.consensus_member
        async with self._membership.lock:
            deferred: list[Op] = []
            if consensus is True:
                # Completes pending removals first, as revoke does; refuses a
                # node that is not UP; writes the record itself.
                await self._membership.grant(node_id)
                if worker is None and controller is None:
                    return m.UpdateNodeRolesResponse()  # nothing more to write
            elif consensus is False:
                deferred = await self._membership.revoke(node_id)

            def change(record: Node) -> Node | None:
                if record.fsm_state != NodeState.UP:
                    raise RPCError(Status.FAILED_PRECONDITION, "node is not UP")
                if worker is None and controller is None and not deferred:
                    return None  # nothing more to write (a revoke wrote its own)
                roles = record.roles or NodeRoles()
                if worker is not None:
                    roles.kubernetes_worker = NodeRolesKubernetesWorker() if worker else None
                if controller is not None:
                    roles.kubernetes_controller = (
                        NodeRolesKubernetesController() if controller else None
                    )
                record.roles = roles
                return record

            await self._records.update(node_id, change, deferred)
        if deferred:
            _log.info("ConsensusMember of %s (this node) to be removed; resigning", node_id)
        return m.UpdateNodeRolesResponse()

    async def delete_node(
        self, request: m.DeleteNodeRequest, ctx: CallContext
    ) -> m.DeleteNodeResponse:
        """Delete a node (:mod:`.deletion`); the role bypass only for a timed-out node."""
        node_id = _requested_id(request.id, request.pubkey)
        heard = await self._heartbeats()

        def timed_out(record: Node) -> bool:
            health, _ = self._health(record, heard, time.time_ns())
            return health == m.NodeHealth.HEARTBEAT_TIMEOUT

        await self._deletion.delete(
            node_id,
            bypass_roles=request.safety_bypass_has_roles is not None,
            timed_out=timed_out,
        )
        return m.DeleteNodeResponse()


def _requested_id(node_id: str | None, public_key: bytes | None) -> str:
    """The node a request names by ID or key; INVALID_ARGUMENT if neither is usable."""
    if not node_id:
        return _node_id(public_key or b"")
    if "/" in node_id or not node_id.isprintable():
        raise RPCError(Status.INVALID_ARGUMENT, "not a node ID")
    return node_id


def _node_id(public_key: bytes) -> str:
    if len(public_key) != 32:
        raise RPCError(Status.INVALID_ARGUMENT, "node public key must be 32 raw bytes")
    return identity.node_id(public_key)
