"""The demo's takeover phase, as the BMDB shows it: the machines file the
static provider reads, each machine's outcome, and the wait until every
machine has its expected one (the good ones heartbeating with a hardware
report, the broken ones failed); `Progress` logs what changed.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import trio

import bmdb
from bmdb.model import MachineSummary, Queries, WorkEvent
from shepherd.localfleet import FleetMachine

logger = logging.getLogger("shepherd.demo_takeover")


@dataclass(frozen=True)
class Outcome:
    """What the BMDB says happened to one machine."""

    provider_id: str
    address: str
    agent_key: bytes | None
    failure: str | None
    heartbeat_at: datetime.datetime | None = None
    hardware_report: bool = False


def write_machines_file(path: Path, machines: Sequence[FleetMachine]) -> list[str]:
    """List ``machines`` in the static provider's format; return their ids."""
    ids = [f"demo-{i:03d}" for i in range(len(machines))]
    entries = "".join(
        f'\n[[machine]]\nid = "{machine_id}"\naddress = "{machine.host}"\n'
        f'port = {machine.port}\nlocation = "loopback"\n'
        for machine_id, machine in zip(ids, machines, strict=True)
    )
    path.write_text("# Machines of the demo fleet, as the static provider reads them.\n" + entries)
    return ids


async def outcomes(conn: bmdb.Connection) -> list[Outcome]:
    """Every machine's outcome so far, in BMDB order (oldest first)."""

    async def fn(q: Queries) -> list[Outcome]:
        result = []
        summaries: list[MachineSummary] = await q.machines()
        for m in summaries:
            if m.provided is None:
                continue
            key = None
            if m.agent_started_at is not None:
                started = await q.agent_started(m.machine_id)
                key = started.public_key if started else None
            failure = None
            if key is None:
                failed = [h for h in await q.history(m.machine_id) if h.event is WorkEvent.FAILED]
                failure = failed[-1].cause if failed else None
            address = f"{m.provided.address}"
            result.append(
                Outcome(
                    m.provided.provider_id,
                    address,
                    key,
                    failure,
                    m.agent_heartbeat_at,
                    m.has_hardware_report,
                )
            )
        return result

    return await conn.transact(fn, isolation=bmdb.Isolation.REPEATABLE_READ)


class Progress:
    """Logs a ``progress:`` line for each thing whose state changed since the last look."""

    def __init__(self) -> None:
        self._last: dict[str, str] = {}

    def show(self, what: str, state: str) -> None:
        if self._last.get(what) != state:
            self._last[what] = state
            logger.info("progress: %s: %s", what, state)


async def watch_takeover(
    conn: bmdb.Connection, expected: dict[str, bool], progress: Progress
) -> tuple[bool, list[Outcome]]:
    """Look every second, saying what changed, until every machine has its
    expected outcome: the good ones an agent that heartbeats with its
    hardware report, the broken ones (those ``expected`` marks False) a
    failure. Callers bound it."""
    broken = sum(not good for good in expected.values())
    while True:
        await trio.sleep(1)
        results = await outcomes(conn)
        started = sum(o.agent_key is not None for o in results)
        failed = sum(o.failure is not None and o.agent_key is None for o in results)
        beating = sum(o.heartbeat_at is not None and o.hardware_report for o in results)
        progress.show(
            "takeover",
            f"{started}/{len(expected)} agents started, {beating} heartbeating with a hardware "
            f"report, {failed}/{len(expected)} machines failed (expected {broken})",
        )
        for o in results:
            if o.failure is not None and o.agent_key is None:
                progress.show(
                    o.provider_id, f"takeover failed, retrying after backoff: {o.failure}"
                )
        if len(results) == len(expected) and all(
            (o.agent_key is not None) == expected[o.provider_id]
            and (expected[o.provider_id] or o.failure is not None)
            and (not expected[o.provider_id] or (o.heartbeat_at and o.hardware_report))
            for o in results
        ):
            return True, results
