"""A recovery whose restored etcd is in place, prepared by the node's curator before it campaigns.

When the node's peer PKI on disk is whole and its own (its CA, its
certificate for this node's key and peer address, the CA's CRL),
``node recover`` (:mod:`.recover`) needs nothing of the restored keyspace
before the node's etcd starts: it puts the restored data in place with a
mark beside it, ``ROOT/data/etcd/recovery.json`` (the recovery's record and
the snapshot's path), and the node's own etcd is the only one that runs on
it. Before the node's curator first campaigns (nothing else of the node
writes to etcd, and etcd's client socket is the node's alone), it
checks that the restored peer CA is the one on disk and prepares the
restored keyspace (:func:`~metropolis.curator.rejoin.prepare_restored`:
its record, the rejoin marks, the recovery's record, the old leader's key
deleted); then the mark goes. Where the mark is, so is the question::

    the mark, no etcd data ─ the recovery was cut before its data was in
                             place: the node refuses to start
                             (:func:`check`); ``node recover`` again
    the mark and etcd data ─ the restored data, not yet prepared: the
                             curator prepares it (:func:`preparation`),
                             again if a crash came before the mark went
                             (the transaction writes the same keys)
    no mark                ─ nothing pending

Written (fsynced) by ``node recover`` once the old data is gone and
before the restored data is renamed into place; removed (the folder
fsynced) once the keyspace is prepared.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from common.durable import atomic_write, fsync_directory
from metropolis.crashpoint import crash_point
from metropolis.errors import MetropolisError
from metropolis.localstorage import Root

if TYPE_CHECKING:
    from metropolis.consensus.join import JoinCluster
    from metropolis.consensus.membership import Status
    from metropolis.curator.recovery import Recovery

__all__ = ["Pending", "PendingRecoveryError", "check", "drop", "preparation", "read", "write"]

_log = logging.getLogger("metropolis.roleserve.recover")


class PendingRecoveryError(MetropolisError):
    """A recovery was cut before its data was in place, or its PKI is not the cluster's."""


@dataclass(frozen=True)
class Pending:
    """The mark: the recovery to record, and the snapshot it came from (for the log)."""

    recovery: Recovery
    snapshot: str

    def to_json(self) -> bytes:
        return json.dumps(
            {"recovery": json.loads(self.recovery.to_json()), "snapshot": self.snapshot}
        ).encode()


def path(root: Root) -> Path:
    """The mark's file."""
    return root.data.etcd.path / "recovery.json"


def write(root: Root, pending: Pending) -> None:
    """Write the mark (fsynced: blocking)."""
    atomic_write(path(root), pending.to_json())


def drop(root: Root) -> None:
    """Remove the mark, if there is one; the folder fsynced (blocking)."""
    try:
        path(root).unlink()
    except FileNotFoundError:
        return
    fsync_directory(path(root).parent)


def read(root: Root) -> Pending | None:
    """The mark, or None (blocking). :class:`PendingRecoveryError` if it is damaged."""
    from metropolis.curator.recovery import Recovery

    try:
        raw = path(root).read_bytes()
    except FileNotFoundError:
        return None
    try:
        data = json.loads(raw)
        recovery = Recovery.from_json(json.dumps(data["recovery"]).encode())
        return Pending(recovery, str(data["snapshot"]))
    except (ValueError, TypeError, KeyError, MetropolisError) as e:
        raise PendingRecoveryError(f"{path(root)}: damaged ({e}): run node recover again") from None


def check(root: Root) -> None:
    """:class:`PendingRecoveryError` if a recovery was cut before its etcd data was in place."""
    if path(root).exists() and not root.data.etcd.data.exists():
        raise PendingRecoveryError(
            f"a recovery from a snapshot was cut before its etcd data was in place"
            f" ({path(root)} without {root.data.etcd.data}): run node recover again"
        )


def preparation(root: Root, join: JoinCluster) -> Callable[[Status], Awaitable[None]] | None:
    """The curator's ``before_campaign`` if a recovery is pending on ``root`` (else None).

    It prepares the restored etcd through the running consensus (``join``:
    this node's join data, as the roles hold it), then drops the mark;
    nothing if the mark went meanwhile (an earlier run of the curator).
    :class:`PendingRecoveryError` if the restored cluster's peer CA is not
    the one on disk; the etcd client's and the curator's errors otherwise.
    """
    pending = read(root)
    if pending is None:
        return None

    async def prepare(status: Status) -> None:
        import trio

        from metropolis.curator.rejoin import prepare_restored

        if not await trio.to_thread.run_sync(path(root).exists):
            return
        recovery = pending.recovery
        node_pki = await status.load_node_pki(recovery.node_id)
        if node_pki.ca.certificate != join.ca_certificate:
            raise PendingRecoveryError(
                f"the peer CA in {root.data.etcd.peer_pki.path} is not the restored cluster's:"
                " delete that folder and run node recover again"
            )
        _, recovery = await prepare_restored(status.curator_client(), recovery, join.to_proto())
        crash_point("recover-prepared")
        await trio.to_thread.run_sync(drop, root)
        log_recovered(pending.snapshot, recovery)

    return prepare


def log_recovered(snapshot: str | Path, recovery: Recovery) -> None:
    """Say that the recovery is done (a warning: the cluster lost what came after the snapshot)."""
    _log.warning(
        "recovered from %s (revision %d, taken %s on %s): etcd restored as a one-member"
        " cluster of %s; to rejoin once they run: %s",
        snapshot,
        recovery.snapshot_revision,
        recovery.snapshot_taken_at,
        recovery.snapshot_node_id,
        recovery.node_id,
        ", ".join(recovery.rejoining) or "none",
    )
