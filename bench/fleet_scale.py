"""A fleet of 100,000 machines on one BMDB: claims, heartbeats, the recoverer, the views.

    python -m bench.fleet_scale [--machines 100000] [--small 1000] [--interval 10]
                                [--seconds 30] [--bringup 60] [--workers N] [--load-processes 2]
                                [--connections 10000] [--silent-every 1000]
                                [--profile DIR] [--phases claims,heartbeats,recoverer,views]
                                [--smoke]

One PostgreSQL 15 for the run; the fleet (`bench.fleet`): ``--machines``
machines as the provisioner and the initializer leave them (each with its
own agent key), every ``--silent-every``-th silent for an hour, and
``--cycles`` x 2 more provided but not taken over. In order:

1. **Claims**: ``--cycles`` claim+finish cycles of agent start
   (`bench.bmdb_work.work_cycles`, ``--claim-workers`` workers) on a copy of
   the fleet and on a fleet of ``--small`` machines with the same pending
   machines: the cost per cycle at the large over the small (goal <= 1.2).
2. **Heartbeats** (`bench.fleet.FleetLoad`, ``--load-processes`` processes
   over ``--connections`` connections, against ``--workers`` server
   processes as in ``bench.heartbeat``): against a *bare* endpoint (the same
   transport and Connect layer, answering without a check or a write), then
   against the real agent callback server. With each: the *bring-up* (every
   agent's first heartbeat, signed and with its hardware report, due within
   ``--bringup`` seconds, as a fleet's agents start over a while; one
   refused, e.g. queued past the server's 5 s, is not sent again before
   the agent's next turn, where the agent would retry after a second) and
   the *capacity* (every connection back to back for
   ``--seconds``); the ratio full/bare of capacities (goal >= 0.5), and of
   what this machine's cores sustain at each one's CPU per answer (server,
   PostgreSQL and load: a ratio the machine's other work moves less). With the
   real server also the *hold*: every agent every ``--interval`` for
   ``--seconds``, an open loop. It is *held* if at most 1% of the
   heartbeats due are unanswered at its end and 99% were answered within a
   tenth of the interval of their due time; the rate held is reported
   against the agents' need (goal >= 1: 10,000/s at 100,000 agents every
   10 s). If not held, longer intervals until one is: first the one at
   which the agents need 80% of the rate accepted, then 1.5 times longer
   each, at most 4. Printed per heartbeat of the hold: CPU seconds of server,
   PostgreSQL and load (where the time goes; ``--profile DIR`` also writes
   a cProfile of each server process there and prints the top functions)
   and WAL bytes (``pg_current_wal_lsn``), as bytes per machine-day.
3. **The recoverer**: its source statement at this fleet size (goal: well
   within its rate interval, 250 ms), then the real control loop
   (`shepherd.recoverer.Recoverer`, static provider, default rate) while
   the agents heartbeat at the interval held (or the longest tried), until
   every silent machine is recovered.
4. **The views**: ``python -m bmdb machines`` (the CLI, wall time), the web
   UI's first machine page, its page of failed machines and one machine's
   page (handler time against the SQL the page runs per request in
   pgbench, as ``bench.web_pages``: goal <= 2 for the first page, under
   50 ms for the failed ones), the list's counts per state (taken at most
   once per period, not per request: timed alone), and the metrics' fleet
   query (goal: under 100 ms). The fleet's failures first: every 10th
   machine's backoff ended an hour ago, every 1,000th is failing now.

``--phases`` runs only some of them (e.g. ``--phases views``: the fleet is
seeded, every agent but the silent ones given a heartbeat as the heartbeat
phase would leave them, then only the views are measured).

``--phases heartbeats`` runs the seeding and section 2 alone: where the
server's CPU goes, without the rest of the run. ``--phases recoverer`` runs
phase 3 alone: the fleet, the real server, the agents' bring-up (so that
the live ones have heartbeated), then the recoverer while they heartbeat
every ``--interval``; with ``heartbeats`` too, it runs after the hold at the
interval held, as in the whole run.

Everything runs on this machine, load included: on a shared machine the
wall-clock rates follow its load (printed); the ratios are taken within
the run.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psycopg
import trio

import bmdb
from bench.bmdb_work import work_cycles
from bench.fleet import Fleet, FleetLoad, LoadResult, seed_fleet
from bench.heartbeat import cpu_seconds, postgres_pids, spent, start_servers, stop_servers
from bench.ratios import report
from bench.smoke import parse_args
from bench.web_pages import (
    counts_sql,
    fleet_query_ms,
    machine_page_sql,
    machines_page_sql,
    pgbench_ms,
    server_ms,
)
from bmdb.errors import NothingToDo
from bmdb.localserver import TEMPLATE_DB, LocalPostgres, start_with_template
from shepherd.agent_server.workers import default_workers
from shepherd.cli import RecovererOptions
from shepherd.control_loop import LoopStats, run_control_loop
from shepherd.providers.static import StaticProvider
from shepherd.rate_limit import Rate, RateLimiter
from shepherd.recoverer import Recoverer

DAY = 86400.0
#: The phases, in the order they run (``--phases`` chooses among them; the
#: recoverer runs inside the heartbeats' phase when both are chosen, since
#: their agents are the ones it watches).
PHASES = ("claims", "heartbeats", "recoverer", "views")

#: Longer intervals tried when --interval is not held.
SEARCH_TRIES = 4


def _load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def _lsn(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn").fetchone()
        assert row is not None
        return int(row[0])


# --- 1. claims --------------------------------------------------------------------


def _claims(server: LocalPostgres, args: argparse.Namespace) -> None:
    small = Fleet(args.small, secret="small", pending=2 * args.cycles)
    seed_fleet(server.create_database("fleet_small", template=TEMPLATE_DB), small)
    rates: dict[int, list[float]] = {args.small: [], args.machines: []}
    for round_ in range(args.claim_rounds):
        for size, template in ((args.small, "fleet_small"), (args.machines, "fleet")):
            name = f"claims_{size}_{round_}"
            server.admin(f"CREATE DATABASE {name} TEMPLATE {template}")
            url = server.url(name)
            rates[size].append(trio.run(work_cycles, url, args.claim_workers, args.cycles).rate)
            server.admin(f"DROP DATABASE {name}")
    small_rate, large_rate = (statistics.median(rates[s]) for s in (args.small, args.machines))
    print(
        f"claims: {args.cycles} claim+finish cycles, {args.claim_workers} workers, median of"
        f" {args.claim_rounds} rounds: {small_rate:.0f}/s at {args.small} machines,"
        f" {large_rate:.0f}/s at {args.machines}\n"
        f"  claim+finish cost per cycle at {args.machines} / {args.small} machines:"
        f" {small_rate / large_rate:.2f} (goal <= 1.2)",
        flush=True,
    )
    report("fleet_scale", "claim+finish cost per cycle, large / small", small_rate / large_rate,
           "<= 1.2")  # fmt: skip


# --- 2. heartbeats ----------------------------------------------------------------


def _held(result: LoadResult, interval: float) -> bool:
    due = result.accepted + result.refused + result.unanswered
    return (
        due > 0
        and result.unanswered <= 0.01 * due
        and result.refused <= 0.01 * due
        and result.lag(0.99) <= interval / 10
    )


def _line(name: str, result: LoadResult, interval: float | None = None) -> str:
    lags = (
        f", lag p50 {result.lag(0.5) * 1000:.0f} ms, p99 {result.lag(0.99) * 1000:.0f} ms,"
        f" max {result.lag(1.0):.1f} s, unanswered {result.unanswered}"
        if interval
        else ""
    )
    return (
        f"  {name}: {result.rate():8.0f}/s accepted {result.accepted}"
        f" (signed {result.signed}, with a session {result.sessions}, hardware reports"
        f" {result.reports}), refused {result.refused}, connection errors {result.errors}{lags}"
    )


@dataclass(frozen=True)
class Capacity:
    """A capacity phase (every connection back to back) and its CPU seconds."""

    result: LoadResult
    server_cpu: float
    db_cpu: float

    def per_machine(self) -> float:
        """Answers/s this machine's cores sustain at this phase's CPU per
        accepted answer of server, PostgreSQL and load together."""
        cpu = self.server_cpu + self.db_cpu + self.result.cpu
        return len(os.sched_getaffinity(0)) * self.result.accepted / max(cpu, 1e-9)

    def line(self) -> str:
        beats = max(self.result.accepted, 1)
        return (
            f"    per answer: server CPU {1000 * self.server_cpu / beats:.3f} ms, PostgreSQL CPU"
            f" {1000 * self.db_cpu / beats:.3f} ms, load CPU {1000 * self.result.cpu / beats:.3f}"
            f" ms: this machine's cores would sustain {self.per_machine():.0f}/s"
            f" (load average {_load_average()})"
        )


def _capacity(
    name: str, server: LocalPostgres, processes: list[subprocess.Popen[bytes]], load: FleetLoad,
    seconds: float,
) -> Capacity:  # fmt: skip
    cpu = _Cpu(server, [p.pid for p in processes])
    cpu.start()
    closed = load.phase(0, seconds)
    server_cpu, db_cpu, _ = cpu.stop()
    capacity = Capacity(closed, server_cpu, db_cpu)
    print(_line(name, closed) + "\n" + capacity.line(), flush=True)
    return capacity


def _bare(server: LocalPostgres, url: str, fleet: Fleet, args: argparse.Namespace) -> Capacity:
    processes, port = start_servers("bare", url, args.workers)
    try:
        with FleetLoad(
            port, fleet, processes=args.load_processes, connections=args.connections,
            dummy_sessions=True,
        ) as load:  # fmt: skip
            up = load.phase(args.bringup, args.bringup, drain=600)
            print(_line("bare, bring-up", up, args.bringup), flush=True)
            return _capacity("bare, capacity", server, processes, load, args.seconds)
    finally:
        stop_servers(processes)


class _Cpu:
    """CPU seconds of the servers and PostgreSQL between `start` and `stop`."""

    def __init__(self, server: LocalPostgres, pids: list[int]) -> None:
        self.server, self.pids = server, pids

    def start(self) -> None:
        self.s0, self.d0 = cpu_seconds(self.pids), cpu_seconds(postgres_pids(self.server))
        self.wall0 = time.monotonic()

    def stop(self) -> tuple[float, float, float]:
        """(server CPU, PostgreSQL CPU, wall) seconds since `start`."""
        return (
            spent(self.s0, cpu_seconds(self.pids)),
            spent(self.d0, cpu_seconds(postgres_pids(self.server))),
            time.monotonic() - self.wall0,
        )


@contextlib.contextmanager
def _brought_up(
    url: str, fleet: Fleet, args: argparse.Namespace
) -> Iterator[tuple[list[subprocess.Popen[bytes]], FleetLoad]]:
    """The real server's processes and the load, once every agent's first
    heartbeat was due (the bring-up, printed); the servers stop on exit."""
    processes, port = start_servers("full", url, args.workers)
    try:
        with FleetLoad(
            port, fleet, processes=args.load_processes, connections=args.connections
        ) as load:
            up = load.phase(args.bringup, args.bringup, drain=600)
            print(_line("full, bring-up", up, args.bringup), flush=True)
            yield processes, load
    finally:
        stop_servers(processes)


def _recoverer_only(url: str, fleet: Fleet, args: argparse.Namespace) -> None:
    """Phase 3 alone: the real server, the agents' bring-up, the recoverer."""
    with _brought_up(url, fleet, args) as (_, load):
        _recover(url, fleet, load, args.interval)


