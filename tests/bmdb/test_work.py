"""Work: claiming, closing, conflicts, bad input and stale locks."""

from __future__ import annotations

import uuid

import psycopg
import pytest

import bmdb
from bmdb import Process, WorkEvent
from bmdb._pg import PgConnection
from bmdb.errors import InvalidArgument, NothingToDo, WorkClosed, WorkConflict
from bmdb.model import Queries
from tests.bmdb.helpers import Source, add_provided_machines, agent_start_source, eventually


def fixed(machine_id: uuid.UUID | str) -> Source:
    """A source that always offers ``machine_id`` (even a malformed one)."""

    async def source(q: Queries) -> list[uuid.UUID]:
        return [machine_id]  # type: ignore[list-item]

    return source


async def events(conn: bmdb.Connection, machine_id: uuid.UUID) -> list[WorkEvent]:
    async def fn(q: Queries) -> list[bmdb.model.HistoryEvent]:
        return await q.history(machine_id)

    return [e.event for e in await conn.transact(fn)]


async def work_rows(conn: bmdb.Connection) -> list[bmdb.model.WorkInfo]:
    async def fn(q: Queries) -> list[bmdb.model.WorkInfo]:
        return await q.work()

    return await conn.transact(fn)


async def test_nothing_to_do(bmdb_conn: bmdb.Connection) -> None:
    async with bmdb_conn.session("test") as sess:
        with pytest.raises(NothingToDo):
            await sess.work(Process.SHEPHERD_AGENT_START, agent_start_source)

        async def empty(q: Queries) -> list[uuid.UUID]:
            return []

        with pytest.raises(NothingToDo):
            await sess.work(Process.UNIT_TEST_1, empty)
    assert bmdb_conn.stats.nothing_to_do == 2


async def test_conflict_between_sessions(bmdb_conn: bmdb.Connection) -> None:
    [machine_id] = await add_provided_machines(bmdb_conn, 1)
    async with bmdb_conn.session("a") as a, bmdb_conn.session("b") as b:
        held = await a.work(Process.UNIT_TEST_1, fixed(machine_id))
        with pytest.raises(WorkConflict):
            await b.work(Process.UNIT_TEST_1, fixed(machine_id))
        # Another process on the same machine is independent.
        other = await b.work(Process.UNIT_TEST_2, fixed(machine_id))
        await other.finish()
        await held.finish()
        again = await b.work(Process.UNIT_TEST_1, fixed(machine_id))
        await again.cancel()
    assert bmdb_conn.stats.conflicts == 1


async def test_closing_twice(bmdb_conn: bmdb.Connection) -> None:
    [machine_id] = await add_provided_machines(bmdb_conn, 1)
    async with bmdb_conn.session("test") as sess:
        work = await sess.work(Process.UNIT_TEST_1, fixed(machine_id))
        await work.finish()
        with pytest.raises(WorkClosed):
            await work.finish()
        with pytest.raises(WorkClosed):
            await work.fail("late", bmdb.Backoff(initial=10))
        await work.cancel()  # idempotent no-op
    assert await events(bmdb_conn, machine_id) == [WorkEvent.STARTED, WorkEvent.FINISHED]


async def test_context_manager_cancels_on_error(bmdb_conn: bmdb.Connection) -> None:
    [machine_id] = await add_provided_machines(bmdb_conn, 1)
    async with bmdb_conn.session("test") as sess:
        with pytest.raises(RuntimeError, match="ssh broke"):
            async with await sess.work(Process.SHEPHERD_AGENT_START, agent_start_source):
                raise RuntimeError("ssh broke")
        assert await work_rows(bmdb_conn) == []
        # Canceled work leaves no backoff: the machine can be claimed again.
        work = await sess.work(Process.SHEPHERD_AGENT_START, agent_start_source)
        assert work.machine_id == machine_id
        await work.cancel()
        await work.cancel()
    assert await events(bmdb_conn, machine_id) == [
        WorkEvent.STARTED,
        WorkEvent.CANCELED,
        WorkEvent.STARTED,
        WorkEvent.CANCELED,
    ]


async def test_failing_apply_rolls_back_finish(bmdb_conn: bmdb.Connection) -> None:
    [machine_id] = await add_provided_machines(bmdb_conn, 1)
    async with bmdb_conn.session("test") as sess:
        work = await sess.work(Process.SHEPHERD_AGENT_START, agent_start_source)

        async def bad_apply(q: Queries) -> None:
            await q.set_hardware_report(machine_id, b"report")
            await q.set_agent_started(machine_id, None, b"")  # type: ignore[arg-type]

        with pytest.raises(InvalidArgument):
            await work.finish(bad_apply)
        assert not work.closed
        # Nothing of the failed finish was written; the lock is still held.
        assert [w.machine_id for w in await work_rows(bmdb_conn)] == [machine_id]
        await work.fail("bad agent answer")

        async def report(q: Queries) -> list[bmdb.model.MachineSummary]:
            return await q.machines()

        [summary] = await sess.transact(report)
        assert not summary.has_hardware_report
    assert await events(bmdb_conn, machine_id) == [WorkEvent.STARTED, WorkEvent.FAILED]


