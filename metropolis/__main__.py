"""Command-line entry point of the ``metropolis`` package.

``metropolis node bootstrap --root DIR --address HOST --owner-key-out FILE
[--insecure-seal]`` creates a cluster with this node as its first member and
keeps running; ``metropolis node run --root DIR`` restarts a node from its
saved state (finishing a registration a crash interrupted; with
``--announce-key FILE`` it writes the node's public key there first, as
``register`` does); ``metropolis
node register --root DIR --ticket HEX --cluster FILE --address HOST
--insecure-seal`` joins an existing cluster (waiting for the owner's
approval) and keeps running; ``--parameters FILE`` (a NodeParameters with
cluster_register, as the Shepherd's install writes it) replaces
``--ticket`` and ``--cluster``; ``--announce-key FILE`` writes the node's
public key there as soon as its identity is saved. Run again on the same
root after a crash, it resumes the saved registration. While no curator
answers it retries with backoff, for ``--register-deadline SECONDS`` in a
row (default 300; ``run`` takes it too, for a saved registration); a
refusal (a wrong ticket) ends it at once. SIGINT or SIGTERM
stops everything (etcd included) and exits 0. Each of the three takes
``--metrics-listen HOST:PORT`` to serve the node's Prometheus metrics at
``/metrics`` (:mod:`metropolis.roleserve.metrics`), and ``--snapshot-interval
SECONDS [--snapshot-keep N] [--snapshot-dir DIR]`` to snapshot the local
etcd member on that schedule (:mod:`metropolis.roleserve.snapshots`);
neither is saved. ``metropolis node recover --root DIR --snapshot FILE``
makes this node the first member of its cluster restored from a snapshot,
then runs it (:mod:`metropolis.roleserve.recover`); it takes the same
metrics and snapshot options.

``metropolis image build --out DIR`` builds a node image
(:mod:`metropolis.image.__main__`, which it hands its arguments to).

``metropolis owner (--cluster FILE | --root NODE_ROOT) --owner-key FILE``
then ``nodes``, ``approve NODE``, ``set-roles NODE [--consensus-member
on|off] [--kubernetes-controller on|off]``, ``delete NODE [--force]``,
``tree NODE``, ``ticket``, ``info [--out FILE]`` or ``snapshot --out FILE``
(of the etcd member running on the node of ``--root``, with its manifest:
:mod:`metropolis.consensus.snapshot`) or ``recoveries`` (the recoveries from
snapshots, read there too): the owner's calls
(:mod:`metropolis.owner`). ``--cluster`` takes what ``info --out`` wrote
and needs no node's disk. Calls that change something print what
changed; one still waiting after a second says what it waits for.

Every command checks its ``--root`` before it reads or writes anything
there (:meth:`~metropolis.localstorage.Root.check`): a root that is a
symlink, not ours, or that another user could write into (the root, a
folder or file in it, a folder above it) is refused with one line naming
the path, its mode and the fix; no mode is changed. A damaged file in the
root is refused the same way (:class:`~metropolis.localstorage.CorruptFile`).
Errors of the package are logged as one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from common.exitcodes import ExitCode, show_in_help
from common.listen import listen_address
from metropolis import identity, pki
from metropolis.consensus.client import Client
from metropolis.consensus.config import CURATOR_NAMESPACE
from metropolis.consensus.process import SOCKET_NAME, SOCKET_PATH_MAX, Tuning
from metropolis.consensus.snapshot import cluster_identity, manifest_path, take_snapshot
from metropolis.curator.rejoin import read_recoveries
from metropolis.errors import MetropolisError
from metropolis.localstorage import Root, atomic_write
from metropolis.owner import (
    Change,
    NodeNotFinished,
    Owner,
    OwnerAccess,
    describe_change,
    format_table,
    format_tree,
    load_owner,
    load_owner_from_cluster,
    load_owner_key,
)
from metropolis.proto import parameters
from metropolis.proto.management import GetClusterInfoResponse
from metropolis.roleserve import disk, recover
from metropolis.roleserve.metrics import NodeMetrics
from metropolis.roleserve.register import DEFAULT_DEADLINE, register
from metropolis.roleserve.server import RoleServer
from metropolis.roleserve.values import BootstrapData, RegisterIntent
from metropolis.supervisor import Node, supervise

log = logging.getLogger("metropolis.cli")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="metropolis",
        description="The node half: run a cluster node, build its image, manage the cluster.",
    )
    show_in_help(parser)
    commands = parser.add_subparsers(dest="command", required=True)
    node = commands.add_parser("node", help="run a cluster node")
    actions = node.add_subparsers(dest="action", required=True)

    boot = actions.add_parser("bootstrap", help="create a new cluster and run its first node")
    boot.add_argument("--root", type=Path, required=True, help="the node's data directory")
    boot.add_argument("--address", required=True, help="IP or name other nodes reach it at")
    boot.add_argument(
        "--owner-key-out", type=Path, required=True, help="where to write the owner's private key"
    )
    boot.add_argument(
        "--insecure-seal",
        action="store_true",
        help="no TPM: store the sealed configuration in plain text",
    )
    boot.add_argument("--peer-port", type=int, default=7834, help="consensus peer port")
    boot.add_argument("--curator-port", type=int, default=7835, help="curator RPC port")
    boot.add_argument(
        "--debug-port", type=int, default=7837, help="debug service port (the owner's view)"
    )
    boot.add_argument(
        "--raft-tuning",
        default="100,1000",
        metavar="HEARTBEAT_MS,ELECTION_MS",
        help="etcd raft timing (loopback clusters can use 20,200)",
    )

    boot.add_argument(
        "--status-interval",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="heartbeat: seconds between status pushes (timeout: twice that)",
    )
    boot.add_argument(
        "--curator-lease-ttl",
        type=int,
        default=10,
        metavar="SECONDS",
        help="how long a dead curator leader blocks the next election (default 10)",
    )

    run = actions.add_parser("run", help="restart a node from its saved state")
    run.add_argument("--root", type=Path, required=True, help="the node's data directory")
    run.add_argument(
        "--announce-key",
        type=Path,
        metavar="FILE",
        help="write the node's Ed25519 public key (32 raw bytes) here before it starts",
    )
    _register_deadline_flag(run, " (when finishing a saved registration)")

    rec = actions.add_parser(
        "recover",
        help="restore the cluster from an etcd snapshot on this node, then run it",
        description="Turn this node into the first member of its cluster restored from a"
        " snapshot ('owner snapshot' or a scheduled one, with its manifest): etcd is restored"
        " by etcdctl as a one-member cluster, the other members are dropped; they rejoin"
        " with their own 'node run'. The snapshot must be whole and of this node's cluster,"
        " and the node stopped: otherwise nothing is changed. Then runs the node (later"
        " starts: 'node run').",
    )
    rec.add_argument("--root", type=Path, required=True, help="the node's data directory")
    rec.add_argument(
        "--snapshot", type=Path, required=True, help="the snapshot file (FILE.manifest beside it)"
    )

    reg = actions.add_parser("register", help="join an existing cluster and run")
    reg.add_argument("--root", type=Path, required=True, help="the node's data directory")
    reg.add_argument("--address", required=True, help="IP or name other nodes reach it at")
    reg.add_argument("--ticket", help="register ticket (hex, from 'owner ticket')")
    reg.add_argument(
        "--directory",
        "--cluster",
        dest="cluster",
        type=Path,
        help="cluster CA and directory (from 'owner info --out FILE')",
    )
    reg.add_argument(
        "--parameters",
        type=Path,
        help="NodeParameters file with cluster_register (instead of --ticket and --directory)",
    )
    reg.add_argument(
        "--announce-key",
        type=Path,
        metavar="FILE",
        help="write the node's Ed25519 public key (32 raw bytes) here once it is saved",
    )
    reg.add_argument("--insecure-seal", action="store_true", help="no TPM: plain-text seal")
    _register_deadline_flag(reg, "")
    reg.add_argument("--peer-port", type=int, default=7834, help="consensus peer port")
    reg.add_argument("--curator-port", type=int, default=7835, help="curator RPC port")
    reg.add_argument(
        "--debug-port", type=int, default=7837, help="debug service port (the owner's view)"
    )
    reg.add_argument("--raft-tuning", default="100,1000", metavar="HEARTBEAT_MS,ELECTION_MS")
    reg.add_argument("--status-interval", type=float, default=5.0, metavar="SECONDS")
    reg.add_argument(
        "--curator-lease-ttl",
        type=int,
        default=10,
        metavar="SECONDS",
        help="how long a dead curator leader blocks the next election (default 10)",
    )

    for command in (boot, run, reg, rec):
        command.add_argument(
            "--metrics-listen",
            type=listen_address,
            metavar="HOST:PORT",
            help="serve Prometheus metrics at http://HOST:PORT/metrics (default: off; not saved)",
        )
        command.add_argument(
            "--snapshot-interval",
            type=float,
            default=0.0,
            metavar="SECONDS",
            help="snapshot the local etcd member this often (default 0: never; not saved)",
        )
        command.add_argument(
            "--snapshot-keep", type=int, default=3, metavar="N", help="keep the newest N (3)"
        )
        command.add_argument(
            "--snapshot-dir",
            type=Path,
            metavar="DIR",
            help="where snapshots go (default: ROOT/data/snapshots)",
        )
    for sub in (boot, reg):
        sub.add_argument(
            "--member-health-wait",
            choices=["on", "off"],
            default="on",
            help="etcd refuses membership changes until every voter has been"
            " connected for 5 s (default on; off only for clusters on one machine)",
        )

    # Listed for --help only: main() hands 'image ...' to metropolis.image
    # before this parser sees it, so that the image tool keeps its own options.
    commands.add_parser("image", help="build a node image ('image build --help')")

    owner = commands.add_parser("owner", help="manage the cluster as its owner")
    where = owner.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--cluster", type=Path, help="cluster CA and directory (from 'owner info --out')"
    )
    where.add_argument("--root", type=Path, help="a node's data directory")
    owner.add_argument("--owner-key", type=Path, required=True, help="the owner's private key")
    owner.add_argument(
        "--curator-port",
        type=int,
        default=7835,
        help="the cluster's curator port (with --cluster; default 7835)",
    )
    calls = owner.add_subparsers(dest="action", required=True)
    calls.add_parser("nodes", help="the node table")
    approve = calls.add_parser("approve", help="approve a registered node")
    approve.add_argument("node", help="node ID (or a unique prefix)")
    roles = calls.add_parser("set-roles", help="grant or revoke roles")
    roles.add_argument("node", help="node ID (or a unique prefix)")
    roles.add_argument("--consensus-member", choices=["on", "off"])
    roles.add_argument("--kubernetes-controller", choices=["on", "off"])
    delete = calls.add_parser("delete", help="delete a node from the cluster")
    delete.add_argument("node", help="node ID (or a unique prefix)")
    delete.add_argument(
        "--force",
        action="store_true",
        help="even if it holds roles (accepted only once its heartbeat has timed out)",
    )
    tree = calls.add_parser("tree", help="a node's supervision tree, from the node")
    tree.add_argument("node", help="node ID (or a unique prefix)")
    calls.add_parser("ticket", help="print the register ticket (hex)")
    info = calls.add_parser("info", help="cluster directory and CA")
    info.add_argument("--out", type=Path, help="write them for 'node register --cluster'")
    snap = calls.add_parser(
        "snapshot", help="snapshot etcd (the member on this --root's node), with a manifest"
    )
    snap.add_argument("--out", type=Path, required=True, help="the snapshot file")
    calls.add_parser(
        "recoveries",
        help="the recoveries from snapshots (read from the etcd member on this --root's node)",
    )
    return parser


def _root(path: Path) -> Root:
    """The node root at ``path``, checked (:meth:`Root.check`) if anything is there.

    The folders above are resolved, the root itself is not: a symlink
    given as ``--root`` is refused by the check, not followed. A missing
    root is left to the command (bootstrap creates it, run refuses it).
    """
    root = _resolved(path)
    if os.path.lexists(root.path):
        root.check()
    return root


def _resolved(path: Path) -> Root:
    """The node root at ``path`` with the folders above it resolved (not checked)."""
    absolute = Path(os.path.abspath(path))
    return Root(absolute.parent.resolve() / absolute.name)


def _check_socket_room(path: Path) -> None:
    """`NodeRootError` if etcd's client socket under the root ``path`` names
    would be longer than a UNIX socket path may be.

    Checked before anything is written: etcd would otherwise fail to
    listen only once the node starts its control plane, with a message
    far from its cause.
    """
    socket = _resolved(path).ephemeral.consensus / SOCKET_NAME
    size = len(os.fsencode(socket))
    if size > SOCKET_PATH_MAX:
        raise disk.NodeRootError(
            f"--root {path}: too long by {size - SOCKET_PATH_MAX} bytes: etcd's client socket "
            f"would be {socket} ({size} bytes; a UNIX socket path has at most "
            f"{SOCKET_PATH_MAX}); use a shorter root"
        )


def _register_deadline_flag(command: argparse.ArgumentParser, when: str) -> None:
    command.add_argument(
        "--register-deadline",
        type=_positive_seconds,
        default=DEFAULT_DEADLINE,
        metavar="SECONDS",
        help=f"while registering{when}, retry with backoff (each retry logged) as long as no "
        f"curator answers, for up to SECONDS in a row, then give up (default "
        f"{DEFAULT_DEADLINE:g}); a refusal (wrong ticket: PERMISSION_DENIED) ends it at once; "
        "the wait for the owner's approval is not bounded (not saved)",
    )


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _settings(args: argparse.Namespace) -> disk.NodeSettings:
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
    settings = _settings(args)
    root = _root(args.root)
    if root.path.exists() and any(root.path.iterdir()):
        raise disk.NodeRootError(f"{root.path} is not empty; use 'run' for an existing node")
    owner = pki.generate_key()
    data = BootstrapData.generate(pki.public_key_bytes(owner))
    args.owner_key_out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(args.owner_key_out.resolve(), pki.encode_private_key(owner))
    disk.save_settings_and_intent(root, settings, data)
    log.info("bootstrap intent saved in %s; owner key in %s", root.path, args.owner_key_out)
    return root


def _onoff(value: str | None) -> bool | None:
    return None if value is None else value == "on"


#: What a call that takes a while is waiting for, said after :data:`_PATIENCE` seconds.
_WAITS = {
    "consensus-on": (
        "waiting for the curator to add the node to etcd (etcd admits a new member "
        "only once its leader is connected to every peer; this can take a while)"
    ),
    "consensus-off": "waiting for the curator to remove the node's etcd member",
    "delete": "waiting for the curator to remove the node's etcd member and revoke it",
    "any": "still waiting for the curators (a leader may be being elected)",
}
_PATIENCE = 1.0


@asynccontextmanager
async def _saying_waits(what: str) -> AsyncIterator[None]:
    """Run the block; if it takes over :data:`_PATIENCE` s, say on stderr what it waits for."""
    async with trio.open_nursery() as nursery:

        async def tell() -> None:
            await trio.sleep(_PATIENCE)
            sys.stderr.write(_WAITS[what] + "...\n")
            sys.stderr.flush()

        nursery.start_soon(tell)
        try:
            yield
        finally:
            nursery.cancel_scope.cancel()


def _owner_access(args: argparse.Namespace) -> OwnerAccess:
    key = load_owner_key(args.owner_key)
    if args.cluster is not None:
        return load_owner_from_cluster(args.cluster, key, args.curator_port)
    return load_owner(_root(args.root), key)


async def _owner(args: argparse.Namespace) -> None:
    access = _owner_access(args)
    async with _saying_waits("any"):
        await access.tls_context()  # the escrow, unless the root keeps a certificate
    async with access.open() as owner:
        await _owner_call(args, owner)


async def _owner_call(args: argparse.Namespace, owner: Owner) -> None:
    out = sys.stdout.write
    if args.action == "nodes":
        async with _saying_waits("any"):
            rows = await owner.nodes()
        out(format_table(rows) + "\n")
    elif args.action == "approve":
        async with _saying_waits("any"):
            row = await owner.approve(args.node)
            after = await owner.current(row)
        # A NEW node has pushed no status yet, so usually no address.
        address = row.address or "none reported yet"
        out(f"approved {row.node_id} (address {address})\n")
        if after is not None:
            out(describe_change(Change(row, after)) + "\n")
    elif args.action == "set-roles":
        consensus = _onoff(args.consensus_member)
        what = "any" if consensus is None else ("consensus-on" if consensus else "consensus-off")
        async with _saying_waits(what):
            change = await owner.set_roles(
                args.node,
                consensus_member=consensus,
                kubernetes_controller=_onoff(args.kubernetes_controller),
            )
        out(describe_change(change) + "\n")
    elif args.action == "delete":
        async with _saying_waits("delete"):
            change = await owner.delete(args.node, force=args.force)
        out(describe_change(change) + "\n")
    elif args.action == "tree":
        tree = await owner.supervision_tree(await owner.row(args.node))
        out(format_tree(tree) + "\n")
    elif args.action == "ticket":
        out((await owner.ticket()).hex() + "\n")
    elif args.action == "snapshot":
        if args.root is None:
            raise MetropolisError("snapshot needs --root: the node whose etcd member it reads")
        # The owner key must be the cluster's: the curators answer it.
        await owner.info()
        out(await _snapshot(_root(args.root), args.out) + "\n")
    elif args.action == "recoveries":
        if args.root is None:
            raise MetropolisError("recoveries needs --root: the node whose etcd member it reads")
        await owner.info()
        out(await _recoveries(_root(args.root)) + "\n")
    else:
        info = await owner.info()
        if args.out is not None:
            atomic_write(args.out.resolve(), bytes(info))
        directory = info.cluster_directory
        for node in directory.nodes if directory else []:
            hosts = ",".join(a.host for a in node.addresses)
            out(f"{identity.node_id(node.public_key)} {hosts}\n")


def _local_etcd(root: Root) -> Path:
    """The client socket of the etcd member on the node of ``root``; refused if none runs."""
    socket = root.ephemeral.consensus / SOCKET_NAME
    if not socket.exists():
        raise MetropolisError(
            f"no etcd member runs on the node of {root.path}: give the root of a node"
            " with ConsensusMember"
        )
    return socket


async def _recoveries(root: Root) -> str:
    """The recoveries recorded in the cluster, one line each (oldest first)."""
    async with Client(_local_etcd(root)) as client:
        found = await read_recoveries(client.namespaced(CURATOR_NAMESPACE))
    if not found:
        return "no recovery from a snapshot"
    return "\n".join(
        f"{r.at} {r.node_id} recovered from snapshot revision {r.snapshot_revision}"
        f" (taken {r.snapshot_taken_at} on {r.snapshot_node_id}, sha256 {r.snapshot_sha256});"
        f" rejoining: {', '.join(r.rejoining) or 'none'}"
        for r in found
    )


async def _snapshot(root: Root, out: Path) -> str:
    """Snapshot the etcd member of the node at ``root`` into ``out``; one line on it."""
    socket = _local_etcd(root)
    saved = await trio.to_thread.run_sync(disk.load, root)
    assert saved.credentials is not None  # the owner call above needs them
    made = await take_snapshot(
        socket,
        out,
        cluster_ca_sha256=cluster_identity(saved.credentials.ca_certificate),
        node_id=saved.credentials.node_id,
    )
    return (
        f"snapshot {out}: revision {made.revision}, {made.size} bytes, sha256 {made.sha256}"
        f" (manifest {manifest_path(out)})"
    )


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


def _announce_saved(path: Path, saved: disk.SavedNode) -> None:
    """``run --announce-key``: the saved node's key, registered or not yet."""
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
    settings = _settings(args)
    root = _root(args.root)
    if disk.register_path(root).exists():
        log.info("resuming the registration saved in %s (with its keys and ticket)", root.path)
        saved = disk.load(root)
        if saved.register is not None:
            _announce(args.announce_key, saved.register.node_public_key)
        elif saved.credentials is not None:
            # Committed; only the intent's removal was left to do.
            _announce(args.announce_key, saved.credentials.public_key)
        return root
    if root.path.exists() and not _fresh(root):
        raise disk.NodeRootError(f"{root.path} is not empty; use 'run' for an existing node")
    ticket, cluster = _register_source(args)
    intent = RegisterIntent.generate(ticket, cluster)
    disk.save_register_intent(root, settings, intent)
    _announce(args.announce_key, intent.node_public_key)
    return root


