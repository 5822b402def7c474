"""``node recover``: one node becomes the first member of a cluster restored from a snapshot.

For the day every consensus member is lost (their etcd data gone) but a
snapshot (:mod:`metropolis.consensus.snapshot`) and a node's root are
left::

    check (nothing changed yet) ─ the root is a finished node of a cluster;
      │                           the snapshot whole (manifest, SHA-256,
      │                           etcd's hash) and of this cluster (its CA's
      │                           SHA-256); no etcd runs on this node, and
      │                           nothing answers on its debug port (the
      │                           node runs)
    start ─ etcdctl snapshot restore started into ROOT/data/recover/data:
      │     a new one-member cluster of this node (old members dropped)
    restore ─ (the rest of the command imported meanwhile) etcdctl done, its
      │       result in place
    prepare ─ a temporary etcd on it (plain-HTTP peers, alone): this node's
      │       peer certificate (the stored one, or a new one), its record
      │       with ConsensusMember for the restored member, rejoin marks for
      │       the other members, the recovery's record
      │       (:mod:`.recoverprep`, imported while etcdctl runs); stopped
    swap ─ peer PKI, CRL and roles written, the old etcd data (if any)
           deleted and the restored data renamed into its place

after which the caller runs the node as ``node run`` would: its etcd
starts on the restored data, its curator leads, and the other nodes come
back with their own ``node run`` (:mod:`metropolis.curator.rejoin`).

Cluster CA, owner, node records, roles and tickets are the snapshot's: the
node's own credentials (issued by that CA) stay valid. What happened in
the cluster after the snapshot was taken is lost.

:func:`check` and :func:`start` need neither Trio nor the node's wire
(etcd's client, the curator's records): ``node recover`` imports those only
once etcdctl runs, and :func:`recover` imports Trio when it is called.

Errors: :class:`RecoverError` (or :class:`~metropolis.consensus.snapshot.SnapshotError`,
:class:`~metropolis.consensus.restore.RestoreError`), one line; before the
swap nothing of the node's state has changed (the work folder is removed).
A crash during the swap leaves the root for ``node recover`` to be run
again. Cancellation: etcdctl is killed, the temporary etcd stopped and the
work folder removed.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from common.durable import atomic_write, fsync_directory
from metropolis import pki
from metropolis.consensus.restore import Restore, start_restore
from metropolis.consensus.settings import SOCKET_NAME
from metropolis.consensus.snapshotfile import SnapshotManifest, cluster_identity, verify_snapshot
from metropolis.errors import MetropolisError
from metropolis.identity import NodeCredentials
from metropolis.localstorage import Root
from metropolis.roleserve import disk

if TYPE_CHECKING:
    from metropolis.consensus.join import JoinCluster
    from metropolis.curator.rejoin import Recovery
    from metropolis.proto.common import NodeRoles

__all__ = ["Checked", "RecoverError", "Restoring", "check", "recover", "start"]

_log = logging.getLogger("metropolis.roleserve.recover")


class RecoverError(MetropolisError):
    """The node or the snapshot cannot be recovered from; nothing was changed."""


@dataclass(frozen=True)
class Checked:
    """What :func:`check` found: the node and the snapshot to recover it from."""

    root: Root
    settings: disk.NodeSettings
    credentials: NodeCredentials
    snapshot: Path
    manifest: SnapshotManifest


def check(root: Root, snapshot: Path) -> Checked:
    """Check the node and the snapshot; change nothing (blocking). See the module docstring."""
    saved = disk.load(root)
    if saved.credentials is None:
        raise RecoverError(
            f"{root.path} holds no finished node (no cluster credentials): recover on a"
            " node of the cluster"
        )
    manifest = verify_snapshot(snapshot)
    ca = cluster_identity(saved.credentials.ca_certificate)
    if manifest.cluster_ca_sha256 != ca:
        raise RecoverError(
            f"{snapshot} is a snapshot of another cluster (CA SHA-256 "
            f"{manifest.cluster_ca_sha256[:16]}..., this node's is {ca[:16]}...): refusing it"
        )
    if _answers(root.ephemeral.consensus / SOCKET_NAME):
        raise RecoverError(
            f"an etcd member runs on the node of {root.path}: stop the node before recovering"
        )
    debug = (saved.settings.address, saved.settings.debug_port)
    if _listens(*debug):
        raise RecoverError(
            f"something answers on the node's debug port {debug[0]}:{debug[1]}: stop the node"
            " before recovering"
        )
    return Checked(root, saved.settings, saved.credentials, snapshot, manifest)


def _listens(host: str, port: int) -> bool:
    """Whether something accepts TCP connections at ``host``:``port`` (within a second)."""
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def _answers(path: Path) -> bool:
    """Whether something accepts connections on the UNIX socket ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True


