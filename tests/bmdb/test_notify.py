"""LISTEN/NOTIFY: a committed request or report is heard at once, a rolled
back one never, and a listener whose connection is lost (server restarted,
backend ended, backend silent) listens again and catches up."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

import bmdb
from bmdb.localserver import LocalPostgres
from bmdb.model import Queries, UpgradePlanEntry, UpgradeRun, channels
from bmdb.notify import Listener
from tests.bmdb.helpers import add_provided_machines

KEY = bytes(range(32))
#: Safety bound on each wait (not a claim about speed).
WITHIN = 60.0


class Heard:
    """What a listener delivered, and a way to wait for more."""

    def __init__(self) -> None:
        self.items: list[tuple[str, str]] = []
        self.catch_ups = 0
        self._changed = trio.Event()

    def __call__(self, channel: str, payload: str) -> None:
        self.items.append((channel, payload))
        self._changed.set()

    async def caught_up(self) -> None:
        self.catch_ups += 1
        self._changed.set()

    async def until(self, predicate: object) -> None:
        assert callable(predicate)
        with trio.fail_after(WITHIN):
            while not predicate():
                self._changed = trio.Event()
                await self._changed.wait()


@asynccontextmanager
async def listening(
    conn: bmdb.Connection, **kwargs: float
) -> AsyncIterator[tuple[Listener, Heard]]:
    heard = Heard()
    listener = conn.listener(channels.CHANNELS, heard, on_listening=heard.caught_up, **kwargs)
    async with trio.open_nursery() as nursery:
        await nursery.start(listener.run)
        assert listener.listening and heard.catch_ups == 1
        yield listener, heard
        nursery.cancel_scope.cancel()


async def _request(q: Queries, machine_id: uuid.UUID, generation: int) -> bool:
    return await q.set_os_installation_request(machine_id, generation, b"request")


class Rollback(Exception):
    pass


async def test_committed_writes_are_heard_rolled_back_ones_never(
    bmdb_conn: bmdb.Connection,
) -> None:
    [mid, other] = await add_provided_machines(bmdb_conn, 2)
    async with listening(bmdb_conn) as (_, heard):

        async def rolled_back(q: Queries) -> None:
            await _request(q, other, 1)
            await q.record_os_installation_report(other, 1, b"r", True, None, KEY)
            raise Rollback

        with pytest.raises(Rollback):
            await bmdb_conn.transact(rolled_back)
        await bmdb_conn.transact(lambda q: _request(q, mid, 2))
        # Not written (generation 1 is older than 2): not heard either.
        assert not await bmdb_conn.transact(lambda q: _request(q, mid, 1))
        # A report of another generation is not stored, nor heard.
        await bmdb_conn.transact(
            lambda q: q.record_os_installation_report(mid, 1, b"r", True, None, KEY)
        )
        await bmdb_conn.transact(
            lambda q: q.record_os_installation_report(mid, 2, b"r", True, None, KEY)
        )
        await heard.until(lambda: len(heard.items) >= 2)
        # Delivered in commit order: had the rolled back writes or those not
        # made been heard, they would have come first.
        assert heard.items == [
            (channels.AGENT_REQUEST, str(mid)),
            (channels.INSTALL_REPORT, str(mid)),
        ]


async def test_what_a_listener_catches_up_on(bmdb_conn: bmdb.Connection) -> None:
    [a, b, c] = await add_provided_machines(bmdb_conn, 3)

    async def body(q: Queries) -> None:
        await _request(q, a, 1)
        await _request(q, b, 1)
        await q.record_os_installation_report(b, 1, b"r", False, "failed", None)
        await _request(q, c, 1)
        await q.execute(
            "INSERT INTO machine_decommission (machine_id, requested_by, reason)"
            " VALUES (%s, 'test', 'test')",
            (c,),
        )

    await bmdb_conn.transact(body)
    pending = await bmdb_conn.transact(lambda q: q.machines_with_agent_requests())
    # b reported on its request; c is being decommissioned.
    assert pending == {a}
    got = await bmdb_conn.transact(lambda q: q.agent_pending(a))
    assert (got.installation_generation, got.installation_request) == (1, b"request")
    got = await bmdb_conn.transact(lambda q: q.agent_pending(b))
    assert (got.installation_generation, got.installation_request) == (None, None)
    got = await bmdb_conn.transact(lambda q: q.agent_pending(c))
    assert (got.installation_generation, got.installation_request) == (1, None)


async def test_an_upgrade_s_request_is_caught_up_on_while_its_run_runs(
    bmdb_conn: bmdb.Connection,
) -> None:
    """A machine asked to write an upgrade's image is one whose agent has a
    request to carry, as with an installation request, until its run ends."""
    [a, b] = await add_provided_machines(bmdb_conn, 2)
    entries = [
        UpgradePlanEntry(m, 0, n, "disk0", "sha256:" + "0" * 64) for n, m in enumerate([a, b])
    ]

    async def start(q: Queries) -> UpgradeRun:
        run = await q.create_upgrade_run(
            image_digest="sha256:" + "e" * 64,
            os_image=b"",
            max_unavailable=1,
            health_timeout=60,
            requested_by="tester",
            machines=entries,
        )
        assert await q.write_upgrade(run.run_id, a, 1, b"write")
        return run

    run = await bmdb_conn.transact(start)
    assert await bmdb_conn.transact(lambda q: q.machines_with_agent_requests()) == {a}
    got = await bmdb_conn.transact(lambda q: q.agent_pending(a))
    assert (got.upgrade_generation, got.upgrade_request) == (1, b"write")
    assert got.installation_request is None
    got = await bmdb_conn.transact(lambda q: q.agent_pending(b))
    assert (got.upgrade_generation, got.upgrade_request) == (None, None)
    assert await bmdb_conn.transact(lambda q: q.stop_upgrade_run(run.run_id, "test"))
    assert await bmdb_conn.transact(lambda q: q.machines_with_agent_requests()) == set()
    got = await bmdb_conn.transact(lambda q: q.agent_pending(a))
    assert (got.upgrade_generation, got.upgrade_request) == (None, None)


async def test_listens_again_after_the_server_restarts(
    postgres_server: LocalPostgres, bmdb_conn: bmdb.Connection
) -> None:
    [mid] = await add_provided_machines(bmdb_conn, 1)
    async with listening(bmdb_conn) as (listener, heard):
        postgres_server.stop()
        postgres_server.start()
        await heard.until(lambda: heard.catch_ups == 2)
        assert listener.listening and listener.listens == 2
        await bmdb_conn.transact(lambda q: _request(q, mid, 1))
        await heard.until(lambda: heard.items)
        assert heard.items == [(channels.AGENT_REQUEST, str(mid))]


async def _listener_pid(conn: bmdb.Connection) -> int:
    async def body(q: Queries) -> list[tuple[int]]:
        rows = await q.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            " AND (query LIKE 'LISTEN %%' OR query = 'SELECT 1') AND pid <> pg_backend_pid()"
        )
        return [(int(pid),) for (pid,) in rows]

    [(pid,)] = await conn.transact(body)
    return pid


async def test_listens_again_after_its_backend_is_ended(bmdb_conn: bmdb.Connection) -> None:
    [mid] = await add_provided_machines(bmdb_conn, 1)
    async with listening(bmdb_conn) as (listener, heard):
        pid = await _listener_pid(bmdb_conn)
        await bmdb_conn.transact(lambda q: q.execute(f"SELECT pg_terminate_backend({pid})"))
        await heard.until(lambda: heard.catch_ups == 2)
        await bmdb_conn.transact(lambda q: _request(q, mid, 1))
        await heard.until(lambda: heard.items)
        assert listener.listens == 2


async def test_a_silent_backend_is_found_by_the_ping(bmdb_conn: bmdb.Connection) -> None:
    """A backend that stops answering (SIGSTOP: as a connection the network
    cut without a word) is given up after the ping's timeout."""
    [mid] = await add_provided_machines(bmdb_conn, 1)
    async with listening(bmdb_conn, ping_interval=0.2) as (listener, heard):
        listener.ping_timeout = 0.5
        pid = await _listener_pid(bmdb_conn)
        os.kill(pid, signal.SIGSTOP)
        try:
            await heard.until(lambda: heard.catch_ups == 2)
        finally:
            os.kill(pid, signal.SIGCONT)
        await bmdb_conn.transact(lambda q: _request(q, mid, 1))
        await heard.until(lambda: heard.items)
        assert heard.items == [(channels.AGENT_REQUEST, str(mid))]


async def test_a_failing_handler_does_not_stop_the_listener(bmdb_conn: bmdb.Connection) -> None:
    [a, b] = await add_provided_machines(bmdb_conn, 2)
    heard = Heard()

    def handler(channel: str, payload: str) -> None:
        heard(channel, payload)
        if payload == str(a):
            raise RuntimeError("a bug in the handler")

    listener = bmdb_conn.listener([channels.AGENT_REQUEST], handler)
    async with trio.open_nursery() as nursery:
        await nursery.start(listener.run)
        await bmdb_conn.transact(lambda q: _request(q, a, 1))
        await bmdb_conn.transact(lambda q: _request(q, b, 1))
        await heard.until(lambda: len(heard.items) >= 2)
        assert [p for _, p in heard.items] == [str(a), str(b)] and listener.listens == 1
        nursery.cancel_scope.cancel()


def test_channel_names_are_checked() -> None:
    with pytest.raises(ValueError, match="channel"):
        Listener("", bmdb.Bounds(), ["x; DROP TABLE machines"], lambda c, p: None)
    with pytest.raises(ValueError, match="a channel"):
        Listener("", bmdb.Bounds(), [], lambda c, p: None)
