"""``python -m shepherd.agent_server``: serve agent heartbeats from a BMDB.

Its own process, not a part of ``python -m shepherd``: it faces the
machines' network (and scales with the fleet), while the Shepherd holds the
provider's and the SSH credentials; the two share nothing but the BMDB.
SIGINT or SIGTERM stops it (exit status 0); an unusable BMDB or an address
that cannot be bound exits with status 1.

``--workers N`` (default: one per CPU) runs N worker processes on the one
port (see `shepherd.agent_server.workers`); this process then supervises
them. ``--workers 1`` serves in this process. ``--reuse-port`` and
``--agent-session-secret-stdin`` (not in the help) are how the supervisor
starts a worker: the second makes it read the agent session secret
(`shepherd.agent_server.session`), hex, from the first line of its stdin,
so that every worker accepts the sessions any of them issued, and the
secret shows in no command line or environment.

``--image-listen HOST:PORT`` with ``--image-dir DIR`` also serves the node
images of DIR (`shepherd.agent_server.images`) on a listener of its own,
over the same TLS certificate and key (or plain HTTP); with several
workers, every worker serves images too, on the one image port
(SO_REUSEPORT, reserved by the supervisor like the heartbeat port).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import trio

import bmdb
from bmdb import Queries
from bmdb.errors import BMDBError
from common.cli import log_to_stderr
from common.listen import split_listen
from shepherd.agent_server.connect import Limits
from shepherd.agent_server.images import ImageServerConfig, serve_images
from shepherd.agent_server.server import AgentServerConfig, run_agent_server, tune_gc
from shepherd.agent_server.session import new_secret
from shepherd.agent_server.workers import default_workers, supervise, watch_parent
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
        help="serve without TLS (tests, or behind a TLS-terminating proxy): requests,"
        " answers and the agents' session keys in them travel in the clear",
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
    parser.add_argument(
        "--agent-session-lifetime",
        type=float,
        default=AgentServerConfig().agent_session_lifetime,
        metavar="SECONDS",
        help="how long an agent's session (MACed heartbeats after one signed one) lasts"
        " (default: %(default)s)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=default_workers(),
        metavar="N",
        help="server processes sharing the port (default: one per CPU, %(default)s)",
    )
    parser.add_argument(
        "--image-listen",
        metavar="HOST:PORT",
        help="also serve node images (GET /images/sha256/<hex>) here (default: off)",
    )
    parser.add_argument(
        "--image-dir",
        type=Path,
        metavar="DIR",
        help="the images served with --image-listen: files <sha256 hex>.pyz",
    )
    parser.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--agent-session-secret-stdin", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return parser


@dataclass(frozen=True)
class Options:
    """The parsed command line."""

    url: str
    config: AgentServerConfig
    verbose: bool
    workers: int
    #: The arguments a worker gets (without --listen and --reuse-port).
    worker_argv: list[str]
    #: Read the agent session secret from stdin (how a worker gets its supervisor's).
    secret_from_stdin: bool = False
    #: The image server, if one is to run.
    images: ImageServerConfig | None = None


def parse_options(argv: Sequence[str] | None) -> Options:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    tls = args.tls_certificate_path is not None or args.tls_key_path is not None
    if tls and (args.tls_certificate_path is None or args.tls_key_path is None):
        parser.error("--tls-certificate-path and --tls-key-path go together")
    if not tls and not args.insecure_plain_http:
        parser.error("give --tls-certificate-path/--tls-key-path, or --insecure-plain-http")
    for path in (args.tls_certificate_path, args.tls_key_path):
        if path is not None and not path.is_file():
            parser.error(f"{path}: no such file")
    if args.max_body < 1024 or args.freshness <= 0 or args.agent_session_lifetime < 1:
        parser.error(
            "--max-body must be at least 1024, --freshness positive,"
            " --agent-session-lifetime at least 1"
        )
    images = None
    if (args.image_listen is None) != (args.image_dir is None):
        parser.error("--image-listen and --image-dir go together")
    if args.image_listen is not None:
        try:
            split_listen(args.image_listen)
        except ValueError as exc:
            parser.error(f"--image-listen: {exc}")
        if not args.image_dir.is_dir():
            parser.error(f"{args.image_dir}: no such directory")
        images = ImageServerConfig(
            listen=args.image_listen, image_dir=args.image_dir, reuse_port=args.reuse_port
        )
    config = AgentServerConfig(
        listen=args.listen,
        certfile=args.tls_certificate_path,
        keyfile=args.tls_key_path,
        limits=Limits(max_body=args.max_body),
        freshness=args.freshness,
        reuse_port=args.reuse_port,
        agent_session_lifetime=args.agent_session_lifetime,
    )
    worker_argv = ["--bmdb-url", args.bmdb_url, "--workers", "1"]
    if tls:
        worker_argv += [
            "--tls-certificate-path",
            str(args.tls_certificate_path),
            "--tls-key-path",
            str(args.tls_key_path),
        ]
    else:
        worker_argv.append("--insecure-plain-http")
    worker_argv += ["--max-body", str(args.max_body), "--freshness", str(args.freshness)]
    worker_argv += ["--agent-session-lifetime", str(args.agent_session_lifetime)]
    if images is not None:
        worker_argv += ["--image-dir", str(images.image_dir)]
    worker_argv.append("--agent-session-secret-stdin")
    if args.verbose:
        worker_argv.append("--verbose")
    return Options(
        args.bmdb_url,
        config,
        args.verbose,
        args.workers,
        worker_argv,
        secret_from_stdin=args.agent_session_secret_stdin,
        images=images,
    )


def read_secret(stream: IO[str]) -> bytes:
    """The agent session secret from the first line of ``stream`` (hex);
    ValueError if it is missing or malformed."""
    secret = bytes.fromhex(stream.readline().strip())
    if len(secret) < 16:
        raise ValueError("agent session secret on stdin missing or too short")
    return secret


def parse_config(argv: Sequence[str] | None) -> tuple[str, AgentServerConfig, bool]:
    """(BMDB URL, config, verbose) of a command line."""
    options = parse_options(argv)
    return options.url, options.config, options.verbose


async def run(options: Options) -> None:
    url, config = options.url, options.config
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with bmdb.open_connection(url) as conn, trio.open_nursery() as nursery:
            if options.workers > 1:
                # Checked here, so that bad TLS files or BMDB fail once, not per worker.
                config.ssl_context()
                await conn.transact(_nothing)
                await nursery.start(
                    functools.partial(
                        supervise,
                        secret=new_secret(),
                        image_listen=options.images.listen if options.images else None,
                    ),
                    options.worker_argv,
                    config.listen,
                    options.workers,
                )
            else:
                if config.reuse_port:
                    nursery.start_soon(watch_parent, nursery.cancel_scope)
                await nursery.start(
                    lambda task_status: run_agent_server(
                        conn, config, runtime_info=default_runtime_info(), task_status=task_status
                    )
                )
                if options.images is not None:
                    await nursery.start(serve_images, options.images, config.ssl_context())
            async for signum in signals:
                logger.info("got %s, stopping", signal.Signals(signum).name)
                nursery.cancel_scope.cancel()
                break


async def _nothing(q: Queries) -> None:
    """A transaction that shows the BMDB usable (reachable, migrated)."""


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_options(argv)
    if options.secret_from_stdin:
        try:
            secret = read_secret(sys.stdin)
        except ValueError as problem:
            print(f"agent-server: {problem}", file=sys.stderr)
            return 1
        config = dataclasses.replace(options.config, agent_session_secret=secret)
        options = dataclasses.replace(options, config=config)
    log_to_stderr(options.verbose)
    errors: list[BaseException] = []
    tune_gc()
    try:
        trio.run(run, options)
    except* (BMDBError, OSError) as group:
        errors.extend(group.exceptions)
    for exc in errors:
        print(f"agent-server: {exc}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
