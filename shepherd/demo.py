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
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import logging
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import trio
import trio_asyncio

import bmdb
from bmdb.errors import BMDBError
from bmdb.localserver import LocalPostgres, LocalPostgresError
from bmdb.model import InstallState, MachineSummary, Queries, WorkEvent
from common.backoff import ExponentialBackoff, Retrier
from common.cli import leaf_errors
from metropolis.consensus.client import Client, Member
from metropolis.consensus.process import SOCKET_NAME
from metropolis.errors import MetropolisError
from metropolis.image.build import IMAGE_SUFFIX
from metropolis.image.cache import cache_dir, cached_image
from metropolis.localstorage import Root
from metropolis.owner import NodeRow
from metropolis.proto import parameters
from shepherd.agent.install import ROOT as NODE_ROOT
from shepherd.agent_bundle import agent_zipapp
from shepherd.agent_server import AgentServerConfig, run_agent_server
from shepherd.agent_server.images import ImageServerConfig, serve_images
from shepherd.agent_server.server import port_of
from shepherd.agent_start import AgentConfig
from shepherd.approver import run_approver
from shepherd.control_loop import start_control_loop
from shepherd.errors import ShepherdError
from shepherd.initializer import Initializer
from shepherd.install import Plan, check_image, image_from_server, install, owner_public_key
from shepherd.localcluster import FirstNode, open_first_node
from shepherd.localfleet import (
    DISK,
    FleetMachine,
    loopback_addresses,
    machine_root,
    open_fleet,
    stop_agent,
    stop_node,
)
from shepherd.providers.static import StaticProvider
from shepherd.provisioner import sync_provided
from shepherd.rate_limit import Rate, RateLimiter
from shepherd.ssh import SSHClient
from shepherd.ssh_key import SSHKey, load_or_create_ssh_key

logger = logging.getLogger("shepherd.demo")

#: The first node's address: not 127.0.0.1 (the Shepherd's servers) nor a
#: machine's 127.0.0.N; it uses the nodes' fixed ports, as installed nodes do.
FIRST_NODE_ADDRESS = "127.0.1.1"

#: How many installed nodes are granted ConsensusMember (fewer if fewer).
CONSENSUS_GRANTS = 2

#: The default fleet: three machines become nodes, two refuse our key.
DEFAULT_MACHINES = 5
DEFAULT_BROKEN = 2

#: Where ``--web`` serves without a HOST:PORT.
DEFAULT_WEB = "127.0.0.1:8080"

#: The working folder's entries (short: they hold the nodes' UNIX sockets).
MACHINES_DIR, BROKEN_DIR, FIRST_DIR = "m", "b", "first"

#: Longest UNIX socket path usable by every program here: ``sun_path`` has
#: 108 bytes and etcd (Go) needs one of them for the terminating NUL.
MAX_SOCKET_PATH = 107

#: Seconds a process of the demo has to exit after SIGTERM before SIGKILL.
STOP_GRACE = 15.0


