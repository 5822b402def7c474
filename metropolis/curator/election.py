"""Curator leader election on an etcd lease.

Every curator grants a lease (TTL 10 s, as in Monogon) and tries to create
the election key on it, create-if-absent::

    txn: if /leader absent -> put LeaderElectionValue{node id, ttl} on our lease
         else              -> read it: we follow its holder
    follower: watch /leader until it is deleted (lease expired or revoked), retry
    leader:   keep the lease alive; losing it ends the term (the runnable fails)

The leader's writes are guarded by the election key's create revision
(:meth:`Leader.guard`), so a leader that lost its lease without noticing
cannot overwrite its successor's work. A key left by this same node's
previous life (the process died, its lease lives on for up to a TTL) is
deleted at once: no other curator can hold our node ID.

**Stepping down.** A node whose ConsensusMember role is revoked while its
curator leads cannot remove its own etcd member (its etcd would vanish under
the write that records it). The leader instead writes a removal mark for
itself (``/consensus-removals/<id>``, see :mod:`.removal`) and the election
hands leadership on::

    leader ── sees its own removal mark (watch) ─┐
              publish Follower(None)             │  stop answering as leader first,
              delete /leader (guarded by term)   │  then end the term: another
                                                 ▼  curator's campaign wins at once
    campaign: if /leader absent AND own mark absent -> lead
              own mark present, no leader        -> wait (follower) until
                                                    one leads or the mark goes

The campaign's mark check is in the same transaction as the leader key
put, so a marked node can never lead again, not even for an instant,
until the new leader has removed its member and the mark.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass

import trio

from common.backoff import ExponentialBackoff, Retrier
from metropolis.consensus.client import (
    KV,
    Compare,
    Delete,
    EtcdError,
    EtcdUnavailable,
    Get,
    Lease,
    Op,
    Put,
    RangeResult,
    TxnResult,
)
from metropolis.curator.settings import DEFAULT_TTL
from metropolis.curator.state import LEADER_KEY, CuratorError, consensus_removal_key
from metropolis.event import Value
from metropolis.proto.curator import LeaderElectionValue

__all__ = [
    "DEFAULT_TTL",
    "WATCH_RETRY",
    "ElectionState",
    "Follower",
    "Leader",
    "NotLeader",
    "run_election",
]

#: Waits between attempts to open a watch while etcd is unavailable (it
#: restarts; the curator is restarted on the new consensus status).
WATCH_RETRY = ExponentialBackoff(initial=0.5, maximum=4.0, jitter=(0.75, 1.25))


class NotLeader(CuratorError):
    """A guarded write failed because this curator no longer leads."""


@dataclass(frozen=True)
class Leader:
    """This curator leads while its lease lives."""

    node_id: str
    lease_id: int
    #: Create revision of the election key: the term's identity.
    revision: int

    def guard(self) -> Compare:
        """True while this term's election key is the current one."""
        return Compare.create_revision(LEADER_KEY, "==", self.revision)

    async def txn(
        self, kv: KV, compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()
    ) -> TxnResult:
        """A transaction that only applies while we lead; :class:`NotLeader` otherwise.

        ``compare`` failing (with leadership intact) returns the failed result.
        """
        result = await kv.txn([self.guard(), *compare], success, [Get(LEADER_KEY), *failure])
        if not result.succeeded:
            held = result.responses[0]
            assert isinstance(held, RangeResult)
            if not held.kvs or held.kvs[0].create_revision != self.revision:
                raise NotLeader(f"leadership of term {self.revision} was lost")
            result = TxnResult(False, result.responses[1:], result.revision)
        return result


@dataclass(frozen=True)
class Follower:
    """Another curator leads (``leader`` None: unknown or unreadable)."""

    leader: LeaderElectionValue | None


ElectionState = Leader | Follower


