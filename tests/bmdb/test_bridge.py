"""Driving psycopg from Trio: cancellation reaches the query on the server,
and the connection is fit for the next user afterwards."""

from __future__ import annotations

import uuid

import psycopg
import pytest
import trio

import bmdb
from bmdb._pg import PgConnection
from bmdb.model import Queries


async def server_activity(conn: bmdb.Connection) -> list[tuple[str, str]]:
    """(state, query) of every other backend connected to our database."""

    async def body(q: bmdb.Queries) -> list[tuple[str, str]]:
        rows = await q.execute(
            """SELECT state, query FROM pg_stat_activity
               WHERE datname = current_database() AND pid <> pg_backend_pid()"""
        )
        return [(r[0], r[1]) for r in rows]

    return await conn.transact(body, isolation=bmdb.Isolation.READ_COMMITTED)


async def test_cancel_reaches_server_and_connection_is_reused(bmdb_url: str) -> None:
    async with bmdb.open_connection(bmdb_url, max_connections=1) as conn:

        async def slow(q: Queries) -> None:
            await q.execute("SELECT pg_sleep(60)")

        with trio.fail_after(10):
            with trio.move_on_after(0.3) as scope:
                await conn.transact(slow)
            assert scope.cancelled_caught

            # One connection only: the next transaction runs on the very
            # connection whose query was cancelled. It must be idle, and the
            # sleep must be gone from the server (not merely abandoned).
            async def ping(q: Queries) -> list[bmdb.model.SessionInfo]:
                return await q.sessions()

            assert await conn.transact(ping) == []

    async with bmdb.open_connection(bmdb_url) as observer:
        with trio.fail_after(10):
            activity = await server_activity(observer)
    assert not [a for a in activity if "pg_sleep" in a[1] and a[0] == "active"]
    assert not [a for a in activity if a[0].startswith("idle in transaction")]


async def test_cancel_mid_transaction_rolls_back(bmdb_conn: bmdb.Connection) -> None:
    async def write_then_hang(q: Queries) -> None:
        await q.new_machine()
        await trio.sleep_forever()

    with trio.move_on_after(0.2):
        await bmdb_conn.transact(write_then_hang)

    async def count(q: Queries) -> int:
        return len(await q.machines())

    assert await bmdb_conn.transact(count) == 0


async def test_no_asyncio_loop_needed(bmdb_url: str) -> None:
    async with bmdb.open_connection(bmdb_url) as conn:
        assert await conn.transact(lambda q: q.sessions()) == []


async def test_statements_larger_than_socket_buffers(bmdb_conn: bmdb.Connection) -> None:
    # Megabytes in and out: libpq cannot flush the query in one go, so the
    # driver has to wait for the socket to be writable (or readable) again.
    blob = b"\x01" * (16 << 20)

    async def body(q: bmdb.Queries) -> tuple[int, bytes]:
        [(length, echoed)] = await q.execute("SELECT length(%s::bytea), %s::bytea", (blob, blob))
        return length, echoed

    length, echoed = await bmdb_conn.transact(body, isolation=bmdb.Isolation.READ_COMMITTED)
    assert length == len(blob) and echoed == blob


async def test_cancelled_claim_leaves_no_lock(bmdb_conn: bmdb.Connection) -> None:
    async def add(q: Queries) -> None:
        await q.add_provided(await q.new_machine(), "Static", "m-1")

    await bmdb_conn.transact(add)

    async def stuck_source(q: Queries) -> list[uuid.UUID]:
        [machine] = await q.machines_for_agent_start(1)  # row locked now
        await trio.sleep_forever()
        return [machine.machine_id]

    async def source(q: Queries) -> list[uuid.UUID]:
        return [m.machine_id for m in await q.machines_for_agent_start(1)]

    async with bmdb_conn.session("test") as sess:
        with trio.move_on_after(0.3) as scope:
            await sess.work(bmdb.Process.SHEPHERD_AGENT_START, stuck_source)
        assert scope.cancelled_caught
        # The row lock went with the rolled-back transaction: the machine is
        # claimable at once (SKIP LOCKED would hide it otherwise).
        with trio.fail_after(10):
            work = await sess.work(bmdb.Process.SHEPHERD_AGENT_START, source)
        await work.finish()


async def test_begin_travels_with_the_first_statement(bmdb_url: str) -> None:
    """`PgConnection.begin` defers BEGIN to the next statement's round trip;
    the server still runs it first, with the isolation asked for."""
    pg = await PgConnection.connect(bmdb_url)
    try:
        with trio.fail_after(10):
            pg.begin("REPEATABLE READ")
            assert not pg.in_transaction  # nothing sent yet
            rows = await pg.execute("SELECT current_setting('transaction_isolation'), %s", (1,))
            assert rows == [("repeatable read", 1)]
            assert pg.in_transaction
            await pg.execute("COMMIT")
            assert pg.reusable

            # A failing first statement leaves a failed transaction (BEGIN ran
            # before it), which rolls back to a reusable connection.
            pg.begin("SERIALIZABLE")
            with pytest.raises(psycopg.errors.DivisionByZero):
                await pg.execute("SELECT 1 / %s", (0,))
            assert pg.in_transaction and not pg.reusable
            await pg.rollback_quietly()
            assert pg.reusable
            assert await pg.execute("SELECT current_setting('transaction_isolation')") == [
                ("read committed",)
            ]
    finally:
        await pg.close()


async def test_statements_are_prepared_once(bmdb_url: str) -> None:
    pg = await PgConnection.connect(bmdb_url)
    try:
        with trio.fail_after(10):
            for i in range(3):
                assert await pg.execute("SELECT %s::int + 1", (i,)) == [(i + 1,)]
            rows = await pg.execute("SELECT statement FROM pg_prepared_statements")
            assert [r[0] for r in rows] == ["SELECT $1::int + 1"]
    finally:
        await pg.close()


async def test_cancel_of_a_statement_sent_with_begin(bmdb_url: str) -> None:
    pg = await PgConnection.connect(bmdb_url)
    try:
        with trio.fail_after(10):
            pg.begin("REPEATABLE READ")
            with trio.move_on_after(0.3) as scope:
                await pg.execute("SELECT pg_sleep(%s)", (60,))
            assert scope.cancelled_caught
            await pg.rollback_quietly()
            assert pg.reusable
            assert await pg.execute("SELECT %s::int", (7,)) == [(7,)]
    finally:
        await pg.close()
