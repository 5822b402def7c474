"""``metropolis node ...``: bootstrap, register, recover and run a node, from parsed arguments.

Imported by :mod:`metropolis.__main__` only for a ``node`` command, which
runs the whole node (etcd, the curator, the role server). Trio, the
cluster's parameters and what runs the node are imported only once they
are needed: ``node recover`` starts etcdctl first (issue 39: ``node
recover`` against etcd's own restore).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from common.durable import atomic_write
from metropolis import identity, pki
from metropolis.cli.root import checked_root, resolved_root
from metropolis.consensus.settings import SOCKET_NAME, SOCKET_PATH_MAX, Tuning
from metropolis.errors import MetropolisError
from metropolis.localstorage import Root
from metropolis.roleserve import disk, recoverpending
from metropolis.roleserve.values import BootstrapData, RegisterIntent

if TYPE_CHECKING:
    from metropolis.proto.management import GetClusterInfoResponse

__all__ = ["check_socket_room", "node_settings", "run"]

#: What ``node recover`` imports while etcdctl and the node's etcd start:
#: Trio, what runs the node, and the temporary etcd's preparation (needed
#: only by a node that lost its peer PKI).
_MEANWHILE = ("trio", "metropolis.cli.noderun", "metropolis.roleserve.recoverprep")

log = logging.getLogger("metropolis.cli")


def check_socket_room(path: Path) -> None:
    """`NodeRootError` if etcd's client socket under the root ``path`` names
    would be longer than a UNIX socket path may be.

    Checked before anything is written: etcd would otherwise fail to
    listen only once the node starts its control plane, with a message
    far from its cause.
    """
    socket = resolved_root(path).ephemeral.consensus / SOCKET_NAME
    size = len(os.fsencode(socket))
    if size > SOCKET_PATH_MAX:
        raise disk.NodeRootError(
            f"--root {path}: too long by {size - SOCKET_PATH_MAX} bytes: etcd's client socket "
            f"would be {socket} ({size} bytes; a UNIX socket path has at most "
            f"{SOCKET_PATH_MAX}); use a shorter root"
        )


def node_settings(args: argparse.Namespace) -> disk.NodeSettings:
    """The settings ``bootstrap`` and ``register`` take from their options."""
    try:
        heartbeat, election = (int(x) for x in args.raft_tuning.split(","))
    except ValueError:
        raise MetropolisError(
            f"--raft-tuning {args.raft_tuning!r}: want HEARTBEAT_MS,ELECTION_MS"
        ) from None
    try:
        tuning = Tuning(heartbeat, election, member_health_wait=args.member_health_wait == "on")
        return _node_settings(args, tuning)
    except ValueError as e:  # NodeSettings refuses values out of range
        raise MetropolisError(str(e)) from None


def _node_settings(args: argparse.Namespace, tuning: Tuning) -> disk.NodeSettings:
    return disk.NodeSettings(
        address=args.address,
        peer_port=args.peer_port,
        curator_port=args.curator_port,
        debug_port=args.debug_port,
        tuning=tuning,
        insecure_seal=True,
        status_interval=args.status_interval,
        curator_lease_ttl=args.curator_lease_ttl,
    )


def _bootstrap(args: argparse.Namespace) -> Root:
    if not args.insecure_seal:
        raise MetropolisError("no TPM support: pass --insecure-seal to store secrets in plain text")
    settings = node_settings(args)
    root = checked_root(args.root)
    if root.path.exists() and any(root.path.iterdir()):
        raise disk.NodeRootError(f"{root.path} is not empty; use 'run' for an existing node")
    owner = pki.generate_key()
    data = BootstrapData.generate(pki.public_key_bytes(owner))
    args.owner_key_out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(args.owner_key_out.resolve(), pki.encode_private_key(owner))
    disk.save_settings_and_intent(root, settings, data)
    log.info("bootstrap intent saved in %s; owner key in %s", root.path, args.owner_key_out)
    return root


def _fresh(root: Root) -> bool:
    """Whether ``root`` holds nothing but an interrupted start of a registration.

    Empty directories of the layout and settings alone are left by a crash
    before the register intent was saved: nothing reached the cluster, so
    registering again may start over.
    """
    for directory, _, files in os.walk(root.path):
        for name in files:
            if Path(directory, name) != disk.settings_path(root):
                return False
    return True


def _check_register_source(args: argparse.Namespace) -> None:
    """Refuse, before anything is read or written, a command line that names
    the cluster twice (``--parameters`` and ``--ticket``/``--directory``) or
    not at all."""
    legacy = args.ticket is not None or args.cluster is not None
    if args.parameters is not None and legacy:
        raise MetropolisError(
            "--parameters replaces --ticket and --directory: give one or the other"
        )
    if args.parameters is None and (args.ticket is None or args.cluster is None):
        raise MetropolisError("give --parameters FILE, or both --ticket HEX and --directory FILE")


def _register_source(args: argparse.Namespace) -> tuple[bytes, GetClusterInfoResponse]:
    """Ticket and cluster (CA, directory) from ``--parameters`` or ``--ticket``/``--directory``.

    Both files are read strictly (:mod:`metropolis.proto.parameters`):
    anything but the exact encoding, with a usable CA and directory, is
    one :class:`~metropolis.proto.parameters.NodeParametersError` naming
    the file.
    """
    from metropolis.proto import parameters

    if args.parameters is not None:
        params = parameters.read(args.parameters)
        register = params.cluster_register
        assert register is not None  # read() accepts only cluster_register
        # No call the cluster offers a node that is not a member yet (nor
        # one that is, short of reading etcd as a consensus member) names
        # the cluster's owner, so the key cannot be checked against the
        # cluster here: it is logged, for the operator to compare.
        log.info(
            "parameters %s: owner public key %s (not checked: the cluster does "
            "not tell a registering node its owner)",
            args.parameters,
            register.owner_public_key.hex(),
        )
        return register.register_ticket, parameters.cluster_info(params)
    try:
        ticket = bytes.fromhex(args.ticket)
    except ValueError as e:
        raise MetropolisError(f"--ticket: not hex ({e})") from e
    if not ticket:
        raise MetropolisError("--ticket: empty")
    return ticket, parameters.read_cluster_info(args.cluster)


def _announce(path: Path | None, public_key: bytes) -> None:
    """Write the node's public key to ``path`` (``--announce-key``), if given.

    Atomically (temp file, fsync, rename, directory fsync) and mode 0644: a
    reader (the installing agent) sees no file or the whole key, never
    part of it, and may be another user. The key is public.
    """
    if path is None:
        return
    try:
        atomic_write(Path(os.path.abspath(path)), public_key, 0o644)
    except OSError as e:
        raise MetropolisError(f"--announce-key {path}: cannot write: {e.strerror or e}") from e
    log.info("announced %s in %s", identity.node_id(public_key), path)


def _announce_saved(path: Path | None, saved: disk.SavedNode) -> None:
    """Announce a saved node's key: its registration's, or once committed
    (only the intent's removal was left to do) its credentials'."""
    if saved.register is not None:
        _announce(path, saved.register.node_public_key)
    elif saved.credentials is not None:
        _announce(path, saved.credentials.public_key)


def _prepare_register(args: argparse.Namespace) -> Root:
    """Save settings and a register intent, or find the intent a crash left; the root.

    Either way the node's public key is announced (``--announce-key``)
    once it is on disk and before the cluster is called.
    """
    _check_register_source(args)
    if not args.insecure_seal:
        raise MetropolisError("no TPM support: pass --insecure-seal to store secrets in plain text")
    settings = node_settings(args)
    root = checked_root(args.root)
    if disk.register_path(root).exists():
        log.info("resuming the registration saved in %s (with its keys and ticket)", root.path)
        _announce_saved(args.announce_key, disk.load(root))
        return root
    if root.path.exists() and not _fresh(root):
        raise disk.NodeRootError(f"{root.path} is not empty; use 'run' for an existing node")
    ticket, cluster = _register_source(args)
    intent = RegisterIntent.generate(ticket, cluster)
    disk.save_register_intent(root, settings, intent)
    _announce(args.announce_key, intent.node_public_key)
    return root


def _snapshots(args: argparse.Namespace, root: Root) -> tuple[Path, float, int] | None:
    """The scheduled snapshots' (folder, interval, keep), or None when off."""
    if args.snapshot_interval == 0:
        return None
    if args.snapshot_interval < 0 or args.snapshot_keep < 1:
        raise MetropolisError("--snapshot-interval must be positive, --snapshot-keep at least 1")
    folder = args.snapshot_dir or root.data.path / "snapshots"
    return Path(os.path.abspath(folder)), args.snapshot_interval, args.snapshot_keep


def run(args: argparse.Namespace) -> None:
    """Run the ``node`` command of ``args`` until the node stops (a signal)."""
    check_socket_room(args.root)
    if args.action == "register":
        root = _prepare_register(args)
    elif args.action == "bootstrap":
        root = _bootstrap(args)
    elif args.action == "recover":
        root = checked_root(args.root)
        from metropolis.roleserve import recover

        checked = recover.check(root, args.snapshot)  # before anything changes
        restoring = recover.start(checked)  # etcdctl runs from here
        _import_meanwhile()
        try:
            if not recover.swap_in_with_own_pki(restoring):
                import trio

                trio.run(recover.recover_with_temporary_etcd, restoring)
        finally:
            restoring.abort()  # after an error; nothing left to do otherwise
    else:
        root = checked_root(args.root)
    try:
        saved = disk.load(root)  # fail before starting anything
        recoverpending.check(root)  # nor on a recovery cut before its data was in place
        if args.action == "run":
            _announce_saved(args.announce_key, saved)
        import trio

        from metropolis.cli.noderun import run_node

        trio.run(
            run_node,
            root,
            args.metrics_listen,
            _snapshots(args, root),
            # Only run and register have it: a registration is finished by them only.
            getattr(args, "register_deadline", None),
            args.boot_info,
            args.announce_healthy,
        )
    finally:
        if args.action == "recover":
            # The etcd it started ahead, should the node not have taken it over.
            from metropolis.consensus.child import stop_ahead

            stop_ahead()


def _import_meanwhile() -> None:
    """Import what the rest of ``node recover`` needs in a thread of its own.

    The restore waits on etcdctl (started before Trio was imported), and
    the node's own etcd, started ahead on the restored data, on its start
    and first election; none of that needs the node's modules (a few
    hundred ms of CPU), which the node then finds imported (issue 39:
    ``node recover`` against etcd's own restore). The main thread meanwhile
    imports only what the swap needs, outside Trio and etcd's client; the
    import lock makes either thread wait for a module the other is
    importing.
    """

    def run() -> None:
        for name in _MEANWHILE:
            importlib.import_module(name)

    threading.Thread(target=run, name="import", daemon=True).start()
