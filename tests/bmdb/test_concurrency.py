"""Many workers, many machines: every machine processed exactly once."""

from __future__ import annotations

import logging
import uuid

import trio

import bmdb
from tests.bmdb.helpers import agent_start_worker, bulk_provided_machines, outcome_counts

logger = logging.getLogger("tests.bmdb.concurrency")

MACHINES = 2000
WORKERS = 16


async def test_sixteen_workers_process_each_machine_once(bmdb_conn: bmdb.Connection) -> None:
    await bulk_provided_machines(bmdb_conn, MACHINES)
    processed: list[list[uuid.UUID]] = [[] for _ in range(WORKERS)]
    # A safety bound against deadlock or livelock, far above the usual time.
    with trio.fail_after(180):
        async with trio.open_nursery() as nursery:
            for i in range(WORKERS):
                nursery.start_soon(agent_start_worker, bmdb_conn, f"w{i}", processed[i])

    everything = [m for mine in processed for m in mine]
    assert len(everything) == len(set(everything)) == MACHINES
    # Work really was spread over the workers, not done by one.
    assert sum(1 for mine in processed if mine) > WORKERS // 2
    counts = await outcome_counts(bmdb_conn)
    assert counts == {
        "machines": MACHINES,
        "tagged": MACHINES,
        "work": 0,
        "finished_once": MACHINES,
        "finished": MACHINES,
        "started": MACHINES,
        "mirror_off": 0,
    }
    stats = bmdb_conn.stats
    logger.info(
        "claims %d, conflicts %d, retries %d, nothing-to-do %d",
        stats.claims,
        stats.conflicts,
        stats.retries,
        stats.nothing_to_do,
    )
    assert stats.claims == MACHINES
