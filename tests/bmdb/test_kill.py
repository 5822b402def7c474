"""A worker killed with SIGKILL mid-work: its machine is taken over after its
session's deadline, and the history shows both attempts."""

from __future__ import annotations

import signal
import subprocess
import sys
import uuid

import pytest
import trio

import bmdb
from bmdb import Process, WorkEvent
from bmdb.errors import NothingToDo
from bmdb.model import Queries
from tests.bmdb.helpers import (
    add_provided_machines,
    agent_start_source,
    eventually,
    finish_agent_start,
)

INTERVAL = 1.0


async def test_killed_worker_machine_is_taken_over(
    bmdb_conn: bmdb.Connection, bmdb_url: str
) -> None:
    [machine_id] = await add_provided_machines(bmdb_conn, 1)
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "tests.bmdb.claim_and_hang", bmdb_url, str(INTERVAL)],
        stdout=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = b""
        with trio.fail_after(30):
            while not line.endswith(b"\n"):
                chunk = await proc.stdout.receive_some()
                assert chunk, "the worker exited before claiming"
                line += chunk
        doomed_session, claimed = (uuid.UUID(part) for part in line.decode().split())
        assert claimed == machine_id

        async with bmdb_conn.session("survivor") as sess:
            # While the worker lives, its lock holds.
            with pytest.raises(NothingToDo):
                await sess.work(Process.SHEPHERD_AGENT_START, agent_start_source)

            proc.send_signal(signal.SIGKILL)
            await proc.wait()

            taken: list[bmdb.Work] = []

            async def take_over() -> bool:
                try:
                    taken.append(await sess.work(Process.SHEPHERD_AGENT_START, agent_start_source))
                except NothingToDo:
                    return False
                return True

            # The dead session's deadline passes within INTERVAL; no one
            # had to collect it for the machine to become available.
            await eventually(take_over)
            async with taken[0] as work:
                assert work.machine_id == machine_id
                await finish_agent_start(work)
    finally:
        if proc.poll() is None:
            proc.kill()
        await proc.wait()
        if proc.stdout is not None:
            await proc.stdout.aclose()

    async def history(q: Queries) -> list[bmdb.model.HistoryEvent]:
        return await q.history(machine_id)

    events = [(e.event, e.session_id) for e in await bmdb_conn.transact(history)]
    assert events[0] == (WorkEvent.STARTED, doomed_session)
    assert events[-2:] == [(WorkEvent.STARTED, sess.id), (WorkEvent.FINISHED, sess.id)]
    # Whatever happened in between (a collector may have recorded the dead
    # lock as canceled) belongs to the dead session.
    assert all(s == doomed_session for _, s in events[1:-2])