@dataclass(frozen=True)
class Restoring:
    """What :func:`start` started: etcdctl restoring the snapshot into ``work``."""

    checked: Checked
    work: Path
    restore: Restore

    @property
    def restored(self) -> Path:
        """Where the restored data is once etcdctl is done."""
        return self.work / "data"

    def abort(self) -> None:
        """Kill etcdctl (if it runs) and remove the work folder (blocking).

        For a caller that will not call :func:`recover` after all; after
        :func:`recover` it does nothing.
        """
        self.restore.abort()
        shutil.rmtree(self.work, ignore_errors=True)


def start(checked: Checked) -> Restoring:
    """Start etcdctl's restore of the checked snapshot (blocking, for a fork).

    The first change to the root: its layout made whole, the work folder
    ``data/recover`` made afresh (a cut recovery's is deleted).
    """
    root, settings, node_id = checked.root, checked.settings, checked.credentials.node_id
    root.create()
    work = root.data.path / "recover"
    _fresh_folder(work)
    _log.info("restoring %s with etcdctl", checked.snapshot)
    try:
        restore = start_restore(
            checked.snapshot,
            work / "data",
            name=node_id,
            peer_url=f"https://{settings.peer_address}",
        )
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return Restoring(checked, work, restore)


async def recover(restoring: Restoring) -> Recovery:
    """Wait for etcdctl, prepare and swap in the snapshot's etcd; the recovery as recorded.

    See the module docstring. The node must not run meanwhile
    (:func:`check` looked); its peer port must be free.
    """
    # Imported here: the command imports Trio once etcdctl runs (see the
    # module docstring).
    import trio

    checked, work, restored = restoring.checked, restoring.work, restoring.restored
    root, credentials = checked.root, checked.credentials
    try:
        await trio.lowlevel.wait_readable(restoring.restore.exited)
        await trio.to_thread.run_sync(restoring.restore.finish)
        # Imported only now, while etcdctl ran: the temporary etcd's modules
        # (etcd's client, the curator's records) are the larger part of
        # this module's; the command imports them meanwhile, in a thread.
        from metropolis.roleserve.recoverprep import prepare

        join, roles, recovery = await prepare(checked, restored, work)
        await trio.to_thread.run_sync(_swap, root, credentials, join, roles, restored, work)
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(restoring.abort)
    _log.warning(
        "recovered from %s (revision %d, taken %s on %s): etcd restored as a one-member"
        " cluster of %s; to rejoin once they run: %s",
        checked.snapshot,
        recovery.snapshot_revision,
        recovery.snapshot_taken_at,
        recovery.snapshot_node_id,
        credentials.node_id,
        ", ".join(recovery.rejoining) or "none",
    )
    return recovery


def _fresh_folder(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(mode=0o700)


def _swap(
    root: Root,
    credentials: NodeCredentials,
    join: JoinCluster,
    roles: NodeRoles,
    restored: Path,
    work: Path,
) -> None:
    """Write peer PKI, CRL and roles, then put the restored data in etcd's place (blocking)."""
    root.create()  # the layout, should the operator have deleted all of data/etcd
    etcd = root.data.etcd
    etcd.peer_pki.write_all(
        ca_certificate=pki.encode_certificate(join.ca_certificate),
        certificate=pki.encode_certificate(join.node_certificate),
        key=pki.encode_private_key(credentials.private_key),
    )
    atomic_write(etcd.peer_crl, pki.encode_crl(join.initial_crl))
    disk.save_roles(root, roles)
    if etcd.data.exists():
        old = work / "old"
        os.replace(etcd.data, old)
        shutil.rmtree(old)
    os.replace(restored, etcd.data)
    fsync_directory(etcd.path)
