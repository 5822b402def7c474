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
      ├─ the node's peer PKI on disk whole and its own (CA, its certificate
      │  for its key and peer address, CRL): nothing to prepare here;
      │  roles (those saved, with ConsensusMember: that PKI) written, the
      │  old etcd data deleted, a mark written (:mod:`.recoverpending`),
      │  the restored data renamed into place, the node's etcd started on
      │  it ahead of the node (its consensus service takes it over:
      │  :mod:`metropolis.consensus.child`)
      └─ else (the PKI lost or not this node's): prepare ─ a temporary
           etcd on it (plain-HTTP peers, alone): this node's peer
           certificate (the stored one, or a new one), its record with
           ConsensusMember for the restored member, rejoin marks for the
           other members, the recovery's record (:mod:`.recoverprep`,
           imported while etcdctl runs); stopped; then swap ─ peer PKI,
           CRL and roles written, the old etcd data (if any) deleted (and
           a cut recovery's mark), the restored data renamed into place

after which the caller runs the node as ``node run`` would: its etcd
starts on the restored data, (with a mark) its curator prepares the
restored keyspace as the temporary etcd would have before it first
campaigns, then leads, and the other nodes come back with their own
``node run`` (:mod:`metropolis.curator.rejoin`). etcd 3.4's restore writes
no key of ours, and the peer CA's key, which a new peer certificate needs,
is only in the restored keyspace: without the node's own PKI, no etcd with
peer TLS can start before a temporary one read it.

Cluster CA, owner, node records, roles and tickets are the snapshot's: the
node's own credentials (issued by that CA) stay valid. What happened in
the cluster after the snapshot was taken is lost.

:func:`check`, :func:`start` and :func:`swap_in_with_own_pki` need
neither Trio nor the node's wire (etcd's client, the curator's records):
``node recover`` imports those in another thread once etcdctl runs, and
:func:`recover_with_temporary_etcd` imports Trio when it is called.

Errors: :class:`RecoverError` (or :class:`~metropolis.consensus.snapshot.SnapshotError`,
:class:`~metropolis.consensus.restore.RestoreError`), one line; before the
swap nothing of the node's state has changed (the work folder is removed).
A crash during the swap leaves the root for ``node recover`` to be run
again (the node refuses to run on a mark without data); one after it, with
a mark, leaves the preparation to the node's next start. Cancellation:
etcdctl is killed, the temporary etcd stopped and the work folder removed.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cryptography import x509

from common.durable import atomic_write, fsync_directory
from metropolis import pki
from metropolis.consensus.restore import Restore, start_restore
from metropolis.consensus.settings import SOCKET_NAME
from metropolis.consensus.snapshotfile import SnapshotManifest, cluster_identity, verify_snapshot
from metropolis.crashpoint import crash_point
from metropolis.errors import ConsensusError, MetropolisError
from metropolis.identity import NodeCredentials
from metropolis.localstorage import Root
from metropolis.roleserve import disk, recoverpending

if TYPE_CHECKING:
    from metropolis.consensus.join import JoinCluster
    from metropolis.proto.common import NodeRoles

__all__ = [
    "Checked",
    "RecoverError",
    "Restoring",
    "check",
    "recover_with_temporary_etcd",
    "start",
    "swap_in_with_own_pki",
]

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
    #: The roles saved on the node (None: none saved).
    roles: NodeRoles | None


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
    return Checked(root, saved.settings, saved.credentials, snapshot, manifest, saved.roles)


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

        For a caller that stops after an error, or will not go on after
        all; after the swap it only removes the emptied work folder.
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


def swap_in_with_own_pki(restoring: Restoring) -> bool:
    """Wait for etcdctl; if the node's own peer PKI is on disk, swap the
    restored data in and start the node's etcd on it (blocking); whether it did.

    Needs no Trio: ``node recover`` calls it on its main thread while the
    rest of the node is imported in another, and etcd started ahead dies
    with that thread (:mod:`metropolis.consensus.child`). False leaves the
    restored data in the work folder for :func:`recover_with_temporary_etcd`.
    See the module docstring. The node must not run meanwhile (:func:`check`
    looked); its peer port must be free. Raises (one line each)
    :class:`~metropolis.consensus.restore.RestoreError` when etcdctl failed,
    :class:`OSError` when a file cannot be written or etcd started; a caller
    that stops after an error calls :meth:`Restoring.abort`.
    """
    checked = restoring.checked
    restoring.restore.finish()
    join = _join_on_disk(checked)
    if join is None:
        return False
    # The node's own etcd starts on the restored data; its curator
    # prepares it before it campaigns (.recoverpending).
    pending, roles = _pending(checked, join)
    _swap(
        checked.root,
        checked.credentials,
        join,
        roles,
        restoring.restored,
        restoring.work,
        pending,
    )
    _start_etcd_ahead(checked, join)
    _log.info(
        "restored %s: the node's etcd starts on it; its curator prepares it",
        checked.snapshot,
    )
    restoring.abort()  # the work folder, now empty
    return True


async def recover_with_temporary_etcd(restoring: Restoring) -> None:
    """After :func:`swap_in_with_own_pki` returned False: prepare the restored
    data with a temporary etcd, then swap it in. See the module docstring.

    Cancellation stops the temporary etcd; the work folder is removed
    either way (:meth:`Restoring.abort`).
    """
    # Imported here: the command imports Trio once etcdctl runs (see the
    # module docstring).
    import trio

    # The larger part of this module's imports (etcd's client, the
    # curator's records): the command imports it in a thread while etcdctl
    # runs.
    from metropolis.roleserve.recoverprep import prepare

    checked, work, restored = restoring.checked, restoring.work, restoring.restored
    try:
        _log.info("no whole peer PKI of this node on disk: a temporary etcd prepares the data")
        join, roles, recovery = await prepare(checked, restored, work)
        await trio.to_thread.run_sync(
            _swap, checked.root, checked.credentials, join, roles, restored, work, None
        )
        _log.info("restored %s, prepared by a temporary etcd", checked.snapshot)
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(restoring.abort)
    recoverpending.log_recovered(checked.snapshot, recovery)


def _start_etcd_ahead(checked: Checked, join: JoinCluster) -> None:
    """Start the node's etcd on the data just put in place, with the command
    line its consensus service will run (blocking, for the fork).

    The service takes it over (:mod:`metropolis.consensus.child`): etcd's
    start and first election go on while the rest of the node is imported
    and started, instead of after.
    """
    from metropolis.consensus.child import start_ahead

    config = checked.settings.consensus_config(checked.root, checked.credentials.private_key, join)
    start_ahead(config.joining_process())


def _join_on_disk(checked: Checked) -> JoinCluster | None:
    """This node's join data from its peer PKI on disk (blocking), if whole and its own.

    Its CA, its certificate (for this node's key, signed by that CA, naming
    the peer address's hosts) and the CA's CRL; None if anything is absent,
    damaged or not this node's. Whether the CA is the restored cluster's
    is checked once etcd runs (:mod:`.recoverpending`).
    """
    from metropolis.consensus.join import JoinCluster
    from metropolis.consensus.peerhosts import peer_hosts

    etcd = checked.root.data.etcd
    try:
        join = JoinCluster(
            pki.decode_certificate(etcd.peer_pki.ca_certificate.read_bytes()),
            pki.decode_certificate(etcd.peer_pki.certificate.read_bytes()),
            pki.decode_crl(etcd.peer_crl.read_bytes()),
            (),
        )
        join.check(checked.credentials.private_key)
    except (OSError, pki.PKIError, ConsensusError):
        return None
    if not set(peer_hosts(checked.settings.peer_address)) <= _hosts(join.node_certificate):
        return None
    return join


def _hosts(certificate: x509.Certificate) -> set[str]:
    """The DNS names and IP addresses a certificate names (its SAN)."""
    try:
        san = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    ips = {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}
    return set(san.get_values_for_type(x509.DNSName)) | ips


def _pending(checked: Checked, join: JoinCluster) -> tuple[recoverpending.Pending, NodeRoles]:
    """The mark for the node's curator, and the node's roles to start with (blocking):
    those saved, with the ConsensusMember role of ``join`` (the role fetch
    gives the restored record's once the curator leads)."""
    from metropolis.curator.recovery import Recovery
    from metropolis.proto.common import NodeRoles

    manifest = checked.manifest
    recovery = Recovery.now(
        checked.credentials.node_id,
        revision=manifest.revision,
        taken_at=manifest.taken_at,
        snapshot_node_id=manifest.node_id,
        sha256=manifest.sha256,
    )
    roles = copy.deepcopy(checked.roles) if checked.roles is not None else NodeRoles()
    roles.consensus_member = join.to_proto()
    return recoverpending.Pending(recovery, str(checked.snapshot)), roles


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
    pending: recoverpending.Pending | None,
) -> None:
    """Write peer PKI, CRL and roles (where they differ), then put the restored
    data in etcd's place (blocking): the old data gone, the mark of a
    ``pending`` preparation written (or a cut recovery's removed), the
    restored data renamed in."""
    root.create()  # the layout, should the operator have deleted all of data/etcd
    etcd = root.data.etcd
    files = {
        etcd.peer_pki.ca_certificate: pki.encode_certificate(join.ca_certificate),
        etcd.peer_pki.certificate: pki.encode_certificate(join.node_certificate),
        etcd.peer_pki.key: pki.encode_private_key(credentials.private_key),
    }
    # Unchanged files (the node's own PKI, reused) are not written again:
    # each write is two fsyncs on the way to the node's start.
    if not all(_holds(path, data) for path, data in files.items()):
        etcd.peer_pki.write_all(*files.values())
    crl = pki.encode_crl(join.initial_crl)
    if not _holds(etcd.peer_crl, crl):
        atomic_write(etcd.peer_crl, crl)
    disk.save_roles(root, roles)
    if etcd.data.exists():
        old = work / "old"
        os.replace(etcd.data, old)
        shutil.rmtree(old)
    if pending is not None:
        recoverpending.write(root, pending)
    else:
        recoverpending.drop(root)
    crash_point("recover-marked")
    os.replace(restored, etcd.data)
    fsync_directory(etcd.path)


def _holds(path: Path, data: bytes) -> bool:
    """Whether ``path`` holds ``data``, owner-only."""
    try:
        return path.stat().st_mode & 0o077 == 0 and path.read_bytes() == data
    except OSError:
        return False
