"""After a recovery from a snapshot: the record of it, and the members added again.

``node recover`` (:mod:`metropolis.roleserve.recover`) restores etcd from a
snapshot as a one-member cluster of the recovering node: every other etcd
member is dropped, but the node records still grant their nodes
ConsensusMember, with join data for members that no longer exist. Before
anything else runs on the restored etcd, :func:`prepare_restored` writes in
one transaction:

- the recovering node's record with its ConsensusMember role (join data for
  the restored member: the cluster's peer CA, its peer certificate);
- a rejoin mark (``/consensus-rejoins/<node id>``, the recovery's time) for
  every other node that holds ConsensusMember (but one whose removal is
  pending: the next leader completes that, :mod:`.removal`);
- the :class:`Recovery` record (``/recoveries/<time>``), which
  ``owner recoveries`` shows;
- the old leader's election key deleted (its lease would block the
  recovered curator's election for a whole TTL), and a removal mark of the
  recovering node itself (it would keep it from campaigning).

Then, while a curator leads, :class:`Rejoins` adds the marked nodes again,
one at a time (etcd 3.4 takes one learner at a time): a marked node is
added as a new learner, with new join data in its record, only once its
heartbeat is newer than the recovery (it runs again: a node that never
comes back does not block every later membership change as a learner that
never starts). The join data carries a new peer certificate: its role
fetch gets it, its control plane restarts etcd on it, and the consensus
service deletes the dropped member's data first
(:mod:`metropolis.roleserve.startup`, :mod:`metropolis.consensus.service`);
the promoter makes it a voter, and the mark goes. A learner added by a
pass whose record was not written (leadership lost in between) gets its
join data at the next pass. A mark goes too when its node has lost the
role or its record. Not handled: a node that dies between its heartbeat
and its learner's start leaves that learner in the way of every later
one (etcd takes one at a time); revoking its ConsensusMember removes it.
"""

from __future__ import annotations

import logging
import random
from dataclasses import asdict, replace

from common.backoff import ExponentialBackoff, Retrier
from metropolis.consensus import ConsensusError
from metropolis.consensus import Status as ConsensusStatus
from metropolis.consensus.client import KV, Delete, EtcdClosed, KeyValue, Member, Op, Put
from metropolis.curator.election import ElectionState
from metropolis.curator.membership import Membership, members, peer_url
from metropolis.curator.records import Records, with_consensus_member
from metropolis.curator.recovery import Recovery
from metropolis.curator.removal import each_term
from metropolis.curator.state import (
    CONSENSUS_REJOINS,
    CONSENSUS_REMOVALS,
    HEARTBEATS,
    LEADER_KEY,
    NODES,
    RECOVERIES,
    CuratorError,
    consensus_rejoin_key,
    consensus_removal_key,
    node_key,
    parse_node,
)
from metropolis.event import ReadOnlyValue
from metropolis.proto.common import NodeRoles, NodeRolesConsensusMember
from metropolis.proto.curator import Node
from metropolis.rpc import RPCError

__all__ = ["PASS", "Recovery", "Rejoins", "prepare_restored", "read_recoveries"]

_log = logging.getLogger("metropolis.curator.rejoin")

#: Waits between looks at the marks while some remain: a marked node to be
#: heard from, a learner to catch up. Short at first (the usual rejoin takes
#: a second or two), then at most every 2 s.
PASS = ExponentialBackoff(initial=0.2, maximum=2.0, multiplier=1.5, jitter=(0.75, 1.25))


def recovery_key(at_ns: int) -> bytes:
    return RECOVERIES + f"{at_ns:020d}".encode()


async def prepare_restored(
    kv: KV, recovery: Recovery, role: NodeRolesConsensusMember
) -> tuple[NodeRoles, Recovery]:
    """Prepare a freshly restored etcd (the curator's view ``kv``); see the module docstring.

    ``role`` is the recovering node's ConsensusMember role for its restored
    member. Returns that node's roles as written, and the recovery as
    recorded (with the nodes that rejoin). Nothing else may use this etcd
    meanwhile: the writes are not leader-guarded. :class:`CuratorError` if
    the snapshot holds no record of the recovering node (then nothing is
    written).
    """
    own_id = recovery.node_id
    result = await kv.range(NODES, prefix=True)
    marked = await kv.range(CONSENSUS_REMOVALS, prefix=True)
    # Their removal was asked for: the next leader completes it (:mod:`.removal`).
    leaving = {m.key.removeprefix(CONSENSUS_REMOVALS).decode() for m in marked.kvs}
    own = None
    rejoining = []
    for stored in result.kvs:
        node_id = stored.key.removeprefix(NODES).decode()
        record = parse_node(stored.value, node_id)
        if node_id == own_id:
            own = record
            continue
        member = record.roles.consensus_member if record.roles is not None else None
        if member is not None and node_id not in leaving:
            rejoining.append(node_id)
    if own is None:
        raise CuratorError(
            f"the snapshot holds no record of this node ({own_id}): recover on a node of"
            " the cluster as it was when the snapshot was taken"
        )
    roles = with_consensus_member(own, role).roles
    assert roles is not None
    recovery = Recovery(**{**asdict(recovery), "rejoining": tuple(sorted(rejoining))})
    ops: list[Op] = [
        Put(node_key(own_id), bytes(own)),
        Delete(LEADER_KEY),
        Delete(consensus_removal_key(own_id)),
        Put(recovery_key(recovery.at_ns), recovery.to_json()),
        *(Put(consensus_rejoin_key(n), str(recovery.at_ns).encode()) for n in rejoining),
    ]
    await kv.txn([], ops, [])
    return roles, recovery


