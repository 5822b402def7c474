"""Eight worker processes on the HA BMDB through two crashes of the
primary's postgres and one planned switchover: every machine is finished
exactly once, no two holds of one machine overlap, no heartbeat the BMDB
accepted from an agent is lost, and the workers carry on without an
operator. Prints, per fault, the time from the primary's loss to
the first commit on the new primary.

``BMDB_FAILOVER_MACHINES`` sets the fleet's size: 2000 by default, the
figure the HA BMDB is held to (a smaller fleet shortens a local run). The
worker processes hold each machine `HOLD` seconds, so that the run
outlasts the three faults (asserted).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path

import pytest
import trio

import bmdb
from bmdb.errors import DatabaseUnavailable
from bmdb.localha import LocalPatroni
from bmdb.model import HeartbeatOutcome, Queries
from common.backoff import ExponentialBackoff, Retrier
from tests.bmdb.helpers import KEY, bulk_provided_machines, outcome_counts

logger = logging.getLogger("tests.bmdb.failover_workers")

MACHINES = int(os.environ.get("BMDB_FAILOVER_MACHINES", "2000"))
PROCESSES = 8
#: Seconds a worker holds each machine (its stand-in for real work): 2000
#: machines take 25 s of holds over the eight workers. The last fault starts
#: at half of them, once the cluster is healthy again after the switchover,
#: which took under 5 s here (each failover took 2.5-4 s to its first
#: commit), so 12 s of holds are still to come when it does.
HOLD = 0.1
#: Session interval: longer than a failover, as a deployment would set it.
INTERVAL = 15.0
#: Progress (fraction of machines tagged) at which each fault starts, once
#: the cluster is healthy again after the one before.
WORKER = [sys.executable, "-m", "tests.bmdb.ha_worker"]
ARGS = [str(HOLD), str(INTERVAL)]
FAULTS = [(0.1, "kill"), (0.3, "switchover"), (0.5, "kill")]


#: How many started agents send heartbeats during the run.
BEATING = 8
RETRY = ExponentialBackoff(initial=0.05, maximum=0.5)


async def _started_agents(q: Queries) -> list[uuid.UUID]:
    rows = await q.execute(
        "SELECT machine_id FROM machine_agent_started ORDER BY machine_id LIMIT %s", (BEATING,)
    )
    return [r[0] for r in rows]


async def _stored_beats(q: Queries) -> dict[uuid.UUID, int]:
    rows = await q.execute("SELECT machine_id, agent_request_time_ns FROM machine_agent_heartbeat")
    return {r[0]: int(r[1]) for r in rows}


@pytest.mark.slow
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
        faults_done.set()

    #: machine -> request time (ns) of its last heartbeat the BMDB accepted.
    acked_beats: dict[uuid.UUID, int] = {}
    faults_done = trio.Event()

    async def beat_agents() -> None:
        """The agent callback server's part: heartbeats of agents already
        started, recorded throughout the faults, each retried on loss."""
        retrier = Retrier(RETRY)
        async with bmdb.open_connection(ha_bmdb_url) as beater:
            while not faults_done.is_set():
                try:
                    started = await beater.transact(_started_agents)
                    for machine in started:
                        sent = time.time_ns()

                        async def beat(q: Queries, m: uuid.UUID = machine, t: int = sent) -> bool:
                            outcome = await q.record_agent_heartbeat(m, KEY, t)
                            return outcome is HeartbeatOutcome.ACCEPTED

                        if await beater.transact(beat, isolation=bmdb.Isolation.READ_COMMITTED):
                            acked_beats[machine] = sent
                    retrier.reset()
                    await trio.sleep(0.05)
                except DatabaseUnavailable:
                    await retrier.sleep()

    outs = [tmp_path / f"w{i}.json" for i in range(PROCESSES)]
    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            procs = [
                await trio.lowlevel.open_process([*WORKER, ha_bmdb_url, f"w{i}", str(out), *ARGS])
                for i, out in enumerate(outs)
            ]
            nursery.start_soon(run_faults)
            nursery.start_soon(beat_agents)
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
        after = [end for _, _, end, by in holds if by == port and end > at]
        assert after, f"no commit on the new primary after the {kind} (workers done too soon?)"
        first = min(after)
        print(f"\n{kind} of {old}: the first commit on the new primary {first - at:.2f} s later")

    async with bmdb.open_connection(ha_bmdb_url) as conn:
        counts = await outcome_counts(conn)
        stored_beats = await conn.transact(_stored_beats)
    # Every heartbeat the BMDB accepted is there (or a later one is).
    assert acked_beats
    lost = [m for m, t in acked_beats.items() if stored_beats.get(m, 0) < t]
    assert not lost, f"{len(lost)} acknowledged heartbeats lost"
    assert counts["machines"] == counts["tagged"] == MACHINES
    assert counts["finished"] == counts["finished_once"] == MACHINES
    assert counts["work"] == 0
    assert counts["mirror_off"] == 0
    await trio.to_thread.run_sync(patroni_cluster.wait_healthy)
