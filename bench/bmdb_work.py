"""BMDB work cycles (source + claim + finish) against pgbench, in one run.

    python -m bench.bmdb_work [--machines 50000] [--share 0.1] [--workers 1,4,16] [--smoke]
    python -m bench.bmdb_work --compare-machines 1000,100000 [--compare-cycles 500] [--smoke]

Every figure is measured here, against one PostgreSQL 15 started for the run:

- **ours**: N Trio workers, each with its own BMDB session, doing
  ``Session.work(SHEPHERD_AGENT_START, machines_for_agent_start)`` then
  ``Work.finish(set_agent_started)``, until ``share`` of the machines are
  processed. Run twice: on a fleet where nothing is processed yet (*first*
  share) and on one where all but the last share already is (*last*), to show
  that the cost of a claim does not grow as machines get processed.
- **pgbench, our SQL**: the same statements (generated from bmdb's own SQL
  text) through ``pgbench -M prepared`` with the same client count: the cost
  of our Python stack (ratio a, goal >= 0.5 at 16 workers). Same SQL, not
  the same round trips: bmdb sends each BEGIN together with the statement
  after it (see `bmdb.transaction`), 6 round trips per cycle against
  pgbench's 8 (pgbench cannot pipeline a statement with gset).
- **pgbench, Go shape**: the Go original's cycle (anti-join ``LIMIT 1`` with
  no locking clause, SERIALIZABLE) with one client (more collide), on the
  same fleets: the quality of the design (ratio b, goal >= 3 at 16 workers).
  Its rate falls as a run goes on: the planner believes the tag tables are
  as empty as they were at the last ANALYZE, so the anti-join scans
  ``machine_agent_started`` for every processed machine it skips. Hence two
  baselines: *go1*, the Go shape over the same cycles as ours (what it
  sustains), and *go best*, its first ``GO_BEST_CYCLES`` cycles on a fresh
  fleet (its best case, about the ~500/s the issue quotes). Ratio b is
  printed against both.

With ``--compare-machines SMALL,LARGE`` it measures only ours, on fresh
fleets of each size, the same cycles on each: the cost of a claim+finish
cycle on the largest over the smallest (goal <= 1.2: a claim costs the same
however large the fleet).

"wasted" is (serialization retries + work conflicts) / successful claims.
"""

from __future__ import annotations

import argparse
import datetime
import re
import shutil
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import trio

import bmdb
from bench.ratios import report
from bench.smoke import parse_args
from bmdb import Process
from bmdb.errors import NothingToDo, WorkConflict
from bmdb.localserver import TEMPLATE_DB, LocalPostgres, find_postgres_bin, start_with_template
from bmdb.model import Queries, sourcing
from bmdb.work import CLAIM_SQL, RELEASE_SQL

KEY = bytes(32)
PGBENCH_SESSION = uuid.UUID(int=1)


@dataclass
class Result:
    rate: float  # cycles per second
    wasted: float  # share of claims


# -- ours ---------------------------------------------------------------------


async def _source(q: Queries) -> list[uuid.UUID]:
    machines = await q.machines_for_agent_start(1)
    if not machines:
        raise NothingToDo
    return [machines[0].machine_id]


async def work_cycles(url: str, workers: int, cycles: int) -> Result:
    """Run ``cycles`` claim+finish cycles of our BMDB work on ``workers``
    concurrent workers against ``url``; the other benchmarks (bmdb_ha) share
    it so that both sides of their ratios run the same work."""
    async with bmdb.open_connection(url, max_connections=2 * workers + 2) as conn:
        remaining = cycles
        started = trio.Event()
        ready = 0

        async def worker(i: int) -> None:
            nonlocal remaining, ready
            async with conn.session("bench", f"w{i}") as sess:
                ready += 1
                if ready == workers:
                    started.set()
                await started.wait()
                while remaining > 0:
                    remaining -= 1
                    try:
                        work = await sess.work(Process.SHEPHERD_AGENT_START, _source)
                    except (NothingToDo, WorkConflict):
                        remaining += 1
                        continue
                    async with work:

                        async def apply(
                            q: Queries, machine_id: uuid.UUID = work.machine_id
                        ) -> None:
                            await q.set_agent_started(machine_id, _now(), KEY)

                        await work.finish(apply)

        async with trio.open_nursery() as nursery:
            for i in range(workers):
                nursery.start_soon(worker, i)
            await started.wait()
            t0 = trio.current_time()
        elapsed = trio.current_time() - t0
        wasted = (conn.stats.retries + conn.stats.conflicts) / max(conn.stats.claims, 1)
        return Result(cycles / elapsed, wasted)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


