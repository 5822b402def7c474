"""Command-line entry point of the ``metropolis`` package.

``metropolis node bootstrap --root DIR --address HOST --owner-key-out FILE
[--insecure-seal]`` creates a cluster with this node as its first member and
keeps running; ``metropolis node run --root DIR`` restarts a node from its
saved state (finishing a registration a crash interrupted); ``metropolis
node register --root DIR --ticket HEX --cluster FILE --address HOST
--insecure-seal`` joins an existing cluster (waiting for the owner's
approval) and keeps running; run again on the same root after a crash, it
resumes the saved registration. SIGINT or SIGTERM stops everything
(etcd included) and exits 0.

``metropolis owner --root NODE_ROOT --owner-key FILE`` then ``nodes``,
``approve NODE``, ``set-roles NODE [--consensus-member on|off]
[--kubernetes-controller on|off]``, ``tree NODE``, ``ticket`` or ``info
[--out FILE]``:
the owner's calls (:mod:`metropolis.owner`).

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
from pathlib import Path

import trio

from metropolis import identity, pki
from metropolis.consensus.process import Tuning
from metropolis.errors import MetropolisError
from metropolis.localstorage import Root, atomic_write
from metropolis.owner import format_table, format_tree, load_owner_key, open_owner
from metropolis.proto.management import GetClusterInfoResponse
from metropolis.roleserve import disk
from metropolis.roleserve.register import register
from metropolis.roleserve.server import RoleServer
from metropolis.roleserve.values import BootstrapData, RegisterIntent
from metropolis.supervisor import Node, supervise

log = logging.getLogger("metropolis.cli")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="metropolis", description=__doc__.splitlines()[0])
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

    run = actions.add_parser("run", help="restart a node from its saved state")
    run.add_argument("--root", type=Path, required=True, help="the node's data directory")

    reg = actions.add_parser("register", help="join an existing cluster and run")
    reg.add_argument("--root", type=Path, required=True, help="the node's data directory")
    reg.add_argument("--address", required=True, help="IP or name other nodes reach it at")
    reg.add_argument("--ticket", required=True, help="register ticket (hex, from 'owner ticket')")
    reg.add_argument(
        "--directory",
        "--cluster",
        dest="cluster",
        type=Path,
        required=True,
        help="cluster CA and directory (from 'owner info --out FILE')",
    )
    reg.add_argument("--insecure-seal", action="store_true", help="no TPM: plain-text seal")
    reg.add_argument("--peer-port", type=int, default=7834, help="consensus peer port")
    reg.add_argument("--curator-port", type=int, default=7835, help="curator RPC port")
    reg.add_argument(
        "--debug-port", type=int, default=7837, help="debug service port (the owner's view)"
    )
    reg.add_argument("--raft-tuning", default="100,1000", metavar="HEARTBEAT_MS,ELECTION_MS")
    reg.add_argument("--status-interval", type=float, default=5.0, metavar="SECONDS")

    owner = commands.add_parser("owner", help="manage the cluster as its owner")
    owner.add_argument("--root", type=Path, required=True, help="a node's data directory")
    owner.add_argument("--owner-key", type=Path, required=True, help="the owner's private key")
    calls = owner.add_subparsers(dest="action", required=True)
    calls.add_parser("nodes", help="the node table")
    approve = calls.add_parser("approve", help="approve a registered node")
    approve.add_argument("node", help="node ID (or a unique prefix)")
    roles = calls.add_parser("set-roles", help="grant or revoke roles")
    roles.add_argument("node", help="node ID (or a unique prefix)")
    roles.add_argument("--consensus-member", choices=["on", "off"])
    roles.add_argument("--kubernetes-controller", choices=["on", "off"])
    tree = calls.add_parser("tree", help="a node's supervision tree, from the node")
    tree.add_argument("node", help="node ID (or a unique prefix)")
    calls.add_parser("ticket", help="print the register ticket (hex)")
    info = calls.add_parser("info", help="cluster directory and CA")
    info.add_argument("--out", type=Path, help="write them for 'node register --cluster'")
    return parser


def _root(path: Path) -> Root:
    """The node root at ``path``, checked (:meth:`Root.check`) if anything is there.

    The folders above are resolved, the root itself is not: a symlink
    given as ``--root`` is refused by the check, not followed. A missing
    root is left to the command (bootstrap creates it, run refuses it).
    """
    absolute = Path(os.path.abspath(path))
    root = Root(absolute.parent.resolve() / absolute.name)
    if os.path.lexists(root.path):
        root.check()
    return root


def _settings(args: argparse.Namespace) -> disk.NodeSettings:
    """The settings ``bootstrap`` and ``register`` take from their options."""
    try:
        heartbeat, election = (int(x) for x in args.raft_tuning.split(","))
    except ValueError:
        raise MetropolisError(
            f"--raft-tuning {args.raft_tuning!r}: want HEARTBEAT_MS,ELECTION_MS"
        ) from None
    return disk.NodeSettings(
        address=args.address,
        peer_port=args.peer_port,
        curator_port=args.curator_port,
        debug_port=args.debug_port,
        tuning=Tuning(heartbeat, election),
        insecure_seal=True,
        status_interval=args.status_interval,
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


async def _owner(args: argparse.Namespace) -> None:
    root = _root(args.root)
    async with open_owner(root, load_owner_key(args.owner_key)) as owner:
        if args.action == "nodes":
            sys.stdout.write(format_table(await owner.nodes()) + "\n")
        elif args.action == "approve":
            await owner.approve(args.node)
        elif args.action == "set-roles":
            await owner.set_roles(
                args.node,
                consensus_member=_onoff(args.consensus_member),
                kubernetes_controller=_onoff(args.kubernetes_controller),
            )
        elif args.action == "tree":
            tree = await owner.supervision_tree(await owner.row(args.node))
            sys.stdout.write(format_tree(tree) + "\n")
        elif args.action == "ticket":
            sys.stdout.write((await owner.ticket()).hex() + "\n")
        else:
            info = await owner.info()
            if args.out is not None:
                atomic_write(args.out.resolve(), bytes(info))
            directory = info.cluster_directory
            for node in directory.nodes if directory else []:
                hosts = ",".join(a.host for a in node.addresses)
                sys.stdout.write(f"{identity.node_id(node.public_key)} {hosts}\n")


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


def _prepare_register(args: argparse.Namespace) -> Root:
    """Save settings and a register intent, or find the intent a crash left; the root."""
    if not args.insecure_seal:
        raise MetropolisError("no TPM support: pass --insecure-seal to store secrets in plain text")
    settings = _settings(args)
    root = _root(args.root)
    if disk.register_path(root).exists():
        log.info("resuming the registration saved in %s (with its keys and ticket)", root.path)
        return root
    if root.path.exists() and not _fresh(root):
        raise disk.NodeRootError(f"{root.path} is not empty; use 'run' for an existing node")
    try:
        ticket = bytes.fromhex(args.ticket)
    except ValueError as e:
        raise MetropolisError(f"--ticket: not hex ({e})") from e
    try:
        raw = args.cluster.read_bytes()
    except OSError as e:
        raise MetropolisError(f"cannot read the cluster file {args.cluster}: {e}") from e
    # A plain message, as 'owner info --out' writes it (and other tools
    # may): the exchange format, not one of the node's own checked files.
    try:
        cluster = GetClusterInfoResponse.parse(raw)
    # betterproto2 raises assorted errors on bad input, hence the broad catch.
    except Exception as e:
        raise MetropolisError(
            f"{args.cluster} is not a cluster file from 'owner info --out' ({e})"
        ) from e
    disk.save_register_intent(root, settings, RegisterIntent.generate(ticket, cluster))
    return root


async def _run_node(root: Root) -> None:
    """Finish a saved registration if there is one, then run the node; until a signal."""
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
                await register(root, saved.settings, saved.register)
                saved = disk.load(root)
            # An intent a crash left beside the credentials is done with.
            await trio.to_thread.run_sync(disk.drop_finished_intents, root)
            server = RoleServer(root, saved)

            async def main(node: Node) -> None:
                node.run("role", server.run)
                node.signal_healthy()
                await trio.sleep_forever()

            nursery.start_soon(supervise, main)


def main(argv: list[str] | None = None) -> int:
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
            if args.action == "register":
                root = _prepare_register(args)
            elif args.action == "bootstrap":
                root = _bootstrap(args)
            else:
                root = _root(args.root)
            disk.load(root)  # fail before starting anything
            trio.run(_run_node, root)
    except MetropolisError as e:
        log.error("%s", e)
        return 2
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
