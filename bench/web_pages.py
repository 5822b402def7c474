"""The web UI's pages and the metrics' fleet query with 50,000 machines.

    python -m bench.web_pages [--machines 50000] [--requests 30] [--smoke]

For each page, **server time** is the handler time the UI reports in its
``Server-Timing`` header (queries, their round trips, rendering), median
over ``--requests`` sequential requests; **SQL alone** is the statements
that page runs per request, each in a REPEATABLE READ transaction as the
page runs it, through ``pgbench -M prepared`` against the same database
(average latency, one client). The ratio server/SQL is the cost of
everything that is not the database (goal <= 2 for the machines list);
the page of failed machines has a goal of its own, under 50 ms of server
time at 100,000 machines (``--machines 100000``).

The machine list's counts per state are not run per request: the UI takes
them at most once per period and shares them (`console.counts`; 5 s, so
within one page's requests here, after the warm-up request, they are
reused). Their statement is timed on its own (**counts, once per
period**), and is in no page's baseline: a baseline that held it would
hide the cost of the page behind a fleet scan the page does not make.
**first ms** is the handler time of each page's first request (not in the
median): the machine list's takes its counts there. The pgbench script has the
parameters written in as literals, so its plans are custom plans; ours are
sent as parameters. The metrics' fleet statement is timed the same way
(goal: under 100 ms of database time per scrape).

The fleet: every machine provided; a third with the agent started, a
quarter of those heartbeating; 5% failed once with a one-day backoff
(history Started, Failed); the rest of the started ones have Started,
Finished in their history.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import trio

import bmdb
from bench.ratios import report
from bench.smoke import parse_args
from bmdb import overview
from bmdb.localserver import LocalPostgres, find_postgres_bin
from bmdb.metrics import FLEET_SQL
from console.server import serve

DB = "bench_web"

_POPULATE = """
INSERT INTO machines (machine_created_at)
SELECT now() - interval '1 day' + make_interval(secs => g / 100.0) FROM generate_series(1, {n}) g;
INSERT INTO machine_provided (machine_id, provider, provider_id, provider_address)
SELECT machine_id, 'Static', 'static-' || row_number() OVER (ORDER BY machine_created_at),
       '10.' || (random() * 255)::int || '.' || (random() * 255)::int || '.1'
FROM machines;
CREATE TEMP TABLE numbered AS
SELECT machine_id, row_number() OVER (ORDER BY machine_created_at) AS n FROM machines;
INSERT INTO machine_agent_started (machine_id, agent_started_at, agent_public_key)
SELECT machine_id, now() - interval '2 hours', '\\x00'::bytea FROM numbered WHERE n % 3 = 0;
INSERT INTO machine_agent_heartbeat (machine_id, agent_heartbeat_at)
SELECT machine_id, now() FROM numbered WHERE n % 12 = 0;
INSERT INTO work_history (machine_id, process, event, at, cause)
SELECT machine_id, 'ShepherdAgentStart', e.event::work_history_event,
       now() - interval '3 hours' + make_interval(secs => n / 10.0 + e.o), e.cause
FROM numbered, LATERAL (VALUES ('Started', 0, NULL), ('Finished', 1, NULL)) e(event, o, cause)
WHERE n % 3 = 0;
INSERT INTO work_history (machine_id, process, event, at, cause)
SELECT machine_id, 'ShepherdAgentStart', e.event::work_history_event,
       now() - interval '1 hour' + make_interval(secs => n / 100.0 + e.o), e.cause
FROM numbered,
     LATERAL (VALUES ('Started', 0, NULL), ('Failed', 1, 'ssh: connection refused'))
         e(event, o, cause)
