"""What heartbeats cost the BMDB per machine and day: table, index and WAL bytes, HOT ratio.

    python -m bench.growth [--machines 10000] [--interval 10] [--window 60]
                           [--batch 64] [--smoke]

Each run starts a PostgreSQL 15 of its own (`bmdb.localserver`, which
runs with ``full_page_writes=off``: the full-page images a production
server writes after each checkpoint are NOT in these figures; checkpoints
happen only where this benchmark asks for them). ``--machines`` machines are
created with a started agent each (setup, in bulk SQL), then one
heartbeat per machine per ``--interval`` seconds is applied for
``--window`` seconds, through the agent callback server's own statement
(`bmdb.Queries.record_agent_heartbeats_pending`, READ COMMITTED, groups of
``--batch`` machines in machine-id order, as the server commits them).
A CHECKPOINT starts the window; the first round's WAL beyond a steady
round's is what a checkpoint costs (full-page images, were they on).

A heartbeat that crosses into the next 5 minutes of the clock also moves
its machine's ``agent_seen_floor`` (migration 0007: a non-HOT update of
``machine_agent_started``, by trigger). After the window every heartbeat
is moved back 5 minutes and one more round is measured: its WAL and size
beyond a steady round's are what one crossing costs, paid once per
machine every 5 minutes, and added to the day's figures.

It runs twice in one process, each time in a fresh database: with the
heartbeat table at fill factor 100 (PostgreSQL's default) and at the
migrated 50 (migration 0002). For each it prints the deltas of
``pg_total_relation_size`` (table, its indexes, TOAST) of the
heartbeat-written tables, WAL bytes (``pg_current_wal_lsn``) and full-page
images (``pg_stat_wal``), HOT updates over updates and dead tuples
(``pg_stat_user_tables``), then per machine and day, and for 100,000
machines a day. WAL per day is projected as the steady rounds' bytes per
heartbeat times the day's heartbeats, plus the first round's extra (the
full-page images) once per checkpoint at the default ``checkpoint_timeout``
of 5 minutes.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import trio

import bmdb
from bench.ratios import report
from bench.smoke import parse_args
from bmdb import Isolation, Queries
from bmdb.connection import migrate
from bmdb.localserver import TEMPLATE_DB, LocalPostgres
from bmdb.model import AgentHeartbeat

#: The heartbeat path's tables (heartbeat row; the hardware report comes
#: with the first heartbeat only, so its table does not grow here).
TABLES = ("machine_agent_heartbeat", "machine_hardware_report", "machine_agent_started")
#: Width of the recovery source's floor (migration 0007), seconds.
FLOOR = 300.0
DAY = 86400.0
FLEET = 100_000
#: PostgreSQL's default checkpoint_timeout, seconds.
CHECKPOINT_TIMEOUT = 300.0
KEY = bytes(range(32))


@dataclass
class Snapshot:
    sizes: dict[str, int]
    lsn: int
    fpi: int
    upd: int
    hot: int
    dead: int


async def _snapshot(conn: bmdb.Connection) -> Snapshot:
    async def fn(q: Queries) -> Snapshot:
        sizes = {
            t: int((await q.execute("SELECT pg_total_relation_size(%s::regclass)", (t,)))[0][0])
            for t in TABLES
        }
        ((lsn, fpi),) = await q.execute(
            "SELECT pg_current_wal_lsn() - '0/0'::pg_lsn, wal_fpi FROM pg_stat_wal"
        )
        ((upd, hot, dead),) = await q.execute(
            """SELECT n_tup_upd, n_tup_hot_upd, n_dead_tup FROM pg_stat_user_tables
               WHERE relname = 'machine_agent_heartbeat'"""
        )
        return Snapshot(sizes, int(lsn), int(fpi), int(upd), int(hot), int(dead))

    return await conn.transact(fn, isolation=Isolation.READ_COMMITTED)


@dataclass
class Result:
    fillfactor: int
    heartbeats: int
    seconds: float
    table_bytes: int
    first_round_wal: int
    steady_wal: int
    steady_beats: int
    fpi: int
    hot_ratio: float
    dead: int
    #: One floor crossing of every machine: WAL and size beyond a steady round.
    crossing_wal: int
    crossing_bytes: int

    def wal_per_beat(self) -> float:
        return self.steady_wal / max(self.steady_beats, 1)

    def fpi_extra(self) -> float:
        """The first round's WAL beyond a steady round's: what a checkpoint costs."""
        per_round = self.wal_per_beat() * (self.heartbeats - self.steady_beats)
        return max(self.first_round_wal - per_round, 0.0)


async def _run(url: str, args: argparse.Namespace, fillfactor: int) -> Result:
    n = int(args.machines)
    async with bmdb.open_connection(url, max_connections=2) as conn:

        async def setup(q: Queries) -> list[uuid.UUID]:
            await q.execute(
                f"ALTER TABLE machine_agent_heartbeat SET (fillfactor = {fillfactor:d})"
            )
            rows = await q.execute(
                """WITH m AS (INSERT INTO machines SELECT FROM generate_series(1, %s)
                              RETURNING machine_id)
                   INSERT INTO machine_agent_started SELECT machine_id, now(), %s FROM m
                   RETURNING machine_id""",
                (n, KEY),
            )
            return sorted((r[0] for r in rows), key=lambda m: m.int)

        machines = await conn.transact(setup, isolation=Isolation.READ_COMMITTED)
        time_ns = 1

        async def round_(reports: bool) -> int:
            nonlocal time_ns
            time_ns += 1
            start = trio.current_time()
            for i in range(0, n, args.batch):
                beats = [
                    AgentHeartbeat(m, KEY, time_ns, b"hw" * 200 if reports else None)
                    for m in machines[i : i + args.batch]
                ]

                async def record(q: Queries, beats: list[AgentHeartbeat] = beats) -> None:
                    await q.record_agent_heartbeats_pending(beats)

                await conn.transact(record, isolation=Isolation.READ_COMMITTED)
                await trio.sleep_until(start + args.interval * min(i + args.batch, n) / n)
            return n

        # The agent's first heartbeat (with its hardware report): outside the window.
        await round_(True)

        async def checkpoint(q: Queries) -> None:
            await q.execute("CHECKPOINT")

        await conn.transact(checkpoint, isolation=Isolation.READ_COMMITTED)
        await trio.sleep(1.5)  # statistics flushed
        before = await _snapshot(conn)
        t0 = trio.current_time()
        beats = await round_(False)
        after_first = await _snapshot(conn)
        rounds = max(1, math.ceil(args.window / args.interval) - 1)
        for _ in range(rounds):
            beats += await round_(False)
        seconds = trio.current_time() - t0
        await trio.sleep(1.5)
        after = await _snapshot(conn)

        async def backdate(q: Queries) -> None:
            await q.execute(
                "UPDATE machine_agent_heartbeat"
                " SET agent_heartbeat_at = agent_heartbeat_at - interval '5 minutes'"
            )

        await conn.transact(backdate, isolation=Isolation.READ_COMMITTED)
        before_crossing = await _snapshot(conn)
        await round_(False)
        after_crossing = await _snapshot(conn)
    upd = after.upd - before.upd
    steady_per_beat = (after.lsn - after_first.lsn) / max(beats - n, 1)
    return Result(
        fillfactor=fillfactor,
        heartbeats=beats,
        seconds=seconds,
        table_bytes=sum(after.sizes.values()) - sum(before.sizes.values()),
        first_round_wal=after_first.lsn - before.lsn,
        steady_wal=after.lsn - after_first.lsn,
        steady_beats=beats - n,
        fpi=after.fpi - before.fpi,
        hot_ratio=(after.hot - before.hot) / upd if upd else 0.0,
        dead=after.dead,
        crossing_wal=max(int(after_crossing.lsn - before_crossing.lsn - steady_per_beat * n), 0),
        crossing_bytes=sum(after_crossing.sizes.values()) - sum(before_crossing.sizes.values()),
    )


def _print(r: Result, args: argparse.Namespace) -> tuple[float, float]:
    machine_days = r.heartbeats * args.interval / DAY
    beats_per_day = DAY / args.interval
    crossings_per_day = DAY / FLOOR
    crossing_day = r.crossing_wal / args.machines * crossings_per_day
    wal_day = (
        r.wal_per_beat() * beats_per_day
        + r.fpi_extra() / args.machines * (DAY / CHECKPOINT_TIMEOUT)
        + crossing_day
    )
    table_day = r.table_bytes / machine_days
    print(f"--- fillfactor {r.fillfactor}: {r.heartbeats} heartbeats in {r.seconds:.1f}s")
    print(f"  HOT updates / updates:         {r.hot_ratio:.3f}")
    print(f"  dead tuples at the end:        {r.dead}")
    print(f"  table+index+toast growth:      {r.table_bytes} bytes")
    print(f"  WAL per heartbeat (steady):    {r.wal_per_beat():.1f} bytes")
    print(f"  WAL of a checkpoint's FPIs:    {r.fpi_extra():.0f} bytes ({r.fpi} FPIs)")
    print(
        f"  floor crossing (every {FLOOR:g}s): WAL {r.crossing_wal / args.machines:.0f} B,"
        f" size {r.crossing_bytes} B for {args.machines} machines;"
        f" {crossing_day / 1e3:.1f} kB WAL per machine-day"
    )
    print(f"  per machine-day: table {table_day:.0f} B, WAL {wal_day / 1e6:.2f} MB")
    print(
        f"  100,000 machines a day: table {table_day * FLEET / 1e6:.1f} MB, "
        f"WAL {wal_day * FLEET / 1e9:.1f} GB"
    )
    return r.hot_ratio, wal_day


async def _main(args: argparse.Namespace, server: LocalPostgres) -> None:
    results = []
    for i, fillfactor in enumerate((100, 50)):
        url = server.create_database(f"growth{i}", template=TEMPLATE_DB)
        results.append(await _run(url, args, fillfactor))
    print(
        f"{args.machines} machines, one heartbeat per {args.interval:g}s, "
        f"window {args.window:g}s, groups of {args.batch}"
    )
    (hot100, wal100), (hot50, wal50) = (_print(r, args) for r in results)
    print(f"HOT ratio ff50/ff100: {hot50 / hot100 if hot100 else math.inf:.2f}")
    print(f"WAL per machine-day ff50/ff100: {wal50 / wal100:.2f}")
    report("growth", "HOT ratio ff50/ff100", hot50 / hot100 if hot100 else float(hot50 > 0), ">= 1")
    report("growth", "WAL per machine-day ff50/ff100", wal50 / wal100, "<= 1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--machines", type=int, default=10_000)
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between heartbeats")
    parser.add_argument("--window", type=float, default=60.0, help="seconds measured")
    parser.add_argument("--batch", type=int, default=64, help="heartbeats per transaction")
    args = parse_args(parser, {"machines": 200, "interval": 0.5, "window": 1.5})
    with tempfile.TemporaryDirectory(prefix="bench-growth-") as tmp:
        server = LocalPostgres(Path(tmp))
        server.create()
        server.start()
        try:
            server.admin(f"CREATE DATABASE {TEMPLATE_DB}")
            trio.run(migrate, server.url(TEMPLATE_DB))
            server.admin("ALTER SYSTEM SET checkpoint_timeout = '1h'")
            server.admin("SELECT pg_reload_conf()")
            trio.run(_main, args, server)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