async def _run_node(
    root: Root,
    metrics_listen: str | None = None,
    snapshots: tuple[Path, float, int] | None = None,
    register_deadline: float = DEFAULT_DEADLINE,
) -> None:
    """Finish a saved registration if there is one, then run the node; until a signal.

    ``metrics_listen``: serve the node's metrics there; ``snapshots``:
    (folder, interval, keep) of scheduled etcd snapshots;
    ``register_deadline``: how long the registration retries an outage of
    every curator (:func:`~metropolis.roleserve.register.register`).
    """
    saved = disk.load(root)
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def stop_on_signal() -> None:
                async for signum in signals:
                    log.info("%s: stopping", signal.Signals(signum).name)
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(stop_on_signal)
            if saved.register is not None:
                await register(root, saved.settings, saved.register, deadline=register_deadline)
                saved = disk.load(root)
            # An intent a crash left beside the credentials is done with.
            await trio.to_thread.run_sync(disk.drop_finished_intents, root)
            metrics = NodeMetrics(metrics_listen) if metrics_listen else None
            server = RoleServer(root, saved, metrics=metrics, snapshots=snapshots)

            async def main(node: Node) -> None:
                node.run("role", server.run)
                node.signal_healthy()
                await trio.sleep_forever()

            nursery.start_soon(supervise, main)


