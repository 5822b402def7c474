"""``python -m shepherd.demo``: from bare machines to a cluster, all on this machine.

Everything is real except the machines' hardware: a private PostgreSQL holds
the BMDB, each machine is an SSH server on its own loopback address that
runs commands for real, the initializer uploads the real agent, and the
agents install the real node image, whose nodes join a real cluster::

    private PostgreSQL 15 ─── BMDB (migrated on open)
    machines.toml (static provider) ──sync_provided──▶ machine_provided tags
    N machines: asyncssh servers on 127.0.0.2, .3, ..., M of them refusing our key
    agent callback server and image server on 127.0.0.1 (plain HTTP)
    initializer control loop (P workers)
        source machine ─▶ SSH ─▶ SFTP agent ─▶ run with TakeoverInit ─▶ key
        success: finish() + AgentStarted    failure: fail() + backoff
        the agent detaches and heartbeats (with its hardware report)
    meanwhile: the node image (python -m metropolis image build, or the
        cached build of the same inputs), and a first node bootstrapping the
        cluster on 127.0.1.1 (shepherd.localcluster)
    then (unless --takeover-only):
        shepherd.install writes an installation request per taken-over machine
        each agent downloads the image, verifies it, starts its node
        the node registers; the approver (owner's credentials) approves it
        because its agent reported its key; the node joins, heartbeats
        the owner grants ConsensusMember to two nodes: they join etcd as voters

Progress lines say what changed; at the end one table: each machine (and
the first node) with its address, node id, roles and health as the
cluster reports them (with ``--takeover-only``: each machine's takeover
outcome as the BMDB records it). ``--web`` serves the web UI
(``python -m console web``) for the run and prints its URL.

With ``--stay`` (implied by ``--web`` unless ``--exit`` is given) every
server keeps running after the table, and the demo prints the commands
that work against them (`shepherd.demo_stay`), until Ctrl-C or SIGTERM.
Then it stops everything, PostgreSQL last (after every BMDB session is
closed), waits until no process it started (agents, nodes, etcd, the web
UI) runs, and removes what it created in its working folder (``--keep``
leaves it, with the Postgres log, the node logs, the machines file and the
SSH key, for a look around). It never removes or chmods anything it did
not create: a ``--workdir`` that exists must be empty, and stays in place
afterwards. A ``--workdir`` so long that a node's etcd socket path would not
fit a UNIX socket address is refused before anything starts. Ctrl-C stops
everything the same way and ends with one line. Exit status: 0 when every
machine ended as expected, 1 otherwise, 2 for bad options, 130 on Ctrl-C.

The command line is this module, the run's order `shepherd.demo_run`; the
phases and the folder have modules of their own: `shepherd.demo_takeover` (the machines
file, each machine's takeover outcome, progress lines),
`shepherd.demo_cluster` (the node image, the install, approval and
ConsensusMember), `shepherd.demo_table` (the final tables),
`shepherd.demo_web` (``--web``) and `shepherd.demo_workdir` (the working
folder, what may be removed from it, and the processes that run from it).
This module parses the command line; the run is `shepherd.demo_run`,
imported once the options are good (``--help`` imports none of it).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from common.commands import DEFAULT, commands_description
from common.exitcodes import show_in_help
from common.lazy import exports

if TYPE_CHECKING:
    from shepherd.demo_takeover import write_machines_file as write_machines_file
    from shepherd.demo_workdir import MACHINES_DIR as MACHINES_DIR
    from shepherd.demo_workdir import MAX_SOCKET_PATH as MAX_SOCKET_PATH
    from shepherd.demo_workdir import WorkdirError as WorkdirError
    from shepherd.demo_workdir import check_workdir_length as check_workdir_length
    from shepherd.demo_workdir import longest_socket_path as longest_socket_path
else:
    # The tests, their fixtures and bench/install.py import these from here
    # (they live in the phase modules); imported on first use (common.lazy).
    __getattr__ = exports(
        __name__,
        {
            "shepherd.demo_takeover": ["write_machines_file"],
            "shepherd.demo_workdir": [
                "MACHINES_DIR",
                "MAX_SOCKET_PATH",
                "WorkdirError",
                "check_workdir_length",
                "longest_socket_path",
            ],
        },
    )

__all__ = [
    "MACHINES_DIR",
    "MAX_SOCKET_PATH",
    "WorkdirError",
    "check_workdir_length",
    "longest_socket_path",
    "main",
    "write_machines_file",
]

#: The first node's address: not 127.0.0.1 (the Shepherd's servers) nor a
#: machine's 127.0.0.N; it uses the nodes' fixed ports, as installed nodes do.
FIRST_NODE_ADDRESS = "127.0.1.1"

#: How many installed nodes are granted ConsensusMember (fewer if fewer).
CONSENSUS_GRANTS = 2

#: The default fleet: three machines become nodes, two refuse our key.
DEFAULT_MACHINES = 5
DEFAULT_BROKEN = 2
#: With ``--real-machines`` (`shepherd.demo_real`): all take the key.
REAL_DEFAULT_MACHINES = 3

#: ``--timeout`` unless given; with ``--real-machines`` (machines boot, twice).
DEFAULT_TIMEOUT = 180.0
REAL_TIMEOUT = 400.0
#: Added to it with ``--upgrade``.
UPGRADE_TIMEOUT = 200.0

#: Where ``--web`` serves without a HOST:PORT.
DEFAULT_WEB = "127.0.0.1:8080"


#: What the demo can do, as its ``--help`` starts (and the README lists).
COMMANDS = (
    (DEFAULT, "the whole path: takeover, image, install, approval, a cluster; then stop"),
    ("--real-machines", "the same on real Linux machines (nspawn, loop disks, a BMC); needs root"),
    ("--upgrade", "with --real-machines: then upgrade the cluster to a second image, A/B"),
    ("--takeover-only", "stop after the takeover: each machine's outcome"),
    ("--stay", "then keep everything up and print commands to try, until Ctrl-C"),
    ("--web", "also serve the web UI and print its URL (implies --stay; --exit ends)"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m shepherd.demo",
        usage="%(prog)s [--real-machines [--upgrade] | --takeover-only] [--stay | --web "
        "[HOST:PORT] [--exit]] [options]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=commands_description(
            COMMANDS,
            "The whole path on one machine: a private PostgreSQL (the BMDB), a fleet of SSH "
            "machines on loopback (127.0.0.2, .3, ...) that the Shepherd takes over (some "
            "refuse our key, to show failure handling), a cluster bootstrapped by a first "
            f"node on {FIRST_NODE_ADDRESS}, the node image built (or reused from the cache), "
            "installed by the agents on every taken-over machine, the new nodes approved by "
            f"the Shepherd with the owner's credentials, {CONSENSUS_GRANTS} of them granted "
            "ConsensusMember. Prints what changes, then one table: machine, address, node "
            "id, roles, health. The default run takes about 30 s on 2 cores (the first one "
            "also builds the image, 10-30 s more). Needs Debian's postgresql (15) and "
            "etcd-server packages. Ctrl-C stops everything. With --real-machines the "
            "machines are real Linux systems (systemd-nspawn, a loop-device disk each, a "
            "Redfish BMC): the node is installed onto the disk, one consensus member is "
            "power-reset through its BMC and comes back, one machine is decommissioned; "
            "about 2 minutes, and Ctrl-C stops every machine and detaches every loop device.",
        ),
    )
    show_in_help(parser)
    parser.add_argument(
        "--machines",
        type=_positive,
        default=None,
        help=f"fleet size (default {DEFAULT_MACHINES}: {DEFAULT_MACHINES - DEFAULT_BROKEN} "
        f"become nodes; with --real-machines {REAL_DEFAULT_MACHINES}); each installed "
        "node is a node process with its own etcd",
    )
    parser.add_argument(
        "--broken",
        type=_non_negative,
        default=None,
        help=f"how many machines refuse our key (default {DEFAULT_BROKEN}; none with "
        "--real-machines)",
    )
    parser.add_argument(
        "--real-machines",
        action="store_true",
        help="the machines are real Linux systems: systemd-nspawn Debian 12 machines, each "
        "with its own NIC on a bridge, a loop-device disk and power through a Redfish BMC; "
        "the node is installed onto the disk and runs under the machine's systemd; one "
        "consensus member is power-reset through its BMC and comes back, one machine is "
        "decommissioned (its disk wiped). Needs root, systemd-nspawn and mmdebstrap (the "
        "first run builds the machines' root, about 95 s)",
    )
    parser.add_argument(
        "--upgrade",
        action="store_true",
        help="with --real-machines: after the power reset, upgrade every machine to a second "
        "release of the image (python -m shepherd upgrade's run, the Shepherd's upgrader): "
        "each writes its other disk slot, boots it once and keeps it when its node is healthy; "
        "the table shows each node's image and slot",
    )
    parser.add_argument(
        "--parallelism", type=_positive, default=4, help="initializer workers (default 4)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help=f"give up after SECONDS, printing the table as it is (default {DEFAULT_TIMEOUT:g}; "
        f"{REAL_TIMEOUT:g} with --real-machines)",
    )
    parser.add_argument(
        "--takeover-only",
        action="store_true",
        help="stop after the takeover (no cluster, no install): the table is each machine's "
        "takeover outcome as the BMDB records it",
    )
    parser.add_argument(
        "--web",
        nargs="?",
        const=DEFAULT_WEB,
        metavar="HOST:PORT",
        help=f"also serve the web UI (python -m console web) for the run, at HOST:PORT "
        f"(default {DEFAULT_WEB}; port 0: any free port); its URL is printed",
    )
    parser.add_argument(
        "--stay",
        action="store_true",
        help="after the table, keep PostgreSQL, the fleet, the nodes, the Shepherd and the "
        "web UI running until Ctrl-C or SIGTERM, and print the commands (bmdb machines, "
        "hold, decommission, metropolis owner nodes, set-roles) that work against them; "
        "implied by --web",
    )
    parser.add_argument(
        "--exit",
        action="store_true",
        help="end after the table even with --web (the run's servers stop)",
    )
    parser.add_argument(
        "--image-cache",
        type=Path,
        metavar="DIR",
        help="where built node images are kept and reused when their inputs (sources, "
        "Python packages, etcd) are unchanged (default $XDG_CACHE_HOME/metropolis-images, "
        "or ~/.cache/metropolis-images)",
    )
    parser.add_argument(
        "--etcd",
        type=Path,
        default=Path("/usr/bin/etcd"),
        metavar="PATH",
        help="the etcd binary bundled into the node image (default /usr/bin/etcd)",
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        help=(
            "working folder: a new folder, or an empty one (default: a new temporary folder);"
            " a non-empty folder is refused, and only what the demo created is removed;"
            " one so long that a node's etcd socket path would pass the kernel's limit is"
            " refused"
        ),
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the working folder (PostgreSQL's and the nodes' logs, machines.toml, keys)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return parser


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m shepherd.demo ...``: parse, then run (`shepherd.demo_run`); the exit status."""
    args = build_parser().parse_args(argv)
    if args.upgrade and not args.real_machines:
        build_parser().error("--upgrade goes with --real-machines")
    if args.real_machines:
        if args.broken or args.takeover_only or args.web is not None or args.stay:
            build_parser().error(
                "--real-machines takes no --broken, --takeover-only, --web or --stay"
            )
        args.broken = 0
        args.machines = args.machines or REAL_DEFAULT_MACHINES
        args.timeout = args.timeout or (REAL_TIMEOUT + UPGRADE_TIMEOUT * args.upgrade)
        from shepherd.demo_real import missing

        why = missing()
        if why is not None:
            sys.stderr.write(f"shepherd.demo: {why}\n")
            return 2
    args.machines = args.machines or DEFAULT_MACHINES
    args.timeout = args.timeout or DEFAULT_TIMEOUT
    args.broken = DEFAULT_BROKEN if args.broken is None else args.broken
    if args.broken > args.machines:
        build_parser().error("--broken cannot exceed --machines")
    from shepherd.demo_run import run

    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