def _full(
    server: LocalPostgres, url: str, fleet: Fleet, args: argparse.Namespace, *, recoverer: bool
) -> tuple[Capacity, LoadResult]:
    """The real server: bring-up, capacity, hold (and the search), then the
    recoverer if asked for. Returns (capacity, hold at --interval)."""
    agents = fleet.size - fleet.silent_count()
    need = agents / args.interval
    try:
        with _brought_up(url, fleet, args) as (processes, load):
            # Right after the bring-up, as with the bare endpoint: the same state.
            closed = _capacity("full, capacity", server, processes, load, args.seconds)
            cpu = _Cpu(server, [p.pid for p in processes])
            wal0 = _lsn(url)
            cpu.start()
            hold = load.phase(args.interval, args.seconds)
            server_cpu, db_cpu, wall = cpu.stop()
            wal = _lsn(url) - wal0
            held = _held(hold, args.interval)
            print(_line(f"full, hold every {args.interval:g} s", hold, args.interval))
            print(
                f"    {agents} agents need {need:.0f}/s: {'held' if held else 'NOT held'};"
                f" {hold.rate() / need:.2f} of the need accepted"
            )
            beats = max(hold.accepted, 1)
            cores = len(os.sched_getaffinity(0))
            used = (server_cpu + db_cpu + hold.cpu) / (wall * cores)
            print(
                f"    per heartbeat: server CPU {1000 * server_cpu / beats:.3f} ms, PostgreSQL"
                f" CPU {1000 * db_cpu / beats:.3f} ms, load CPU {1000 * hold.cpu / beats:.3f} ms;"
                f" the three used {used:.0%} of this machine's {cores} cores"
                f" (load average {_load_average()})\n"
                f"    WAL: {wal / beats:.0f} bytes per heartbeat,"
                f" {wal / beats * DAY / args.interval / 1e6:.2f} MB per machine-day at one"
                f" heartbeat per {args.interval:g} s,"
                f" {wal / beats * DAY / args.interval * fleet.size / 1e9:.1f} GB a day for"
                f" {fleet.size} machines",
                flush=True,
            )
            report("fleet_scale", f"heartbeats held at {args.interval:g} s / need",
                   hold.rate() / need, ">= 1")  # fmt: skip
            interval = args.interval if held else _search(load, agents, hold.rate(), args)
            if recoverer:
                _recover(url, fleet, load, interval)
            return closed, hold
    finally:
        if args.profile:
            _print_profiles(Path(args.profile))