# -- pgbench ------------------------------------------------------------------


def _bind(sql: str, values: dict[str, str]) -> str:
    """bmdb's SQL (psycopg %(name)s placeholders) as pgbench SQL."""
    for name, value in values.items():
        sql = sql.replace(f"%({name})s", value)
    assert "%(" not in sql, sql
    return " ".join(sql.split())


_OURS_VALUES = {
    "process": "'ShepherdAgentStart'",
    "machine": ":machine_id::uuid",
    "session": ":session_id::uuid",
    "event": "'Finished'",
    "cause": "NULL",
}

_SET_AGENT_STARTED = (
    "INSERT INTO machine_agent_started (machine_id, agent_started_at, agent_public_key)"
    " VALUES (:machine_id::uuid, now(), '\\x00'::bytea)"
    " ON CONFLICT (machine_id) DO UPDATE SET agent_started_at = EXCLUDED.agent_started_at"
)


def _ours_script() -> str:
    source = _bind(sourcing.agent_start_lock_sql(1), _OURS_VALUES)
    source = source.replace("SELECT p.machine_id,", "SELECT p.machine_id AS machine_id,", 1)
    return "\n".join(
        [
            "BEGIN ISOLATION LEVEL REPEATABLE READ;",
            f"{source} \\gset",
            _bind(CLAIM_SQL, _OURS_VALUES) + ";",
            "COMMIT;",
            "BEGIN ISOLATION LEVEL REPEATABLE READ;",
            _bind(RELEASE_SQL, _OURS_VALUES) + ";",
            _SET_AGENT_STARTED + ";",
            "COMMIT;",
        ]
    )


# The Go original: GetMachinesForAgentStart with LIMIT 1, no locking clause;
# its Session.Transact checks the session first; Work() inserts the work and
# history rows; Finish() deletes work and backoff, logs, applies the tag.
_GO_SCRIPT = r"""
BEGIN ISOLATION LEVEL SERIALIZABLE;
SELECT session_id FROM sessions
WHERE session_id = :session_id::uuid AND session_deadline > now();
SELECT machine_provided.machine_id AS machine_id
FROM machines
INNER JOIN machine_provided ON machines.machine_id = machine_provided.machine_id
LEFT JOIN work ON machines.machine_id = work.machine_id
    AND work.process IN ('ShepherdAgentStart', 'ShepherdRecovery')
LEFT JOIN work_backoff ON machines.machine_id = work_backoff.machine_id
    AND work_backoff.until > now() AND work_backoff.process = 'ShepherdAgentStart'
LEFT JOIN machine_agent_started ON machines.machine_id = machine_agent_started.machine_id
WHERE machine_agent_started.machine_id IS NULL
    AND work.machine_id IS NULL AND work_backoff.machine_id IS NULL
LIMIT 1 \gset
INSERT INTO work (machine_id, session_id, process)
VALUES (:machine_id::uuid, :session_id::uuid, 'ShepherdAgentStart');
INSERT INTO work_history (machine_id, process, event)
VALUES (:machine_id::uuid, 'ShepherdAgentStart', 'Started');
COMMIT;
BEGIN ISOLATION LEVEL SERIALIZABLE;
SELECT session_id FROM sessions
WHERE session_id = :session_id::uuid AND session_deadline > now();
DELETE FROM work
WHERE machine_id = :machine_id::uuid AND session_id = :session_id::uuid
    AND process = 'ShepherdAgentStart';
DELETE FROM work_backoff
WHERE machine_id = :machine_id::uuid AND process = 'ShepherdAgentStart';
INSERT INTO work_history (machine_id, process, event)
VALUES (:machine_id::uuid, 'ShepherdAgentStart', 'Finished');
INSERT INTO machine_agent_started (machine_id, agent_started_at, agent_public_key)
VALUES (:machine_id::uuid, now(), '\x00'::bytea)
ON CONFLICT (machine_id) DO UPDATE SET agent_started_at = EXCLUDED.agent_started_at;
COMMIT;
"""


