"""Shared helpers of the BMDB tests: populating machines, common sources."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable

import trio

import bmdb
from bmdb import Provider
from bmdb.errors import NothingToDo
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

    async def body(pg: bmdb._pg.PgConnection) -> None:
        await pg.execute(
            """WITH m AS (INSERT INTO machines (machine_created_at)
                          SELECT now() + make_interval(secs => g / 1000.0)
                          FROM generate_series(1, %s) g RETURNING machine_id)
               INSERT INTO machine_provided (machine_id, provider, provider_id)
               SELECT machine_id, 'Static', machine_id::text FROM m""",
            (count,),
        )

    await conn.run(bmdb.Isolation.READ_COMMITTED, body)


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
