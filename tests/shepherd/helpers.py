"""Reading and writing the BMDB from Shepherd tests."""

from __future__ import annotations

import uuid

import bmdb
from bmdb import Isolation, Process, Provider, Queries, WorkEvent


async def provide(conn: bmdb.Connection, provider_ids: list[str]) -> dict[str, uuid.UUID]:
    """Add machines to the BMDB as provided by the static provider."""

    async def add(q: Queries) -> dict[str, uuid.UUID]:
        ids = {}
        for pid in provider_ids:
            ids[pid] = await q.new_machine()
            await q.add_provided(ids[pid], Provider.STATIC, pid, address="ignored")
        return ids

    return await conn.transact(add)


async def events(
    conn: bmdb.Connection,
    machine_id: uuid.UUID,
    process: Process = Process.SHEPHERD_AGENT_START,
) -> list[tuple[WorkEvent, str]]:
    """The machine's history for ``process``: (event, cause or "")."""

    async def read(q: Queries) -> list[tuple[WorkEvent, str]]:
        return [
            (h.event, h.cause or "") for h in await q.history(machine_id) if h.process == process
        ]

    return await conn.transact(read)


async def agent_keys(conn: bmdb.Connection) -> dict[uuid.UUID, bytes]:
    async def read(q: Queries) -> dict[uuid.UUID, bytes]:
        rows = await q.execute("SELECT machine_id, agent_public_key FROM machine_agent_started")
        return {r[0]: bytes(r[1]) for r in rows}

    return await conn.transact(read, isolation=Isolation.READ_COMMITTED)


async def backoffs(
    conn: bmdb.Connection, process: Process = Process.SHEPHERD_AGENT_START
) -> dict[uuid.UUID, tuple[int, str]]:
    """(last interval, cause) of every machine in backoff for ``process``."""

    async def read(q: Queries) -> dict[uuid.UUID, tuple[int, str]]:
        rows = await q.execute(
            "SELECT machine_id, last_interval_seconds, cause FROM work_backoff WHERE process = %s",
            (process,),
        )
        return {r[0]: (r[1], r[2]) for r in rows}

    return await conn.transact(read, isolation=Isolation.READ_COMMITTED)


async def host_key_of(conn: bmdb.Connection, machine_id: uuid.UUID) -> bytes | None:
    async def read(q: Queries) -> bytes | None:
        return await q.get_ssh_host_key(machine_id)

    return await conn.transact(read)


async def settled(conn: bmdb.Connection, machine_ids: list[uuid.UUID]) -> bool:
    """Every machine has a Finished or Failed agent start in its history."""
    for mid in machine_ids:
        if not any(e in (WorkEvent.FINISHED, WorkEvent.FAILED) for e, _ in await events(conn, mid)):
            return False
    return True
