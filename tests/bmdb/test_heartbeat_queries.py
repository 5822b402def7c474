"""Queries for agent heartbeats and recovery: authentication, replays, timeouts, window."""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Awaitable, Callable

import pytest

import bmdb
from bmdb import Process
from bmdb.errors import InvalidArgument
from bmdb.model import AgentHeartbeat, HeartbeatOutcome, Queries
from tests.bmdb.helpers import add_provided_machines

KEY = bytes(range(32))
OTHER_KEY = bytes(32)


async def _state(conn: bmdb.Connection, machine_id: uuid.UUID) -> tuple[object, bytes | None]:
    async def read(q: Queries) -> tuple[object, bytes | None]:
        return await q.agent_heartbeat(machine_id), await q.hardware_report(machine_id)

    return await conn.transact(read)


async def test_heartbeat_needs_the_started_agents_key_and_a_newer_time(
    bmdb_conn: bmdb.Connection,
) -> None:
    (machine,) = await add_provided_machines(bmdb_conn, 1)

    async def record(key: bytes, time_ns: int, report: bytes | None = None) -> HeartbeatOutcome:
        async def fn(q: Queries) -> HeartbeatOutcome:
            return await q.record_agent_heartbeat(machine, key, time_ns, report)

        return await bmdb_conn.transact(fn)

    # No agent started yet: nobody's key is good.
    assert await record(KEY, 10, b"r") is HeartbeatOutcome.UNKNOWN_AGENT
    assert await _state(bmdb_conn, machine) == (None, None)

    async def start(q: Queries) -> None:
        await q.set_agent_started(machine, datetime.datetime.now(datetime.UTC), KEY)

    await bmdb_conn.transact(start)
    assert await record(OTHER_KEY, 10, b"r") is HeartbeatOutcome.UNKNOWN_AGENT
    assert await _state(bmdb_conn, machine) == (None, None)

    assert await record(KEY, 10, b"report-1") is HeartbeatOutcome.ACCEPTED
    first, report = await _state(bmdb_conn, machine)
    assert first is not None and report == b"report-1"

    # The same time again, or an older one, is a replay: nothing changes.
    assert await record(KEY, 10, b"report-2") is HeartbeatOutcome.REPLAYED
    assert await record(KEY, 9) is HeartbeatOutcome.REPLAYED
    assert await _state(bmdb_conn, machine) == (first, b"report-1")

    # A newer one without report moves the time and keeps the report.
    assert await record(KEY, 11) is HeartbeatOutcome.ACCEPTED
    later, report = await _state(bmdb_conn, machine)
    assert isinstance(later, datetime.datetime) and isinstance(first, datetime.datetime)
    assert later > first and report == b"report-1"


async def test_recovery_timeouts_are_parameters(bmdb_conn: bmdb.Connection) -> None:
    silent, beating = await add_provided_machines(bmdb_conn, 2)
    now = datetime.datetime.now(datetime.UTC)

    async def setup(q: Queries) -> None:
        await q.set_agent_started(silent, now - datetime.timedelta(seconds=20), KEY)
        await q.set_agent_started(beating, now - datetime.timedelta(seconds=20), KEY)
        await q.set_agent_heartbeat(beating, now - datetime.timedelta(seconds=5))

    await bmdb_conn.transact(setup)

    async def source(first: float, last: float) -> list[uuid.UUID]:
        async def fn(q: Queries) -> list[uuid.UUID]:
            found = await q.machines_for_agent_recovery(
                10, first_heartbeat_timeout=first, heartbeat_timeout=last
            )
            # In an order of their last sign of life to 5 minutes: both
            # may fall in the same 5 minutes.
            return sorted(m.machine_id for m in found)

        return await bmdb_conn.transact(fn)

    assert await source(1800, 600) == []
    assert await source(10, 600) == [silent]
    assert await source(10, 2) == sorted([silent, beating])
    assert await source(1800, 2) == [beating]


async def test_recovery_source_filters_by_provider(bmdb_conn: bmdb.Connection) -> None:
    (machine,) = await add_provided_machines(bmdb_conn, 1)

    async def setup(q: Queries) -> None:
        old = datetime.datetime.now(datetime.UTC) - datetime.timedelta(hours=1)
        await q.set_agent_started(machine, old, KEY)

    await bmdb_conn.transact(setup)

    async def source(provider: str) -> list[uuid.UUID]:
        async def fn(q: Queries) -> list[uuid.UUID]:
            return [m.machine_id for m in await q.machines_for_agent_recovery(5, provider=provider)]

        return await bmdb_conn.transact(fn)

    assert await source("Static") == [machine]
    assert await source("Equinix") == []


async def test_parallel_recovery_claims_spread_over_the_window(bmdb_conn: bmdb.Connection) -> None:
    """Locking recovery sources pick at random among the oldest candidates,
    like agent-start sourcing: sixteen claims in a row do not all go for the
    oldest machine, and never for one twice."""
    machines = await add_provided_machines(bmdb_conn, 40)

    async def setup(q: Queries) -> None:
        old = datetime.datetime.now(datetime.UTC) - datetime.timedelta(hours=1)
        for m in machines:
            await q.set_agent_started(m, old, KEY)

    await bmdb_conn.transact(setup)
    claimed: list[uuid.UUID] = []
    async with bmdb_conn.session("test-recoverer") as sess:
        for _ in range(16):

            async def source(q: Queries) -> list[uuid.UUID]:
                return [m.machine_id for m in await q.machines_for_agent_recovery(1)]

            work = await sess.work(Process.SHEPHERD_RECOVERY, source)
            claimed.append(work.machine_id)
    assert len(set(claimed)) == 16
    # In creation order they would be exactly the 16 oldest.
    assert set(claimed) != set(machines[:16])