async def test_bad_input(bmdb_conn: bmdb.Connection) -> None:
    await add_provided_machines(bmdb_conn, 2)
    async with bmdb_conn.session("test") as sess:
        with pytest.raises(InvalidArgument, match="unknown Process 'NoSuchProcess'"):
            await sess.work("NoSuchProcess", agent_start_source)
        with pytest.raises(InvalidArgument, match="not a machine id"):
            await sess.work(Process.UNIT_TEST_1, fixed("not-a-uuid"))
        with pytest.raises(InvalidArgument, match="one machine"):

            async def two(q: Queries) -> list[uuid.UUID]:
                return [m.machine_id for m in await q.machines_for_agent_start(2)]

            await sess.work(Process.UNIT_TEST_1, two)
        with pytest.raises(InvalidArgument):
            # A well-formed id of no machine violates the foreign key.
            await sess.work(Process.UNIT_TEST_1, fixed(uuid.uuid4()))

        async def history_of_garbage(q: Queries) -> object:
            return await q.history("12345")

        with pytest.raises(InvalidArgument, match="not a machine id"):
            await sess.transact(history_of_garbage)
        with pytest.raises(InvalidArgument):
            await sess.work(Process.UNIT_TEST_1, fixed(uuid.uuid4()))
        assert await work_rows(bmdb_conn) == []


async def _dead_session_holding(conn: bmdb.Connection, machine_id: uuid.UUID) -> uuid.UUID:
    """Write the leftovers of a crashed worker: a session past its deadline
    that still holds agent-start work on the machine."""

    async def body(q: bmdb.Queries) -> uuid.UUID:
        rows = await q.execute(
            """INSERT INTO sessions (session_component_name, session_runtime_info,
                   session_interval_seconds, session_deadline)
               VALUES ('crashed', 'gone', 5, now() - interval '1 second')
               RETURNING session_id"""
        )
        session_id: uuid.UUID = rows[0][0]
        await q.execute(
            "INSERT INTO work VALUES (%s, %s, 'ShepherdAgentStart')", (machine_id, session_id)
        )
        return session_id

    return await conn.transact(body, isolation=bmdb.Isolation.READ_COMMITTED)


async def test_stale_work_does_not_block(bmdb_conn: bmdb.Connection) -> None:
    [machine_id] = await add_provided_machines(bmdb_conn, 1)
    async with bmdb_conn.session("test") as sess:
        # Created after our session's start, so the collector has not run
        # since: the dead lock is still there.
        dead = await _dead_session_holding(bmdb_conn, machine_id)
        # The source ignores the dead lock, and the claim takes the row over.
        work = await sess.work(Process.SHEPHERD_AGENT_START, agent_start_source)
        assert work.machine_id == machine_id
        [row] = await work_rows(bmdb_conn)
        assert row.session_id == sess.id != dead
        await work.finish()
    assert await events(bmdb_conn, machine_id) == [WorkEvent.STARTED, WorkEvent.FINISHED]


async def test_collector_deletes_expired_sessions(bmdb_conn: bmdb.Connection) -> None:
    [machine_id] = await add_provided_machines(bmdb_conn, 1)
    dead = await _dead_session_holding(bmdb_conn, machine_id)
    async with bmdb_conn.session("alive") as sess:
        # Starting a session collects; a second run finds nothing more to do.
        await bmdb_conn.collect_expired()

        async def sessions(q: Queries) -> list[bmdb.model.SessionInfo]:
            return await q.sessions()

        assert [s.session_id for s in await sess.transact(sessions)] == [sess.id]
    assert dead != sess.id
    assert await work_rows(bmdb_conn) == []

    async def history(q: Queries) -> list[bmdb.model.HistoryEvent]:
        return await q.history(machine_id)

    [event] = await bmdb_conn.transact(history)
    assert (event.event, event.session_id, event.cause) == (
        WorkEvent.CANCELED,
        dead,
        "session expired",
    )


async def test_heartbeat_collects_periodically(
    bmdb_conn: bmdb.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bmdb.session, "GC_PERIOD", 0.2)
    [machine_id] = await add_provided_machines(bmdb_conn, 1)
    async with bmdb_conn.session("alive", interval=0.2):
        # Died after our session started: only the heartbeat's periodic
        # collection can remove it.
        dead = await _dead_session_holding(bmdb_conn, machine_id)

        async def collected() -> bool:
            return not await work_rows(bmdb_conn)

        await eventually(collected)

    async def history(q: Queries) -> list[bmdb.model.HistoryEvent]:
        return await q.history(machine_id)

    [event] = await bmdb_conn.transact(history)
    assert (event.event, event.session_id) == (WorkEvent.CANCELED, dead)


async def test_claim_invalidates_older_snapshots(bmdb_conn: bmdb.Connection, bmdb_url: str) -> None:
    """The invariant the claim relies on: a claimer whose snapshot predates
    another claim of the same machine cannot lock that machine."""
    [machine_id] = await add_provided_machines(bmdb_conn, 1)
    late = await PgConnection.connect(bmdb_url)
    try:
        await late.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        # The late claimer's snapshot: the machine is free.
        q = Queries(late)
        assert [m.machine_id for m in await q.machines_for_agent_start(1)] == [machine_id]
        async with bmdb_conn.session("early") as sess:
            work = await sess.work(Process.SHEPHERD_AGENT_START, agent_start_source)
            assert work.machine_id == machine_id
            # Locking it now, from the old snapshot, must fail to serialize
            # rather than let a second claim through.
            with pytest.raises(psycopg.errors.SerializationFailure):
                await Queries(late, locking=True).machines_for_agent_start(1)
            await work.cancel()
    finally:
        await late.rollback_quietly()
        await late.close()
