"""Eight worker processes on the HA BMDB through two crashes of the
primary's postgres and one planned switchover: every machine is finished
exactly once, no two holds of one machine overlap, and the workers carry on
without an operator. Prints, per fault, the time from the primary's loss to
the first commit on the new primary.

``BMDB_FAILOVER_MACHINES`` sets the fleet's size: 600 by default, to keep
the suite's time down (the faults, each waited out until the cluster is
healthy again, take most of it); 2000 is the issue's figure. The worker
processes hold each machine `HOLD` seconds, so that the run outlasts the
three faults (asserted).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import trio

import bmdb
from bmdb.errors import DatabaseUnavailable
from bmdb.localha import LocalPatroni
from tests.bmdb.helpers import bulk_provided_machines, outcome_counts

logger = logging.getLogger("tests.bmdb.failover_workers")

MACHINES = int(os.environ.get("BMDB_FAILOVER_MACHINES", "600"))
PROCESSES = 8
#: Seconds a worker holds each machine (its stand-in for real work).
HOLD = 0.1
#: Session interval: longer than a failover, as a deployment would set it.
INTERVAL = 15.0
#: Progress (fraction of machines tagged) at which each fault starts, once
#: the cluster is healthy again after the one before.
WORKER = [sys.executable, "-m", "tests.bmdb.ha_worker"]
ARGS = [str(HOLD), str(INTERVAL)]
FAULTS = [(0.15, "kill"), (0.4, "switchover"), (0.65, "kill")]


async def test_eight_workers_through_two_kills_and_a_switchover(
    ha_bmdb_url: str, patroni_cluster: LocalPatroni, tmp_path: Path
) -> None:
    async with bmdb.open_connection(ha_bmdb_url) as conn:
        await bulk_provided_machines(conn, MACHINES)
    faults: list[tuple[str, str, float, int]] = []  # (kind, old primary, at, new port)

    async def run_faults() -> None:
        async with bmdb.open_connection(ha_bmdb_url) as observer:
            for fraction, kind in FAULTS:
                while True:
                    try:
                        tagged = (await outcome_counts(observer))["tagged"]
                    except DatabaseUnavailable:
                        tagged = 0
                    if tagged >= fraction * MACHINES:
                        break
                    await trio.sleep(0.2)
                old = await trio.to_thread.run_sync(patroni_cluster.wait_healthy)
                at = time.monotonic()
                if kind == "kill":
                    await trio.to_thread.run_sync(patroni_cluster.kill_primary)
                else:
                    await trio.to_thread.run_sync(patroni_cluster.switchover)
                logger.info("%s of %s at %d tagged", kind, old, tagged)
                new = await trio.to_thread.run_sync(patroni_cluster.wait_new_primary, old)
                faults.append((kind, old, at, patroni_cluster.member(new).pg_port))

    outs = [tmp_path / f"w{i}.json" for i in range(PROCESSES)]
    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            procs = [
                await trio.lowlevel.open_process([*WORKER, ha_bmdb_url, f"w{i}", str(out), *ARGS])
                for i, out in enumerate(outs)
            ]
            nursery.start_soon(run_faults)
            try:
                for proc in procs:
                    await proc.wait()
            finally:
                for proc in procs:
                    if proc.returncode is None:
                        proc.kill()
                        await proc.wait()
    assert [p.returncode for p in procs] == [0] * PROCESSES

    reports = [json.loads(out.read_text()) for out in outs]
    holds = [tuple(h) for r in reports for h in r["holds"]]
    # Every fault happened while the workers ran, each from a live primary.
    assert [f[0] for f in faults] == [kind for _, kind in FAULTS]

    by_machine: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for machine, start, end, _port in holds:
        by_machine[machine].append((start, end))
    overlapping = [
        m
        for m, spans in by_machine.items()
        if any(b[0] < a[1] for a, b in zip(sorted(spans), sorted(spans)[1:], strict=False))
    ]
    assert not overlapping, f"{len(overlapping)} machines held twice at once"

    for kind, old, at, port in faults:
        first = min(end for _, _, end, by in holds if by == port and end > at)
        print(f"\n{kind} of {old}: the first commit on the new primary {first - at:.2f} s later")

    async with bmdb.open_connection(ha_bmdb_url) as conn:
        counts = await outcome_counts(conn)
    assert counts["machines"] == counts["tagged"] == MACHINES
    assert counts["finished"] == counts["finished_once"] == MACHINES
    assert counts["work"] == 0
    assert counts["mirror_off"] == 0
    await trio.to_thread.run_sync(patroni_cluster.wait_healthy)