def _snapshots(args: argparse.Namespace, root: Root) -> tuple[Path, float, int] | None:
    """The scheduled snapshots' (folder, interval, keep), or None when off."""
    if args.snapshot_interval == 0:
        return None
    if args.snapshot_interval < 0 or args.snapshot_keep < 1:
        raise MetropolisError("--snapshot-interval must be positive, --snapshot-keep at least 1")
    folder = args.snapshot_dir or root.data.path / "snapshots"
    return Path(os.path.abspath(folder)), args.snapshot_interval, args.snapshot_keep


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["image"]:
        # Imported here: a node (run from an image) never needs the build tools.
        from metropolis.image.__main__ import main as image_main

        return image_main(argv[1:])
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        if args.command == "owner":
            trio.run(_owner, args)
        else:
            _check_socket_room(args.root)
            if args.action == "register":
                root = _prepare_register(args)
            elif args.action == "bootstrap":
                root = _bootstrap(args)
            elif args.action == "recover":
                root = _root(args.root)
                checked = recover.check(root, args.snapshot)  # before anything changes
                trio.run(recover.recover, checked)
            else:
                root = _root(args.root)
            saved = disk.load(root)  # fail before starting anything
            if args.action == "run" and args.announce_key is not None:
                _announce_saved(args.announce_key, saved)
            trio.run(
                _run_node,
                root,
                args.metrics_listen,
                _snapshots(args, root),
                getattr(args, "register_deadline", DEFAULT_DEADLINE),
            )
    except MetropolisError as e:
        log.error("%s", e)
        return ExitCode.TRY_AGAIN if isinstance(e, NodeNotFinished) else 2
    except BaseExceptionGroup as group:
        # Errors from inside the node's nursery (a refused registration):
        # one line each, like any other error of ours, not a traceback.
        ours, rest = group.split(MetropolisError)
        if ours is None or rest is not None:
            raise
        for error in _leaves(ours):
            log.error("%s", error)
        return 2
    return 0


def _leaves(group: BaseExceptionGroup[MetropolisError]) -> list[BaseException]:
    leaves: list[BaseException] = []
    for error in group.exceptions:
        leaves += _leaves(error) if isinstance(error, BaseExceptionGroup) else [error]
    return leaves


if __name__ == "__main__":
    raise SystemExit(main())