def _search(load: FleetLoad, agents: int, rate: float, args: argparse.Namespace) -> float:
    """Longer intervals until one is held: first the one at which the agents
    need 80% of the ``rate`` accepted at --interval, then each 1.5 times the
    last. Returns the one held (or the last tried)."""
    interval: float = max(float(args.interval) * 1.25, agents / max(0.8 * rate, 1e-9))
    for _ in range(SEARCH_TRIES):
        interval = round(interval, 1)
        hold = load.phase(interval, args.seconds)
        held = _held(hold, interval)
        print(_line(f"full, hold every {interval:g} s", hold, interval))
        print(
            f"    {agents} agents need {agents / interval:.0f}/s:"
            f" {'held' if held else 'NOT held'} (load average {_load_average()})",
            flush=True,
        )
        if held:
            return interval
        interval *= 1.5
    print("    not held at any interval tried")
    return interval / 1.5


def _print_profiles(folder: Path) -> None:
    files = sorted(str(f) for f in folder.glob("full-*.prof"))
    if not files:
        return
    print(f"  where the server's time goes (cProfile of {len(files)} processes, top 20):")
    stats = pstats.Stats(*files, stream=sys.stdout)
    stats.sort_stats("tottime").print_stats(20)


# --- 3. the recoverer ---------------------------------------------------------------


