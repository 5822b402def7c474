"""Queries: tags, sourcing filters, introspection and bad input."""

from __future__ import annotations

import datetime
import uuid

import pytest

import bmdb
from bmdb import Process, Provider, ProviderStatus
from bmdb.errors import InvalidArgument
from bmdb.model import AgentStarted, Queries
from tests.bmdb.helpers import add_provided_machines

NOW = datetime.datetime.now(datetime.UTC)
KEY = bytes(range(32))


async def test_provided_tags(bmdb_conn: bmdb.Connection) -> None:
    async def fn(q: Queries) -> list[bmdb.model.MachineProvided]:
        a = await q.new_machine()
        await q.add_provided(a, "Equinix", "dev-1", "192.0.2.1", "fr2", ProviderStatus.RUNNING)
        b = await q.new_machine()
        await q.add_provided(b, Provider.STATIC, "rack-3")
        assert await q.update_provided(b, "192.0.2.9", "ams", "Provisioning")
        assert not await q.update_provided(await q.new_machine(), None, None, "Unknown")
        return await q.provided_by_provider(Provider.EQUINIX) + await q.provided_by_provider(
            "Static"
        )

    equinix, static = await bmdb_conn.transact(fn)
    assert (equinix.provider, equinix.provider_id, equinix.address, equinix.status) == (
        Provider.EQUINIX,
        "dev-1",
        "192.0.2.1",
        ProviderStatus.RUNNING,
    )
    assert (static.address, static.location, static.status) == (
        "192.0.2.9",
        "ams",
        ProviderStatus.PROVISIONING,
    )


async def test_provider_id_unique_per_provider(bmdb_conn: bmdb.Connection) -> None:
    await add_provided_machines(bmdb_conn, 1)  # static-0

    async def duplicate(q: Queries) -> None:
        await q.add_provided(await q.new_machine(), Provider.STATIC, "static-0")

    with pytest.raises(InvalidArgument, match="duplicate key"):
        await bmdb_conn.transact(duplicate)

    async def same_id_other_provider(q: Queries) -> None:
        await q.add_provided(await q.new_machine(), Provider.EQUINIX, "static-0")

    await bmdb_conn.transact(same_id_other_provider)

    async def count(q: Queries) -> int:
        return len(await q.machines())

    # The failed transaction left nothing behind (its new machine included).
    assert await bmdb_conn.transact(count) == 2


@pytest.mark.parametrize(
    "call",
    [
        lambda q: q.add_provided(uuid.uuid4(), "Hetzner", "x"),
        lambda q: q.add_provided(uuid.uuid4(), "Static", ""),
        lambda q: q.add_provided(uuid.uuid4(), "Static", "x", status="Exploded"),
        lambda q: q.add_provided(uuid.uuid4(), "Static", "x"),  # no such machine
        lambda q: q.set_agent_started("nope", NOW, KEY),
        lambda q: q.set_agent_started(uuid.uuid4(), datetime.datetime(2024, 1, 1), KEY),
        lambda q: q.machines_for_agent_start(0),
        lambda q: q.machines_for_process("Bogus", 1),
        lambda q: q.set_ssh_host_key(uuid.uuid4(), b""),
    ],
)
async def test_bad_input(bmdb_conn: bmdb.Connection, call: object) -> None:
    with pytest.raises(InvalidArgument):
        await bmdb_conn.transact(call)  # type: ignore[arg-type]


async def _set_agent(
    q: Queries, machine_id: uuid.UUID, started_ago: float, heartbeat_ago: float | None
) -> None:
    # Now, not NOW: the recovery source compares with the server's now(), and
    # a long test session can run this test many minutes after import.
    now = datetime.datetime.now(datetime.UTC)
    await q.set_agent_started(machine_id, now - datetime.timedelta(minutes=started_ago), KEY)
    if heartbeat_ago is not None:
        at = now - datetime.timedelta(minutes=heartbeat_ago)
        await q.set_agent_heartbeat(machine_id, at)


