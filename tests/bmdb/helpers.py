"""Shared helpers of the BMDB tests: populating machines, common sources."""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Awaitable, Callable

import trio

import bmdb
from bmdb import Provider
from bmdb.errors import NothingToDo, WorkConflict
from bmdb.model import Queries


async def add_provided_machines(conn: bmdb.Connection, count: int) -> list[uuid.UUID]:
    """Create ``count`` machines provided by the static provider, oldest first."""

    async def fn(q: Queries) -> list[uuid.UUID]:
        ids = []
        for i in range(count):
            machine_id = await q.new_machine()
            await q.add_provided(machine_id, Provider.STATIC, f"static-{i}", f"10.0.0.{i % 250}")
            ids.append(machine_id)
        return ids

    return await conn.transact(fn)


async def bulk_provided_machines(conn: bmdb.Connection, count: int) -> None:
    """Create ``count`` provided machines in one statement (for big fleets)."""

    async def body(q: bmdb.Queries) -> None:
        await q.execute(
            """WITH m AS (INSERT INTO machines (machine_created_at)
                          SELECT now() + make_interval(secs => g / 1000.0)
                          FROM generate_series(1, %s) g RETURNING machine_id)
               INSERT INTO machine_provided (machine_id, provider, provider_id)
               SELECT machine_id, 'Static', machine_id::text FROM m""",
            (count,),
        )

    await conn.transact(body, isolation=bmdb.Isolation.READ_COMMITTED)


async def agent_start_source(q: Queries) -> list[uuid.UUID]:
    """The initializer's source: one machine that needs its agent started."""
    machines = await q.machines_for_agent_start(1)
    if not machines:
        raise NothingToDo
    return [machines[0].machine_id]


Source = Callable[[Queries], Awaitable[list[uuid.UUID]]]


def source_for(process: bmdb.Process) -> Source:
    """A source of any machine free for ``process``."""

    async def source(q: Queries) -> list[uuid.UUID]:
        return await q.machines_for_process(process, 1)

    return source


#: Safety bound of `eventually`, in seconds (not a claim about speed).
EVENTUALLY = 10.0


async def eventually(check: Callable[[], Awaitable[bool]]) -> None:
    """Poll the database until ``check()`` holds; fail after `EVENTUALLY`."""
    with trio.fail_after(EVENTUALLY):
        while True:
            if await check():
                return
            await trio.sleep(0.05)


async def finish_agent_start(work: bmdb.Work) -> None:
    """Finish agent-start work the way the initializer does: set the tag."""
    machine_id = work.machine_id

    async def apply(q: Queries) -> None:
        await q.set_agent_started(machine_id, datetime.datetime.now(datetime.UTC), KEY)

    await work.finish(apply)


#: The agent key the test workers record.
KEY = bytes(32)


async def agent_start_worker(conn: bmdb.Connection, name: str, processed: list[uuid.UUID]) -> None:
    """Process agent-start work in one session until there is nothing left."""
    async with conn.session("test-worker", name) as sess:
        while True:
            try:
                work = await sess.work(bmdb.Process.SHEPHERD_AGENT_START, agent_start_source)
            except NothingToDo:
                return
            except WorkConflict:
                continue
            async with work:
                await finish_agent_start(work)
            processed.append(work.machine_id)


async def outcome_counts(conn: bmdb.Connection) -> dict[str, int]:
    """Aggregate facts to check exactly-once processing with."""

    async def body(q: bmdb.Queries) -> dict[str, int]:
        [row] = await q.execute(
            """SELECT
                 (SELECT count(*) FROM machines),
                 (SELECT count(*) FROM machine_agent_started),
                 (SELECT count(*) FROM work),
                 (SELECT count(*) FROM (SELECT machine_id FROM work_history
                                        WHERE event = 'Finished' GROUP BY machine_id
                                        HAVING count(*) = 1) once),
                 (SELECT count(*) FROM work_history WHERE event = 'Finished'),
                 (SELECT count(*) FROM work_history WHERE event = 'Started'),
                 (SELECT count(*) FROM machines m WHERE m.agent_started <> EXISTS (
                      SELECT 1 FROM machine_agent_started a WHERE a.machine_id = m.machine_id))"""
        )
        keys = ("machines", "tagged", "work", "finished_once", "finished", "started", "mirror_off")
        return dict(zip(keys, row, strict=True))

    return await conn.transact(body, isolation=bmdb.Isolation.REPEATABLE_READ)
