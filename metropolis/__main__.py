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
neither is saved. ``--boot-info FILE`` (what the boot chose: the disk slot,
the image, whether this boot is a one-shot try) and ``--announce-healthy
FILE`` (written once the cluster took the node's status and its roles
run) are the node's part of an A/B upgrade (:mod:`metropolis.roleserve.bootinfo`,
:mod:`metropolis.roleserve.bootcheck`); their defaults come from
``METROPOLIS_BOOT_INFO`` and ``METROPOLIS_ANNOUNCE_HEALTHY``, which the
installed node unit sets. ``metropolis node recover --root DIR --snapshot FILE``
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
``--keep-open SECONDS`` hands the call to a session process that keeps the
connection open (started by the first such call; :mod:`metropolis.cli.ownerlink`,
:mod:`metropolis.cli.ownersession`, run as the internal command
``owner-session``).

Every command checks its ``--root`` before it reads or writes anything
there (:meth:`~metropolis.localstorage.Root.check`): a root that is a
symlink, not ours, or that another user could write into (the root, a
folder or file in it, a folder above it) is refused with one line naming
the path, its mode and the fix; no mode is changed. A damaged file in the
root is refused the same way (:class:`~metropolis.localstorage.CorruptFile`).
Errors of the package are logged as one line and exit with status 2.

This module parses the command line and nothing more: each command's
modules are imported when it runs (:mod:`metropolis.cli.node`,
:mod:`metropolis.cli.owner`), so that ``--help`` and a usage error import
no protocol stack (``tests/test_cli_imports.py`` bounds what each command
imports).
"""

from __future__ import annotations

import os
import sys

# Imported where they are used, not here: an owner call that a kept-open
# session answers (metropolis.cli.ownerlink) runs before any of them, and
# costs little more than the interpreter's start.
TYPE_CHECKING = False
if TYPE_CHECKING:
    import argparse
    from pathlib import Path

    from metropolis.errors import MetropolisError

#: The logger of this CLI's own lines.
LOG_NAME = "metropolis.cli"

#: How this CLI's log lines (its errors among them) look.
_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

#: ``--register-deadline``'s default, seconds: the same as
#: :data:`metropolis.roleserve.register.DEFAULT_DEADLINE` (a test holds
#: them equal), written here so that parsing imports no node module.
REGISTER_DEADLINE = 300.0

#: The environment variables that give ``--boot-info`` and
#: ``--announce-healthy`` their defaults: the same as
#: :mod:`metropolis.roleserve.bootinfo`'s (a test holds them equal),
#: written here for the same reason.
BOOT_INFO_ENV = "METROPOLIS_BOOT_INFO"
ANNOUNCE_HEALTHY_ENV = "METROPOLIS_ANNOUNCE_HEALTHY"


def _parser() -> argparse.ArgumentParser:
    import argparse
    from pathlib import Path

    from common.exitcodes import show_in_help
    from common.listen import listen_address

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
        command.add_argument(
            "--boot-info",
            type=Path,
            default=_env_path(BOOT_INFO_ENV),
            metavar="FILE",
            help="what the boot chose (disk slot, image, one-shot try), to report in the node's"
            f" status (default: ${BOOT_INFO_ENV}; not saved)",
        )
        command.add_argument(
            "--announce-healthy",
            type=Path,
            default=_env_path(ANNOUNCE_HEALTHY_ENV),
            metavar="FILE",
            help="write FILE once the cluster took this node's status and its roles run: the"
            f" health check of a slot tried once (default: ${ANNOUNCE_HEALTHY_ENV}; not saved)",
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
    owner.add_argument(
        "--keep-open",
        type=_positive_seconds,
        metavar="SECONDS",
        help="keep a session process with the connection to the curators open for SECONDS "
        "after the last call, and hand later calls with the same options to it (as ssh's "
        "ControlPersist does): they then skip the start of Python's TLS, HTTP/2 and protobuf. "
        "The session runs as you; its socket is in a folder only you can enter "
        "($XDG_RUNTIME_DIR or /tmp, metropolis-owner-UID)",
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


def _register_deadline_flag(command: argparse.ArgumentParser, when: str) -> None:
    command.add_argument(
        "--register-deadline",
        type=_positive_seconds,
        default=REGISTER_DEADLINE,
        metavar="SECONDS",
        help=f"while registering{when}, retry with backoff (each retry logged) as long as no "
        f"curator answers, for up to SECONDS in a row, then give up (default "
        f"{REGISTER_DEADLINE:g}); a refusal (wrong ticket: PERMISSION_DENIED) ends it at once; "
        "the wait for the owner's approval is not bounded (not saved)",
    )


def _env_path(name: str) -> Path | None:
    """The path an environment variable names, if set and not empty."""
    from pathlib import Path

    value = os.environ.get(name)
    return Path(value) if value else None


def _positive_seconds(text: str) -> float:
    import argparse

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["image"]:
        # Imported here: a node (run from an image) never needs the build tools.
        from metropolis.image.__main__ import main as image_main

        return image_main(argv[1:])
    if argv[:1] == ["owner"] and any(a.startswith("--keep-open") for a in argv):
        # Before anything heavy: a kept-open session may answer the call.
        from metropolis.cli import ownerlink

        code = ownerlink.forward(argv)
        if code is not None:
            return code
    if argv[:1] == ["owner-session"]:
        # Internal: the session an owner call with --keep-open started.
        from metropolis.cli import ownersession

        return ownersession.main(argv[1:], _parser().parse_args, _error_answer)
    import logging

    from metropolis.errors import MetropolisError

    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=_LOG_FORMAT, stream=sys.stderr)
    log = logging.getLogger(LOG_NAME)
    try:
        if args.command == "owner":
            import trio

            from metropolis.cli import owner, ownerlink

            trio.run(owner.run, args)
            found = ownerlink.scan(argv)
            if args.keep_open is not None and found is not None:
                ownerlink.start_session(found)
        else:
            from metropolis.cli import node

            node.run(args)
    except MetropolisError as e:
        log.error("%s", e)
        return _exit_code(e)
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


def _error_answer(error: MetropolisError) -> tuple[str, int]:
    """An owner call's error as this CLI reports it (its log line, its exit
    code), for a call an owner session ran."""
    import logging

    record = logging.LogRecord(LOG_NAME, logging.ERROR, __file__, 0, "%s", (error,), None)
    line = logging.Formatter(_LOG_FORMAT).format(record) + "\n"
    return line, _exit_code(error)


def _exit_code(error: MetropolisError) -> int:
    from common.exitcodes import ExitCode

    return ExitCode.TRY_AGAIN if _not_yet(error) else 2


def _not_yet(error: MetropolisError) -> bool:
    """Whether ``error`` means "try again" (a node still bootstrapping)."""
    # Only the owner's commands raise it, and they imported its module.
    owner = sys.modules.get("metropolis.owner")
    return owner is not None and isinstance(error, owner.NodeNotFinished)


def _leaves(group: BaseExceptionGroup[MetropolisError]) -> list[BaseException]:
    leaves: list[BaseException] = []
    for error in group.exceptions:
        leaves += _leaves(error) if isinstance(error, BaseExceptionGroup) else [error]
    return leaves


if __name__ == "__main__":
    raise SystemExit(main())
