"""The curator's RPC API, answered from etcd by the leading curator.

Node side (``Curator`` service): ``Watch`` of the caller's own record,
``UpdateNodeStatus``, ``RegisterNode`` (a register ticket, with a proof of
possession of the node key) and ``CommitNode``. Owner side (``Management``):
``GetRegisterTicket``, ``GetClusterInfo``, ``GetNodes``, ``ApproveNode``,
``UpdateNodeRoles``. Who may call what is declared in
:mod:`metropolis.rpc.api` and checked before a handler runs.

Every write is a leader-guarded transaction (:meth:`Leader.txn`): a curator
that lost its lease between the leadership check and the write gets
:class:`~metropolis.curator.election.NotLeader`, answered UNAVAILABLE, and
nothing is written. The node lifecycle follows Monogon's::

    RegisterNode (ticket)  -> NEW       record with the node key and join key
    ApproveNode (owner)    -> STANDBY
    CommitNode (node)      -> UP        node certificate issued, unlock key kept

The security hooks (:meth:`CuratorAPI.security`) answer from memory: the
owner key and CA are fixed at bootstrap and read once, the CRL is re-read
after every revocation this curator makes and on start, and leadership is
the last value of the election.

Granting ConsensusMember adds an etcd learner; revoking removes the member
and revokes its etcd peer certificate (:meth:`CuratorAPI.update_node_roles`).
The cluster CRL (``CRL_KEY``) is followed for the security hook; nothing
here writes it yet (decommissioning a node is not built).

Heartbeats: every accepted ``UpdateNodeStatus`` is one (the status push
repeats itself periodically). The leader stores its own wall-clock time of
it under ``/heartbeats/<id>`` (a small key apart from the record, so that
a repeated status does not wake every Watch of the record), and
``GetNodes`` reports HEALTHY within ``heartbeat_timeout`` of it,
HEARTBEAT_TIMEOUT after, UNKNOWN if the node never reported or is not UP.
Kept in etcd, the times survive a change of leader (on another machine
its clock may differ a little: ages are clamped at zero).

A follower's UNAVAILABLE names the leader's node ID and, from the leader's
reported status, its curator's ``host:port``: a client whose directory
predates that curator goes there.

A learner that never starts is removed at the next grant after
:data:`LEARNER_TIMEOUT`. ``Watch`` computes a ConsensusMember's peer list
when it sends the role (from etcd's member list then), so a node that
(re)starts its etcd later joins the members of that moment, not those of
the grant.

**Revoking ConsensusMember from the leader's own node.** The leader cannot
remove its own etcd member: the write that records the revocation and the
answer to the owner go through that very etcd. So the work is split across
two terms::

    owner ─ UpdateNodeRoles(n1, consensus off) ─▶ leader on n1
      n1 leader: guarded txn: /consensus-removals/n1 = n1's key (the record
                 keeps ConsensusMember: n1's etcd must run on) ── answers OK
      n1 election: sees its own mark ─▶ Follower, deletes /leader (resigns);
                   it cannot campaign again while the mark exists
      n2 curator wins; at the start of its term (and whenever a mark appears)
        complete_removals: member remove(n1) while n1's etcd still votes
                           (a 2-member cluster keeps its quorum for it),
                           n1's peer cert revoked, CRL written
                        ─▶ guarded txn: n1's record without ConsensusMember
                                        + delete the mark
      n1's etcd, removed, exits; n1's role fetch (through n2/n3: its cluster
      directory keeps itself current) gets the record: its control plane
      stops (curator, lease revoked; then etcd) and etcd's data is wiped

Stopping n1's etcd first and removing its member afterwards (as a removal
of another node does) would be wrong here: in a two-member cluster the
survivor alone has no quorum to elect a curator or remove anything. etcd
3.4 would also let the leader remove its own member (the raft leader steps
down), but the local etcd then exits under the curator before the record
is written and answered. Any ConsensusMember change while a mark is still
there completes that removal first, so the last-voter check counts right
and a granted node always joins as a new member. Leadership moves only
through the election key, so there is never a second leader.
"""

from __future__ import annotations

import datetime
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence

import trio
from cryptography import x509

