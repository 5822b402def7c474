"""Granting and revoking ConsensusMember: etcd's membership beside the node records.

Granting adds an etcd learner at the node's reported address and this
cluster's peer port, and stores the node's join data in its record; its
role fetch then starts etcd. Revoking removes the member and revokes its
etcd peer certificate, then drops the role; for the node this curator runs
on, the removal is left to the next leader (:mod:`.removal`). One change
at a time (``lock``): etcd allows one learner, and two revokes racing
could both pass the last-voter check.

A learner that never starts is removed at the next grant after
:data:`LEARNER_TIMEOUT`.
"""

from __future__ import annotations

import logging

import trio

from metropolis.consensus import ConsensusError
from metropolis.consensus import Status as ConsensusStatus
from metropolis.consensus.client import Member, Op
from metropolis.consensus.peerpki import NodePKI
from metropolis.curator.records import Records, with_consensus_member, without_consensus_member
from metropolis.curator.removal import Removals
from metropolis.gather import gather
from metropolis.proto.common import NodeState
from metropolis.proto.curator import Node
from metropolis.rpc import RPCError
from metropolis.rpc.status import Status

__all__ = ["LEARNER_TIMEOUT", "Membership", "members", "peer_url"]

_log = logging.getLogger("metropolis.curator.membership")

#: Seconds a granted node has to start its etcd before a later grant removes it.
LEARNER_TIMEOUT = 60.0


def peer_url(record: Node, peer_port: int) -> str | None:
    """The etcd peer URL of a node at its reported address (None: none reported)."""
    address = record.status.external_address if record.status else ""
    if not address:
        return None
    host = f"[{address}]" if ":" in address else address
    return f"https://{host}:{peer_port}"


async def members(consensus: ConsensusStatus) -> list[Member]:
    """etcd's members now; UNAVAILABLE if the list cannot be read."""
    try:
        return await consensus.members()
    except ConsensusError as e:
        raise RPCError(Status.UNAVAILABLE, f"etcd member list unreadable: {e}") from None