def _recover(url: str, fleet: Fleet, load: FleetLoad, interval: float) -> None:
    """The recoverer's source statement, then its control loop until the silent
    machines are recovered, while every agent heartbeats every ``interval``."""
    silent = [fleet.machine_id(i) for i in range(fleet.size) if fleet.silent(i)]
    rate = RecovererOptions().rate
    # Long enough for the loop at its rate, with room; the phase runs in its own thread.
    seconds = len(silent) * rate.interval * 1.5 + 2
    results: list[LoadResult] = []
    thread = threading.Thread(target=lambda: results.append(load.phase(interval, seconds)))
    thread.start()
    try:
        source_ms, took, recovered, others, counts = trio.run(_recover_loop, url, silent, rate)
    finally:
        thread.join()
    print(
        f"  recoverer: its source at {fleet.size} machines, as its loop runs it (locking, in the"
        f" claiming transaction), takes {source_ms:.1f} ms"
        f" (median; its rate interval: {rate.interval * 1000:.0f} ms);"
        f" the control loop recovered {recovered} of {len(silent)} silent machines and"
        f" {others} others (past a timeout: never heartbeated, or not within 10 min)"
        f" in {took:.1f} s"
        f" ({took / max(recovered + others, 1) * 1000:.0f} ms each),"
        f" while agents heartbeat every {interval:g} s"
        f" ({results[0].rate() if results else 0:.0f}/s accepted)\n"
        f"    its iterations: {counts}; load average {_load_average()}",
        flush=True,
    )
    report("fleet_scale", "recoverer source (locking) ms / its rate interval",
           source_ms / (rate.interval * 1000), "<= 1")  # fmt: skip