async def test_heartbeat_batch_judges_each_member_and_writes_the_accepted(
    bmdb_conn: bmdb.Connection,
) -> None:
    """One statement for several machines: unknown keys and replays are refused
    per member, the others written, with their reports."""
    good, replayed, wrong_key, never_started = await add_provided_machines(bmdb_conn, 4)

    async def start(q: Queries) -> None:
        now = datetime.datetime.now(datetime.UTC)
        for machine in (good, replayed, wrong_key):
            await q.set_agent_started(machine, now, KEY)
        assert await q.record_agent_heartbeat(replayed, KEY, 50) is HeartbeatOutcome.ACCEPTED

    await bmdb_conn.transact(start)
    beats = [
        AgentHeartbeat(good, KEY, 10, b"good-report"),
        AgentHeartbeat(replayed, KEY, 50, b"replayed-report"),
        AgentHeartbeat(wrong_key, OTHER_KEY, 10, b"r"),
        AgentHeartbeat(never_started, KEY, 10, None),
    ]

    async def record(q: Queries) -> list[HeartbeatOutcome]:
        return await q.record_agent_heartbeats(beats)

    assert await bmdb_conn.transact(record) == [
        HeartbeatOutcome.ACCEPTED,
        HeartbeatOutcome.REPLAYED,
        HeartbeatOutcome.UNKNOWN_AGENT,
        HeartbeatOutcome.UNKNOWN_AGENT,
    ]
    at, report = await _state(bmdb_conn, good)
    assert at is not None and report == b"good-report"
    assert (await _state(bmdb_conn, replayed))[1] is None
    assert await _state(bmdb_conn, wrong_key) == (None, None)
    assert await _state(bmdb_conn, never_started) == (None, None)


async def test_heartbeat_batch_with_a_machine_twice_is_refused_whole(
    bmdb_conn: bmdb.Connection,
) -> None:
    (machine,) = await add_provided_machines(bmdb_conn, 1)

    async def record(q: Queries) -> list[HeartbeatOutcome]:
        await q.set_agent_started(machine, datetime.datetime.now(datetime.UTC), KEY)
        return await q.record_agent_heartbeats(
            [AgentHeartbeat(machine, KEY, 10), AgentHeartbeat(machine, KEY, 11)]
        )

    with pytest.raises(InvalidArgument):
        await bmdb_conn.transact(record)
    assert await _state(bmdb_conn, machine) == (None, None)


async def test_seen_floor_follows_every_writer(bmdb_conn: bmdb.Connection) -> None:
    """The recovery source's index key (migration 0007) is the last sign of
    life rounded down to 5 minutes, whoever writes the start or the
    heartbeat: the start, a heartbeat set or recorded, one moved back, and
    the heartbeat's deletion (back to the start)."""
    (machine,) = await add_provided_machines(bmdb_conn, 1)
    now = datetime.datetime.now(datetime.UTC)

    async def floor_and_expected(q: Queries) -> tuple[object, object]:
        [(floor, expected)] = await q.execute(
            """SELECT a.agent_seen_floor, agent_seen_floor(coalesce(
                          (SELECT agent_heartbeat_at FROM machine_agent_heartbeat h
                           WHERE h.machine_id = a.machine_id), a.agent_started_at),
                          a.machine_id)
               FROM machine_agent_started a WHERE a.machine_id = %s""",
            (machine,),
        )
        return floor, expected

    hours = datetime.timedelta(hours=1)

    async def started(q: Queries) -> None:
        await q.set_agent_started(machine, now - 3 * hours, KEY)

    async def heartbeat_set(q: Queries) -> None:
        await q.set_agent_heartbeat(machine, now - hours)

    async def heartbeat_recorded(q: Queries) -> None:
        await q.record_agent_heartbeat(machine, KEY, 5)

    async def heartbeat_moved_back(q: Queries) -> None:
        await q.set_agent_heartbeat(machine, now - 2 * hours)

    async def heartbeat_deleted(q: Queries) -> None:
        await q.delete_agent_heartbeat(machine)

    floors = []
    for step in (
        started,
        heartbeat_set,
        heartbeat_recorded,
        heartbeat_moved_back,
        heartbeat_deleted,
    ):

        async def fn(
            q: Queries, step: Callable[[Queries], Awaitable[None]] = step
        ) -> tuple[object, object]:
            await step(q)
            return await floor_and_expected(q)

        floor, expected = await bmdb_conn.transact(fn)
        assert floor == expected, step.__name__
        floors.append(floor)
    # Every step moved it (hours apart, each in its own 5 minutes), the last
    # one back to the start's.
    assert len(set(floors[:4])) == 4 and floors[4] == floors[0]


async def test_seen_floors_of_machines_are_spread_over_five_minutes(
    bmdb_conn: bmdb.Connection,
) -> None:
    """Each machine's 5 minutes start at an offset of its own: at one
    instant, 300 machines with ids 0 to 299 have 300 different floors, all
    in the last 5 minutes (so heartbeats cross into the next 5 minutes
    spread out, not all at once)."""

    async def fn(q: Queries) -> tuple[int, bool]:
        [(distinct, within)] = await q.execute(
            """SELECT count(DISTINCT f), bool_and(f <= now() AND f > now() - interval '5 minutes')
               FROM (SELECT agent_seen_floor(now(), ('00000000-0000-0000-0000-'
                                                     || lpad(to_hex(g), 12, '0'))::uuid) f
                     FROM generate_series(0, 299) g) floors"""
        )
        return int(distinct), bool(within)

    assert await bmdb_conn.transact(fn) == (300, True)