WHERE n % 20 = 1;
INSERT INTO work_backoff (machine_id, process, until, cause, last_interval_seconds)
SELECT machine_id, 'ShepherdAgentStart', now() + interval '1 day', 'ssh: connection refused', 86400
FROM numbered WHERE n % 20 = 1;
ANALYZE;
"""


def _literal(value: object) -> str:
    if value is None:
        return "NULL"
    text = str(value).replace("'", "''")
    return f"'{text}'"


def _bind(sql: str, params: dict[str, object]) -> str:
    """bmdb's SQL with its %(name)s parameters written in as literals."""
    for name, value in params.items():
        sql = sql.replace(f"%({name})s", _literal(value))
    sql = sql.replace("%s", _literal(params.get("%s")))
    assert "%(" not in sql, sql
    return " ".join(sql.split())


def pgbench_ms(
    server: LocalPostgres, statements: list[str], requests: int, root: Path, db: str = DB
) -> float:
    """Average latency in ms of ``statements`` in one REPEATABLE READ transaction
    (``requests`` times, one client) in database ``db``."""
    script = root / "page.sql"
    body = "".join(f"{s};\n" for s in statements)
    script.write_text(f"BEGIN ISOLATION LEVEL REPEATABLE READ;\n{body}COMMIT;\n")
    out = subprocess.run(
        [
            str(find_postgres_bin() / "pgbench"), "-n", "-M", "prepared", "-c", "1",
            "-t", str(requests), "-f", str(script),
            "-h", str(server.socket_dir), "-p", str(server.port), "-U", "postgres", db,
        ],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    match = re.search(r"latency average = ([\d.]+) ms", out.stdout)
    assert match, out.stdout
    return float(match[1])


def _app_ms(r: httpx.Response) -> float:
    return float(r.headers["server-timing"].removeprefix("app;dur="))


async def server_ms(
    client: httpx.AsyncClient, path: str, requests: int
) -> tuple[float, float, float]:
    """Median handler ms (Server-Timing) and median wall ms per request of
    ``path``, and the handler ms of the first request (which warms prepared
    statements, plans and caches: the machine list takes its counts there)."""
    first = _app_ms(await client.get(path))
    app, wall = [], []
    for _ in range(requests):
        started = time.perf_counter()
        r = await client.get(path)
        wall.append((time.perf_counter() - started) * 1000)
        assert r.status_code == 200, (path, r.status_code, r.text[:300])
        app.append(_app_ms(r))
    return statistics.median(app), statistics.median(wall), first


def machines_page_sql(size: int, **kw: object) -> list[str]:
    """The statement the machine list's page of ``size`` machines runs per
    request (filters ``kw`` as `overview.machines_params` takes them),
    parameters written in: its rows; not its counts (`counts_sql`)."""
    params = overview.machines_params(limit=size + 1, **kw)  # type: ignore[arg-type]
    return [_bind(overview.machines_sql(params), params)]


def counts_sql(provider: object = None) -> list[str]:
    """The machine list's count statement (run at most once per period)."""
    return [_bind(overview.STATE_COUNTS_SQL, {"provider": provider})]


def machine_page_sql(machine_id: object) -> list[str]:
    """The statements of one machine's page, parameters written in."""
    detail = overview.detail_params(uuid.UUID(str(machine_id)))
    audit = {"machine": machine_id, "before": None, "limit": overview.MAX_AUDIT}
    return [
        _bind(overview.DETAIL_SQL, detail),
        _bind(overview.HISTORY_SQL, {"%s": machine_id}),
        _bind(overview.AUDIT_SQL, audit),
    ]


async def fleet_query_ms(
    conn: bmdb.Connection, server: LocalPostgres, requests: int, root: Path, db: str = DB
) -> tuple[float, float]:
    """The metrics' fleet query, median ms from bmdb (`FleetGauges.update`) and
    average ms in pgbench, over ``requests`` runs each."""
    from bmdb.metrics import FleetGauges

    gauges = FleetGauges(conn)
    durations = []
    for _ in range(requests):
        await gauges.update()
        durations.append(gauges.duration * 1000)
    fleet_sql = await trio.to_thread.run_sync(
        functools.partial(pgbench_ms, server, [" ".join(FLEET_SQL.split())], requests, root, db)
    )
    return statistics.median(durations), fleet_sql


async def _measure(server: LocalPostgres, root: Path, requests: int) -> None:
    url = server.url(DB)
    async with bmdb.open_connection(url, max_connections=4) as conn:
        everything = await overview.machines(conn, limit=100_000)
        middle = everything[len(everything) // 2].machine_id
        failed = next(m.machine_id for m in everything if m.state == "failed")
        size = 100
        pages: list[tuple[str, str, list[str]]] = []

        def machines_page(name: str, path: str, **kw: object) -> None:
            pages.append((name, path, machines_page_sql(size, **kw)))

        machines_page("machines, first page", "/machines")
        machines_page("machines, middle page", f"/machines?after={middle}", after=middle)
        machines_page("machines, failed", "/machines?state=failed", state="failed")
        pages.append(("machine page", f"/machine/{failed}", machine_page_sql(failed)))

        async with trio.open_nursery() as nursery:
            [base] = await nursery.start(serve, conn, "127.0.0.1:0")
            async with httpx.AsyncClient(base_url=base, timeout=60) as client:
                print(
                    f"{len(everything)} machines, {requests} requests per page"
                    f" (load average {_load_average()})\n"
                )
                header = (
                    f"{'page':<24} {'server ms':>10} {'wall ms':>8} {'SQL ms':>7} {'ratio':>6}"
                    f" {'first ms':>9}"
                )
                print(header)
                for name, path, sql in pages:
                    app_ms, wall_ms, first_ms = await server_ms(client, path, requests)
                    sql_ms = pgbench_ms(server, sql, requests, root)
                    ratio = app_ms / sql_ms
                    print(
                        f"{name:<24} {app_ms:>10.2f} {wall_ms:>8.2f} {sql_ms:>7.2f} {ratio:>6.2f}"
                        f" {first_ms:>9.2f}"
                    )
                    goal = "<= 2" if name.startswith("machines") else ""
                    report("web_pages", f"{name}: server / SQL time", ratio, goal)
                    if name == "machines, failed":
                        report("web_pages", f"{name}: server ms / 50 ms", app_ms / 50, "< 1")
            nursery.cancel_scope.cancel()

        counts_ms = pgbench_ms(server, counts_sql(), requests, root)
        print(f"\nmachine list's counts, once per period: {counts_ms:.2f} ms in pgbench")
        ours, fleet_sql = await fleet_query_ms(conn, server, requests, root)
        print(
            f"metrics fleet query: {fleet_sql:.2f} ms in pgbench, {ours:.2f} ms from bmdb"
            f" (goal: under 100 ms of database time)"
        )
        report("web_pages", "fleet query DB ms / 100 ms budget", fleet_sql / 100, "< 1")
        print(f"load average at the end: {_load_average()}")


def _load_average() -> str:
    """The machine's 1, 5 and 15 minute load averages (it is shared: the
    ratios are what count)."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--machines", type=int, default=50_000)
    parser.add_argument("--requests", type=int, default=30)
    args = parse_args(parser, {"machines": 100, "requests": 1})
    root = Path(tempfile.mkdtemp(prefix="bench-web-"))
    root.chmod(0o755)  # the server may run as the postgres user
    server = LocalPostgres(root / "pg")
    try:
        server.create()
        server.start()
        try:
            server.admin(f"CREATE DATABASE {DB}")
            trio.run(_migrate, server.url(DB))
            started = time.perf_counter()
            _populate(server, args.machines)
            print(f"populated in {time.perf_counter() - started:.1f} s")
            trio.run(_measure, server, root, args.requests)
        finally:
            server.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def _migrate(url: str) -> None:
    async with bmdb.open_connection(url, migrate=True, max_connections=1):
        pass


def _populate(server: LocalPostgres, machines: int) -> None:
    import psycopg

    with psycopg.connect(server.url(DB), autocommit=True) as conn:
        conn.execute(_POPULATE.format(n=machines).encode())


if __name__ == "__main__":
    main()