def default_image_cache() -> Path:
    """``$XDG_CACHE_HOME/metropolis-images`` (``~/.cache/...`` without it)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base, "metropolis-images")


@dataclass(frozen=True)
class Options:
    machines: int
    broken: int
    parallelism: int
    timeout: float
    workdir: Path
    keep: bool
    takeover_only: bool = False
    web: str | None = None
    image_cache: Path | None = None
    etcd: Path = Path("/usr/bin/etcd")


@dataclass(frozen=True)
class Outcome:
    """What the BMDB says happened to one machine."""

    provider_id: str
    address: str
    agent_key: bytes | None
    failure: str | None
    heartbeat_at: datetime.datetime | None = None
    hardware_report: bool = False


class DemoFailed(ShepherdError):
    """A step of the demo failed (the image build, the web UI); everything was stopped."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m shepherd.demo",
        description=(
            "The whole path on one machine: a private PostgreSQL (the BMDB), a fleet of SSH "
            "machines on loopback (127.0.0.2, .3, ...) that the Shepherd takes over (some "
            "refuse our key, to show failure handling), a cluster bootstrapped by a first "
            f"node on {FIRST_NODE_ADDRESS}, the node image built (or reused from the cache), "
            "installed by the agents on every taken-over machine, the new nodes approved by "
            f"the Shepherd with the owner's credentials, {CONSENSUS_GRANTS} of them granted "
            "ConsensusMember. Prints what changes, then one table: machine, address, node "
            "id, roles, health. The default run takes about 30 s on 2 cores (the first one "
            "also builds the image, 10-30 s more). Needs Debian's postgresql (15) and "
            "etcd-server packages. Ctrl-C stops everything."
        ),
    )
    parser.add_argument(
        "--machines",
        type=_positive,
        default=DEFAULT_MACHINES,
        help=f"fleet size (default {DEFAULT_MACHINES}: {DEFAULT_MACHINES - DEFAULT_BROKEN} "
        f"become nodes); each installed node is a node process with its own etcd",
    )
    parser.add_argument(
        "--broken",
        type=_non_negative,
        default=DEFAULT_BROKEN,
        help=f"how many machines refuse our key (default {DEFAULT_BROKEN})",
    )
    parser.add_argument(
        "--parallelism", type=_positive, default=4, help="initializer workers (default 4)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=180.0,
        help="give up after SECONDS, printing the table as it is (default 180)",
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


def longest_socket_path(workdir: Path, machines: int, *, nodes: bool = True) -> Path:
    """The longest UNIX socket path the demo in ``workdir`` makes: with
    ``nodes``, the etcd client socket of a node installed on the last
    machine's disk (deeper than the first node's); without, PostgreSQL's."""
    candidates = [workdir / "postgres" / "socket" / ".s.PGSQL.65535"]
    if nodes:
        disk = machine_root(workdir / MACHINES_DIR, max(machines - 1, 0), prefix="") / DISK
        candidates += [
            Root(disk / NODE_ROOT).ephemeral.consensus / SOCKET_NAME,
            Root(workdir / FIRST_DIR).ephemeral.consensus / SOCKET_NAME,
        ]
    return max(candidates, key=lambda p: len(os.fsencode(p)))


def check_workdir_length(workdir: Path, machines: int, *, nodes: bool = True) -> None:
    """`WorkdirError` if a socket path under ``workdir`` would be too long."""
    path = longest_socket_path(workdir, machines, nodes=nodes)
    size = len(os.fsencode(path))
    if size > MAX_SOCKET_PATH:
        what = "a node's etcd socket" if nodes else "PostgreSQL's socket"
        raise WorkdirError(
            f"--workdir {workdir}: too long by {size - MAX_SOCKET_PATH} bytes: {what} "
            f"would be {path} ({size} bytes; a UNIX socket path has at most "
            f"{MAX_SOCKET_PATH})"
        )


def write_machines_file(path: Path, machines: Sequence[FleetMachine]) -> list[str]:
    """List ``machines`` in the static provider's format; return their ids."""
    ids = [f"demo-{i:03d}" for i in range(len(machines))]
    entries = "".join(
        f'\n[[machine]]\nid = "{machine_id}"\naddress = "{machine.host}"\n'
        f'port = {machine.port}\nlocation = "loopback"\n'
        for machine_id, machine in zip(ids, machines, strict=True)
    )
    path.write_text("# Machines of the demo fleet, as the static provider reads them.\n" + entries)
    return ids


async def outcomes(conn: bmdb.Connection) -> list[Outcome]:
    """Every machine's outcome so far, in BMDB order (oldest first)."""

    async def fn(q: Queries) -> list[Outcome]:
        result = []
        summaries: list[MachineSummary] = await q.machines()
        for m in summaries:
            if m.provided is None:
                continue
            key = None
            if m.agent_started_at is not None:
                started = await q.agent_started(m.machine_id)
                key = started.public_key if started else None
            failure = None
            if key is None:
                failed = [h for h in await q.history(m.machine_id) if h.event is WorkEvent.FAILED]
                failure = failed[-1].cause if failed else None
            address = f"{m.provided.address}"
            result.append(
                Outcome(
                    m.provided.provider_id,
                    address,
                    key,
                    failure,
                    m.agent_heartbeat_at,
                    m.has_hardware_report,
                )
            )
        return result

    return await conn.transact(fn, isolation=bmdb.Isolation.REPEATABLE_READ)


def render(results: Sequence[Outcome], ports: dict[str, int]) -> str:
    rows = [("MACHINE", "ADDRESS", "OUTCOME")]
    now = datetime.datetime.now(datetime.UTC)
    for o in results:
        if o.agent_key is not None:
            what = f"agent started, key {o.agent_key.hex()[:16]}..."
            if o.heartbeat_at is not None:
                what += f", heartbeat {(now - o.heartbeat_at).total_seconds():.1f}s ago"
            if o.hardware_report:
                what += ", hardware report stored"
        elif o.failure is not None:
            what = f"failed, retrying after backoff: {o.failure}"
        else:
            what = "pending"
        rows.append((o.provider_id, f"{o.address}:{ports.get(o.provider_id, 22)}", what))
    widths = [max(len(r[i]) for r in rows) for i in range(2)]
    return "\n".join(f"{a.ljust(widths[0])}  {b.ljust(widths[1])}  {c}" for a, b, c in rows)


class Progress:
    """Logs a ``progress:`` line for each thing whose state changed since the last look."""

    def __init__(self) -> None:
        self._last: dict[str, str] = {}

    def show(self, what: str, state: str) -> None:
        if self._last.get(what) != state:
            self._last[what] = state
            logger.info("progress: %s: %s", what, state)


#: Seconds a Ctrl-C gives the demo to stop everything before it gives up.
SHUTDOWN_BOUND = 45.0


async def run_interruptible(options: Options, postgres: LocalPostgres) -> bool | None:
    """`run_demo`, ended in order by a Ctrl-C: None if it was interrupted.

    SIGINT is taken as an event here, not as Trio's KeyboardInterrupt: a
    KeyboardInterrupt is raised wherever the main thread happens to be,
    and that can be inside asyncssh's asyncio callbacks (under
    trio-asyncio), beyond Trio's protection, where it left the demo
    waiting forever now and then. Instead the work is cancelled, so every
    cleanup (sessions closed, agents and nodes stopped) runs while
    PostgreSQL is still up. Should a cleanup still hang, a watchdog thread
    stops PostgreSQL and ends the process after `SHUTDOWN_BOUND` seconds.
    """
    result: bool | None = None
    with trio.open_signal_receiver(signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:

            async def on_interrupt() -> None:
                async for _ in signals:
                    _start_watchdog(postgres)
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(on_interrupt)
            result = await run_demo(options, postgres)
            nursery.cancel_scope.cancel()
    # Set only if run_demo finished: an interrupted run leaves it None.
    return result


def _start_watchdog(postgres: LocalPostgres) -> None:
    def give_up() -> None:
        sys.stderr.write(
            f"shepherd.demo: interrupted, but stopping took over {SHUTDOWN_BOUND:g} s;"
            " stopping PostgreSQL and exiting\n"
        )
        postgres.stop()
        os._exit(130)

    timer = threading.Timer(SHUTDOWN_BOUND, give_up)
    timer.daemon = True
    timer.start()


async def run_demo(options: Options, postgres: LocalPostgres) -> bool:
    """Run the demo until every machine has its expected outcome (or the
    timeout); print the table. Leaves no process of its own running: on the
    way out (cancelled too) it stops the agents and nodes and waits until
    no process under the fleet's and the first node's folders runs."""
    try:
        return await _run(options, postgres)
    finally:
        with trio.CancelScope(shield=True):
            await _reap(options.workdir)


async def _run(options: Options, postgres: LocalPostgres) -> bool:
    key = load_or_create_ssh_key(options.workdir / "shepherd_ed25519")
    stranger = SSHKey.generate()  # the broken machines trust this one instead
    good_count = options.machines - options.broken
    machines_file = options.workdir / "machines.toml"
    started = trio.current_time()
    deadline = started + options.timeout
    image_cache = options.image_cache or default_image_cache()

    async with (
        trio_asyncio.open_loop(),
        open_fleet(
            options.workdir / MACHINES_DIR,
            count=good_count,
            authorized_key=key.authorized_key,
            prefix="",
        ) as good,
        open_fleet(
            options.workdir / BROKEN_DIR,
            count=options.broken,
            authorized_key=stranger.authorized_key,
            hosts=loopback_addresses(options.broken, first=2 + good_count),  # after the good ones
            prefix="",
        ) as broken,
        bmdb.open_connection(postgres.url("bmdb"), migrate=True) as conn,
        trio.open_nursery() as nursery,
    ):
        machines = good.machines + broken.machines  # the broken ones last
        ids = write_machines_file(machines_file, machines)
        good_ids, broken_ids = ids[:good_count], ids[good_count:]
        ports = {i: m.port for i, m in zip(ids, machines, strict=True)}
        provider = StaticProvider.from_file(machines_file)
        synced = await sync_provided(conn, provider)
        logger.info("%d machines provided from %s", len(synced.added), machines_file)

        image: list[Path] = []  # set once the image is there
        image_ready = trio.Event()
        if not options.takeover_only:

            async def get_image() -> None:
                image.append(await _node_image(image_cache, options.etcd))
                image_ready.set()

            nursery.start_soon(get_image)

        binds = await nursery.start(
            lambda task_status: run_agent_server(
                conn, AgentServerConfig(listen="127.0.0.1:0"), task_status=task_status
            )
        )
        config = AgentConfig(
            executable=agent_zipapp(),
            target_path="/root/agent",
            endpoint=f"http://127.0.0.1:{port_of(binds[0])}",
            endpoint_ca_certificate=b"",
            ssh_connect_timeout=5.0,
            ssh_exec_timeout=60.0,
            heartbeat_interval=1.0,
            heartbeat_backoff_cap=10.0,
        )
        for machine in machines:
            (machine.root / "root").mkdir(exist_ok=True)  # holds /root/agent
        ssh = SSHClient(key, username="root", connect_timeout=config.ssh_connect_timeout)
        initializer = Initializer(provider, ssh, config)
        start_control_loop(
            nursery,
            conn,
            initializer,
            parallelism=options.parallelism,
            limiter=RateLimiter(Rate(interval=0.01, burst=options.parallelism)),
        )

        expected = {i: True for i in good_ids} | {i: False for i in broken_ids}
        progress = Progress()
        try:
            if options.takeover_only:
                if options.web is not None:
                    await _start_web(nursery, options, postgres, None)
                finished, results = False, list[Outcome]()
                with trio.move_on_at(deadline):
                    finished, results = await _watch(conn, options, expected, progress)
                table = render(results, ports)
            else:
                async with open_first_node(
                    options.workdir / FIRST_DIR,
                    FIRST_NODE_ADDRESS,
                    options.workdir / "owner.pem",
                    options.workdir / "first.log",
                    ready_within=max(deadline - trio.current_time(), 1.0),
                ) as first:
                    logger.info(
                        "progress: cluster bootstrapped: first node on %s (its log: %s)",
                        FIRST_NODE_ADDRESS,
                        options.workdir / "first.log",
                    )
                    if options.web is not None:
                        await _start_web(nursery, options, postgres, first)
                    finished, seen = await _whole_path(
                        options,
                        conn,
                        first,
                        expected,
                        progress,
                        deadline,
                        image,
                        image_ready,
                    )
                    table = final_table(seen, dict(zip(ids, machines, strict=True)), expected)
        finally:
            # Cancelled first, so that no new agent starts after this.
            nursery.cancel_scope.cancel()
            for machine in good.machines:
                stop_agent(machine.root / "root" / "agent")
                stop_node(machine.root / DISK)

    sys.stdout.write(table + "\n")
    logger.info(
        "the run took %.1f s",
        trio.current_time() - started,
    )
    if not finished:
        if trio.current_time() >= deadline:
            logger.error(
                "gave up after %.0f s (--timeout): not every machine reached its outcome",
                options.timeout,
            )
        else:
            logger.error(
                "stopped early: a step failed (above), not every machine reached its outcome"
            )
    return finished


async def _node_image(cache: Path, etcd: Path) -> Path:
    """The node image of today's inputs: the cached build, or a new build
    (``python -m metropolis image build``, in a session of its own, stopped
    with SIGINT if cancelled so that it removes its temporary files)."""
    folder = await trio.to_thread.run_sync(cache_dir, cache, etcd, abandon_on_cancel=True)
    found = cached_image(folder)
    if found is not None:
        logger.info(
            "progress: node image: reusing the cached build %s (%.1f MiB)",
            found,
            found.stat().st_size / 2**20,
        )
        return found
    folder.mkdir(parents=True, exist_ok=True)
    logger.info("progress: node image: building into %s (python -m metropolis image build)", folder)
    started = time.monotonic()

    async def interrupt(process: trio.Process) -> None:
        process.send_signal(signal.SIGINT)
        with trio.move_on_after(STOP_GRACE):
            await process.wait()
            return
        process.kill()

    argv = [sys.executable, "-m", "metropolis", "image", "build", "--out", str(folder)]
    result = await trio.run_process(
        [*argv, "--etcd", str(etcd)],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        start_new_session=True,
        deliver_cancel=interrupt,
    )
    found = cached_image(folder)
    if result.returncode != 0 or found is None:
        said = result.stderr.decode(errors="replace").strip().splitlines()
        raise DemoFailed(f"the node image build failed: {said[-1] if said else result.returncode}")
    logger.info(
        "progress: node image: built %s (%.1f MiB) in %.1f s",
        found.name,
        found.stat().st_size / 2**20,
        time.monotonic() - started,
    )
    return found


async def _start_web(
    nursery: trio.Nursery, options: Options, postgres: LocalPostgres, first: FirstNode | None
) -> None:
    """Start ``python -m console web`` (its own session: the demo stops it,
    before PostgreSQL) and log its URL; `DemoFailed` if it does not serve."""
    assert options.web is not None
    argv = [sys.executable, "-m", "console", "--url", postgres.url("bmdb")]
    argv += ["web", "--listen", options.web]
    if first is not None:
        argv += ["--cluster-owner-root", str(first.root.path)]
        argv += ["--cluster-owner-key", str(first.owner_key)]
    log = options.workdir / "web.log"
    with log.open("ab") as err:
        process = await trio.lowlevel.open_process(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err,
            start_new_session=True,
        )
    ready = trio.Event()
    urls: list[str] = []

    async def serve() -> None:
        try:
            assert process.stdout is not None
            buffer = b""
            async for chunk in process.stdout:
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    text = line.decode(errors="replace")
                    if text.startswith("serving on "):
                        urls.extend(text.removeprefix("serving on ").split())
                        ready.set()
            ready.set()
            await trio.sleep_forever()
        finally:
            await _stop_process(process)

    nursery.start_soon(serve)
    with trio.fail_after(60):
        await ready.wait()
    if not urls:
        said = log.read_text(errors="replace").strip().splitlines()
        raise DemoFailed(f"the web UI did not start: {said[-1] if said else 'no output'}")
    what = "the machines' pages" + (" and the cluster's nodes" if first is not None else "")
    logger.info("progress: web UI: %s (%s; open it in a browser)", " ".join(urls), what)


async def _stop_process(process: trio.Process) -> None:
    with trio.CancelScope(shield=True):
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            with trio.move_on_after(STOP_GRACE):
                await process.wait()
        if process.returncode is None:
            process.kill()
            await process.wait()


@dataclass(frozen=True)
class _Machine:
    """A taken-over machine, as the install path tracks it."""

    provider_id: str
    machine_id: str
    #: Its own loopback address: its node's address too.
    address: str


@dataclass
class _Path:
    """What the whole path has seen so far (the final table shows it)."""

    results: list[Outcome]
    machines: dict[str, _Machine]
    installs: dict[str, str]
    nodes: dict[str, NodeRow]


async def _whole_path(
    options: Options,
    conn: bmdb.Connection,
    first: FirstNode,
    expected: dict[str, bool],
    progress: Progress,
    deadline: float,
    image: list[Path],
    image_ready: trio.Event,
) -> tuple[bool, _Path]:
    """Takeover, install, approval, roles, bounded by ``deadline``: whether
    every machine ended as expected, and what was seen."""
    seen = _Path([], {}, {}, {})
    finished = False
    # Its own nursery: the image server and the approver stop before the first node does.
    async with trio.open_nursery() as servers:
        with trio.move_on_at(deadline):
            finished = await _steps(
                options,
                conn,
                servers,
                first,
                expected,
                progress,
                image,
                image_ready,
                seen,
            )
        servers.cancel_scope.cancel()
    with trio.move_on_after(5):
        seen.results = await outcomes(conn)
        seen.nodes = await _nodes(first, seen.nodes)
    return finished, seen


async def _steps(
    options: Options,
    conn: bmdb.Connection,
    nursery: trio.Nursery,
    first: FirstNode,
    expected: dict[str, bool],
    progress: Progress,
    image: list[Path],
    image_ready: trio.Event,
    seen: _Path,
) -> bool:
    taken_over, seen.results = await _watch(conn, options, expected, progress)
    if not taken_over:
        return False
    if not image_ready.is_set():
        logger.info("progress: waiting for the node image")
    await image_ready.wait()
    images = await nursery.start(serve_images, ImageServerConfig("127.0.0.1:0", image[0].parent))
    digest = "sha256:" + image[0].name.removesuffix(IMAGE_SUFFIX)
    plan = await _plan(first, images, digest)
    await check_image(plan.image, ssl.create_default_context())
    seen.machines = await _taken_over(conn, [p for p, good in expected.items() if good])
    by_machine = {m.machine_id: m for m in seen.machines.values()}
    decisions = await install(conn, plan, machines=[uuid.UUID(m) for m in by_machine])
    refused = [d for d in decisions if d.refused is not None]
    for d in refused:
        logger.error(
            "install refused for %s: %s", by_machine[str(d.machine_id)].provider_id, d.refused
        )
    if refused:
        return False
    logger.info(
        "progress: install requested for %d machines: image %s from %s, root device %s",
        len(decisions),
        digest,
        images,
        plan.root_device,
    )
    nursery.start_soon(run_approver, first.access, conn, 0.5)

    # Installed, registered, approved (by the approver), joined and healthy.
    while True:
        seen.installs = await _install_states(conn, seen.machines)
        seen.nodes = await _nodes(first, seen.nodes)
        for provider_id, state in seen.installs.items():
            progress.show(provider_id, state)
        for row in seen.nodes.values():
            progress.show(f"node {row.node_id} ({row.address or '-'})", _node_state(row))
        if any(state.startswith("install failed") for state in seen.installs.values()):
            return False
        if all(_healthy(seen.nodes.get(m.address)) for m in seen.machines.values()):
            break
        await trio.sleep(0.5)

    # ConsensusMember for the first machines' nodes, one at a time (etcd
    # takes one new member at a time): each becomes an etcd voter.
    chosen = [seen.nodes[m.address] for m in seen.machines.values()][:CONSENSUS_GRANTS]
    for row in chosen:
        await _grant_consensus(first, row)
        # Polling: the state lives in other processes.
        while not await _votes(first, row, seen, progress):  # noqa: ASYNC110
            await trio.sleep(0.5)
    # Every node healthy at once: a heartbeat may be missed while curators
    # start on the new members.
    while True:
        seen.nodes = await _nodes(first, seen.nodes)
        for node in seen.nodes.values():
            progress.show(f"node {node.node_id} ({node.address or '-'})", _node_state(node))
        if all(_healthy(seen.nodes.get(m.address)) for m in seen.machines.values()):
            return True
        await trio.sleep(0.5)


#: Waits after a refused role change (etcd busy with the last new member).
_GRANT_BACKOFF = ExponentialBackoff(initial=0.5, maximum=5.0)


async def _grant_consensus(first: FirstNode, row: NodeRow) -> None:
    """Grant ConsensusMember to ``row``'s node, retrying refusals with backoff
    (the caller bounds it)."""
    retrier = Retrier(_GRANT_BACKOFF)
    while True:
        try:
            async with first.access.open() as owner:
                await owner.set_roles(row.node_id, consensus_member=True)
        except MetropolisError as e:
            logger.info("progress: ConsensusMember for %s not granted yet: %s", row.node_id, e)
            await retrier.sleep()
            continue
        logger.info("progress: ConsensusMember granted to %s (%s)", row.node_id, row.address)
        return


async def _votes(first: FirstNode, row: NodeRow, seen: _Path, progress: Progress) -> bool:
    """Whether ``row``'s node is an etcd voter, has the role and is healthy
    (saying what changed in etcd's membership)."""
    members = await _members(first)
    seen.nodes = await _nodes(first, seen.nodes)
    for member in members:
        if member.name:
            progress.show(f"etcd member {member.name}", "learner" if member.is_learner else "voter")
    now = seen.nodes.get(row.address)
    voting = any(m.name == row.node_id and not m.is_learner for m in members)
    return voting and now is not None and "ConsensusMember" in now.roles and _healthy(now)


async def _plan(first: FirstNode, images: str, digest: str) -> Plan:
    """What each machine is asked to install: register into ``first``'s
    cluster with its ticket, for its owner, from the demo's image server."""
    async with first.access.open() as owner:
        ticket = await owner.ticket()
    owner_key = owner_public_key(first.owner_key.read_bytes(), str(first.owner_key))
    params = parameters.register_parameters(first.info, ticket, owner_key)
    return Plan(
        node_parameters=parameters.encode(params),
        # Plain HTTP, as the agents' endpoint: the agents verify the digest.
        image=image_from_server(images, digest, plain_http=True),
        root_device=DISK.name,
    )


async def _taken_over(conn: bmdb.Connection, provider_ids: list[str]) -> dict[str, _Machine]:
    """The BMDB's ids and the addresses of the machines ``provider_ids``, in that order."""
    rows = await conn.transact(lambda q: q.machines())
    found = {
        r.provided.provider_id: _Machine(
            r.provided.provider_id, str(r.machine_id), str(r.provided.address)
        )
        for r in rows
        if r.provided is not None
    }
    return {p: found[p] for p in provider_ids}


async def _install_states(conn: bmdb.Connection, machines: dict[str, _Machine]) -> dict[str, str]:
    """Each machine's installation as the BMDB shows it, in words."""

    async def fn(q: Queries) -> dict[str, str]:
        states = {}
        for provider_id, machine in machines.items():
            got = await q.os_installation(machine.machine_id)
            if got is None:
                states[provider_id] = "not requested"
            elif got.state is InstallState.INSTALLED:
                states[provider_id] = f"installed (generation {got.generation}), node {got.node_id}"
            elif got.state is InstallState.INSTALL_FAILED:
                states[provider_id] = f"install failed: {got.cause}"
            else:
                states[provider_id] = f"installing generation {got.generation}"
        return states

    return await conn.transact(fn, isolation=bmdb.Isolation.REPEATABLE_READ)


async def _nodes(first: FirstNode, before: dict[str, NodeRow]) -> dict[str, NodeRow]:
    """The cluster's nodes by address; ``before`` while the curators do not
    answer (a leader changing, a curator starting)."""
    try:
        async with first.access.open() as owner:
            return {row.address: row for row in await owner.nodes() if row.address}
    except MetropolisError as e:
        logger.debug("the curators did not answer: %s", e)
        return before


async def _members(first: FirstNode) -> list[Member]:
    """etcd's members, from the first node's etcd; none while it does not answer."""
    try:
        async with Client(first.root.ephemeral.consensus / SOCKET_NAME) as etcd:
            members: list[Member] = await etcd.member_list()
            return members
    except MetropolisError as e:
        logger.debug("etcd did not answer: %s", e)
        return []


def _healthy(row: NodeRow | None) -> bool:
    return row is not None and row.state == "UP" and row.health == "HEALTHY"


def _node_state(row: NodeRow) -> str:
    roles = ",".join(row.roles) or "no roles"
    return f"{row.state}, {row.health}, {roles}"


def final_table(seen: _Path, by_id: dict[str, FleetMachine], expected: dict[str, bool]) -> str:
    """One line per machine (and the first node): address, node id, roles, health."""
    rows = [("MACHINE", "ADDRESS", "NODE", "ROLES", "HEALTH")]

    def node_columns(row: NodeRow | None) -> tuple[str, str, str]:
        if row is None:
            return "-", "-", "-"
        health = row.health if row.state == "UP" else f"{row.health} ({row.state})"
        return row.node_id, ",".join(row.roles) or "-", health

    by_address = {row.address: row for row in seen.nodes.values()}
    rows.append(
        ("first-node", FIRST_NODE_ADDRESS, *node_columns(by_address.get(FIRST_NODE_ADDRESS)))
    )
    outcome = {o.provider_id: o for o in seen.results}
    for provider_id, machine in by_id.items():
        row = by_address.get(machine.host)
        node, roles, health = node_columns(row)
        if row is None:
            o = outcome.get(provider_id)
            if not expected[provider_id]:
                cause = o.failure if o is not None and o.failure else "not tried yet"
                health = f"no node: not taken over ({cause})"
            elif o is None or o.agent_key is None:
                health = "no node: not taken over yet"
            else:
                health = f"no node: {seen.installs.get(provider_id, 'not installed')}"
        rows.append((provider_id, machine.host, node, roles, health))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(r[:4], widths, strict=True))
        + "  "
        + r[4]
        for r in rows
    )


