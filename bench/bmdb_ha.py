"""BMDB work cycles on a Patroni cluster against a single server, in one run.

    python -m bench.bmdb_ha [--machines 20000] [--cycles 2000] [--workers 16] [--rounds 1] [--smoke]

Both servers are started for the run: one `bmdb.localserver` PostgreSQL 15
and one `bmdb.localha` cluster (three members under Patroni, synchronous
replication, reached through its multi-host URL). Measured:

- **cycles/s**: N Trio workers, each in its own BMDB session, doing claim +
  finish of agent-start work (`bench.bmdb_work`'s loop) until ``cycles`` are
  done, on each server; with ``--rounds R``, R such runs on each, single and
  cluster alternating on the same databases, and the median of the R
  ratios. The ratio HA/single is what commits that wait for their WAL (and
  for the synchronous standby) and TCP cost, against a single server that
  acknowledges a commit before writing its WAL (``synchronous_commit=off``,
  `bmdb.localserver`) (goal >= 0.5).
- **failover pause**: the same workers on the cluster, restarting their
  session on any loss, while the primary's postgres is SIGKILLed: the time
  from the kill to the first finish committed by the new primary (each
  finish names the port of the server that committed it), against Patroni's
  leader TTL (goal < 2x).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from statistics import median

import trio

import bmdb
from bench.bmdb_work import work_cycles
from bench.ratios import report
from bench.smoke import parse_args
from bmdb import localha, localserver
from bmdb.errors import BMDBError, NothingToDo, WorkConflict
from bmdb.localserver import TEMPLATE_DB
from bmdb.model import Queries
from common.backoff import ExponentialBackoff, Retrier

KEY = bytes(32)
RETRY = ExponentialBackoff(initial=0.05, maximum=0.5)


async def _populate(url: str, machines: int) -> None:
    async with bmdb.open_connection(url) as conn:

        async def body(q: Queries) -> None:
            await q.execute(
                """WITH m AS (INSERT INTO machines (machine_created_at)
                              SELECT now() + make_interval(secs => g / 1000.0)
                              FROM generate_series(1, %s) g RETURNING machine_id)
                   INSERT INTO machine_provided (machine_id, provider, provider_id)
                   SELECT machine_id, 'Static', machine_id::text FROM m""",
                (machines,),
            )
            await q.execute("ANALYZE")

        await conn.transact(body, isolation=bmdb.Isolation.READ_COMMITTED)


async def _source(q: Queries) -> list[uuid.UUID]:
    machines = await q.machines_for_agent_start(1)
    if not machines:
        raise NothingToDo
    return [machines[0].machine_id]


async def _failover_pause(cluster: localha.LocalPatroni, url: str, workers: int) -> float:
    """Seconds from a SIGKILL of the primary's postgres to the first finish
    committed by the new primary, with ``workers`` working throughout."""
    commits: list[tuple[float, int]] = []  # (when, port of the committing server)
    killed: list[tuple[float, int]] = []  # (when, port of the new primary)
    warm = trio.Event()  # enough commits before the kill
    done = trio.Event()  # the new primary committed

    async with bmdb.open_connection(url, max_connections=2 * workers + 2) as conn:

        async def worker(i: int) -> None:
            retrier = Retrier(RETRY)
            while not done.is_set():
                try:
                    async with conn.session("bench-ha", f"w{i}", interval=15.0) as sess:
                        while not done.is_set():
                            try:
                                work = await sess.work(bmdb.Process.SHEPHERD_AGENT_START, _source)
                            except (NothingToDo, WorkConflict):
                                continue
                            port = 0
                            async with work:

                                async def apply(q: Queries, m: uuid.UUID = work.machine_id) -> None:
                                    nonlocal port
                                    now = datetime.datetime.now(datetime.UTC)
                                    await q.set_agent_started(m, now, KEY)
                                    [(port,)] = await q.execute("SELECT inet_server_port()")

                                await work.finish(apply)
                            commits.append((time.monotonic(), int(port)))
                            if len(commits) >= 10 * workers:
                                warm.set()
                            if killed and int(port) == killed[0][1]:
                                done.set()
                            retrier.reset()
                except BMDBError:
                    await retrier.sleep()

        async def kill_then_wait() -> None:
            await warm.wait()
            old = await trio.to_thread.run_sync(cluster.kill_primary)
            at = time.monotonic()
            new = await trio.to_thread.run_sync(cluster.wait_new_primary, old)
            killed.append((at, cluster.member(new).pg_port))
            if any(t > at and p == killed[0][1] for t, p in commits):
                done.set()

        with trio.fail_after(300):
            async with trio.open_nursery() as nursery:
                for i in range(workers):
                    nursery.start_soon(worker, i)
                nursery.start_soon(kill_then_wait)
    at, port = killed[0]
    return min(t for t, p in commits if t > at and p == port) - at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--machines", type=int, default=20_000)
    parser.add_argument("--cycles", type=int, default=2_000)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument(
        "--rounds", type=int, default=1, help="single/cluster pairs of runs (median ratio)"
    )
    args = parse_args(parser, {"machines": 400, "cycles": 100, "workers": 2})
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.cycles * args.rounds > args.machines:
        parser.error("--cycles x --rounds must not exceed --machines (each cycle takes one)")

    root = Path(tempfile.mkdtemp(prefix="bmdb-bench-ha-"))
    root.chmod(0o711)  # the servers run as user postgres, which must enter it
    single = cluster = None
    try:
        single = localserver.start_with_template(root / "single")
        cluster = localha.start_with_template(root / "ha")
        urls = {
            "single": single.create_database("bench", template=TEMPLATE_DB),
            "patroni": cluster.create_database("bench", template=TEMPLATE_DB),
        }
        for url in urls.values():
            trio.run(_populate, url, args.machines)
        print(f"{args.workers} workers, {args.cycles} claim+finish cycles on {args.machines}")
        print(f"{'round':>5}  {'single':>9}  {'patroni':>9}  {'ratio':>5}   (cycles/s)")
        ratios = []
        # Alternating, so that a burst of load from elsewhere hits both alike.
        for round_ in range(1, args.rounds + 1):
            rates = {
                name: trio.run(work_cycles, url, args.workers, args.cycles).rate
                for name, url in urls.items()
            }
            ratios.append(rates["patroni"] / rates["single"])
            print(
                f"{round_:>5}  {rates['single']:>9.0f}  {rates['patroni']:>9.0f}"
                f"  {ratios[-1]:>5.2f}",
                flush=True,
            )
        ratio = median(ratios)
        print(f"ratio patroni/single: {ratio:.2f} (median of {len(ratios)}; goal >= 0.5)")
        report("bmdb_ha", f"{args.workers} workers: patroni/single cycles", ratio, ">= 0.5")

        # The failover makes the BMDB warn about every lost connection.
        logging.getLogger("bmdb").setLevel(logging.ERROR)
        url = cluster.create_database("bench_failover", template=TEMPLATE_DB)
        trio.run(_populate, url, args.machines)
        pause = trio.run(_failover_pause, cluster, url, args.workers)
        print(
            f"failover pause: {pause:.2f} s from the primary's SIGKILL to the first commit"
            f" on the new primary; Patroni ttl {cluster.ttl} s: {pause / cluster.ttl:.2f}x"
            " (goal < 2x)"
        )
        report("bmdb_ha", "failover pause / Patroni ttl", pause / cluster.ttl, "< 2")
    finally:
        if cluster is not None:
            cluster.stop()
        if single is not None:
            single.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