async def test_agent_start_and_recovery_sourcing(bmdb_conn: bmdb.Connection) -> None:
    fresh, silent, late, beating, stale_beat, busy = await add_provided_machines(bmdb_conn, 6)

    async def setup(q: Queries) -> None:
        await _set_agent(q, silent, started_ago=31, heartbeat_ago=None)
        await _set_agent(q, late, started_ago=5, heartbeat_ago=None)  # still within 30 min
        await _set_agent(q, beating, started_ago=60, heartbeat_ago=1)
        await _set_agent(q, stale_beat, started_ago=60, heartbeat_ago=11)
        await _set_agent(q, busy, started_ago=60, heartbeat_ago=20)

    await bmdb_conn.transact(setup)
    async with bmdb_conn.session("test") as sess:

        async def busy_source(q: Queries) -> list[uuid.UUID]:
            return [busy]

        work = await sess.work(Process.SHEPHERD_AGENT_START, busy_source)

        async def sources(q: Queries) -> tuple[list[uuid.UUID], list[uuid.UUID]]:
            start = [m.machine_id for m in await q.machines_for_agent_start(10)]
            recovery = [m.machine_id for m in await q.machines_for_agent_recovery(10)]
            return start, recovery

        start, recovery = await sess.transact(sources)
        await work.cancel()
        assert start == [fresh]
        assert recovery == [silent, stale_beat]
        start, recovery = await sess.transact(sources)
        # Longest silent first: by the last sign of life, to 5 minutes.
        assert recovery == [silent, busy, stale_beat]


async def test_agent_authentication_and_host_keys(bmdb_conn: bmdb.Connection) -> None:
    [machine_id] = await add_provided_machines(bmdb_conn, 1)

    async def fn(q: Queries) -> tuple[bool, bool, bool, bytes | None, bytes | None]:
        before = await q.authenticate_agent(machine_id, KEY)
        await q.set_agent_started(machine_id, NOW, KEY)
        good = await q.authenticate_agent(machine_id, KEY)
        bad = await q.authenticate_agent(machine_id, bytes(32))
        no_key = await q.get_ssh_host_key(machine_id)
        await q.set_ssh_host_key(machine_id, b"ssh-ed25519 AAAA")
        return before, good, bad, no_key, await q.get_ssh_host_key(machine_id)

    assert await bmdb_conn.transact(fn) == (False, True, False, None, b"ssh-ed25519 AAAA")


async def test_agent_started_tag_reads_back(bmdb_conn: bmdb.Connection) -> None:
    first, second = await add_provided_machines(bmdb_conn, 2)

    async def fn(q: Queries) -> tuple[AgentStarted | None, AgentStarted | None]:
        await q.set_agent_started(first, NOW, KEY)
        return await q.agent_started(first), await q.agent_started(second)

    started, never = await bmdb_conn.transact(fn)
    assert never is None
    assert started is not None
    assert (started.machine_id, started.started_at, started.public_key) == (first, NOW, KEY)
    assert started.provided is not None and started.provided.provider_id == "static-0"


async def test_machine_summary(bmdb_conn: bmdb.Connection) -> None:
    [machine_id] = await add_provided_machines(bmdb_conn, 1)

    async def fn(q: Queries) -> list[bmdb.model.MachineSummary]:
        await _set_agent(q, machine_id, started_ago=2, heartbeat_ago=1)
        await q.set_hardware_report(machine_id, b"\x0a\x00")
        await q.set_os_installation_request(machine_id, 1, b"req")
        await q.set_os_installation_report(machine_id, 1, b"ok")
        return await q.machines()

    [summary] = await bmdb_conn.transact(fn)
    assert summary.machine_id == machine_id
    assert summary.provided is not None and summary.provided.provider_id == "static-0"
    assert summary.agent_started_at is not None and summary.agent_heartbeat_at is not None
    assert summary.has_hardware_report
    assert summary.work == ()