async def _watch(
    conn: bmdb.Connection, options: Options, expected: dict[str, bool], progress: Progress
) -> tuple[bool, list[Outcome]]:
    """Look every second, saying what changed, until every machine has its
    expected outcome: the good ones an agent that heartbeats with its
    hardware report, the broken ones a failure. Callers bound it."""
    while True:
        await trio.sleep(1)
        results = await outcomes(conn)
        started = sum(o.agent_key is not None for o in results)
        failed = sum(o.failure is not None and o.agent_key is None for o in results)
        beating = sum(o.heartbeat_at is not None and o.hardware_report for o in results)
        progress.show(
            "takeover",
            f"{started}/{len(expected)} agents started, {beating} heartbeating with a hardware "
            f"report, {failed}/{len(expected)} machines failed (expected {options.broken})",
        )
        for o in results:
            if o.failure is not None and o.agent_key is None:
                progress.show(
                    o.provider_id, f"takeover failed, retrying after backoff: {o.failure}"
                )
        if len(results) == len(expected) and all(
            (o.agent_key is not None) == expected[o.provider_id]
            and (expected[o.provider_id] or o.failure is not None)
            and (not expected[o.provider_id] or (o.heartbeat_at and o.hardware_report))
            for o in results
        ):
            return True, results


def processes_under(folder: Path) -> list[int]:
    """Pids of processes (not this one, nor its ancestors) whose command
    line names a path under ``folder``."""
    mine = {os.getpid()}
    pid = os.getppid()
    while pid > 1:
        mine.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    prefix = os.fsencode(folder)
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in mine:
            continue
        try:
            cmdline = Path("/proc", entry, "cmdline").read_bytes()
        except OSError:
            continue
        if any(arg.startswith(prefix) or b"=" + prefix in arg for arg in cmdline.split(b"\0")):
            found.append(int(entry))
    return found


