"""``python -m shepherd.demo``: the Shepherd taking over a fleet, all on this machine.

Everything is real except the machines' hardware: a private PostgreSQL holds
the BMDB, each machine is an SSH server on loopback that runs commands for
real, and the initializer uploads the real agent and runs it::

    private PostgreSQL 15 ─── BMDB (migrated on open)
    machines.toml (static provider) ──sync_provided──▶ machine_provided tags
    N machines: asyncssh servers on 127.0.0.2, .3, ..., M of them refusing our key
    agent callback server on 127.0.0.1 (plain HTTP), its own BMDB session
    initializer control loop (P workers)
        source machine ─▶ SSH ─▶ SFTP agent ─▶ run with TakeoverInit ─▶ key
        success: finish() + AgentStarted    failure: fail() + backoff
        the agent detaches and heartbeats (with its hardware report) every 2 s
    progress line every second, until every good machine has an agent that
    heartbeats and reported its hardware, and every broken one has failed
    (and is waiting out its backoff)

Then it prints each machine's outcome as the BMDB records it, stops
everything and removes what it created in its working folder (``--keep``
leaves it, with the Postgres log, the machines file and the SSH key, for a
look around). It never removes or chmods anything it did not create: a
``--workdir`` that exists must be empty, and stays in place afterwards.
Exit status: 0 when every machine ended as expected, 1 otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import trio
import trio_asyncio

import bmdb
from bmdb.localserver import LocalPostgres, LocalPostgresError
from bmdb.model import MachineSummary, Queries, WorkEvent
from common.cli import leaf_errors
from shepherd.agent_bundle import agent_zipapp
from shepherd.agent_server import AgentServerConfig, run_agent_server
from shepherd.agent_server.server import port_of
from shepherd.agent_start import AgentConfig
from shepherd.control_loop import start_control_loop
from shepherd.errors import ShepherdError
from shepherd.initializer import Initializer
from shepherd.localfleet import FleetMachine, loopback_addresses, open_fleet, stop_agent
from shepherd.providers.static import StaticProvider
from shepherd.provisioner import sync_provided
from shepherd.rate_limit import Rate, RateLimiter
from shepherd.ssh import SSHClient
from shepherd.ssh_key import SSHKey, load_or_create_ssh_key

logger = logging.getLogger("shepherd.demo")


@dataclass(frozen=True)
class Options:
    machines: int
    broken: int
    parallelism: int
    timeout: float
    workdir: Path
    keep: bool


@dataclass(frozen=True)
class Outcome:
    """What the BMDB says happened to one machine."""

    provider_id: str
    address: str
    agent_key: bytes | None
    failure: str | None
    heartbeat_at: datetime.datetime | None = None
    hardware_report: bool = False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m shepherd.demo",
        description=(
            "Start a private PostgreSQL and a fleet of SSH machines on loopback, then let "
            "the Shepherd's initializer take them over: upload the agent, run it, record "
            "its key in the BMDB. Some machines refuse the Shepherd's key, to show failure "
            "handling. Needs Debian's postgresql (15) package."
        ),
    )
    parser.add_argument("--machines", type=_positive, default=12, help="fleet size (default 12)")
    parser.add_argument(
        "--broken", type=_non_negative, default=2, help="how many refuse our key (default 2)"
    )
    parser.add_argument(
        "--parallelism", type=_positive, default=4, help="initializer workers (default 4)"
    )
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="give up after SECONDS (default 120)"
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        help=(
            "working folder: a new folder, or an empty one (default: a new temporary folder);"
            " a non-empty folder is refused, and only what the demo created is removed"
        ),
    )
    parser.add_argument("--keep", action="store_true", help="keep the working folder")
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


#: Seconds a Ctrl-C gives the demo to stop everything before it gives up.
SHUTDOWN_BOUND = 30.0


async def run_interruptible(options: Options, postgres: LocalPostgres) -> bool | None:
    """`run_demo`, ended in order by a Ctrl-C: None if it was interrupted.

    SIGINT is taken as an event here, not as Trio's KeyboardInterrupt: a
    KeyboardInterrupt is raised wherever the main thread happens to be,
    and that can be inside asyncssh's asyncio callbacks (under
    trio-asyncio), beyond Trio's protection, where it left the demo
    waiting forever now and then. Instead the work is cancelled, so every
    cleanup (sessions closed, agents stopped) runs while PostgreSQL is
    still up. Should a cleanup still hang, a watchdog thread stops
    PostgreSQL and ends the process after `SHUTDOWN_BOUND` seconds.
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
    """Run the fleet and the initializer until every machine has its expected outcome."""
    key = load_or_create_ssh_key(options.workdir / "shepherd_ed25519")
    stranger = SSHKey.generate()  # the broken machines trust this one instead
    good_count = options.machines - options.broken
    machines_file = options.workdir / "machines.toml"

    async with (
        trio_asyncio.open_loop(),
        open_fleet(
            options.workdir / "fleet", count=good_count, authorized_key=key.authorized_key
        ) as good,
        open_fleet(
            options.workdir / "broken",
            count=options.broken,
            authorized_key=stranger.authorized_key,
            hosts=loopback_addresses(options.broken, first=2 + good_count),  # after the good ones
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
            heartbeat_interval=2.0,
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
        agents = [machine.root / "root" / "agent" for machine in good.machines]
        try:
            finished, results = await _watch(conn, options, expected)
        finally:
            # Cancelled first, so that no new agent starts after this.
            nursery.cancel_scope.cancel()
            for target in agents:
                stop_agent(target)

    sys.stdout.write(render(results, ports) + "\n")
    if not finished:
        logger.error("gave up after %.0f s: not every machine reached its outcome", options.timeout)
    return finished


async def _watch(
    conn: bmdb.Connection, options: Options, expected: dict[str, bool]
) -> tuple[bool, list[Outcome]]:
    """Report progress every second until every machine has its expected outcome."""
    finished = False
    results: list[Outcome] = []
    with trio.move_on_after(options.timeout):
        while not finished:
            await trio.sleep(1)
            results = await outcomes(conn)
            started = sum(o.agent_key is not None for o in results)
            failed = sum(o.failure is not None and o.agent_key is None for o in results)
            logger.info(
                "progress: %d/%d agents started, %d/%d machines failed (expected %d)",
                started,
                len(expected),
                failed,
                len(expected),
                options.broken,
            )
            beating = sum(o.heartbeat_at is not None and o.hardware_report for o in results)
            logger.info("progress: %d agents heartbeating with a hardware report", beating)
            finished = all(
                (o.agent_key is not None) == expected[o.provider_id]
                and (expected[o.provider_id] or o.failure is not None)
                and (not expected[o.provider_id] or (o.heartbeat_at and o.hardware_report))
                for o in results
            ) and len(results) == len(expected)
    return finished, results


#: What the demo puts into its working folder; nothing else there is ever removed.
_DEMO_ENTRIES = ("postgres", "fleet", "broken", "machines.toml", "shepherd_ed25519")


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
        workdir = Workdir.prepare(args.workdir)
    except (WorkdirError, OSError) as exc:
        sys.stderr.write(f"shepherd.demo: {exc}\n")
        return 2
    options = Options(
        machines=args.machines,
        broken=args.broken,
        parallelism=args.parallelism,
        timeout=args.timeout,
        workdir=workdir.path,
        keep=args.keep,
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
            "shepherd.demo: interrupted; the fleet, the Shepherd and PostgreSQL stopped\n"
        )
        return 130
    return 0 if ok else 1


def interrupted(exc: BaseException) -> bool:
    """Whether ``exc`` is a Ctrl-C, alone or in (nested) groups with the
    cancellations it caused."""
    leaves = leaf_errors(exc)
    return any(isinstance(e, KeyboardInterrupt) for e in leaves) and all(
        isinstance(e, KeyboardInterrupt | trio.Cancelled) for e in leaves
    )


if __name__ == "__main__":
    raise SystemExit(main())
