"""Sessions: liveness, expiry cancelling what runs under them, cleanup."""

from __future__ import annotations

import contextlib
import uuid

import pytest
import trio

import bmdb
import bmdb.errors
from bmdb import Process, WorkEvent
from bmdb.errors import InvalidArgument, SessionExpired
from bmdb.model import Queries
from tests.bmdb.helpers import add_provided_machines, agent_start_source, eventually


async def session_rows(conn: bmdb.Connection) -> list[bmdb.model.SessionInfo]:
    async def fn(q: Queries) -> list[bmdb.model.SessionInfo]:
        return await q.sessions()

    return await conn.transact(fn)


async def expire_now(conn: bmdb.Connection, session_id: uuid.UUID) -> None:
    """Push a session's deadline into the past, as if its owner had stalled."""

    async def body(q: bmdb.Queries) -> None:
        await q.execute(
            "UPDATE sessions SET session_deadline = now() - interval '1 second'"
            " WHERE session_id = %s",
            (session_id,),
        )

    await conn.transact(body, isolation=bmdb.Isolation.READ_COMMITTED)


async def test_session_row_lifecycle(bmdb_conn: bmdb.Connection) -> None:
    async with bmdb_conn.session("shepherd-initializer", "host:1234", interval=0.4) as sess:
        [row] = await session_rows(bmdb_conn)
        assert (row.session_id, row.component, row.runtime_info, row.interval) == (
            sess.id,
            "shepherd-initializer",
            "host:1234",
            0.4,
        )
        first_deadline = row.deadline

        # Outlive several intervals: the heartbeat keeps the session valid.
        async def poked() -> bool:
            return (await session_rows(bmdb_conn))[0].deadline > first_deadline

        await eventually(poked)
        await trio.sleep(1.0)
        [row] = await session_rows(bmdb_conn)
        assert not row.expired
        assert await sess.transact(lambda q: q.sessions()) != []
    assert await session_rows(bmdb_conn) == []
    assert sess.expired
    with pytest.raises(SessionExpired):
        await sess.transact(lambda q: q.sessions())


async def test_expiry_cancels_work_in_flight(bmdb_conn: bmdb.Connection) -> None:
    [machine_id] = await add_provided_machines(bmdb_conn, 1)
    in_flight_cancelled = False
    with trio.fail_after(10), pytest.raises(SessionExpired):
        async with bmdb_conn.session("test", interval=0.5) as sess:
            work = await sess.work(Process.SHEPHERD_AGENT_START, agent_start_source)
            async with work:
                await expire_now(bmdb_conn, sess.id)
                try:
                    await trio.sleep_forever()  # e.g. a long SSH session
                except trio.Cancelled:
                    in_flight_cancelled = True
                    raise
    assert in_flight_cancelled
    assert sess.expired
    with pytest.raises(SessionExpired):
        await sess.work(Process.SHEPHERD_AGENT_START, agent_start_source)
    # The lock died with the session: the machine is free for a new session.
    async with bmdb_conn.session("next") as nxt:
        work = await nxt.work(Process.SHEPHERD_AGENT_START, agent_start_source)
        assert work.machine_id == machine_id
        await work.finish()

    async def history(q: Queries) -> list[bmdb.model.HistoryEvent]:
        return await q.history(machine_id)

    events = await bmdb_conn.transact(history)
    assert [(e.event, e.session_id) for e in events] == [
        (WorkEvent.STARTED, sess.id),
        (WorkEvent.CANCELED, sess.id),
        (WorkEvent.STARTED, nxt.id),
        (WorkEvent.FINISHED, nxt.id),
    ]


async def test_transact_checks_session(bmdb_conn: bmdb.Connection) -> None:
    with pytest.raises(SessionExpired):
        async with bmdb_conn.session("test", interval=30) as sess:
            await expire_now(bmdb_conn, sess.id)
            await sess.transact(lambda q: q.sessions())


async def test_finish_after_expiry_fails(bmdb_conn: bmdb.Connection) -> None:
    await add_provided_machines(bmdb_conn, 1)
    with pytest.raises(SessionExpired):
        async with bmdb_conn.session("test", interval=30) as sess:
            work = await sess.work(Process.SHEPHERD_AGENT_START, agent_start_source)
            await expire_now(bmdb_conn, sess.id)
            await work.finish()
    assert work.closed


