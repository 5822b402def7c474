"""Deleting a node from the cluster (``DeleteNode``): record, etcd member, certificate.

::

    owner ─ DeleteNode(n, bypass?) ─▶ leader (membership lock held)
      refuse: n holds roles, unless bypass and n's heartbeat timed out
      refuse: n is this curator's node, or the last consensus member
      n's etcd member removed (if any), its peer certificate revoked
      ─▶ guarded txn: n's record, heartbeat and join key deleted,
                      the cluster CA's CRL (``CRL_KEY``) with n's certificate

Every curator follows ``CRL_KEY`` and refuses a revoked certificate on
every call (:mod:`metropolis.rpc.auth`), so from the write on the node's
mutual TLS gets it nothing from any curator. The record's deletion is a
tombstone in every node's directory watch.

The node's etcd member goes first: a node deleted but still voting would
count in the quorum with nobody to remove it. A crash between the two
leaves the member gone and the record there: deleting again finishes
(the member removal is idempotent).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from cryptography import x509

from metropolis import pki
from metropolis.consensus import ConsensusError
from metropolis.consensus import Status as ConsensusStatus
from metropolis.consensus.client import Compare, Delete, Op, Put
from metropolis.curator.membership import Membership, members, peer_url
from metropolis.curator.records import Records
from metropolis.curator.state import (
    CA_KEY_KEY,
    CRL_KEY,
    heartbeat_key,
    issued_certificate_key,
    join_key_key,
    node_key,
)
from metropolis.proto.common import role_names
from metropolis.proto.curator import Node
from metropolis.rpc import RPCError
from metropolis.rpc.status import Status

__all__ = ["Deleted", "Deletion"]

_log = logging.getLogger("metropolis.curator.deletion")


@dataclass(frozen=True)
class Deleted:
    """What a deletion did."""

    node_id: str
    #: Whether an etcd member of the node was removed.
    member_removed: bool
    #: Serial of the node certificate put on the CRL (None: it had none).
    revoked_serial: int | None


class Deletion:
    """Deletes nodes for the leading curator; one at a time with the membership changes.

    ``crl_changed`` is told each CRL this curator writes, before the call
    is answered, so that its own next call already checks it (the CRL
    watch of every curator follows a moment later).
    """

    def __init__(
        self,
        records: Records,
        consensus: ConsensusStatus,
        membership: Membership,
        *,
        ca: x509.Certificate,
        peer_port: int,
        crl_changed: Callable[[x509.CertificateRevocationList], None],
    ) -> None:
        self._records = records
        self._consensus = consensus
        self._membership = membership
        self._ca = ca
        self._peer_port = peer_port
        self._crl_changed = crl_changed

    async def delete(
        self, node_id: str, *, bypass_roles: bool, timed_out: Callable[[Node], bool]
    ) -> Deleted:
        """Delete ``node_id``; :class:`RPCError` (nothing changed) if refused.

        NOT_FOUND without a record. FAILED_PRECONDITION: the node holds
        roles and ``bypass_roles`` is off, or it is on but ``timed_out``
        (the caller's health check) says the node still heartbeats; the
        node is this curator's own; it is the last consensus member.
        UNAVAILABLE if etcd refuses the member's removal or this curator
        stops leading (nothing of the record is written then).
        """
        async with self._membership.lock:
            await self._membership.complete_pending_removals()
            found = await self._records.read(node_id)
            if found is None:
                raise RPCError(Status.NOT_FOUND, f"no node {node_id}")
            record = found[0]
            held = role_names(record.roles)
            if held and not bypass_roles:
                raise RPCError(
                    Status.FAILED_PRECONDITION,
                    f"{node_id} holds roles ({', '.join(held)}): take them away first "
                    "(or force it, once its heartbeat has timed out)",
                )
            if held and not timed_out(record):
                raise RPCError(
                    Status.FAILED_PRECONDITION,
                    f"{node_id} holds roles ({', '.join(held)}) and its heartbeat has not "
                    "timed out: forcing is only for a dead node",
                )
            if node_id == self._consensus.node_id:
                raise RPCError(
                    Status.FAILED_PRECONDITION, f"{node_id} runs the leading curator itself"
                )
            if record.roles is not None and record.roles.consensus_member is not None:
                voters = [
                    r for r in await self._records.all() if r.roles and r.roles.consensus_member
                ]
                if len(voters) <= 1:
                    raise RPCError(
                        Status.FAILED_PRECONDITION, "refusing to delete the last consensus member"
                    )
            removed = await self._remove_member(node_id, record)
            serial = await self._delete_record(node_id)
        _log.info(
            "deleted %s (etcd member %s, certificate %s)",
            node_id,
            "removed" if removed else "none",
            f"serial {serial} revoked" if serial is not None else "none",
        )
        return Deleted(node_id, removed, serial)

    async def _remove_member(self, node_id: str, record: Node) -> bool:
        """Remove the node's etcd member if etcd lists one; whether it did."""
        url = peer_url(record, self._peer_port)
        current = await members(self._consensus)
        listed = any(m.name == node_id or (url and url in m.peer_urls) for m in current)
        if not listed and (record.roles is None or record.roles.consensus_member is None):
            return False
        try:
            await self._consensus.remove_node(record.public_key)
        except ConsensusError as e:
            raise RPCError(Status.UNAVAILABLE, f"etcd refused the member's removal: {e}") from None
        return listed

    async def _delete_record(self, node_id: str) -> int | None:
        """Delete the record (and what hangs off it) with the CRL; the revoked serial."""
        kv = self._records.kv
        while True:
            found = await self._records.read(node_id)
            if found is None:
                raise RPCError(Status.NOT_FOUND, f"no node {node_id}")
            record, revision = found
            issued = await kv.get(issued_certificate_key(node_id))
            ops: list[Op] = [Delete(node_key(node_id)), Delete(heartbeat_key(node_id))]
            if record.join_key:
                ops.append(Delete(join_key_key(record.join_key)))
            compare = [Compare.mod_revision(node_key(node_id), "==", revision)]
            serial: int | None = None
            crl: x509.CertificateRevocationList | None = None
            if issued is not None:
                serial = pki.decode_certificate(issued.value).serial_number
                current = await kv.get(CRL_KEY)
                crl = await self._revoked(current.value if current else None, serial)
                ops.append(Put(CRL_KEY, pki.encode_crl(crl, pki.Encoding.DER)))
                compare.append(
                    Compare.mod_revision(CRL_KEY, "==", current.mod_revision)
                    if current is not None
                    else Compare.absent(CRL_KEY)
                )
            if await self._records.txn(compare, ops):
                if crl is not None:
                    self._crl_changed(crl)
                return serial

    async def _revoked(self, current: bytes | None, serial: int) -> x509.CertificateRevocationList:
        stored = await self._records.kv.get(CA_KEY_KEY)
        if stored is None:
            raise RPCError(Status.INTERNAL, "cluster CA key missing")
        try:
            ca_key = pki.decode_private_key(stored.value)
            if current is None:
                return pki.new_crl(ca_key, self._ca, [serial])
            return pki.revoke(pki.decode_crl(current), ca_key, self._ca, [serial])
        except pki.PKIError as e:
            raise RPCError(Status.INTERNAL, f"cluster CRL unusable: {e}") from None
