"""Rolling upgrade runs in the BMDB: one at a time, sourced in their order and
within their limits, carried in heartbeat answers while requested, ended
by the first machine that does not make it."""

from __future__ import annotations

import datetime
import uuid

import pytest

import bmdb
from bmdb.errors import InvalidArgument
from bmdb.model import (
    AgentHeartbeat,
    Queries,
    UpgradePlanEntry,
    UpgradeRun,
    UpgradeState,
)
from tests.bmdb.helpers import add_provided_machines

NEW = "sha256:" + "e" * 64
OLD = "sha256:" + "0" * 64


async def _installed(conn: bmdb.Connection, count: int) -> list[uuid.UUID]:
    ids = await add_provided_machines(conn, count)

    async def body(q: Queries) -> None:
        for n, mid in enumerate(ids):
            await q.set_os_installation_request(
                mid, 1, b"req", root_device="disk0", image_digest=OLD, node_address="10.0.0.1"
            )
            await q.record_os_installation_report(mid, 1, b"ok", True, None, bytes([n]) * 32)
            await q.set_agent_started(
                mid, datetime.datetime.now(datetime.UTC), bytes([n + 100]) * 32
            )

    await conn.transact(body)
    return ids


async def _run(
    conn: bmdb.Connection, phases: list[tuple[uuid.UUID, int]], max_unavailable: int = 1
) -> UpgradeRun:
    async def body(q: Queries) -> UpgradeRun:
        return await q.create_upgrade_run(
            image_digest=NEW,
            os_image=b"image-ref",
            max_unavailable=max_unavailable,
            health_timeout=60,
            requested_by="tester",
            machines=[
                UpgradePlanEntry(mid, phase, position, "disk0", OLD)
                for position, (mid, phase) in enumerate(phases)
            ],
        )

    return await conn.transact(body, isolation=bmdb.Isolation.SERIALIZABLE)


async def _sourced(conn: bmdb.Connection) -> list[uuid.UUID]:
    async def body(q: Queries) -> list[uuid.UUID]:
        return [t.machine.machine_id for t in await q.machines_for_upgrade(10)]

    return await conn.transact(body)


async def _request(conn: bmdb.Connection, run: UpgradeRun, mid: uuid.UUID) -> str | None:
    async def body(q: Queries) -> str | None:
        g = await q.next_upgrade_generation(mid)
        return await q.request_upgrade(run.run_id, mid, g, f"upgrade {g}".encode())

    return await conn.transact(body)


async def test_machines_come_in_phases_and_within_the_limit(bmdb_conn: bmdb.Connection) -> None:
    w1, w2, member, leader = await _installed(bmdb_conn, 4)
    run = await _run(bmdb_conn, [(w1, 0), (w2, 0), (member, 1), (leader, 2)], max_unavailable=2)
    # Only phase 0 while it is not done.
    assert await _sourced(bmdb_conn) == [w1, w2]
    assert await _request(bmdb_conn, run, w1) is None
    assert await _request(bmdb_conn, run, w2) is None
    # The run's room is used: a third would be refused even if asked.
    assert await _sourced(bmdb_conn) == [w1, w2]  # requested ones are taken up again first
    why = await _request(bmdb_conn, run, member)
    assert why == "2 machine(s) of the run are being upgraded (at most 1)"

    async def end(q: Queries, mid: uuid.UUID) -> UpgradeRun | None:
        return await q.end_machine_upgrade(
            run.run_id, mid, UpgradeState.UPGRADED, "ok", slot="B", running_digest=NEW
        )

    await bmdb_conn.transact(lambda q: end(q, w1))
    assert await _sourced(bmdb_conn) == [w2]  # phase 1 waits for w2
    await bmdb_conn.transact(lambda q: end(q, w2))
    assert await _sourced(bmdb_conn) == [member]  # then the member, alone, not the leader
    assert await _request(bmdb_conn, run, member) is None
    assert await _request(bmdb_conn, run, leader) is not None  # phase 2: one at a time
    after = await bmdb_conn.transact(lambda q: end(q, member))
    assert after is not None and after.running
    assert await _sourced(bmdb_conn) == [leader]
    assert await _request(bmdb_conn, run, leader) is None
    after = await bmdb_conn.transact(lambda q: end(q, leader))
    assert after is not None and after.finished_at is not None and after.stop_cause is None
    assert await _sourced(bmdb_conn) == []


async def test_one_run_at_a_time_and_the_first_failure_stops_it(
    bmdb_conn: bmdb.Connection,
) -> None:
    a, b = await _installed(bmdb_conn, 2)
    run = await _run(bmdb_conn, [(a, 0), (b, 0)])
    with pytest.raises(InvalidArgument, match="not finished"):
        await _run(bmdb_conn, [(b, 0)])
    assert await _request(bmdb_conn, run, a) is None

    async def back(q: Queries) -> UpgradeRun | None:
        return await q.end_machine_upgrade(
            run.run_id, a, UpgradeState.ROLLED_BACK, "not healthy within 60 s"
        )

    after = await bmdb_conn.transact(back)
    assert after is not None and after.finished_at is not None
    assert after.stop_cause == f"machine {a} rolled-back: not healthy within 60 s"
    assert await _sourced(bmdb_conn) == []  # b is never asked
    # A new run may start now, and b's generation starts at 1, a's goes on.
    run2 = await _run(bmdb_conn, [(a, 0), (b, 0)])
    assert await _request(bmdb_conn, run2, a) is None
    machines = dict(
        (m.machine_id, m)
        for m, _ in await bmdb_conn.transact(lambda q: q.upgrade_machines(run2.run_id))
    )
    assert machines[a].generation == 2 and machines[b].generation is None


async def test_a_requested_upgrade_rides_on_heartbeats_until_it_ends(
    bmdb_conn: bmdb.Connection,
) -> None:
    [mid] = await _installed(bmdb_conn, 1)
    run = await _run(bmdb_conn, [(mid, 0)])
    beat = 0

    async def heartbeat(q: Queries) -> tuple[bytes | None, int | None]:
        nonlocal beat
        beat += 1
        [result] = await q.record_agent_heartbeats_pending(
            [AgentHeartbeat(mid, bytes([100]) * 32, beat, None)]
        )
        return result.upgrade_request, result.upgrade_generation

    assert await bmdb_conn.transact(heartbeat) == (None, None)
    assert await _request(bmdb_conn, run, mid) is None
    assert await bmdb_conn.transact(heartbeat) == (b"upgrade 1", 1)

    async def report(q: Queries, generation: int) -> bool:
        return await q.record_upgrade_report(mid, generation, "staged", "slot b", "b")

    assert not await bmdb_conn.transact(lambda q: report(q, 2))  # not the requested one
    assert await bmdb_conn.transact(lambda q: report(q, 1))
    [(row, key)] = await bmdb_conn.transact(lambda q: q.upgrade_machines(run.run_id))
    assert (row.agent_state, row.agent_slot, key) == ("staged", "b", bytes([0]) * 32)
    assert await bmdb_conn.transact(heartbeat) == (b"upgrade 1", 1)  # still carried

    async def end(q: Queries) -> UpgradeRun | None:
        return await q.end_machine_upgrade(run.run_id, mid, UpgradeState.UPGRADED, "ok")

    await bmdb_conn.transact(end)
    assert await bmdb_conn.transact(heartbeat) == (None, None)
