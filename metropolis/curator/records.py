"""The node records as the leading curator reads and writes them.

Every handler of the curator's API (:mod:`.nodeapi`, :mod:`.managementapi`)
and every ConsensusMember change (:mod:`.membership`, :mod:`.removal`)
goes through one :class:`Records`: it knows the election's latest state,
and every write is a leader-guarded transaction (:meth:`Leader.txn`). A
curator that lost its lease between the leadership check and the write
gets :class:`~metropolis.curator.election.NotLeader`, answered UNAVAILABLE,
and nothing is written.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from metropolis.consensus.client import KV, Compare, Get, Op, Put
from metropolis.curator.election import ElectionState, Leader, NotLeader
from metropolis.curator.state import NODES, CuratorError, node_key, parse_node
from metropolis.proto.common import NodeRoles, NodeRolesConsensusMember
from metropolis.proto.curator import Node
from metropolis.rpc import RPCError
from metropolis.rpc.status import Status

__all__ = ["Records", "with_consensus_member", "without_consensus_member"]

_log = logging.getLogger("metropolis.curator.records")


class Records:
    """Leader-guarded access to the node records in the curator's etcd view."""

    def __init__(self, kv: KV) -> None:
        self.kv = kv
        #: The election's latest state, kept current by the curator's server
        #: (None until its first value).
        self.election: ElectionState | None = None

    def leader(self) -> Leader:
        """This curator's term; UNAVAILABLE if it does not lead."""
        state = self.election
        if not isinstance(state, Leader):
            raise RPCError(Status.UNAVAILABLE, "this curator is not the leader")
        return state

    async def txn(
        self, compare: list[Compare], success: Sequence[Op], failure: list[Get] | None = None
    ) -> bool:
        """A leader-guarded txn; whether ``compare`` held. UNAVAILABLE if we no longer lead."""
        try:
            result = await self.leader().txn(self.kv, compare, success, failure or [])
        except NotLeader as e:
            raise RPCError(Status.UNAVAILABLE, str(e)) from None
        return result.succeeded

    async def read(self, node_id: str) -> tuple[Node, int] | None:
        """The record of ``node_id`` and its mod revision; None if there is none."""
        stored = await self.kv.get(node_key(node_id))
        if stored is None:
            return None
        return parse_node(stored.value, node_id), stored.mod_revision

    async def all(self) -> list[Node]:
        """Every record; a damaged one is logged and skipped."""
        result = await self.kv.range(NODES, prefix=True)
        records = []
        for kv in result.kvs:
            try:
                records.append(parse_node(kv.value, kv.key.decode()))
            except CuratorError as e:
                _log.error("skipping a record: %s", e)
        return records

    async def update(
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
                found = await self.read(node_id)
            if found is None:
                raise RPCError(Status.NOT_FOUND, f"no node {node_id}")
            record, revision = found
            found = None
            new = change(record)
            if new is None:
                return record
            key = node_key(node_id)
            if await self.txn(
                [Compare.mod_revision(key, "==", revision)], [Put(key, bytes(new)), *also]
            ):
                return new


def without_consensus_member(record: Node) -> Node:
    """``record`` without the ConsensusMember role (a change for :meth:`Records.update`)."""
    if record.roles is not None:
        record.roles.consensus_member = None
    return record


def with_consensus_member(record: Node, role: NodeRolesConsensusMember) -> Node:
    """``record`` with ``role`` as its ConsensusMember role (its join data)."""
    roles = record.roles or NodeRoles()
    roles.consensus_member = role
    record.roles = roles
    return record