from metropolis import identity, pki
from metropolis.consensus import ConsensusError
from metropolis.consensus import Status as ConsensusStatus
from metropolis.consensus.client import (
    Compare,
    Delete,
    EtcdClosed,
    EtcdError,
    Get,
    Member,
    Op,
    Put,
    RangeResult,
)
from metropolis.consensus.peerpki import NodePKI
from metropolis.curator.bootstrap import node_certificate
from metropolis.curator.election import ElectionState, Follower, Leader, NotLeader
from metropolis.curator.state import (
    CA_CERTIFICATE_KEY,
    CA_KEY_KEY,
    CONSENSUS_REMOVALS,
    INITIAL_OWNER_KEY,
    CuratorError,
    consensus_removal_key,
    heartbeat_key,
    issued_certificate_key,
    join_key_key,
    node_key,
    parse_node,
    watch_node,
)
from metropolis.event import ReadOnlyValue
from metropolis.gather import gather
from metropolis.proto import curator_api as c
from metropolis.proto import management as m
from metropolis.proto.common import (
    ClusterDirectory,
    ClusterDirectoryNode,
    ClusterDirectoryNodeAddress,
    NodeRoles,
    NodeRolesConsensusMember,
    NodeRolesConsensusMemberPeer,
    NodeRolesKubernetesController,
    NodeRolesKubernetesWorker,
    NodeState,
)
from metropolis.proto.curator import InitialOwner, Node, RegisterTicket
from metropolis.rpc import CallContext, LeaderHint, Leadership, RPCError, Server, ServerSecurity
from metropolis.rpc import api as methods
from metropolis.rpc.status import Status

__all__ = ["CRL_KEY", "HEARTBEAT_TIMEOUT", "LEARNER_TIMEOUT", "REGISTER_TICKET_KEY", "CuratorAPI"]

_log = logging.getLogger("metropolis.curator.api")

#: The cluster CA's current CRL (DER); absent while nothing is revoked.
CRL_KEY = b"/cluster-pki/ca/crl"
#: Seconds a granted node has to start its etcd before a later grant removes it.
LEARNER_TIMEOUT = 60.0
#: Seconds without a status update after which a node is HEARTBEAT_TIMEOUT
#: (Monogon's: twice its 5 s heartbeat interval).
HEARTBEAT_TIMEOUT = 10.0
#: The register ticket (curator.RegisterTicket), made on first request.
REGISTER_TICKET_KEY = b"/global/register_ticket"