def _never_heartbeated(url: str) -> int:
    """Started agents without a heartbeat: the recoverer takes those too,
    once their first-heartbeat timeout passed (the fleet's started 2 h ago)."""
    with psycopg.connect(url, autocommit=True) as db:
        row = db.execute(
            """SELECT count(*) FROM machine_agent_started a WHERE NOT EXISTS
               (SELECT 1 FROM machine_agent_heartbeat h WHERE h.machine_id = a.machine_id)"""
        ).fetchone()
        assert row is not None
        return int(row[0])


async def _source_ms(conn: bmdb.Connection, recoverer: Recoverer) -> list[float]:
    """Milliseconds of 11 runs of the recoverer's source as its loop runs it:
    the locking statement (a window of candidates, one picked at random and
    locked), in the claiming transaction of a session; then nothing is
    claimed (the transaction is rolled back). The listing statement
    (``conn.transact``) is a different one, which stops at the first
    silent machine."""
    durations: list[float] = []

    async def source(q: bmdb.Queries) -> list[uuid.UUID]:
        started = time.perf_counter()
        await recoverer.source(q)
        durations.append((time.perf_counter() - started) * 1000)
        raise NothingToDo("only timed")

    async with conn.session("fleet-scale-bench") as session:
        for _ in range(11):
            with contextlib.suppress(NothingToDo):
                await session.work(recoverer.process, source)
    return durations