async def _reap(workdir: Path) -> None:
    """Wait until no process runs from the fleet's or the first node's
    folders (agents, nodes, their etcd); SIGKILL what is left after
    `STOP_GRACE` seconds. The caller shields it."""
    folders = [workdir / MACHINES_DIR, workdir / BROKEN_DIR, workdir / FIRST_DIR]
    # Again: an agent stopped mid-install may have started its node after
    # the first round of stops.
    for agent in (workdir / MACHINES_DIR).glob("*/root/agent"):
        stop_agent(agent)
    for disk in (workdir / MACHINES_DIR).glob(f"*/{DISK}"):
        stop_node(disk)

    def left() -> list[int]:
        return [pid for folder in folders for pid in processes_under(folder)]

    with trio.move_on_after(STOP_GRACE):
        while left():  # noqa: ASYNC110  (other processes: nothing to wait on but /proc)
            await trio.sleep(0.1)
        return
    for pid in left():
        logger.warning("process %d still runs from %s: killing it", pid, workdir)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


#: What the demo puts into its working folder; nothing else there is ever removed.
_DEMO_ENTRIES = (
    "postgres",
    MACHINES_DIR,
    BROKEN_DIR,
    FIRST_DIR,
    "first.log",
    "owner.pem",
    "web.log",
    "machines.toml",
    "shepherd_ed25519",
)


