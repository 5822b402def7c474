"""Several Shepherd-like processes share one fleet: every machine is taken
by exactly one of them, for agent start and for recovery, and claims are
not wasted (no claim finds its machine taken; few retry)."""

from __future__ import annotations

import functools
import json
import logging
import subprocess
import sys
from pathlib import Path

import trio

import bmdb
from bmdb.model import Queries
from tests.bmdb.helpers import KEY, bulk_provided_machines

logger = logging.getLogger("tests.bmdb.shared_fleet")

PROCESSES = 3
#: Machines that need their agent started, and started ones gone silent.
TO_START = 300
SILENT = 150
WORKER = [sys.executable, "-m", "tests.bmdb.fleet_worker"]
#: Claims that may be retried (a serialization failure: another process
#: claimed the machine after this claim's snapshot), as a share of claims.
#: Loose on purpose; the run logs the figure.
RETRY_SHARE = 0.25


async def test_processes_share_the_fleet_without_wasted_claims(
    bmdb_conn: bmdb.Connection, bmdb_url: str, tmp_path: Path
) -> None:
    await bulk_provided_machines(bmdb_conn, TO_START + SILENT)

    async def silence(q: Queries) -> set[str]:
        rows = await q.execute(
            """INSERT INTO machine_agent_started (machine_id, agent_started_at, agent_public_key)
               SELECT machine_id, now() - interval '2 hours', %s FROM machines
               ORDER BY machine_created_at DESC LIMIT %s RETURNING machine_id""",
            (KEY, SILENT),
        )
        return {str(r[0]) for r in rows}

    silent = await bmdb_conn.transact(silence)
    outs = [tmp_path / f"w{i}.json" for i in range(PROCESSES)]

    ready = trio.Semaphore(0)
    go = trio.Event()

    async def worker(i: int) -> None:
        command = [*WORKER, bmdb_url, f"w{i}", str(outs[i])]
        run = functools.partial(
            trio.run_process, command, stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        # run_process waits for the exit (check=True: a failure raises),
        # and kills the process if the test is cancelled.
        async with trio.open_nursery() as own:
            process: trio.Process = await own.start(run)
            assert process.stdin is not None and process.stdout is not None
            line = b""
            while not line.endswith(b"\n"):
                chunk = await process.stdout.receive_some(100)
                assert chunk, f"worker {i} exited before it was ready"
                line += chunk
            assert line == b"ready\n", line
            ready.release()
            await go.wait()
            await process.stdin.send_all(b"go\n")

    # A safety bound against a hang, far above the usual time.
    with trio.fail_after(240):
        async with trio.open_nursery() as nursery:
            for i in range(PROCESSES):
                nursery.start_soon(worker, i)
            # Every process connected before any claims: they share the work.
            for _ in range(PROCESSES):
                await ready.acquire()
            go.set()
    results = [json.loads(out.read_text()) for out in outs]
    started = [m for r in results for m in r["started"]]
    recovered = [m for r in results for m in r["recovered"]]
    assert len(started) == len(set(started)) == TO_START
    assert set(started).isdisjoint(silent)
    assert sorted(recovered) == sorted(silent)
    # Every process did part of the work.
    assert all(r["started"] and r["recovered"] for r in results)
    claims = sum(r["claims"] for r in results)
    retries = sum(r["retries"] for r in results)
    logger.info(
        "%d processes: %d claims, %d conflicts, %d retries",
        PROCESSES,
        claims,
        sum(r["conflicts"] for r in results),
        retries,
    )
    assert claims == TO_START + SILENT
    assert [r["conflicts"] for r in results] == [0] * PROCESSES
    assert retries <= RETRY_SHARE * claims, (retries, claims)