async def _recover_loop(
    url: str, silent: list[str], rate: Rate
) -> tuple[float, float, int, int, str]:
    """(median source ms, seconds until all of ``silent`` were recovered or
    the bound, how many were, how many others were, what the loop's
    iterations did: outcomes, rate-limiter waits, transaction retries)."""
    recoverer = Recoverer(StaticProvider([]))
    async with bmdb.open_connection(url, max_connections=4) as conn:
        durations = await _source_ms(conn, recoverer)

        def remaining() -> tuple[int, int]:
            with psycopg.connect(url, autocommit=True) as db:
                row = db.execute(
                    """SELECT count(*) FILTER (WHERE machine_id::text = ANY(%s)),
                              (SELECT count(*) FROM machines WHERE NOT agent_started)
                       FROM machine_agent_started""",
                    (silent,),
                ).fetchone()
                assert row is not None
                return int(row[0]), int(row[1])

        unheard = _never_heartbeated(url)
        left, pending0 = remaining()
        bound = len(silent) * rate.interval * 4 + 30
        stats = LoopStats()
        retries0 = conn.stats.retries
        started = time.monotonic()
        async with trio.open_nursery() as nursery:
            loop = functools.partial(
                run_control_loop, conn, recoverer, parallelism=1, limiter=RateLimiter(rate),
                stats=stats,
            )  # fmt: skip
            nursery.start_soon(loop)
            while left and time.monotonic() - started < bound:
                await trio.sleep(0.2)
                left, pending = await trio.to_thread.run_sync(remaining)
            took = time.monotonic() - started
            nursery.cancel_scope.cancel()
        left, pending = remaining()
    recovered = len(silent) - left
    component = recoverer.component
    outcomes = ", ".join(
        f"{outcome} {n}" for (c, outcome), n in sorted(stats.iterations.items()) if c == component
    )
    counts = (
        f"{outcomes or 'none'} ({unheard} started agents had never heartbeated at its start);"
        f" rate-limiter waits {stats.limiter_waits[component]}"
        f" ({stats.limiter_wait_seconds.get(component, 0.0):.1f} s);"
        f" transaction retries {conn.stats.retries - retries0}"
    )
    return statistics.median(durations), took, recovered, pending - pending0 - recovered, counts


# --- 4. the views --------------------------------------------------------------------