class WorkdirError(ShepherdError):
    """The folder given with ``--workdir`` cannot be used; nothing was changed."""


@dataclass(frozen=True)
class Workdir:
    """The demo's working folder and how much of it the demo may remove.

    ``created`` is the outermost folder the demo created itself (``path`` or
    one of its ancestors), removed whole at the end. When it is ``None`` the
    folder was the user's (it existed, empty): the demo removes only the
    entries it put there and never changes the folder's own mode.
    """

    path: Path
    created: Path | None

    @classmethod
    def prepare(cls, requested: Path | None) -> Workdir:
        if requested is None:
            path = Path(tempfile.mkdtemp(prefix="shepherd-demo-"))
            # As root, PostgreSQL runs as the postgres user, which must reach
            # its folder inside ours (mkdtemp makes ours 0700).
            path.chmod(0o711)
            return cls(path, created=path)
        path = requested.absolute()
        if path.is_symlink() or path.exists():
            if not path.is_dir() or path.is_symlink():
                raise WorkdirError(f"--workdir {requested}: exists and is not a folder")
            if any(path.iterdir()):
                raise WorkdirError(
                    f"--workdir {requested}: folder is not empty; give a new or empty folder"
                    " (the demo removes what it creates, so it will not share a folder)"
                )
            return cls(path, created=None)
        outermost = path
        while not outermost.parent.exists():
            outermost = outermost.parent
        path.mkdir(parents=True)
        return cls(path, created=outermost)

    def remove(self) -> None:
        """Remove what the demo created, and nothing else."""
        if self.created is not None:
            shutil.rmtree(self.created, ignore_errors=True)
            return
        for name in _DEMO_ENTRIES:
            entry = self.path / name
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.broken > args.machines:
        build_parser().error("--broken cannot exceed --machines")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("asyncssh").setLevel(logging.DEBUG if args.verbose else logging.WARNING)
    try:
        if args.workdir is not None:  # refused before anything is created
            check_workdir_length(
                args.workdir.absolute(), args.machines, nodes=not args.takeover_only
            )
        workdir = Workdir.prepare(args.workdir)
    except (WorkdirError, OSError) as exc:
        sys.stderr.write(f"shepherd.demo: {exc}\n")
        return 2
    try:
        check_workdir_length(workdir.path, args.machines, nodes=not args.takeover_only)
    except WorkdirError as exc:
        workdir.remove()
        sys.stderr.write(f"shepherd.demo: {exc} (TMPDIR is too long: give --workdir)\n")
        return 2
    options = Options(
        machines=args.machines,
        broken=args.broken,
        parallelism=args.parallelism,
        timeout=args.timeout,
        workdir=workdir.path,
        keep=args.keep,
        takeover_only=args.takeover_only,
        web=args.web,
        image_cache=args.image_cache,
        etcd=args.etcd,
    )
    postgres = None
    try:
        postgres = LocalPostgres(workdir.path / "postgres")
        logger.info("starting a private PostgreSQL in %s", postgres.root)
        postgres.create()
        postgres.start()
        postgres.create_database("bmdb")
        logger.info("BMDB at %s", postgres.url("bmdb"))
        ok = trio.run(run_interruptible, options, postgres)
    except LocalPostgresError as exc:
        sys.stderr.write(f"shepherd.demo: {exc}\n")
        return 1
    except BaseException as exc:
        failures = known_failures(exc)
        if failures:
            for line in dict.fromkeys(failures):
                sys.stderr.write(f"shepherd.demo: {line}\n")
            return 1
        if not interrupted(exc):
            raise
        ok = None
    finally:
        # Cleanup is bounded (PostgreSQL's stop waits, then kills): a second
        # Ctrl-C must not cut it short and leave the server running.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        # Last, after trio.run has closed every BMDB session: the server
        # runs in its own process group, so Ctrl-C did not stop it.
        if postgres is not None:
            postgres.stop()
        if options.keep:
            logger.info("kept %s", workdir.path)
        else:
            workdir.remove()
    if ok is None:
        sys.stderr.write(
            "shepherd.demo: interrupted; the nodes, the fleet, the Shepherd and PostgreSQL"
            " stopped\n"
        )
        return 130
    return 0 if ok else 1


def known_failures(exc: BaseException) -> list[str]:
    """The messages of ``exc``'s errors if each is one the demo reports in a
    line (a failed step: the product's own errors, an OS error), alone or
    with the cancellations they caused; empty otherwise."""
    known = (ShepherdError, MetropolisError, BMDBError, OSError)
    leaves = [e for e in leaf_errors(exc) if not isinstance(e, trio.Cancelled)]
    if leaves and all(isinstance(e, known) for e in leaves):
        return [str(e) or type(e).__name__ for e in leaves]
    return []


def interrupted(exc: BaseException) -> bool:
    """Whether ``exc`` is a Ctrl-C, alone or in (nested) groups with the
    cancellations it caused."""
    leaves = leaf_errors(exc)
    return any(isinstance(e, KeyboardInterrupt) for e in leaves) and all(
        isinstance(e, KeyboardInterrupt | trio.Cancelled) for e in leaves
    )


if __name__ == "__main__":
    raise SystemExit(main())