async def read_recoveries(kv: KV) -> list[Recovery]:
    """Every recovery recorded in the curator's view ``kv``, oldest first."""
    result = await kv.range(RECOVERIES, prefix=True)
    return [Recovery.from_json(stored.value) for stored in result.kvs]


class Rejoins:
    """Adds the nodes marked by a recovery to etcd again while this curator leads.

    Shares the membership lock of ``membership``: one membership change at
    a time. ``rng`` draws the jitter of the waits (:data:`PASS`).
    """

    def __init__(
        self,
        records: Records,
        consensus: ConsensusStatus,
        membership: Membership,
        *,
        peer_port: int,
        rng: random.Random | None = None,
    ) -> None:
        self._records = records
        self._consensus = consensus
        self._membership = membership
        self._peer_port = peer_port
        self._rng = rng if rng is not None else random.Random()

    async def run(self, election: ReadOnlyValue[ElectionState]) -> None:
        """While this curator leads, add marked nodes again; until cancelled.

        While marks remain it looks again after each wait of :data:`PASS`
        (reset whenever a node was added or a mark went); without marks it
        watches for one. A failure (etcd refusing the change, leadership
        lost) is logged at WARNING and tried again after a wait. Raises
        ``EtcdClosed`` (the curator restarts on the new consensus status).
        """
        await each_term(election, self._of_term)

    async def _of_term(self) -> None:
        retrier = Retrier(PASS, self._rng)
        kv = self._records.kv
        while True:
            try:
                pending = await kv.range(CONSENSUS_REJOINS, prefix=True)
                if not pending.kvs:
                    async with kv.watch(
                        CONSENSUS_REJOINS, prefix=True, start_revision=pending.revision + 1
                    ) as watch:
                        async for response in watch:
                            if any(e.type == "PUT" for e in response.events):
                                break
                    continue
                if await self._pass(pending.kvs):
                    retrier.reset()
            except EtcdClosed:
                raise
            except (RPCError, ConsensusError, CuratorError) as e:
                _log.warning("rejoin after the recovery not done yet: %s", e)
            await retrier.sleep()

    async def _pass(self, marks: list[KeyValue]) -> bool:
        """One look at every mark; whether anything changed."""
        current = await members(self._consensus)
        beats = await self._records.kv.range(HEARTBEATS, prefix=True)
        heard = {kv.key.removeprefix(HEARTBEATS).decode(): kv.value for kv in beats.kvs}
        progressed = False
        for mark in marks:
            node_id = mark.key.removeprefix(CONSENSUS_REJOINS).decode()
            found = await self._records.read(node_id)
            record = found[0] if found is not None else None
            if record is None or record.roles is None or record.roles.consensus_member is None:
                await self._records.txn([], [Delete(mark.key)])
                _log.info("%s no longer holds ConsensusMember: it does not rejoin", node_id)
                progressed = True
                continue
            url = peer_url(record, self._peer_port)
            member = _member_of(current, node_id, url)
            if member is not None and not member.is_learner:
                await self._records.txn([], [Delete(mark.key)])
                _log.info("%s votes again after the recovery", node_id)
                progressed = True
                continue
            if member is not None and member.name:
                continue  # a started learner catching up: the promoter's
            if url is None:
                continue  # no address yet
            if member is None:
                if any(m.is_learner for m in current):
                    continue  # etcd takes one learner at a time
                if not _heard_since(heard.get(node_id), mark.value):
                    continue
            async with self._membership.lock:
                if await self._add(node_id, record, url, added=member is not None):
                    progressed = True
                    current = await members(self._consensus)
        return progressed

    async def _add(self, node_id: str, record: Node, url: str, *, added: bool) -> bool:
        """Add the node as a new learner (unless ``added``) and write its join data.

        The join data gets a new peer certificate, not the one its record
        holds: that is how the node tells its new member from the dropped
        one (whose etcd data it then deletes) and restarts its etcd. A
        learner added by an earlier pass whose record was not written
        (leadership lost between the two) is ``added``: the certificate
        stored then is used, and only the record is written. Whether
        anything was done.
        """
        role = record.roles.consensus_member if record.roles else None
        handed_out = role.peer_certificate if role is not None else None
        issuing = await self._consensus.load_node_pki(node_id)
        if issuing.stored_certificate == handed_out:
            if added:
                return False  # its join data is in its record: the node starts it
            issuing = replace(issuing, stored_certificate=None)
        join = await self._consensus.add_node(record.public_key, peer_url=url, node_pki=issuing)
        new = join.to_proto()

        def change(r: Node) -> Node:
            return with_consensus_member(r, new)

        await self._records.update(node_id, change)
        _log.info("%s added to etcd again as a new learner (after the recovery)", node_id)
        return True


def _member_of(current: list[Member], node_id: str, url: str | None) -> Member | None:
    for member in current:
        if member.name == node_id or (url is not None and url in member.peer_urls):
            return member
    return None


def _heard_since(beat: bytes | None, since: bytes) -> bool:
    """Whether a heartbeat (Unix ns, text) is newer than a mark's time (the same)."""
    try:
        return beat is not None and int(beat) > int(since)
    except ValueError:
        return False