def _beat_all(url: str) -> None:
    """What the heartbeat phase leaves for the views: every agent that is not
    silent heartbeated just now (the silent ones keep their old heartbeat)."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            """INSERT INTO machine_agent_heartbeat (machine_id, agent_heartbeat_at)
               SELECT machine_id, now() FROM machine_agent_started
               ON CONFLICT (machine_id) DO NOTHING"""
        )
        conn.execute("VACUUM ANALYZE")


def _past_failures(url: str) -> tuple[int, int]:
    """What a fleet's failures leave for the failed machines page: every
    10th machine failed once and its backoff ended an hour ago (the row
    stays until the process next finishes there), every 1,000th is failing
    now (the newest first: a page walking the fleet in order would read it
    all). The last phase: it changes no other phase's fleet. Returns the
    active and the ended backoffs."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            """CREATE TEMP TABLE numbered AS
               SELECT machine_id, row_number() OVER (ORDER BY machine_created_at DESC) AS n
               FROM machines"""
        )
        conn.execute(
            """INSERT INTO work_backoff (machine_id, process, until, cause, last_interval_seconds)
               SELECT machine_id, 'ShepherdRecovery', now() - interval '1 hour', 'ended', 60
               FROM numbered WHERE n % 10 = 0
               ON CONFLICT DO NOTHING"""
        )
        conn.execute(
            """INSERT INTO work_backoff (machine_id, process, until, cause, last_interval_seconds)
               SELECT machine_id, 'ShepherdAgentStart', now() + interval '1 day', 'failing', 86400
               FROM numbered WHERE n % 1000 = 1
               ON CONFLICT (machine_id, process) DO UPDATE SET until = EXCLUDED.until"""
        )
        conn.execute("VACUUM ANALYZE work_backoff")
        [(active, ended)] = conn.execute(
            "SELECT count(*) FILTER (WHERE until > now()), count(*) FILTER (WHERE until <= now())"
            " FROM work_backoff"
        ).fetchall()
    return active, ended


def _views(server: LocalPostgres, db: str, root: Path, args: argparse.Namespace) -> None:
    url = server.url(db)
    active, ended = _past_failures(url)
    print(f"  backoffs: {active} active (failed machines), {ended} ended", flush=True)
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "bmdb", "--url", url, "machines"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    cli = time.perf_counter() - started
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import bmdb.__main__"], check=True)
    startup = time.perf_counter() - started
    print(
        f"  bmdb machines: {cli:.2f} s wall for {len(out.stdout.splitlines())} lines"
        f" (of which importing the CLI: {startup:.2f} s)",
        flush=True,
    )
    trio.run(_pages, server, db, root, args.requests)


async def _pages(server: LocalPostgres, db: str, root: Path, requests: int) -> None:
    from console.server import serve

    url = server.url(db)
    async with bmdb.open_connection(url, max_connections=4) as conn:

        async def one(q: bmdb.Queries) -> str:
            rows = await q.execute("SELECT machine_id FROM machine_agent_heartbeat LIMIT 1")
            return str(rows[0][0])

        machine = await conn.transact(one)
        pages = [
            ("web first machine page", "/machines", machines_page_sql(100)),
            ("web failed machines page", "/machines?state=failed",
             machines_page_sql(100, state="failed")),
            ("web machine page", f"/machine/{machine}", machine_page_sql(machine)),
        ]  # fmt: skip
        async with trio.open_nursery() as nursery:
            [base] = await nursery.start(serve, conn, "127.0.0.1:0")
            async with httpx.AsyncClient(base_url=base, timeout=60) as client:
                for name, path, sql in pages:
                    app_ms, wall_ms, first_ms = await server_ms(client, path, requests)
                    sql_ms = await trio.to_thread.run_sync(
                        functools.partial(pgbench_ms, server, sql, requests, root, db)
                    )
                    goal = {
                        "web first machine page": " (goal <= 2)",
                        "web failed machines page": " (goal: server under 50 ms)",
                    }.get(name, "")
                    print(
                        f"  {name} at {await _count(conn)} machines: server {app_ms:.2f} ms"
                        f" (wall {wall_ms:.2f} ms; the first request {first_ms:.1f} ms),"
                        f" the SQL it runs per request alone {sql_ms:.2f} ms:"
                        f" ratio {app_ms / sql_ms:.2f}{goal}",
                        flush=True,
                    )
                    report("fleet_scale", f"{name}: server / SQL time", app_ms / sql_ms,
                           "<= 2" if name == "web first machine page" else "")  # fmt: skip
                    if name == "web failed machines page":
                        report("fleet_scale", f"{name}: server ms / 50 ms", app_ms / 50, "< 1")
            nursery.cancel_scope.cancel()
        counts_ms = await trio.to_thread.run_sync(
            functools.partial(pgbench_ms, server, counts_sql(), requests, root, db)
        )
        print(
            f"  the machine list's counts per state (at most once per period, shared):"
            f" {counts_ms:.1f} ms in pgbench",
            flush=True,
        )
        ours, fleet_sql = await fleet_query_ms(conn, server, requests, root, db)
        print(
            f"  metrics scrape (fleet query): {ours:.1f} ms from bmdb,"
            f" {fleet_sql:.1f} ms in pgbench (goal: under 100 ms)",
            flush=True,
        )
        report("fleet_scale", "metrics fleet query DB ms / 100 ms", fleet_sql / 100, "< 1")


async def _count(conn: bmdb.Connection) -> int:
    async def fn(q: bmdb.Queries) -> int:
        return int((await q.execute("SELECT count(*) FROM machines"))[0][0])

    return await conn.transact(fn)


# --- the run ---------------------------------------------------------------------------


def _heartbeats(
    server: LocalPostgres, url: str, fleet: Fleet, args: argparse.Namespace, *, recoverer: bool
) -> None:
    """Bare endpoint, then the real server (and the recoverer, if asked); the capacity ratio."""
    print(
        f"heartbeats: {args.machines - fleet.silent_count()} agents, {args.workers} server"
        f" processes, {args.load_processes} load processes, {args.connections} connections",
        flush=True,
    )
    bare = _bare(server, url, fleet, args)
    full, _ = _full(server, url, fleet, args, recoverer=recoverer)
    ratio = full.result.rate() / max(bare.result.rate(), 1e-9)
    cpu_ratio = full.per_machine() / max(bare.per_machine(), 1e-9)
    print(
        f"  capacity full/bare at {fleet.size} machines: {ratio:.2f} (goal >= 0.5); of what this"
        f" machine's cores sustain at each one's CPU per answer: {cpu_ratio:.2f}"
        f" (load average {_load_average()})"
    )
    report("fleet_scale", "heartbeat capacity full / bare", ratio, ">= 0.5")
    report("fleet_scale", "heartbeat CPU-bound capacity full / bare", cpu_ratio, ">= 0.5")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--machines", type=int, default=100_000, help="fleet size (%(default)s)")
    parser.add_argument("--small", type=int, default=1000, help="small fleet for the claims")
    parser.add_argument("--cycles", type=int, default=500, help="claim+finish cycles per fleet")
    parser.add_argument("--claim-workers", type=int, default=16)
    parser.add_argument("--claim-rounds", type=int, default=3)
    parser.add_argument("--interval", type=float, default=10.0, help="heartbeat interval, s")
    parser.add_argument("--seconds", type=float, default=30.0, help="each measured phase, s")
    parser.add_argument(
        "--bringup", type=float, default=60.0, help="seconds over which agents first heartbeat"
    )
    parser.add_argument(
        "--workers", type=int, default=default_workers(), help="server processes (%(default)s)"
    )
    parser.add_argument("--load-processes", type=int, default=2)
    parser.add_argument("--connections", type=int, default=10_000, help="load connections")
    parser.add_argument("--silent-every", type=int, default=1000, help="every N-th is silent")
    parser.add_argument("--requests", type=int, default=30, help="requests per web page")
    parser.add_argument("--profile", default="", help="cProfile the servers into this folder")
    parser.add_argument(
        "--phases",
        default=",".join(PHASES),
        help="comma-separated phases to run, of %(default)s (the fleet is seeded for any)",
    )
    args = parse_args(
        parser,
        {
            "machines": 60, "small": 20, "cycles": 4, "claim_workers": 2, "claim_rounds": 1,
            "interval": 0.5, "seconds": 1.0, "bringup": 0.5, "workers": 1, "load_processes": 1,
            "connections": 8, "silent_every": 20, "requests": 1,
        },
    )  # fmt: skip
    for name in ("machines", "small", "cycles", "claim_workers", "claim_rounds", "workers",
                 "load_processes", "connections", "requests"):  # fmt: skip
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not args.interval > 0 or not args.seconds > 0 or not args.bringup > 0:
        parser.error("--interval, --seconds and --bringup must be positive")
    if args.cycles * 2 > args.small:
        parser.error("--cycles must be at most half of --small")
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = sorted(set(phases) - set(PHASES))
    if unknown or not phases:
        parser.error(f"--phases takes some of {','.join(PHASES)}, got {args.phases!r}")
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        os.environ["HEARTBEAT_BENCH_PROFILE"] = str(Path(args.profile).resolve())

    root = Path(tempfile.mkdtemp(prefix="fleet-scale-"))
    root.chmod(0o755)  # the server may run as the postgres user
    server = start_with_template(root)
    try:
        fleet = Fleet(args.machines, silent_every=args.silent_every, pending=2 * args.cycles)
        url = server.create_database("fleet", template=TEMPLATE_DB)
        started = time.perf_counter()
        seed_fleet(url, fleet)
        print(
            f"{args.machines} machines seeded in {time.perf_counter() - started:.1f} s"
            f" ({fleet.silent_count()} silent, {fleet.pending} not taken over);"
            f" load average {_load_average()}",
            flush=True,
        )
        if "claims" in phases:
            _claims(server, args)
        if "heartbeats" in phases:
            _heartbeats(server, url, fleet, args, recoverer="recoverer" in phases)
        elif "recoverer" in phases:
            _recoverer_only(url, fleet, args)
        if "views" in phases:
            if "heartbeats" not in phases and "recoverer" not in phases:
                _beat_all(url)
            print(f"views (load average {_load_average()}):", flush=True)
            _views(server, "fleet", root, args)
        print(f"load average at the end: {_load_average()}")
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
