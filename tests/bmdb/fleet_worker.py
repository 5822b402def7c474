"""A Shepherd-like process for the shared-fleet test (started by it).

    python -m tests.bmdb.fleet_worker URL NAME OUT

Once connected it prints ``ready`` and waits for a line on stdin (so that
the test starts every process's claims together). Then it runs, on one
connection, `LOOPS` initializer-like and `LOOPS` recoverer-like
worker loops with the Shepherd's own sourcing queries (each loop in a
session of its own, like the Shepherd's control loops), until neither
source finds anything. An initializer finishes by setting the
AgentStarted tag, a recoverer by recording a heartbeat (stand-ins for the
Shepherd's work that take the machine out of its source). On exit it
writes ``OUT`` (JSON): the machines it finished per process, and its
connection's counters (claims, conflicts, retries, nothing to do).
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
import uuid
from collections.abc import Awaitable, Callable

import trio

import bmdb
from bmdb.errors import NothingToDo, WorkConflict
from bmdb.model import Queries
from tests.bmdb.helpers import KEY, agent_start_source

logger = logging.getLogger("tests.bmdb.fleet_worker")

#: Loops of each kind per process.
LOOPS = 2


async def recovery_source(q: Queries) -> list[uuid.UUID]:
    """The recoverer's source: one machine whose agent went silent."""
    machines = await q.machines_for_agent_recovery(1)
    if not machines:
        raise NothingToDo
    return [machines[0].machine_id]


async def _start_agent(q: Queries, machine: uuid.UUID) -> None:
    await q.set_agent_started(machine, datetime.datetime.now(datetime.UTC), KEY)


async def _heartbeat(q: Queries, machine: uuid.UUID) -> None:
    await q.set_agent_heartbeat(machine, datetime.datetime.now(datetime.UTC))


async def _loop(
    conn: bmdb.Connection,
    name: str,
    process: bmdb.Process,
    source: Callable[[Queries], Awaitable[list[uuid.UUID]]],
    finish: Callable[[Queries, uuid.UUID], Awaitable[None]],
    done: list[str],
) -> None:
    async with conn.session("fleet-worker", name) as sess:
        while True:
            try:
                work = await sess.work(process, source)
            except NothingToDo:
                return
            except WorkConflict:
                continue
            machine = work.machine_id

            async def apply(q: Queries, machine: uuid.UUID = machine) -> None:
                await finish(q, machine)

            async with work:
                await work.finish(apply)
            done.append(str(machine))


async def _connected(q: Queries) -> None:
    await q.execute("SELECT 1")


async def run(url: str, name: str) -> dict[str, object]:
    started: list[str] = []
    recovered: list[str] = []
    async with bmdb.open_connection(url) as conn, trio.open_nursery() as nursery:
        await conn.transact(_connected)
        print("ready", flush=True)
        await trio.to_thread.run_sync(sys.stdin.readline)
        for i in range(LOOPS):
            nursery.start_soon(
                _loop,
                conn,
                f"{name}-init{i}",
                bmdb.Process.SHEPHERD_AGENT_START,
                agent_start_source,
                _start_agent,
                started,
            )
            nursery.start_soon(
                _loop,
                conn,
                f"{name}-recover{i}",
                bmdb.Process.SHEPHERD_RECOVERY,
                recovery_source,
                _heartbeat,
                recovered,
            )
    stats = conn.stats
    return {
        "started": started,
        "recovered": recovered,
        "claims": stats.claims,
        "conflicts": stats.conflicts,
        "retries": stats.retries,
        "nothing_to_do": stats.nothing_to_do,
    }


def main() -> None:
    url, name, out = sys.argv[1:4]
    logging.basicConfig(level=logging.WARNING)
    result = trio.run(run, url, name)
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