class Membership:
    """ConsensusMember changes made by this curator while it leads.

    Hold :attr:`lock` around :meth:`grant` or :meth:`revoke` and the
    record's write that goes with it.
    """

    def __init__(
        self,
        records: Records,
        consensus: ConsensusStatus,
        removals: Removals,
        lock: trio.Lock,
        *,
        peer_port: int,
        learner_timeout: float = LEARNER_TIMEOUT,
    ) -> None:
        self._records = records
        self._consensus = consensus
        self._removals = removals
        #: One membership change at a time from this curator.
        self.lock = lock
        self._peer_port = peer_port
        self._learner_timeout = learner_timeout
        #: Learners this curator added: node ID -> (peer URL, when added).
        self._learners: dict[str, tuple[str, float]] = {}

    async def complete_pending_removals(self) -> None:
        """Finish the removals earlier leaders left (:mod:`.removal`). Call with the lock held."""
        await self._removals.complete_pending()

    async def grant(self, node_id: str) -> None:
        """Complete pending removals, add the node as a learner, store its join data.

        Its reads (removal marks, the record, etcd's members and the peer
        PKI) go at once; the usual grant then takes two more round trips:
        the certificate's write together with the member's addition, and the
        record's write. NOT_FOUND without a record, FAILED_PRECONDITION for
        a node that is not UP or has reported no address, UNAVAILABLE if
        etcd refuses. Call with the lock held.
        """
        pending, found, current, node_pki = await gather(
            self._removals.pending,
            lambda: self._records.read(node_id),
            lambda: members(self._consensus),
            lambda: self._node_pki(node_id),
        )
        if pending.kvs:
            # Rare: a removal a former leader left. It changes the members,
            # the CRL and perhaps this very record: read them again after it.
            await self._removals.complete_pending()
            found, current, node_pki = await gather(
                lambda: self._records.read(node_id),
                lambda: members(self._consensus),
                lambda: self._node_pki(node_id),
            )
        if found is None:
            raise RPCError(Status.NOT_FOUND, f"no node {node_id}")
        record = found[0]
        if record.fsm_state != NodeState.UP:
            raise RPCError(Status.FAILED_PRECONDITION, "node is not UP")
        if record.roles is not None and record.roles.consensus_member is not None:
            return
        url = peer_url(record, self._peer_port)
        if url is None:
            raise RPCError(Status.FAILED_PRECONDITION, "node has not reported its address yet")
        address = record.status.external_address if record.status else ""
        stuck = await self._remove_stuck_learners(node_id, current)
        if stuck:
            current = await members(self._consensus)
        try:
            join = await self._consensus.add_node(
                record.public_key,
                peer_url=url,
                members=current,
                # Stale if a stuck learner was removed (its certificate
                # revoked): read again then.
                node_pki=None if stuck else node_pki,
            )
        except ConsensusError as e:
            raise RPCError(Status.UNAVAILABLE, f"etcd refused the new member: {e}") from None
        self._learners[node_id] = (url, trio.current_time())
        member = join.to_proto()

        def change(r: Node) -> Node:
            return with_consensus_member(r, member)

        # The record as read above: if it changed since, the write retries.
        await self._records.update(node_id, change, read=found)
        _log.info("granted ConsensusMember to %s at %s", node_id, address)

    async def _node_pki(self, node_id: str) -> NodePKI:
        try:
            return await self._consensus.load_node_pki(node_id)
        except ConsensusError as e:
            raise RPCError(Status.UNAVAILABLE, f"etcd peer PKI unreadable: {e}") from None

    async def _remove_stuck_learners(self, granting: str, current: list[Member]) -> bool:
        """Remove learners this curator added that never started within the timeout.

        ``current`` is etcd's member list as just read; returns whether any
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
        for node_id, (url, added) in list(self._learners.items()):
            member = next((m for m in current if url in m.peer_urls), None)
            if member is None or not member.is_learner or member.name:
                del self._learners[node_id]  # started (or gone): not stuck
                continue
            if node_id == granting or now - added < self._learner_timeout:
                continue
            found = await self._records.read(node_id)
            if found is None:
                continue
            _log.warning("learner %s never started; removing it", node_id)
            await self._consensus.remove_node(found[0].public_key)
            del self._learners[node_id]
            removed = True
            await self._records.update(node_id, without_consensus_member)
        return removed

    async def revoke(self, node_id: str) -> list[Op]:
        """Revoke ConsensusMember; the ops to write with the record (none: done here).

        Pending removals are completed first. For another node, its member
        is removed and the role dropped now. For this curator's own node,
        the removal mark is returned, to be written with the record (which
        keeps the role until the next leader has removed the member:
        :mod:`.removal`). NOT_FOUND without a record, FAILED_PRECONDITION
        for the last consensus member. Call with the lock held.
        """
        await self._removals.complete_pending()
        found = await self._records.read(node_id)
        if found is None:
            raise RPCError(Status.NOT_FOUND, f"no node {node_id}")
        record = found[0]
        if record.roles is None or record.roles.consensus_member is None:
            return []
        voters = [r for r in await self._records.all() if r.roles and r.roles.consensus_member]
        if len(voters) <= 1:
            raise RPCError(
                Status.FAILED_PRECONDITION, "refusing to remove the last consensus member"
            )
        if node_id == self._consensus.node_id:
            return [self._removals.mark(node_id, record.public_key)]
        # The member goes and its *peer* certificate lands on the etcd peer
        # CRL (remove_node). The node's cluster certificate stays valid: the
        # node stays in the cluster and keeps fetching its roles.
        await self._consensus.remove_node(record.public_key)
        await self._records.update(node_id, without_consensus_member)
        _log.info("revoked ConsensusMember of %s", node_id)
        return []