class CuratorAPI:
    """Handlers and security hooks for one curator's RPC server.

    Build with :meth:`load` once consensus runs; keep :meth:`follow_election`
    running beside the server so ``leadership()`` stays current.
    """

    def __init__(
        self,
        consensus: ConsensusStatus,
        *,
        owner_key: bytes,
        ca: x509.Certificate,
        crl: x509.CertificateRevocationList | None,
        peer_port: int = 7834,
        learner_timeout: float = LEARNER_TIMEOUT,
        heartbeat_timeout: float = HEARTBEAT_TIMEOUT,
    ) -> None:
        self._consensus = consensus
        self._learner_timeout = learner_timeout
        self._heartbeat_timeout = heartbeat_timeout
        #: Learners this curator added: node ID -> (peer URL, when added).
        self._learners: dict[str, tuple[str, float]] = {}
        self._kv = consensus.curator_client()
        self._peer_port = peer_port
        # One membership change at a time from this curator: etcd allows one
        # learner, and two revokes racing could both pass the last-voter check.
        self._membership_lock = trio.Lock()
        self._owner_key = owner_key
        self._ca = ca
        self._crl = crl
        self._election: ElectionState | None = None
        #: The leading curator's host:port when following (for the hint).
        self._leader_address = ""

    @classmethod
    async def load(
        cls,
        consensus: ConsensusStatus,
        *,
        peer_port: int = 7834,
        learner_timeout: float = LEARNER_TIMEOUT,
        heartbeat_timeout: float = HEARTBEAT_TIMEOUT,
    ) -> CuratorAPI:
        """Read owner key, CA and CRL; :class:`CuratorError` if the cluster is missing.

        ``consensus`` must be running (its etcd client is used for every call).

        Serializable reads, answered by this node's etcd member alone: the
        owner key and the CA never change once the cluster exists, and the
        CRL is a cache that :meth:`follow_crl` keeps current (its first
        read is linearizable), as it would have to after a linearizable
        read too. On a node that has just joined, a linearizable read waits
        for the leader to confirm it still leads (a round of heartbeats):
        4-17 ms on the grant of ConsensusMember's critical path, measured.
        """
        kv = consensus.curator_client()
        keys = (INITIAL_OWNER_KEY, CA_CERTIFICATE_KEY, CRL_KEY)
        result = await kv.txn([], [Get(k, serializable=True) for k in keys], [])
        owner, ca, crl = (r for r in result.responses if isinstance(r, RangeResult))
        if not owner.kvs or not ca.kvs:
            raise CuratorError("no cluster in etcd (owner or CA missing)")
        try:
            return cls(
                consensus,
                peer_port=peer_port,
                learner_timeout=learner_timeout,
                heartbeat_timeout=heartbeat_timeout,
                owner_key=InitialOwner.parse(owner.kvs[0].value).public_key,
                ca=pki.decode_certificate(ca.kvs[0].value),
                crl=pki.decode_crl(crl.kvs[0].value) if crl.kvs else None,
            )
        except pki.PKIError as e:
            raise CuratorError(f"cluster PKI in etcd is damaged: {e}") from e

    # --- security hooks ---------------------------------------------------

    def security(self) -> ServerSecurity:
        return ServerSecurity(
            owner_key=lambda: self._owner_key,
            crl=lambda: self._crl,
            leadership=self._leadership,
        )

    def _leadership(self) -> Leadership:
        state = self._election
        if isinstance(state, Leader):
            return Leadership(True)
        if state is None or state.leader is None:
            return Leadership(False)
        return Leadership(False, LeaderHint(state.leader.node_id, self._leader_address))

    async def follow_election(self, election: ReadOnlyValue[ElectionState]) -> None:
        """Keep ``leadership()`` at the election's latest state; runs until cancelled."""
        with election.watch() as watcher:
            while True:
                self._election = state = await watcher.get()
                self._leader_address = ""
                if isinstance(state, Follower) and state.leader is not None:
                    self._leader_address = await self._curator_address(state.leader.node_id)

    async def _curator_address(self, node_id: str) -> str:
        """``host:port`` of the curator on ``node_id`` as its status says; "" if unknown.

        Sent with UNAVAILABLE, it lets a client whose directory predates
        that curator reach the leader.
        """
        try:
            found = await self._read(node_id)
        except (CuratorError, EtcdError) as e:
            _log.info("leader's address unknown: %s", e)
            return ""
        status = found[0].status if found is not None else None
        if status is None or not status.external_address or status.running_curator is None:
            return ""
        host = status.external_address
        host = f"[{host}]" if ":" in host else host
        return f"{host}:{status.running_curator.port}"

    def _leader(self) -> Leader:
        state = self._election
        if not isinstance(state, Leader):
            raise RPCError(Status.UNAVAILABLE, "this curator is not the leader")
        return state

    async def _txn(
        self, compare: list[Compare], success: Sequence[Op], failure: list[Get] | None = None
    ) -> bool:
        """A leader-guarded txn; whether ``compare`` held. UNAVAILABLE if we no longer lead."""
        try:
            result = await self._leader().txn(self._kv, compare, success, failure or [])
        except NotLeader as e:
            raise RPCError(Status.UNAVAILABLE, str(e)) from None
        return result.succeeded

    async def _read(self, node_id: str) -> tuple[Node, int] | None:
        stored = await self._kv.get(node_key(node_id))
        if stored is None:
            return None
        return parse_node(stored.value, node_id), stored.mod_revision

    async def _update(
        self,
        node_id: str,
        change: Callable[[Node], Node | None],
        also: Sequence[Op] = (),
        *,
        read: tuple[Node, int] | None = None,
    ) -> Node:
        """Apply ``change`` to the record of ``node_id`` atomically (retried on races).

        ``change`` returns the new record, or None to leave it as is.
        ``also`` is written in the same transaction as a changed record.
        NOT_FOUND if there is no record. ``read``: the record and its mod
        revision as the caller just read them (the first attempt skips the
        read; the revision check makes a stale one merely retry).
        """
        found = read
        while True:
            if found is None:
                found = await self._read(node_id)
            if found is None:
                raise RPCError(Status.NOT_FOUND, f"no node {node_id}")
            record, revision = found
            found = None
            new = change(record)
            if new is None:
                return record
            key = node_key(node_id)
            if await self._txn(
                [Compare.mod_revision(key, "==", revision)], [Put(key, bytes(new)), *also]
            ):
                return new

    # --- node side -------------------------------------------------------

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
        try:
            members = await self._consensus.members()
        except ConsensusError as e:
            raise RPCError(Status.UNAVAILABLE, f"etcd member list unreadable: {e}") from None
        own_url = self._peer_url(record)
        peers = [
            NodeRolesConsensusMemberPeer(name=m.name or f"unstarted-{m.id:x}", url=m.peer_urls[0])
            for m in members
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

    def _peer_url(self, record: Node) -> str | None:
        """The etcd peer URL of a node at its reported address (None: none reported)."""
        address = record.status.external_address if record.status else ""
        if not address:
            return None
        host = f"[{address}]" if ":" in address else address
        return f"https://{host}:{self._peer_port}"

    async def _watch_all(self, send: Callable[[c.WatchEvent], Awaitable[None]]) -> None:
        """Every node (ID, status, role names), then each change; until cancelled."""
        first = await self._kv.range(b"/nodes/", prefix=True)
        backlog = [n for kv in first.kvs if (n := _directory_node(kv.key, kv.value)) is not None]
        await send(c.WatchEvent(nodes=backlog, progress=c.WatchEventProgress.LAST_BACKLOGGED))
        async with self._kv.watch(b"/nodes/", prefix=True, start_revision=first.revision + 1) as w:
            async for response in w:
                event = c.WatchEvent()
                for change in response.events:
                    if change.type == "DELETE":
                        node_id = change.kv.key.removeprefix(b"/nodes/").decode()
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
            found = await self._read(request.node_id)
            if found is None:
                raise RPCError(Status.NOT_FOUND, f"no node {request.node_id}")
            record, revision = found
            # The heartbeat always; the record only when the status changed.
            writes = [Put(heartbeat_key(request.node_id), str(time.time_ns()).encode())]
            if record.status != status:
                record.status = status
                writes.append(Put(key, bytes(record)))
            if await self._txn([Compare.mod_revision(key, "==", revision)], writes):
                return c.UpdateNodeStatusResponse()

    async def _ticket(self) -> bytes:
        stored = await self._kv.get(REGISTER_TICKET_KEY)
        if stored is not None:
            return RegisterTicket.parse(stored.value).opaque
        ticket = secrets.token_bytes(32)
        await self._txn(
            [Compare.absent(REGISTER_TICKET_KEY)],
            [Put(REGISTER_TICKET_KEY, bytes(RegisterTicket(opaque=ticket)))],
        )
        stored = await self._kv.get(REGISTER_TICKET_KEY)
        assert stored is not None
        return RegisterTicket.parse(stored.value).opaque

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
        if await self._txn(
            [Compare.absent(key), Compare.absent(join_key_key(request.join_key))],
            [Put(key, bytes(record)), Put(join_key_key(request.join_key), node_id.encode())],
        ):
            _log.info("registered %s", node_id)
            return c.RegisterNodeResponse()
        found = await self._read(node_id)
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
        found = await self._read(node_id)
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
        if not await self._txn(
            [Compare.mod_revision(key, "==", revision)],
            [Put(key, bytes(record)), Put(issued_certificate_key(node_id), der)],
        ):
            raise RPCError(Status.ABORTED, "node record changed; retry")
        _log.info("committed %s", node_id)
        return c.CommitNodeResponse(
            ca_certificate=pki.encode_certificate(self._ca, pki.Encoding.DER),
            node_certificate=der,
        )

    # --- owner side ------------------------------------------------------

    async def get_register_ticket(
        self, request: m.GetRegisterTicketRequest, ctx: CallContext
    ) -> m.GetRegisterTicketResponse:
        return m.GetRegisterTicketResponse(ticket=await self._ticket())

    async def _records(self) -> list[Node]:
        result = await self._kv.range(b"/nodes/", prefix=True)
        records = []
        for kv in result.kvs:
            try:
                records.append(parse_node(kv.value, kv.key.decode()))
            except CuratorError as e:
                _log.error("skipping a record: %s", e)
        return records

    async def get_cluster_info(
        self, request: m.GetClusterInfoRequest, ctx: CallContext
    ) -> m.GetClusterInfoResponse:
        """The directory: every node with a running curator and a reported address."""
        nodes = [
            ClusterDirectoryNode(
                public_key=r.public_key,
                addresses=[ClusterDirectoryNodeAddress(host=r.status.external_address)],
            )
            for r in await self._records()
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
        beats = await self._kv.range(b"/heartbeats/", prefix=True)
        heard = {kv.key.removeprefix(b"/heartbeats/").decode(): kv.value for kv in beats.kvs}
        now = time.time_ns()
        for record in await self._records():
            health, since = self._health(record, heard, now)
            await send(
                m.Node(
                    pubkey=record.public_key,
                    state=record.fsm_state,
                    status=record.status,
                    roles=record.roles or NodeRoles(),
                    health=health,
                    time_since_heartbeat=since,
                )
            )

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

        await self._update(node_id, change)
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
        the removal is left to the next leader (see the module docstring):
        a removal mark is written, this curator resigns once it has
        answered, and the next leader removes the member, then the role.
        """
        node_id = request.id if request.id else _node_id(request.pubkey or b"")
        worker, controller = request.kubernetes_worker, request.kubernetes_controller
        consensus = request.consensus_member
        async with self._membership_lock:
            deferred: list[Op] = []
            if consensus is True:
                # Completes pending removals first, as below; refuses a node
                # that is not UP; writes the record itself.
                await self._grant_consensus(node_id)
                if worker is None and controller is None:
                    return m.UpdateNodeRolesResponse()  # nothing more to write
            elif consensus is False:
                await self._complete_pending_removals()
                deferred = await self._revoke_consensus(node_id)

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

            await self._update(node_id, change, deferred)
        if deferred:
            _log.info("ConsensusMember of %s (this node) to be removed; resigning", node_id)
        return m.UpdateNodeRolesResponse()

    async def _grant_consensus(self, node_id: str) -> None:
        """Complete pending removals, add the node as a learner, store its join data.

        Its reads (removal marks, the record, etcd's members and the peer
        PKI) go at once; the usual grant then takes two more round trips:
        the certificate's write together with the member's addition, and the
        record's write. Call with the membership lock held.
        """
        pending, found, members, node_pki = await gather(
            lambda: self._kv.range(CONSENSUS_REMOVALS, prefix=True),
            lambda: self._read(node_id),
            self._members,
            lambda: self._node_pki(node_id),
        )
        if pending.kvs:
            # Rare: a removal a former leader left. It changes the members,
            # the CRL and perhaps this very record: read them again after it.
            await self._complete_pending_removals()
            found, members, node_pki = await gather(
                lambda: self._read(node_id), self._members, lambda: self._node_pki(node_id)
            )
        if found is None:
            raise RPCError(Status.NOT_FOUND, f"no node {node_id}")
        record = found[0]
        if record.fsm_state != NodeState.UP:
            raise RPCError(Status.FAILED_PRECONDITION, "node is not UP")
        if record.roles is not None and record.roles.consensus_member is not None:
            return
        peer_url = self._peer_url(record)
        if peer_url is None:
            raise RPCError(Status.FAILED_PRECONDITION, "node has not reported its address yet")
        address = record.status.external_address if record.status else ""
        stuck = await self._remove_stuck_learners(node_id, members)
        if stuck:
            members = await self._members()
        try:
            join = await self._consensus.add_node(
                record.public_key,
                peer_url=peer_url,
                members=members,
                # Stale if a stuck learner was removed (its certificate
                # revoked): read again then.
                node_pki=None if stuck else node_pki,
            )
        except ConsensusError as e:
            raise RPCError(Status.UNAVAILABLE, f"etcd refused the new member: {e}") from None
        self._learners[node_id] = (peer_url, trio.current_time())
        member = join.to_proto()

        def change(r: Node) -> Node:
            roles = r.roles or NodeRoles()
            roles.consensus_member = member
            r.roles = roles
            return r

        # The record as read above: if it changed since, the write retries.
        await self._update(node_id, change, read=found)
        _log.info("granted ConsensusMember to %s at %s", node_id, address)

    async def _node_pki(self, node_id: str) -> NodePKI:
        try:
            return await self._consensus.load_node_pki(node_id)
        except ConsensusError as e:
            raise RPCError(Status.UNAVAILABLE, f"etcd peer PKI unreadable: {e}") from None

    async def _members(self) -> list[Member]:
        try:
            return await self._consensus.members()
        except ConsensusError as e:
            raise RPCError(Status.UNAVAILABLE, f"etcd member list unreadable: {e}") from None

    async def _remove_stuck_learners(self, granting: str, members: list[Member]) -> bool:
        """Remove learners this curator added that never started within the timeout.

        ``members`` is etcd's member list as just read; returns whether any
        learner was removed (the list is then out of date).

        etcd 3.4 takes one learner at a time: a node granted the role that
        never starts its etcd would block every later grant. Such a node
        loses the role (its member and peer certificate go, as on revoke);
        granting it again retries. Only learners added by this curator are
        tracked: after a change of leader, a stuck learner is removed at the
        next grant after the timeout counted from then.
        """
        removed = False
        now = trio.current_time()
        for node_id, (peer_url, added) in list(self._learners.items()):
            member = next((m for m in members if peer_url in m.peer_urls), None)
            if member is None or not member.is_learner or member.name:
                del self._learners[node_id]  # started (or gone): not stuck
                continue
            if node_id == granting or now - added < self._learner_timeout:
                continue
            found = await self._read(node_id)
            if found is None:
                continue
            _log.warning("learner %s never started; removing it", node_id)
            await self._consensus.remove_node(found[0].public_key)
            del self._learners[node_id]
            removed = True

            def change(r: Node) -> Node:
                if r.roles is not None:
                    r.roles.consensus_member = None
                return r

            await self._update(node_id, change)
        return removed

    async def _revoke_consensus(self, node_id: str) -> list[Op]:
        """Revoke ConsensusMember; the ops to write with the record (none: done here).

        For another node, its member is removed and the role dropped now.
        For this curator's own node, the removal mark is returned, to be
        written with the record (which keeps the role until the next leader
        has removed the member: :meth:`_complete_removal`).
        """
        found = await self._read(node_id)
        if found is None:
            raise RPCError(Status.NOT_FOUND, f"no node {node_id}")
        record = found[0]
        if record.roles is None or record.roles.consensus_member is None:
            return []
        members = [r for r in await self._records() if r.roles and r.roles.consensus_member]
        if len(members) <= 1:
            raise RPCError(
                Status.FAILED_PRECONDITION, "refusing to remove the last consensus member"
            )
        if node_id == self._consensus.node_id:
            return [Put(consensus_removal_key(node_id), record.public_key)]
        # The member goes and its *peer* certificate lands on the etcd peer
        # CRL (remove_node). The node's cluster certificate stays valid: the
        # node stays in the cluster and keeps fetching its roles.
        await self._consensus.remove_node(record.public_key)

        def change(r: Node) -> Node:
            if r.roles is not None:
                r.roles.consensus_member = None
            return r

        await self._update(node_id, change)
        _log.info("revoked ConsensusMember of %s", node_id)
        return []

    async def _complete_removal(self, node_id: str, public_key: bytes) -> None:
        """Remove the member of a node revoked while its curator led; drop role and mark.

        The role goes only now, in one transaction with the mark: until its
        member is removed the node keeps its etcd running, so that a
        two-member cluster keeps its quorum for the removal itself.
        Idempotent (a member already gone is skipped, a certificate revoked
        again stays revoked), so a leader that dies half-way leaves the mark
        for its successor. UNAVAILABLE if this curator lost leadership.
        """
        try:
            await self._consensus.remove_node(public_key)
        except ConsensusError as e:
            raise RPCError(Status.UNAVAILABLE, f"etcd refused the removal: {e}") from None
        mark = consensus_removal_key(node_id)

        def change(r: Node) -> Node:
            if r.roles is not None:
                r.roles.consensus_member = None
            return r

        try:
            await self._update(node_id, change, [Delete(mark)])
        except RPCError as e:
            if e.code is not Status.NOT_FOUND:
                raise
            await self._txn([], [Delete(mark)])  # the node is gone altogether
        _log.info("revoked ConsensusMember of %s (its member removed after it led)", node_id)

    async def complete_removals(self, election: ReadOnlyValue[ElectionState]) -> None:
        """While this curator leads, finish the removals earlier leaders left.

        Runs until cancelled. At the start of each term, and whenever a mark
        appears, every marked node's member is removed (:meth:`_complete_removal`).
        A failure (etcd refusing membership changes for a while, leadership
        lost) is logged and retried after a pause while this curator leads.
        """
        with election.watch() as watcher:
            state = await watcher.get(lambda s: isinstance(s, Leader))
            while True:
                with trio.CancelScope() as term:
                    async with trio.open_nursery() as nursery:

                        async def until_term_ends(leader: ElectionState = state) -> None:
                            nonlocal state
                            state = await watcher.get(lambda s: s != leader)
                            term.cancel()

                        nursery.start_soon(until_term_ends)
                        await self._removals_of_term()
                if not isinstance(state, Leader):
                    state = await watcher.get(lambda s: isinstance(s, Leader))

    async def _complete_pending_removals(self) -> int:
        """Complete every pending removal; the revision they were read at.

        Call with the membership lock held. Any other membership change
        waits for these: a marked node still holds its role (the last-voter
        check would count it) and its member (a grant must add a new one).
        """
        pending = await self._kv.range(CONSENSUS_REMOVALS, prefix=True)
        for kv in pending.kvs:
            node_id = kv.key.removeprefix(CONSENSUS_REMOVALS).decode()
            if node_id != self._consensus.node_id:  # always: a marked node does not lead
                await self._complete_removal(node_id, kv.value)
        return pending.revision

    async def _removals_of_term(self) -> None:
        while True:
            try:
                async with self._membership_lock:
                    revision = await self._complete_pending_removals()
                async with self._kv.watch(
                    CONSENSUS_REMOVALS, prefix=True, start_revision=revision + 1
                ) as watch:
                    async for response in watch:
                        if any(e.type == "PUT" for e in response.events):
                            break
            except EtcdClosed:
                raise  # the curator restarts on the new consensus status
            except (RPCError, ConsensusError) as e:
                _log.warning("pending consensus removal not done yet: %s", e)
                await trio.sleep(0.25)  # mostly "leader changed": the member just left

    async def follow_crl(self) -> None:
        """Keep the cached CRL at etcd's (other curators revoke too); runs until cancelled."""
        first = await self._kv.range(CRL_KEY)
        async with self._kv.watch(CRL_KEY, start_revision=first.revision + 1) as watch:
            async for response in watch:
                for event in response.events:
                    if event.type == "PUT":
                        try:
                            self._crl = pki.decode_crl(event.kv.value)
                        except pki.PKIError as e:
                            _log.error("ignoring a damaged CRL: %s", e)

    # --- wiring ----------------------------------------------------------

    def register(self, server: Server) -> None:
        """Register every handler with ``server``."""
        server.stream(methods.WATCH, self.watch)
        server.unary(methods.UPDATE_NODE_STATUS, self.update_node_status)
        server.unary(methods.REGISTER_NODE, self.register_node)
        server.unary(methods.COMMIT_NODE, self.commit_node)
        server.unary(methods.GET_REGISTER_TICKET, self.get_register_ticket)
        server.unary(methods.GET_CLUSTER_INFO, self.get_cluster_info)
        server.stream(methods.GET_NODES, self.get_nodes)
        server.unary(methods.APPROVE_NODE, self.approve_node)
        server.unary(methods.UPDATE_NODE_ROLES, self.update_node_roles)

    async def serve(
        self,
        server: Server,
        election: ReadOnlyValue[ElectionState],
        listeners: list[trio.SocketListener],
        *,
        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Follow the election and serve on ``listeners`` until cancelled; reports the port."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.follow_election, election)
            nursery.start_soon(self.follow_crl)
            nursery.start_soon(self.complete_removals, election)
            task_status.started(await nursery.start(server.serve_listeners, listeners))


def _directory_node(key: bytes, raw: bytes) -> c.Node | None:
    """A record as ``nodes_in_cluster`` sends it: ID, status, role names only.

    The ConsensusMember join data is the node's own business (peer
    certificates); others learn only that it has the role.
    """
    node_id = key.removeprefix(b"/nodes/").decode()
    try:
        record = parse_node(raw, node_id)
    except CuratorError as e:
        _log.error("skipping a record: %s", e)
        return None
    roles = record.roles or NodeRoles()
    return c.Node(
        id=node_id,
        status=record.status,
        roles=NodeRoles(
            consensus_member=NodeRolesConsensusMember() if roles.consensus_member else None,
            kubernetes_controller=roles.kubernetes_controller,
            kubernetes_worker=roles.kubernetes_worker,
        ),
    )


def _node_id(public_key: bytes) -> str:
    if len(public_key) != 32:
        raise RPCError(Status.INVALID_ARGUMENT, "node public key must be 32 raw bytes")
    return identity.node_id(public_key)
