"""End-to-end smoke test: one machine through agent start."""

from __future__ import annotations

import datetime

import bmdb
from bmdb import Process, WorkEvent
from bmdb.model import Queries
from tests.bmdb.helpers import add_provided_machines, agent_start_source


async def test_agent_start_roundtrip(bmdb_conn: bmdb.Connection) -> None:
    [machine_id] = await add_provided_machines(bmdb_conn, 1)
    async with bmdb_conn.session("test", "smoke") as sess:
        work = await sess.work(Process.SHEPHERD_AGENT_START, agent_start_source)
        assert work.machine_id == machine_id
        async with work:

            async def apply(q: Queries) -> None:
                await q.set_agent_started(
                    machine_id, datetime.datetime.now(datetime.UTC), b"k" * 32
                )

            await work.finish(apply)

        async def check(q: Queries) -> tuple[list[bmdb.model.HistoryEvent], bool, int]:
            return (
                await q.history(machine_id),
                await q.authenticate_agent(machine_id, b"k" * 32),
                len(await q.machines_for_agent_start(10)),
            )

        history, authenticated, left = await sess.transact(check)
    assert [h.event for h in history] == [WorkEvent.STARTED, WorkEvent.FINISHED]
    assert authenticated
    assert left == 0