async def run_election(
    kv: KV,
    node_id: str,
    state: Value[ElectionState],
    *,
    ttl: int = DEFAULT_TTL,
    logger: logging.Logger | None = None,
    lease: Lease | None = None,
    rng: random.Random | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Campaign until cancelled, publishing the state to ``state``.

    ``lease``: one granted already (with ``ttl``) for this campaign, used
    instead of granting one here; it is revoked on the way out like our own.
    ``rng`` draws the jitter of the watches' retries (:data:`WATCH_RETRY`).
    Signals ``task_status.started()`` once the lease is held. Raises the
    etcd client's errors (``LeaseExpired`` when the lease is lost, which
    ends a term; ``EtcdClosed`` when the client goes away). On the way out
    the lease is revoked (best effort), so that another curator can lead
    at once instead of after a TTL.
    """
    log = logger or logging.getLogger("metropolis.curator.election")
    value = bytes(LeaderElectionValue(node_id=node_id, ttl=ttl))
    removal = consensus_removal_key(node_id)
    rng = rng if rng is not None else random.Random()
    if lease is None:
        lease = await kv.grant(ttl)
    try:
        async with trio.open_nursery() as nursery:
            # The lease holds for its TTL from the grant: campaign at once
            # rather than a round trip later, after the first refresh.
            nursery.start_soon(kv.keep_alive, lease)
            task_status.started()
            while True:
                result = await kv.txn(
                    [Compare.absent(LEADER_KEY), Compare.absent(removal)],
                    [Put(LEADER_KEY, value, lease=lease.id)],
                    [Get(LEADER_KEY), Get(removal)],
                )
                if result.succeeded:
                    log.info("won the election (term %d)", result.revision)
                    state.set(Leader(node_id, lease.id, result.revision))
                    # Until keep_alive loses the lease (it raises), or this
                    # node's ConsensusMember role is revoked.
                    await _until(kv, rng, result.revision + 1, (removal, "PUT"))
                    log.info("resigning: this node leaves consensus (term %d)", result.revision)
                    # Not leader first, then end the term: never two leaders.
                    state.set(Follower(None))
                    await kv.txn(
                        [Compare.create_revision(LEADER_KEY, "==", result.revision)],
                        [Delete(LEADER_KEY)],
                    )
                    continue
                held, marked = result.responses
                assert isinstance(held, RangeResult) and isinstance(marked, RangeResult)
                if not held.kvs:
                    if not marked.kvs:
                        continue  # deleted in between: try again
                    # No leader, but this node is on its way out of consensus:
                    # leave the election to the others; look again when one
                    # leads or the mark goes (its removal is done).
                    state.set(Follower(None))
                    await _until(
                        kv, rng, result.revision + 1, (LEADER_KEY, "PUT"), (removal, "DELETE")
                    )
                    continue
                current = held.kvs[0]
                try:
                    leader: LeaderElectionValue | None = LeaderElectionValue.parse(current.value)
                except Exception:  # betterproto2 raises assorted errors on bad input
                    leader = None
                if leader is not None and leader.node_id == node_id:
                    log.info("removing the election key of this node's previous life")
                    await kv.txn(
                        [Compare.mod_revision(LEADER_KEY, "==", current.mod_revision)],
                        [Delete(LEADER_KEY)],
                    )
                    continue
                log.info("following %s", leader.node_id if leader else "an unknown leader")
                state.set(Follower(leader))
                async with kv.watch(LEADER_KEY, start_revision=result.revision + 1) as watch:
                    async for response in watch:
                        if any(e.type == "DELETE" for e in response.events):
                            break
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(2):
            try:
                await kv.revoke(lease.id)
            except EtcdError as e:
                log.info("lease not revoked on exit: %s", e)


async def _until(
    kv: KV, rng: random.Random, start_revision: int, *events: tuple[bytes, str]
) -> None:
    """Return once any of ``events`` (key, "PUT" or "DELETE") happens from ``start_revision``."""
    async with trio.open_nursery() as nursery:

        async def one(key: bytes, kind: str) -> None:
            retrier = Retrier(WATCH_RETRY, rng)
            while True:
                try:
                    # Once open, the watch reconnects by itself; opening it
                    # fails while etcd restarts (the curator is restarted on
                    # the new consensus status; until then, retry quietly).
                    async with kv.watch(key, start_revision=start_revision) as watch:
                        async for response in watch:
                            if any(e.type == kind for e in response.events):
                                nursery.cancel_scope.cancel()
                except EtcdUnavailable:
                    await retrier.sleep()

        for key, kind in events:
            nursery.start_soon(one, key, kind)
