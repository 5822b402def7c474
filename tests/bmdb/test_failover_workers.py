"""Eight worker processes on the HA BMDB through three faults: a crash of
the primary's postgres, a SIGKILL of the next primary's Patroni (its
postgres runs on, writable, while another member is promoted: the case the
proxy fences, `bmdb.localha`), and a planned switchover. Every machine is
finished exactly once, no two holds of one machine overlap, no heartbeat
the BMDB accepted from an agent is lost, the workers carry on without an
operator, and none is without a session for longer than two session
intervals once the new leader is up. Prints, per fault, the time from the
primary's loss to the first commit on the new primary.

A run whose work stops moving for `STALL` seconds fails at once, saying
how far it got (before the fencing, the Patroni kill stalled it for good).

``BMDB_FAILOVER_MACHINES`` sets the fleet's size: 2000 by default, the
figure the HA BMDB is held to (a smaller fleet shortens a local run). The
worker processes hold each machine `HOLD` seconds, so that the run
outlasts the three faults (asserted).
"""

from __future__ import annotations

import contextlib
import itertools
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
FAULTS = [(0.1, "kill"), (0.3, "kill-patroni"), (0.5, "switchover")]
#: Seconds without a machine tagged after which the run has stalled: far
#: more than a failover takes (Patroni's ttl, 20 s, for the Patroni kill).
STALL = 120.0


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


async def _open_observer(url: str, *, task_status: trio.TaskStatus[bmdb.Connection]) -> None:
    """A connection for the watchers, open until cancelled."""
    async with bmdb.open_connection(url) as observer:
        task_status.started(observer)
        await trio.sleep_forever()


@pytest.mark.slow
async def test_eight_workers_through_a_kill_a_patroni_kill_and_a_switchover(
    ha_bmdb_url: str, patroni_cluster: LocalPatroni, tmp_path: Path
) -> None:
    async with bmdb.open_connection(ha_bmdb_url) as conn:
        await bulk_provided_machines(conn, MACHINES)
    # (kind, old primary, at, new port, new leader up at)
    faults: list[tuple[str, str, float, int, float]] = []
    progress: dict[str, float] = {"tagged": 0, "at": time.monotonic()}
    orphans: list[str] = []

    async def watch_progress(observer: bmdb.Connection) -> None:
        while True:
            tagged: float = progress["tagged"]
            with contextlib.suppress(DatabaseUnavailable):
                tagged = (await outcome_counts(observer))["tagged"]
            if tagged > progress["tagged"]:
                progress.update(tagged=tagged, at=time.monotonic())
            stalled = time.monotonic() - progress["at"]
            assert stalled < STALL, (
                f"work stalled: {progress['tagged']} of {MACHINES} machines tagged,"
                f" none more for {stalled:.0f} s (faults so far: {[f[0] for f in faults]})"
            )
            await trio.sleep(0.2)

    async def run_faults() -> None:
        for fraction, kind in FAULTS:
            while progress["tagged"] < fraction * MACHINES:  # noqa: ASYNC110 (set by a poller)
                await trio.sleep(0.2)
            old = await trio.to_thread.run_sync(patroni_cluster.wait_healthy)
            at = time.monotonic()
            if kind == "kill":
                await trio.to_thread.run_sync(patroni_cluster.kill_primary)
            elif kind == "kill-patroni":
                await trio.to_thread.run_sync(patroni_cluster.kill_patroni)
            else:
                await trio.to_thread.run_sync(patroni_cluster.switchover)
            logger.info("%s of %s at %d tagged", kind, old, progress["tagged"])
            new = await trio.to_thread.run_sync(patroni_cluster.wait_new_primary, old)
            up = time.monotonic()
            faults.append((kind, old, at, patroni_cluster.member(new).pg_port, up))
            if kind == "kill-patroni":
                # Its postgres runs on, writable, for the rest of the run:
                # nothing may reach it (the fence) and nothing may wait on it.
                orphans.append(old)
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
            observer = await nursery.start(_open_observer, ha_bmdb_url)
            nursery.start_soon(watch_progress, observer)
            nursery.start_soon(run_faults)
            nursery.start_soon(beat_agents)
            try:
                for proc in procs:
                    await proc.wait()
                nursery.cancel_scope.cancel()
            finally:
                # Every worker is killed before any wait: a failed run is
                # cancelled here, and its first wait would end the loop.
                for proc in procs:
                    if proc.returncode is None:
                        proc.kill()
                with trio.CancelScope(shield=True):
                    for proc in procs:
                        await proc.wait()
                # As a service manager would, late: the dead Patroni comes
                # back, and demotes (and rewinds) the postgres it left.
                for name in orphans:
                    patroni_cluster.restart_member(name)
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

    # After each new leader is up, every worker has a session again within
    # two session intervals (or has finished).
    late = []
    for i, report in enumerate(reports):
        spans = sorted(tuple(span) for span in report["sessions"])
        for (_, ended), (began, _) in itertools.pairwise(spans):
            ups = [f[4] for f in faults if f[4] <= began]
            if ups and began - max(ended, ups[-1]) > 2 * INTERVAL:
                late.append((f"w{i}", round(began - max(ended, ups[-1]), 1)))
    assert not late, f"workers without a session for over {2 * INTERVAL} s: {late}"

    for kind, old, at, port, _up in faults:
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
