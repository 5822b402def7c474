"""``python -m shepherd.agent_server``: serve agent heartbeats from a BMDB.

Its own process, not a part of ``python -m shepherd``: it faces the
machines' network (and scales with the fleet), while the Shepherd holds the
provider's and the SSH credentials; the two share nothing but the BMDB.
SIGINT or SIGTERM stops it (exit status 0); an unusable BMDB or an address
that cannot be bound exits with status 1.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import trio

import bmdb
from bmdb.errors import BMDBError
from shepherd.agent_server.connect import Limits
from shepherd.agent_server.server import AgentServerConfig, run_agent_server
from shepherd.control_loop import default_runtime_info

logger = logging.getLogger("shepherd.agent_server.main")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m shepherd.agent_server",
        description="Serve the agent callback (heartbeats, hardware reports) into a BMDB.",
    )
    parser.add_argument("--bmdb-url", required=True, metavar="URL", help="libpq URL of the BMDB")
    parser.add_argument(
        "--listen", default="[::]:8443", metavar="HOST:PORT", help="(default: %(default)s)"
    )
    parser.add_argument("--tls-certificate-path", type=Path, metavar="PEM")
    parser.add_argument("--tls-key-path", type=Path, metavar="PEM")
    parser.add_argument(
        "--insecure-plain-http",
        action="store_true",
        help="serve without TLS (tests, or behind a TLS-terminating proxy)",
    )
    parser.add_argument(
        "--max-body", type=int, default=Limits().max_body, metavar="BYTES", help="(%(default)s)"
    )
    parser.add_argument(
        "--freshness",
        type=float,
        default=AgentServerConfig().freshness,
        metavar="SECONDS",
        help="accepted clock difference agent/server (default: %(default)s)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return parser


def parse_config(argv: Sequence[str] | None) -> tuple[str, AgentServerConfig, bool]:
    parser = build_parser()
    args = parser.parse_args(argv)
    tls = args.tls_certificate_path is not None or args.tls_key_path is not None
    if tls and (args.tls_certificate_path is None or args.tls_key_path is None):
        parser.error("--tls-certificate-path and --tls-key-path go together")
    if not tls and not args.insecure_plain_http:
        parser.error("give --tls-certificate-path/--tls-key-path, or --insecure-plain-http")
    for path in (args.tls_certificate_path, args.tls_key_path):
        if path is not None and not path.is_file():
            parser.error(f"{path}: no such file")
    if args.max_body < 1024 or args.freshness <= 0:
        parser.error("--max-body must be at least 1024, --freshness positive")
    config = AgentServerConfig(
        listen=args.listen,
        certfile=args.tls_certificate_path,
        keyfile=args.tls_key_path,
        limits=Limits(max_body=args.max_body),
        freshness=args.freshness,
    )
    return args.bmdb_url, config, args.verbose


async def run(url: str, config: AgentServerConfig) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with bmdb.open_connection(url) as conn, trio.open_nursery() as nursery:
            await nursery.start(
                lambda task_status: run_agent_server(
                    conn, config, runtime_info=default_runtime_info(), task_status=task_status
                )
            )
            async for signum in signals:
                logger.info("got %s, stopping", signal.Signals(signum).name)
                nursery.cancel_scope.cancel()
                break


def main(argv: Sequence[str] | None = None) -> int:
    url, config, verbose = parse_config(argv)
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    errors: list[BaseException] = []
    try:
        trio.run(run, url, config)
    except* (BMDBError, OSError) as group:
        errors.extend(group.exceptions)
    for exc in errors:
        print(f"agent-server: {exc}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