async def test_body_errors_propagate_unwrapped(bmdb_conn: bmdb.Connection) -> None:
    with pytest.raises(KeyError):
        async with bmdb_conn.session("test"):
            raise KeyError("boom")
    assert await session_rows(bmdb_conn) == []


@pytest.mark.parametrize(("component", "interval"), [("", 5.0), ("x", 0.0), ("x", -1.0)])
async def test_invalid_session_arguments(
    bmdb_conn: bmdb.Connection, component: str, interval: float
) -> None:
    with pytest.raises(InvalidArgument):
        async with bmdb_conn.session(component, interval=interval):
            pass
    assert await session_rows(bmdb_conn) == []


async def test_expiry_seen_by_one_task_cancels_the_others(bmdb_conn: bmdb.Connection) -> None:
    # The heartbeat would not look again for 30 s: only the transaction's
    # session check can notice the expiry within the test's bound.
    others_cancelled = False
    with trio.fail_after(10), pytest.raises(SessionExpired):
        async with bmdb_conn.session("test", interval=60) as sess, trio.open_nursery() as nursery:

            async def other() -> None:
                nonlocal others_cancelled
                try:
                    await trio.sleep_forever()
                except trio.Cancelled:
                    others_cancelled = True
                    raise

            async def sloppy() -> None:
                await expire_now(bmdb_conn, sess.id)
                # Swallowed: the session must end all the same.
                with contextlib.suppress(SessionExpired):
                    await sess.transact(lambda q: q.sessions())

            nursery.start_soon(other)
            nursery.start_soon(sloppy)
    assert others_cancelled


async def test_closing_releases_work_left_open(bmdb_conn: bmdb.Connection) -> None:
    [machine_id] = await add_provided_machines(bmdb_conn, 1)
    async with bmdb_conn.session("test") as sess:
        # Neither finished nor used as a context manager: a caller bug.
        await sess.work(Process.SHEPHERD_AGENT_START, agent_start_source)

    async def state(q: Queries) -> tuple[list[bmdb.model.WorkInfo], list[bmdb.model.HistoryEvent]]:
        return await q.work(), await q.history(machine_id)

    work, history = await bmdb_conn.transact(state)
    assert work == []
    assert [(e.event, e.cause) for e in history] == [
        (WorkEvent.STARTED, None),
        (WorkEvent.CANCELED, "session closed"),
    ]


#: Nothing listens here (port 1 on loopback): connecting fails at once.
UNREACHABLE = "postgresql://nobody@127.0.0.1:1/bmdb?connect_timeout=2"


async def _expire_while_shielded(
    conn: bmdb.Connection, sess: bmdb.Session, then: type[BaseException] | None
) -> None:
    """Expire ``sess`` (its row's deadline in the past: the heartbeat's next
    poke finds it gone and raises `SessionExpired`, cancelling the body),
    while the body, shielded, waits for that and then fails on its own: with
    a real `DatabaseUnavailable` (``then`` None) or ``then``."""
    await expire_now(conn, sess.id)
    with trio.CancelScope(shield=True):
        with trio.fail_after(10):
            while not sess.expired:  # noqa: ASYNC110 (the heartbeat sets it)
                await trio.sleep(0.05)
        if then is not None:
            raise then("the body's own error")
        async with bmdb.open_connection(UNREACHABLE):
            pass


async def test_an_expiry_and_a_database_error_at_once_raise_session_expired(
    bmdb_conn: bmdb.Connection,
) -> None:
    """Both the heartbeat (`SessionExpired`) and the body
    (`DatabaseUnavailable`) fail: the block raises one documented error,
    `SessionExpired`, with the other chained and noted, never a group."""
    with pytest.raises(SessionExpired) as caught:
        async with bmdb_conn.session("both-fail", interval=0.4) as sess:
            await _expire_while_shielded(bmdb_conn, sess, None)
    assert isinstance(caught.value.__cause__, bmdb.errors.DatabaseUnavailable)
    assert any("also: DatabaseUnavailable" in n for n in getattr(caught.value, "__notes__", []))


async def test_a_bug_in_the_body_beside_an_expiry_is_raised_as_itself(
    bmdb_conn: bmdb.Connection,
) -> None:
    """The body's own exception (not a BMDB error) is what it would be
    without the session, with the expiry noted."""
    with pytest.raises(KeyError) as caught:
        async with bmdb_conn.session("bug-and-expiry", interval=0.4) as sess:
            await _expire_while_shielded(bmdb_conn, sess, KeyError)
    assert isinstance(caught.value.__cause__, SessionExpired)