def _pgbench(server: LocalPostgres, db: str, script: Path, clients: int, cycles: int) -> Result:
    out = subprocess.run(
        [
            str(find_postgres_bin() / "pgbench"),
            "-n",
            "-M", "prepared",
            "-c", str(clients),
            "-j", str(min(clients, 2)),
            "-t", str(max(cycles // clients, 1)),
            "--max-tries", "1000",
            "-D", f"session_id={PGBENCH_SESSION}",
            "-f", str(script),
            "-h", str(server.socket_dir),
            "-p", str(server.port),
            "-U", "postgres",
            db,
        ],
        check=True,
        capture_output=True,
        text=True,
    )  # fmt: skip
    tps = float(re.search(r"tps = ([\d.]+) \(without initial", out.stdout)[1])  # type: ignore[index]
    retried = re.search(r"number of transactions retried: (\d+)", out.stdout)
    done = int(re.search(r"number of transactions actually processed: (\d+)", out.stdout)[1])  # type: ignore[index]
    return Result(tps, (int(retried[1]) if retried else 0) / max(done, 1))


# -- fleets -------------------------------------------------------------------


def _prepare_fleet(server: LocalPostgres, name: str, machines: int) -> None:
    """Database ``name``: ``machines`` provided, none processed, and the
    pgbench session."""
    server.admin(f"CREATE DATABASE {name} TEMPLATE {TEMPLATE_DB}")
    server.admin(f"""
        DO $$ BEGIN
        WITH m AS (INSERT INTO machines (machine_created_at)
                   SELECT now() + make_interval(secs => g / 1000.0)
                   FROM generate_series(1, {machines}) g RETURNING machine_id)
        INSERT INTO machine_provided (machine_id, provider, provider_id)
        SELECT machine_id, 'Static', machine_id::text FROM m;
        INSERT INTO sessions (session_id, session_component_name, session_runtime_info,
                              session_interval_seconds, session_deadline)
        VALUES ('{PGBENCH_SESSION}', 'pgbench', '', 3600, now() + interval '1 day');
        END $$""", db=name)  # fmt: skip
    server.admin("VACUUM ANALYZE", db=name)


def _prepare_templates(server: LocalPostgres, machines: int, processed: int) -> None:
    """bench_first: ``machines`` provided, none processed; bench_last: the
    oldest ``processed`` of them already have their agent started."""
    _prepare_fleet(server, "bench_first", machines)
    server.admin("CREATE DATABASE bench_last TEMPLATE bench_first")
    server.admin(f"""
        INSERT INTO machine_agent_started (machine_id, agent_started_at, agent_public_key)
        SELECT machine_id, now(), '\\x00'::bytea FROM machines
        ORDER BY machine_created_at LIMIT {processed}""", db="bench_last")  # fmt: skip
    server.admin("VACUUM ANALYZE", db="bench_last")


#: Cycles of the Go shape's best-case run: before its plan degrades.
GO_BEST_CYCLES = 200

_run_ids = iter(range(1_000_000))


def _fresh(server: LocalPostgres, template: str) -> str:
    name = f"run_{next(_run_ids)}"
    server.admin(f"CREATE DATABASE {name} TEMPLATE {template}")
    return name


def _compare_fleets(server: LocalPostgres, sizes: list[int], workers: int, cycles: int) -> None:
    """Claim+finish cycles per second of ours on fleets of ``sizes`` machines
    (none processed), and the cost per cycle of the largest over the smallest."""
    rates = {}
    for size in sizes:
        _prepare_fleet(server, f"bench_fleet_{size}", size)
        url = server.url(_fresh(server, f"bench_fleet_{size}"))
        rates[size] = trio.run(work_cycles, url, workers, cycles).rate
    print(f"{workers} workers, {cycles} claim+finish cycles per fleet\n")
    print(f"{'machines':>9}  {'cycles/s':>8}  {'cost vs smallest':>16}")
    small = min(sizes)
    for size in sizes:
        print(f"{size:>9}  {rates[size]:>8.0f}  {rates[small] / rates[size]:>16.2f}")
    large = max(sizes)
    report(
        "bmdb_work",
        f"claim+finish cost per cycle, {large} / {small} machines",
        rates[small] / rates[large],
        "<= 1.2",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--machines", type=int, default=50_000)
    parser.add_argument("--share", type=float, default=0.1, help="share processed per run")
    parser.add_argument("--workers", default="1,4,16")
    parser.add_argument(
        "--compare-machines",
        default="",
        metavar="SMALL,LARGE",
        help="instead: claim+finish cost per cycle on fleets of these sizes (e.g. 1000,100000),"
        " --compare-cycles cycles each with the largest of --workers",
    )
    parser.add_argument("--compare-cycles", type=int, default=500)
    args = parse_args(parser, {"machines": 200, "workers": "2", "compare_cycles": 20})
    worker_counts = [int(w) for w in args.workers.split(",")]
    cycles = int(args.machines * args.share)

    root = Path(tempfile.mkdtemp(prefix="bmdb-bench-"))
    server = start_with_template(root)
    try:
        if args.compare_machines:
            sizes = sorted(int(n) for n in args.compare_machines.split(","))
            if args.compare_cycles > sizes[0] // 2:
                # More would run out of machines to start on the smallest fleet.
                parser.error(f"--compare-cycles must be at most half of {sizes[0]}")
            _compare_fleets(server, sizes, max(worker_counts), args.compare_cycles)
            return
        _prepare_templates(server, args.machines, args.machines - cycles)
        ours_script = root / "ours.sql"
        ours_script.write_text(_ours_script())
        go_script = root / "go.sql"
        go_script.write_text(_GO_SCRIPT)

        go = {
            phase: _pgbench(server, _fresh(server, f"bench_{phase}"), go_script, 1, cycles)
            for phase in ("first", "last")
        }
        go_best = _pgbench(
            server, _fresh(server, "bench_first"), go_script, 1, min(GO_BEST_CYCLES, cycles)
        )
        print(
            f"{args.machines} provided machines; each run processes {cycles}"
            f" ({args.share:.0%}): the first share of a fresh fleet, or the last one.\n"
            f"Go shape, pgbench, 1 client: first {go['first'].rate:.0f}/s,"
            f" last {go['last'].rate:.0f}/s;"
            f" best case (first {min(GO_BEST_CYCLES, cycles)} cycles) {go_best.rate:.0f}/s\n"
        )
        header = (
            f"{'workers':>7}  {'phase':>5}  {'ours/s':>8}  {'wasted':>7}  {'pgbench/s':>9}"
            f"  {'pgb wasted':>10}  {'a: ours/pgb':>11}  {'b: ours/go1':>11}"
            f"  {'b: ours/go best':>15}"
        )
        print(header)
        for workers in worker_counts:
            for phase in ("first", "last"):
                ours = trio.run(
                    work_cycles, server.url(_fresh(server, f"bench_{phase}")), workers, cycles
                )
                pgb = _pgbench(
                    server, _fresh(server, f"bench_{phase}"), ours_script, workers, cycles
                )
                print(
                    f"{workers:>7}  {phase:>5}  {ours.rate:>8.0f}  {ours.wasted:>7.1%}"
                    f"  {pgb.rate:>9.0f}  {pgb.wasted:>10.1%}  {ours.rate / pgb.rate:>11.2f}"
                    f"  {ours.rate / go[phase].rate:>11.2f}"
                    f"  {ours.rate / go_best.rate:>15.2f}",
                    flush=True,
                )
                measure = f"{workers} workers, {phase} share"
                report("bmdb_work", f"{measure}: a ours/pgbench", ours.rate / pgb.rate, ">= 0.5")
                report("bmdb_work", f"{measure}: b ours/go best", ours.rate / go_best.rate, ">= 3")
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
