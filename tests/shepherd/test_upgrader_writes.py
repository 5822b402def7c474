"""The upgrader's first gate: every machine of a run writes the image at once
(``shepherd.upgrade.ask_writes``), and no node goes down before all wrote it.

Against a real BMDB, with the agents' reports recorded as the agent callback
server records them (`Queries.record_upgrade_report` on the generation the
heartbeat carried) and the upgrader's real control loop; without the
cluster owner's credentials, which the writes gate comes before: so a
machine that passes it says "no owner credentials", and none is requested.
"""

from __future__ import annotations

import time
import uuid

import trio

import bmdb
from bmdb import Backoff, Process, Queries
from bmdb.model import AgentHeartbeat, MachineUpgrade, UpgradePlanEntry, UpgradeRun
from shepherd.control_loop import start_control_loop
from shepherd.proto.agent_callback import UpgradeRequest
from shepherd.rate_limit import Rate, RateLimiter
from shepherd.upgrade import ask_writes
from shepherd.upgrader import Upgrader
from tests.bmdb.test_upgrade_runs import NEW, OLD, _installed
from tests.shepherd.helpers import events

FAST = Backoff(initial=0.2, maximum=0.5, exponent=1.5)


async def _run(conn: bmdb.Connection, phases: list[tuple[uuid.UUID, int]]) -> UpgradeRun:
    """A run made as `shepherd upgrade` makes it: its writes asked at once."""

    async def body(q: Queries) -> UpgradeRun:
        entries = [
            UpgradePlanEntry(mid, phase, position, "disk0", OLD)
            for position, (mid, phase) in enumerate(phases)
        ]
        run = await q.create_upgrade_run(
            image_digest=NEW,
            os_image=b"",
            max_unavailable=1,
            health_timeout=60,
            requested_by="tester",
            machines=entries,
        )
        await ask_writes(q, run, entries)
        return run

    return await conn.transact(body, isolation=bmdb.Isolation.SERIALIZABLE)


async def _carried(conn: bmdb.Connection, mid: uuid.UUID, n: int) -> UpgradeRequest | None:
    """The upgrade request the heartbeat answer of machine ``mid`` (the
    ``n``th of `_installed`, whose agent key it has) carries."""

    async def body(q: Queries) -> bytes | None:
        [result] = await q.record_agent_heartbeats_pending(
            [AgentHeartbeat(mid, bytes([n + 100]) * 32, time.time_ns(), None)]
        )
        return result.upgrade_request

    raw = await conn.transact(body)
    return None if raw is None else UpgradeRequest.parse(raw)


async def _report(
    conn: bmdb.Connection, run: UpgradeRun, mid: uuid.UUID, state: str, detail: str
) -> None:
    """The agent's report on the generation of its write request."""
    g = (await _machines(conn, run))[mid].generation
    assert g is not None
    assert await conn.transact(lambda q: q.record_upgrade_report(mid, g, state, detail, "b"))


async def _machines(conn: bmdb.Connection, run: UpgradeRun) -> dict[uuid.UUID, MachineUpgrade]:
    members = await conn.transact(lambda q: q.upgrade_machines(run.run_id))
    return {m.machine_id: m for m, _ in members}


async def _finished(conn: bmdb.Connection, run: UpgradeRun) -> UpgradeRun:
    while True:
        now = await conn.transact(lambda q: q.upgrade_run(run.run_id))
        assert now is not None
        if now.finished_at is not None:
            return now
        await trio.sleep(0.1)


def _loop(nursery: trio.Nursery, conn: bmdb.Connection, upgrader: Upgrader) -> None:
    start_control_loop(nursery, conn, upgrader, parallelism=2, limiter=RateLimiter(Rate(0.01, 4)))


async def test_every_machine_is_asked_to_write_at_once_without_activating(
    bmdb_conn: bmdb.Connection,
) -> None:
    """The run's start carries a write (no activate) to every machine, of the
    generation the upgrader activates later; a stopped run carries none."""
    ids = await _installed(bmdb_conn, 3)
    run = await _run(bmdb_conn, [(ids[0], 0), (ids[1], 1), (ids[2], 1)])
    for n, mid in enumerate(ids):
        carried = await _carried(bmdb_conn, mid, n)
        assert carried is not None
        assert (carried.generation, carried.activate, carried.root_device) == (1, False, "disk0")
    # The report on a pending machine's write is stored.
    await _report(bmdb_conn, run, ids[0], "written", "slot b holds it")
    assert (await _machines(bmdb_conn, run))[ids[0]].agent_state == "written"
    assert await bmdb_conn.transact(lambda q: q.stop_upgrade_run(run.run_id, "operator"))
    assert [await _carried(bmdb_conn, mid, n) for n, mid in enumerate(ids)] == [None] * 3


