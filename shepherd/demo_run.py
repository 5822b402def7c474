"""The demo's run, in order (``python -m shepherd.demo``; its command line is
`shepherd.demo`'s): a private PostgreSQL, the fleet and its takeover, then
(unless ``--takeover-only``) the cluster, the image and the installs, the
final table, and the stop of everything it started.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import trio
import trio_asyncio

import bmdb
from bmdb.errors import BMDBError
from bmdb.localserver import LocalPostgres, LocalPostgresError
from common.cli import leaf_errors, log_to_stderr
from metropolis.errors import MetropolisError
from shepherd.agent_server import AgentServerConfig, run_agent_server
from shepherd.agent_server.server import port_of
from shepherd.control_loop import start_control_loop
from shepherd.demo import FIRST_NODE_ADDRESS
from shepherd.demo_cluster import (
    default_image_cache,
    node_image,
    whole_path,
)
from shepherd.demo_stay import look_around
from shepherd.demo_table import final_table, render
from shepherd.demo_takeover import Outcome, Progress, watch_takeover, write_machines_file
from shepherd.demo_web import start_web
from shepherd.demo_workdir import (
    BROKEN_DIR,
    FIRST_DIR,
    MACHINES_DIR,
    Workdir,
    WorkdirError,
    check_workdir_length,
    reap,
)
from shepherd.errors import ShepherdError
from shepherd.initializer import Initializer
from shepherd.localcluster import open_first_node
from shepherd.localfleet import (
    DISK,
    agent_config,
    loopback_addresses,
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
    #: After the table, keep every server up until Ctrl-C/SIGTERM.
    stay: bool = False
    image_cache: Path | None = None
    etcd: Path = Path("/usr/bin/etcd")
    #: ``--upgrade`` (with ``--real-machines``).
    upgrade: bool = False


#: Seconds a Ctrl-C gives the demo to stop everything before it gives up.
SHUTDOWN_BOUND = 45.0


async def run_interruptible(
    options: Options,
    postgres: LocalPostgres,
    body: Callable[[Options, LocalPostgres], Awaitable[bool]] | None = None,
) -> bool | None:
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
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def on_interrupt() -> None:
                async for _ in signals:
                    _start_watchdog(postgres)
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(on_interrupt)
            result = await (body or run_demo)(options, postgres)
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
            await reap(options.workdir)


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
                image.append(await node_image(image_cache, options.etcd))
                image_ready.set()

            nursery.start_soon(get_image)

        binds = await nursery.start(
            lambda task_status: run_agent_server(
                conn, AgentServerConfig(listen="127.0.0.1:0"), task_status=task_status
            )
        )
        config = agent_config(
            port_of(binds[0]),
            ssh_connect_timeout=5.0,
            ssh_exec_timeout=60.0,
            heartbeat_interval=1.0,
            heartbeat_backoff_cap=10.0,
        )
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
                urls: list[str] = []
                if options.web is not None:
                    urls = await start_web(
                        nursery, options.web, options.workdir / "web.log", postgres.url("bmdb")
                    )
                finished, results = False, list[Outcome]()
                with trio.move_on_at(deadline):
                    finished, results = await watch_takeover(conn, expected, progress)
                table = render(results, ports)
                if options.stay:
                    await _stay(
                        table,
                        look_around(
                            bmdb_url=postgres.url("bmdb"),
                            machine=await _machine_id(conn, provider, ids[0]),
                            web_urls=urls,
                        ),
                    )
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
                    urls = []
                    if options.web is not None:
                        urls = await start_web(
                            nursery,
                            options.web,
                            options.workdir / "web.log",
                            postgres.url("bmdb"),
                            first,
                        )
                    finished, seen = await whole_path(
                        conn,
                        first,
                        expected,
                        progress,
                        deadline,
                        image,
                        image_ready,
                    )
                    table = final_table(seen, dict(zip(ids, machines, strict=True)), expected)
                    if options.stay:
                        cluster_file = options.workdir / "cluster.pb"
                        cluster_file.write_bytes(bytes(first.info))
                        text = look_around(
                            bmdb_url=postgres.url("bmdb"),
                            machine=await _machine_id(conn, provider, ids[0]),
                            web_urls=urls,
                            cluster_file=cluster_file,
                            owner_key=first.owner_key,
                            node=_node_of(table, ids[0]),
                        )
                        await _stay(table, text)
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


async def run_real_machines(options: Options, postgres: LocalPostgres) -> bool:
    """``--real-machines`` (`shepherd.demo_real`): the path, then the table."""
    from shepherd import demo_real

    started = trio.current_time()
    try:
        ok, table = await demo_real.run_real(
            demo_real.RealOptions(
                machines=options.machines,
                deadline=started + options.timeout,
                workdir=options.workdir,
                bmdb_url=postgres.url("bmdb"),
                image_cache=options.image_cache or default_image_cache(),
                etcd=options.etcd,
                upgrade=options.upgrade,
            )
        )
    finally:
        with trio.CancelScope(shield=True):
            await reap(options.workdir)
    sys.stdout.write(table + "\n")
    logger.info("the run took %.1f s", trio.current_time() - started)
    return ok


async def _stay(table: str, commands: str) -> None:
    """Print ``table`` and ``commands``, then wait until cancelled (Ctrl-C,
    SIGTERM): the servers of the run stay up meanwhile."""
    sys.stdout.write(table + "\n" + commands)
    sys.stdout.flush()
    logger.info("progress: staying up; Ctrl-C (or SIGTERM) stops everything")
    await trio.sleep_forever()


async def _machine_id(conn: bmdb.Connection, provider: StaticProvider, name: str) -> str:
    """The BMDB's machine id (what ``python -m bmdb`` takes) of the provider's ``name``."""

    async def read(q: bmdb.Queries) -> list[str]:
        provided = await q.provided_by_provider(provider.type)
        return [str(p.machine_id) for p in provided if p.provider_id == name]

    found = await conn.transact(read)
    return found[0] if found else name


def _node_of(table: str, machine: str) -> str | None:
    """The node id the final ``table`` gives ``machine`` (its third column), if any."""
    for line in table.splitlines():
        cells = line.split()
        if len(cells) > 2 and cells[0] == machine and cells[2].startswith("metropolis-"):
            return cells[2]
    return None


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


def run(args: argparse.Namespace) -> int:
    """Run the demo of ``args`` (parsed by `shepherd.demo.build_parser`); the exit status."""
    log_to_stderr(args.verbose)
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
        stay=args.stay or (args.web is not None and not args.exit),
        image_cache=args.image_cache,
        etcd=args.etcd,
        upgrade=args.upgrade,
    )
    postgres = None
    try:
        postgres = LocalPostgres(workdir.path / "postgres")
        logger.info("starting a private PostgreSQL in %s", postgres.root)
        postgres.create()
        postgres.start()
        postgres.create_database("bmdb")
        logger.info("BMDB at %s", postgres.url("bmdb"))
        body = run_real_machines if args.real_machines else None
        ok = trio.run(run_interruptible, options, postgres, body)
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
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
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
