"""The operator's commands against their Go and C counterparts, in one run.

    python -m bench.cli [--runs 9] [--machines 1000] [--smoke]

Each command is a process of its own, as an operator runs it; its wall time
(spawn to exit) and CPU (user + system, from ``os.wait4``) are the median of
``--runs``, the two sides of a pair run one after the other (the machine's
load drifts):

- ``--help`` of every CLI (``metropolis``, ``metropolis owner``, ``metropolis
  node``, ``bmdb``, ``shepherd``, ``shepherd install``, ``console`` and
  bin/demo's ``python -m shepherd.demo``): CPU against 150 ms (goal: under),
  ``python -c pass`` shown beside;
- ``metropolis owner nodes`` on a three-node cluster (`metropolis.localcluster`),
  from the first node's root and from the cluster file (``owner info --out``,
  which escrows the owner's certificate first), against ``etcdctl member
  list`` on the same cluster's etcd (goal: within 4x); and from the cluster
  file with ``--keep-open`` (a session process answers the call; its CPU
  per call is added to the caller's);
- ``bmdb machines`` on ``--machines`` machines (`bench.fleet`'s fleet, taken
  over, in a private PostgreSQL) against ``psql -c`` of the query it runs
  (`bmdb.overview.machines_sql`; goal: within 4x).

Needs ``etcd``, ``etcdctl`` and PostgreSQL 15 (Debian ``etcd-server``,
``etcd-client``, ``postgresql``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import trio

from bench.fleet import Fleet, seed_fleet
from bench.ratios import report
from bench.smoke import parse_args
from bmdb import overview
from bmdb.localserver import LocalPostgres, find_postgres_bin
from metropolis.consensus.restore import etcdctl
from metropolis.localcluster import start_cluster

#: A --help may take this much CPU (issue 39), seconds.
HELP_BUDGET = 0.150

#: Every CLI's --help (argv after the interpreter).
HELPS: list[tuple[str, list[str]]] = [
    ("metropolis --help", ["-m", "metropolis", "--help"]),
    ("metropolis owner --help", ["-m", "metropolis", "owner", "--help"]),
    ("metropolis node run --help", ["-m", "metropolis", "node", "run", "--help"]),
    ("bmdb --help", ["-m", "bmdb", "--help"]),
    ("shepherd --help", ["-m", "shepherd", "--help"]),
    ("shepherd install --help", ["-m", "shepherd", "install", "--help"]),
    ("console --help", ["-m", "console", "--help"]),
    ("bin/demo --help", ["-m", "shepherd.demo", "--help"]),
]


@dataclass(frozen=True)
class Run:
    """One process: seconds of wall time (spawn to exit) and of CPU."""

    wall: float
    cpu: float


def run(argv: Sequence[str], env: dict[str, str] | None = None) -> Run:
    """Run ``argv`` (output discarded) to its end; SystemExit if it fails."""
    start = time.perf_counter()
    process = subprocess.Popen(
        list(argv), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env
    )
    assert process.stderr is not None
    err = process.stderr.read()
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    process.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        tail = err.decode(errors="replace").strip().splitlines()[-3:]
        raise SystemExit(f"bench.cli: {' '.join(argv)} failed: {' | '.join(tail)}")
    return Run(wall, usage.ru_utime + usage.ru_stime)


@dataclass(frozen=True)
class Pair:
    """Medians of ours and of the baseline, run in turns."""

    ours: Run
    base: Run


def pair(
    ours: Sequence[str],
    base: Sequence[str],
    runs: int,
    env: dict[str, str],
    ours_env: dict[str, str] | None = None,
) -> Pair:
    mine: list[Run] = []
    theirs: list[Run] = []
    for _ in range(runs):
        mine.append(run(ours, ours_env))
        theirs.append(run(base, env))
    return Pair(_median(mine), _median(theirs))


def _median(runs: list[Run]) -> Run:
    return Run(statistics.median(r.wall for r in runs), statistics.median(r.cpu for r in runs))


def helps(runs: int) -> None:
    bare = _median([run([sys.executable, "-c", "pass"]) for _ in range(runs)])
    print(f"--help, CPU (median of {runs}); python -c pass: {bare.cpu * 1000:.0f} ms")
    print(f"{'command':<30}{'CPU ms':>8}{'x pass':>8}{'/ 150 ms':>10}")
    for label, argv in HELPS:
        took = _median([run([sys.executable, *argv]) for _ in range(runs)])
        print(
            f"{label:<30}{took.cpu * 1000:>8.0f}{took.cpu / bare.cpu:>8.1f}"
            f"{took.cpu / HELP_BUDGET:>10.2f}"
        )
        report("cli", f"{label}: CPU / 150 ms", took.cpu / HELP_BUDGET, "< 1")


def _row(label: str, p: Pair, goal: str) -> None:
    print(
        f"{label:<34}{p.ours.wall * 1000:>8.0f}{p.base.wall * 1000:>8.0f}"
        f"{p.ours.wall / p.base.wall:>8.1f}{p.ours.cpu * 1000:>8.0f}{p.base.cpu * 1000:>8.0f}"
        f"{p.ours.cpu / p.base.cpu:>8.1f}"
    )
    report("cli", f"{label} (wall)", p.ours.wall / p.base.wall, goal)
    report("cli", f"{label} (CPU)", p.ours.cpu / p.base.cpu, goal)


def _header(baseline: str) -> None:
    print(f"\n{'ours / ' + baseline:<34}{'wall ms':>8}{'base':>8}{'ratio':>8}", end="")
    print(f"{'CPU ms':>8}{'base':>8}{'ratio':>8}")


async def owner_nodes(base: Path, runs: int) -> None:
    cluster = await start_cluster(base / "cluster", ("127.0.0.1", "127.0.0.2", "127.0.0.3"))
    try:
        member_list = [
            *(etcdctl(), f"--endpoints=unix://{cluster.nodes[0].etcd_socket}"),
            *("member", "list"),
        ]
        env = {**os.environ, "ETCDCTL_API": "3"}
        owner = [sys.executable, "-m", "metropolis", "owner"]
        key = ["--owner-key", str(cluster.owner_key)]
        from_root = [*owner, "--root", str(cluster.nodes[0].root.path), *key, "nodes"]
        from_file = [*owner, "--cluster", str(cluster.cluster_file), *key]
        from_file += ["--curator-port", str(cluster.curator_port), "nodes"]
        root_pair = await trio.to_thread.run_sync(pair, from_root, member_list, runs, env)
        file_pair = await trio.to_thread.run_sync(pair, from_file, member_list, runs, env)
        kept = [*from_file[:-1], "--keep-open", "300", "nodes"]
        kept_pair, session_share = await trio.to_thread.run_sync(
            kept_open, kept, member_list, runs, env, base / "runtime"
        )
    finally:
        await cluster.stop()
    _header("etcdctl member list")
    _row("owner --root nodes", root_pair, "<= 4")
    _row("owner --cluster nodes", file_pair, "<= 4")
    _row("owner --cluster --keep-open nodes", kept_pair, "<= 4")
    print(f"  (--keep-open: CPU per call includes the session's {session_share * 1000:.0f} ms)")


def kept_open(
    ours: Sequence[str], base: Sequence[str], runs: int, env: dict[str, str], runtime: Path
) -> tuple[Pair, float]:
    """`pair` for an owner call with ``--keep-open``, once its session runs
    (the first call starts it). Each call's CPU includes its share of the
    session's CPU over the runs (from /proc), so the figure is what a call
    costs the machine; returns that share too. Ends the session."""
    runtime.mkdir(mode=0o700)
    mine = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
    run(ours, mine)  # runs the call itself, then starts the session
    deadline = time.monotonic() + 60
    while not (logs := list(runtime.glob("*/*.log"))) or "(pid " not in logs[0].read_text():
        if time.monotonic() > deadline:
            raise SystemExit("bench.cli: the owner session did not start")
        time.sleep(0.05)
    pid = int(logs[0].read_text().split("(pid ", 1)[1].split(")", 1)[0])
    try:
        before = _process_cpu(pid)
        measured = pair(ours, base, runs, env, ours_env=mine)
        share = (_process_cpu(pid) - before) / runs
    finally:
        os.kill(pid, signal.SIGTERM)
    ours_run = Run(measured.ours.wall, measured.ours.cpu + share)
    return Pair(ours_run, measured.base), share


def _process_cpu(pid: int) -> float:
    """Seconds of CPU (user + system) process ``pid`` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bmdb_machines(base: Path, machines: int, runs: int) -> None:
    server = LocalPostgres(base / "postgres")
    server.create()
    server.start()
    try:
        url = server.create_database("bmdb")
        run([sys.executable, "-m", "bmdb", "--url", url, "migrate"])
        seed_fleet(url, Fleet(machines))
        sql = overview.machines_sql(overview.machines_params(limit=1000))
        psql = [str(find_postgres_bin() / "psql"), "-X", "-q", url, "-c", sql]
        ours = [sys.executable, "-m", "bmdb", "--url", url, "machines"]
        machines_pair = pair(ours, psql, runs, dict(os.environ))
    finally:
        server.stop()
    _header("psql -c (its query)")
    _row(f"bmdb machines ({machines})", machines_pair, "<= 4")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cli", description=__doc__)
    parser.add_argument("--runs", type=int, default=9, help="runs of each command (9)")
    parser.add_argument("--machines", type=int, default=1000, help="BMDB machines (1000)")
    args = parse_args(parser, {"runs": 1, "machines": 20}, argv)
    base = Path(tempfile.mkdtemp(prefix="bench-cli-"))
    # The postgres user runs the server when we are root: it must reach it.
    base.chmod(0o711)
    try:
        helps(args.runs)
        trio.run(owner_nodes, base, args.runs)
        bmdb_machines(base, args.machines, args.runs)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