async def test_a_failed_write_stops_the_run_before_any_node_goes_down(
    bmdb_conn: bmdb.Connection,
) -> None:
    worker, member, other = await _installed(bmdb_conn, 3)
    run = await _run(bmdb_conn, [(worker, 0), (member, 1), (other, 1)])
    await _report(bmdb_conn, run, worker, "written", "slot b holds it")
    await _report(bmdb_conn, run, other, "written", "slot b holds it")
    await _report(bmdb_conn, run, member, "failed", "download: the image server said 404")
    async with trio.open_nursery() as nursery:
        _loop(nursery, bmdb_conn, Upgrader(None, poll=0.1, wait_backoff=FAST))
        with trio.fail_after(60):
            stopped = await _finished(bmdb_conn, run)
        nursery.cancel_scope.cancel()
    assert stopped.stop_cause is not None
    assert f"machine {member} failed" in stopped.stop_cause
    assert "writing the image: the agent: download: the image server said 404" in (
        stopped.stop_cause
    )
    rows = await _machines(bmdb_conn, run)
    # Nobody was asked to go down: the worker, first in order, still pending.
    assert all(m.requested_at is None for m in rows.values())
    assert [rows[m].state for m in (worker, member, other)] == ["pending", "failed", "pending"]
    history = await events(bmdb_conn, worker, Process.SHEPHERD_UPGRADE)
    assert any(f"machine {member} failed" in cause for _, cause in history)


async def test_no_node_goes_down_while_a_machine_still_writes(
    bmdb_conn: bmdb.Connection,
) -> None:
    worker, member = await _installed(bmdb_conn, 2)
    run = await _run(bmdb_conn, [(worker, 0), (member, 1)])
    await _report(bmdb_conn, run, worker, "written", "slot b holds it")
    async with trio.open_nursery() as nursery:
        _loop(nursery, bmdb_conn, Upgrader(None, poll=0.1, wait_backoff=FAST))
        with trio.fail_after(60):
            while (await _machines(bmdb_conn, run))[worker].detail is None:  # noqa: ASYNC110
                await trio.sleep(0.1)
        waiting = (await _machines(bmdb_conn, run))[worker]
        assert waiting.detail == "waiting: 1 machine(s) of the run still writing the image"
        assert waiting.requested_at is None
        # The member's write done: the worker passes the gate (and meets the
        # next: the cluster's view, which this upgrader has no way into).
        await _report(bmdb_conn, run, member, "written", "slot b holds it")
        with trio.fail_after(60):
            while not any(  # noqa: ASYNC110 (the state is in Postgres)
                "no owner credentials" in cause
                for _, cause in await events(bmdb_conn, worker, Process.SHEPHERD_UPGRADE)
            ):
                await trio.sleep(0.1)
        nursery.cancel_scope.cancel()
    assert all(m.requested_at is None for m in (await _machines(bmdb_conn, run)).values())


async def test_a_write_never_reported_stops_the_run(bmdb_conn: bmdb.Connection) -> None:
    """An agent that never reports its write (its machine off, say) stops the
    run once the stage allowance from the run's start is over, naming it."""
    worker, member = await _installed(bmdb_conn, 2)
    run = await _run(bmdb_conn, [(worker, 0), (member, 1)])
    await _report(bmdb_conn, run, worker, "written", "slot b holds it")
    async with trio.open_nursery() as nursery:
        _loop(nursery, bmdb_conn, Upgrader(None, poll=0.1, stage_allowance=1, wait_backoff=FAST))
        with trio.fail_after(60):
            stopped = await _finished(bmdb_conn, run)
        nursery.cancel_scope.cancel()
    assert stopped.stop_cause is not None
    assert f"machine {member} failed: no report of its write of the image" in stopped.stop_cause
    assert all(m.requested_at is None for m in (await _machines(bmdb_conn, run)).values())
