"""The operator console's command.

    python -m console [--url URL] web [--listen HOST:PORT]   read-only web UI
        [--cluster-owner-root DIR --cluster-owner-key FILE]  with the cluster's pages
        [--metrics-listen HOST:PORT [--metrics-fleet-period SECONDS]]
        [--counts-period SECONDS]                            machine list's counts reused

``--url`` is the BMDB's, as ``python -m bmdb`` takes it (without it, the
libpq ``PG*`` environment variables locate the database). The server runs
until SIGINT or SIGTERM, then prints ``stopped`` and exits 0. Errors (the
BMDB unreachable or not migrated, unreadable owner files) are printed as one
line on stderr, with exit status 1 (see :mod:`common.cli`).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from bmdb.cli import add_url_option
from bmdb.errors import BMDBError
from common.cli import run_main
from common.exitcodes import show_in_help
from common.listen import listen_address
from console.errors import ConsoleError
from metropolis.errors import MetropolisError

#: ``--counts-period``'s default, seconds: `console.counts.DEFAULT_PERIOD`
#: (a test holds them equal), written here so that parsing imports nothing
#: of the server.
COUNTS_PERIOD = 5.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="console",
        description="The operator console: the fleet (BMDB) and the cluster it runs.",
    )
    show_in_help(parser)
    add_url_option(parser)
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    web = commands.add_parser("web", help="serve the read-only web UI until SIGINT/SIGTERM")
    web.add_argument(
        "--listen",
        type=listen_address,
        default="127.0.0.1:8080",
        metavar="HOST:PORT",
        help="(default: %(default)s)",
    )
    web.add_argument(
        "--metrics-listen",
        type=listen_address,
        metavar="HOST:PORT",
        help="also serve Prometheus metrics at http://HOST:PORT/metrics",
    )
    # "owner root": the node root whose owner certificate the owner's tools
    # read (`python -m metropolis owner --root`); "cluster-" groups both
    # flags apart from the BMDB's --url.
    web.add_argument(
        "--cluster-owner-root",
        type=Path,
        metavar="DIR",
        help="also show the cluster: a node root with the owner certificate, "
        "as 'python -m metropolis owner --root' takes",
    )
    web.add_argument(
        "--cluster-owner-key",
        type=Path,
        metavar="FILE",
        help="the cluster owner's private key (with --cluster-owner-root)",
    )
    web.add_argument(
        "--metrics-fleet-period",
        type=float,
        default=15.0,
        metavar="SECONDS",
        help="how often the fleet gauges are queried (default: %(default)s)",
    )
    web.add_argument(
        "--counts-period",
        type=float,
        default=COUNTS_PERIOD,
        metavar="SECONDS",
        help="how long the machine list's counts per state are reused before they are"
        " taken again (each take reads the whole fleet; default: %(default)s)",
    )
    args = parser.parse_args(argv)
    if not args.counts_period >= 0:  # NaN too
        parser.error(f"--counts-period must be >= 0, got {args.counts_period:g}")
    if (args.cluster_owner_root is None) != (args.cluster_owner_key is None):
        parser.error("--cluster-owner-root and --cluster-owner-key go together")
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )

    def body() -> int:
        # Imported now that the options are good: --help imports none of it.
        import trio

        from console.web_command import run

        print(trio.run(run, args))
        return 0

    # MetropolisError: the cluster owner's files (--cluster-owner-*).
    return run_main("console", body, known=(BMDBError, MetropolisError, ConsoleError))


if __name__ == "__main__":
    raise SystemExit(main())
