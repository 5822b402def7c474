"""Revoking ConsensusMember from the leader's own node: the removal protocol.

The leader cannot remove its own etcd member: the write that records the
revocation and the answer to the owner go through that very etcd. So the
work is split across two terms::

    owner ─ UpdateNodeRoles(n1, consensus off) ─▶ leader on n1
      n1 leader: guarded txn: /consensus-removals/n1 = n1's key (the record
                 keeps ConsensusMember: n1's etcd must run on) ── answers OK
      n1 election: sees its own mark ─▶ Follower, deletes /leader (resigns);
                   it cannot campaign again while the mark exists
      n2 curator wins; at the start of its term (and whenever a mark appears)
        Removals.run: member remove(n1) while n1's etcd still votes
                      (a 2-member cluster keeps its quorum for it),
                      n1's peer cert revoked, CRL written
                   ─▶ guarded txn: n1's record without ConsensusMember
                                   + delete the mark
      n1's etcd, removed, exits; n1's role fetch (through n2/n3: its cluster
      directory keeps itself current) gets the record: its control plane
      stops (curator, lease revoked; then etcd) and etcd's data is wiped

Stopping n1's etcd first and removing its member afterwards (as a removal
of another node does, :mod:`.membership`) would be wrong here: in a
two-member cluster the survivor alone has no quorum to elect a curator or
remove anything. etcd 3.4 would also let the leader remove its own member
(the raft leader steps down), but the local etcd then exits under the
curator before the record is written and answered. Any ConsensusMember
change while a mark is still there completes that removal first, so the
last-voter check counts right and a granted node always joins as a new
member. Leadership moves only through the election key, so there is never
a second leader (the resigning side is :mod:`.election`'s).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable

import trio

from common.backoff import ExponentialBackoff, Retrier
from metropolis.consensus import ConsensusError
from metropolis.consensus import Status as ConsensusStatus
from metropolis.consensus.client import Delete, EtcdClosed, Op, Put, RangeResult
from metropolis.curator.election import ElectionState, Leader
from metropolis.curator.records import Records, without_consensus_member
from metropolis.curator.state import CONSENSUS_REMOVALS, consensus_removal_key
from metropolis.event import ReadOnlyValue
from metropolis.rpc import RPCError
from metropolis.rpc.status import Status

__all__ = ["RETRY", "Removals", "each_term"]

_log = logging.getLogger("metropolis.curator.removal")

#: Waits between attempts at a pending removal while etcd refuses it; mostly
#: "leader changed" just after the marked member left, which settles quickly.
RETRY = ExponentialBackoff(initial=0.25, maximum=4.0, jitter=(0.75, 1.25))


async def each_term(
    election: ReadOnlyValue[ElectionState], of_term: Callable[[], Awaitable[None]]
) -> None:
    """Run ``of_term()`` in each term of this curator's leadership, until cancelled.

    It starts when a term starts and is cancelled when the term ends (any
    new election state); what it raises ends this call.
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
                    await of_term()
            if not isinstance(state, Leader):
                state = await watcher.get(lambda s: isinstance(s, Leader))


class Removals:
    """The removal marks: written by the leading curator for its own node, completed by the next.

    ``lock`` is the one membership change at a time that this curator makes
    (shared with :class:`~metropolis.curator.membership.Membership`).
    ``rng`` draws the jitter of the retries of :meth:`run`.
    """

    def __init__(
        self,
        records: Records,
        consensus: ConsensusStatus,
        lock: trio.Lock,
        *,
        rng: random.Random | None = None,
    ) -> None:
        self._records = records
        self._consensus = consensus
        self._lock = lock
        self._rng = rng if rng is not None else random.Random()

    @staticmethod
    def mark(node_id: str, public_key: bytes) -> Op:
        """The write that leaves the removal of ``node_id``'s member to the next leader."""
        return Put(consensus_removal_key(node_id), public_key)

    async def pending(self) -> RangeResult:
        """The marks now (key: ``CONSENSUS_REMOVALS`` + node ID, value: its public key)."""
        return await self._records.kv.range(CONSENSUS_REMOVALS, prefix=True)

    async def complete_pending(self) -> int:
        """Complete every pending removal; the revision they were read at.

        Call with the membership lock held. Any other membership change
        waits for these: a marked node still holds its role (the last-voter
        check would count it) and its member (a grant must add a new one).
        """
        pending = await self.pending()
        for kv in pending.kvs:
            node_id = kv.key.removeprefix(CONSENSUS_REMOVALS).decode()
            if node_id != self._consensus.node_id:  # always: a marked node does not lead
                await self._complete(node_id, kv.value)
        return pending.revision

    async def _complete(self, node_id: str, public_key: bytes) -> None:
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
        try:
            await self._records.update(node_id, without_consensus_member, [Delete(mark)])
        except RPCError as e:
            if e.code is not Status.NOT_FOUND:
                raise
            await self._records.txn([], [Delete(mark)])  # the node is gone altogether
        _log.info("revoked ConsensusMember of %s (its member removed after it led)", node_id)

    async def run(self, election: ReadOnlyValue[ElectionState]) -> None:
        """While this curator leads, finish the removals earlier leaders left.

        Runs until cancelled. At the start of each term, and whenever a mark
        appears, every marked node's member is removed (:meth:`_complete`).
        A failure (etcd refusing membership changes for a while, leadership
        lost) is logged and retried after a backoff (:data:`RETRY`) while
        this curator leads. Raises ``EtcdClosed`` (the curator restarts on
        the new consensus status).
        """
        await each_term(election, self._of_term)

    async def _of_term(self) -> None:
        retrier = Retrier(RETRY, self._rng)
        while True:
            try:
                async with self._lock:
                    revision = await self.complete_pending()
                retrier.reset()
                async with self._records.kv.watch(
                    CONSENSUS_REMOVALS, prefix=True, start_revision=revision + 1
                ) as watch:
                    async for response in watch:
                        if any(e.type == "PUT" for e in response.events):
                            break
            except EtcdClosed:
                raise  # the curator restarts on the new consensus status
            except (RPCError, ConsensusError) as e:
                _log.warning("pending consensus removal not done yet: %s", e)
                await retrier.sleep()
