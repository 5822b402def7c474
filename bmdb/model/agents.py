"""The agent on a machine: its start, its heartbeats and hardware report,
and the requests its heartbeats carry back.

The initializer records an agent's start and key (`set_agent_started`);
the agent callback server authenticates and records heartbeats, a batch in
one statement (`record_agent_heartbeats_pending`), and answers each with
the machine's pending OS installation or upgrade request, read in the same
statement; the recoverer forgets a silent agent (`delete_agent_started`).
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bmdb.errors import InvalidArgument
from bmdb.model import rows as records
from bmdb.model.base import QueriesBase
from bmdb.model.checks import as_uuid, check_aware
from bmdb.model.machines import PROVIDED_COLUMNS, provided_from_row

AGENT_STARTED_COLUMNS = "a.machine_id, a.agent_started_at, a.agent_public_key"


# What an agent is carried, in the words of the statements below (each
# reads it once): an installation request ``q`` with no report of its
# generation or a later one; an upgrade ``mu`` with a request, requested
# (the upgrader activated it) until the upgrader ends it, or pending in the
# running run (its write). A machine asked to be decommissioned keeps its
# generations but is carried no request (`_unless_decommissioned`).
_INSTALL_UNREPORTED = """NOT EXISTS (SELECT 1 FROM machine_os_installation_report p
                      WHERE p.machine_id = q.machine_id AND p.generation >= q.generation)"""
_UPGRADE_CARRIED = """mu.request_raw IS NOT NULL AND mu.state IN ('pending', 'requested')
          AND (mu.state = 'requested'
               OR EXISTS (SELECT 1 FROM upgrade_run ur
                          WHERE ur.run_id = mu.run_id AND ur.finished_at IS NULL))"""
_NOT_DECOMMISSIONED = "NOT EXISTS (SELECT 1 FROM machine_decommission dc WHERE dc.machine_id = {})"


def _unless_decommissioned(machine: str, request: str) -> str:
    """SQL: ``request``, or NULL if the machine ``machine`` is asked to be
    decommissioned."""
    return f"CASE WHEN {_NOT_DECOMMISSIONED.format(machine)} THEN {request} END"


# One statement authenticates a heartbeat and records it: the agent's key
# must be the one of the AgentStarted tag, and the request time newer than
# the last accepted one; the hardware report is written only with an
# accepted heartbeat. Counts say which check failed.
#
# Safe under READ COMMITTED (what the callback server uses: SERIALIZABLE's
# page-level predicate locks made concurrent heartbeats of different
# machines abort each other): FOR KEY SHARE holds the AgentStarted row, so a
# recoverer deleting it either waits for the heartbeat to commit (and then
# deletes its row too), or has deleted it first, and the heartbeat then
# finds no row and writes nothing.
# Heartbeats of several machines in one statement (the agent callback
# server commits concurrent heartbeats as a group). Each request row is
# authenticated against its machine's AgentStarted key; authenticated ones
# with a newer request time are written. The inserts go in machine-id order
# so that two concurrent groups lock heartbeat rows in the same order.
# The arrays go in binary (%b): psycopg's text array dumper quotes every
# element through regular expressions, which was most of a heartbeat's
# database CPU in the callback server (bench/heartbeat.py). Only refused
# heartbeats come back as rows (the common case: none to load), and
# accepted ones whose machine has an OS installation request with no report
# of its generation or a later one: the request travels back in the
# heartbeat's answer, read in the same statement so that the answers cost
# no query of their own (the main query sees the tables as they were before
# the statement, which its CTEs do not change). A machine asked to be
# decommissioned gets the generation (a report on it is still stored: the
# decommissioner must learn of a node the install started) but not the
# request: its agent is never sent an install from then on. The same for a
# machine's upgrade request (machine_upgrade, migration 0011), probed by its
# partial index: a requested one (the upgrader activated it) carried until
# the upgrader ends it, else a pending one of the running run (its write).
_RECORD_HEARTBEATS = f"""
    WITH req AS (
        SELECT * FROM unnest(
            %(machine_ids)b::uuid[], %(keys)b::bytea[], %(times)b::bigint[], %(reports)b::bytea[]
        ) WITH ORDINALITY AS r(machine_id, key, time_ns, report, ord)
    ), auth AS (
        SELECT r.machine_id, r.time_ns, r.report FROM req r
        JOIN machine_agent_started s
          ON s.machine_id = r.machine_id AND s.agent_public_key = r.key
        FOR KEY SHARE OF s
    ), beat AS (
        INSERT INTO machine_agent_heartbeat AS h
            (machine_id, agent_heartbeat_at, agent_request_time_ns)
        SELECT machine_id, now(), time_ns FROM auth ORDER BY machine_id
        ON CONFLICT (machine_id) DO UPDATE
        SET agent_heartbeat_at = EXCLUDED.agent_heartbeat_at,
            agent_request_time_ns = EXCLUDED.agent_request_time_ns
        WHERE h.agent_request_time_ns < EXCLUDED.agent_request_time_ns
        RETURNING machine_id
    ), report AS (
        INSERT INTO machine_hardware_report (machine_id, hardware_report_raw)
        SELECT a.machine_id, a.report FROM auth a JOIN beat b USING (machine_id)
        WHERE a.report IS NOT NULL
        ORDER BY a.machine_id
        ON CONFLICT (machine_id) DO UPDATE
        SET hardware_report_raw = EXCLUDED.hardware_report_raw
        RETURNING 1
    )
    SELECT r.ord,
           EXISTS (SELECT 1 FROM auth a WHERE a.machine_id = r.machine_id),
           NULL::bigint, NULL::bytea, NULL::bigint, NULL::bytea
    FROM req r
    WHERE NOT EXISTS (SELECT 1 FROM beat b WHERE b.machine_id = r.machine_id)
    UNION ALL
    SELECT r.ord, true, q.generation,
           {_unless_decommissioned("r.machine_id", "q.os_installation_request_raw")},
           NULL::bigint, NULL::bytea
    FROM req r
    JOIN beat b ON b.machine_id = r.machine_id
    JOIN machine_os_installation_request q ON q.machine_id = r.machine_id
    WHERE {_INSTALL_UNREPORTED}
    UNION ALL
    SELECT r.ord, true, NULL::bigint, NULL::bytea, u.generation,
           {_unless_decommissioned("r.machine_id", "u.request_raw")}
    FROM req r
    JOIN beat b ON b.machine_id = r.machine_id
    JOIN LATERAL (
        SELECT mu.generation, mu.request_raw FROM machine_upgrade mu
        WHERE mu.machine_id = r.machine_id
          AND {_UPGRADE_CARRIED}
        ORDER BY mu.state = 'requested' DESC LIMIT 1) u ON true
"""


# A machine's pending request as `_RECORD_HEARTBEATS` reads it, alone.
_AGENT_PENDING = f"""
    SELECT q.generation, {_unless_decommissioned("q.machine_id", "q.os_installation_request_raw")}
    FROM machine_os_installation_request q
    WHERE q.machine_id = %s AND {_INSTALL_UNREPORTED}
"""

# A machine's carried upgrade request as `_RECORD_HEARTBEATS` reads it, alone.
_AGENT_PENDING_UPGRADE = f"""
    SELECT mu.generation, {_unless_decommissioned("mu.machine_id", "mu.request_raw")}
    FROM machine_upgrade mu
    WHERE mu.machine_id = %s AND {_UPGRADE_CARRIED}
    ORDER BY mu.state = 'requested' DESC LIMIT 1
"""

_MACHINES_WITH_AGENT_REQUESTS = f"""
    SELECT q.machine_id FROM machine_os_installation_request q
    WHERE {_INSTALL_UNREPORTED} AND {_NOT_DECOMMISSIONED.format("q.machine_id")}
    UNION
    SELECT mu.machine_id FROM machine_upgrade mu
    WHERE {_UPGRADE_CARRIED} AND {_NOT_DECOMMISSIONED.format("mu.machine_id")}
"""


class HeartbeatOutcome(enum.Enum):
    """What `Queries.record_agent_heartbeat` did."""

    ACCEPTED = "accepted"
    #: No started agent with this key on this machine (or no such machine).
    UNKNOWN_AGENT = "unknown agent"
    #: The request time is not newer than the last accepted one.
    REPLAYED = "replayed"


@dataclass(frozen=True)
class AgentHeartbeat:
    """One agent's heartbeat request, as `Queries.record_agent_heartbeats` takes it."""

    machine_id: uuid.UUID
    public_key: bytes
    #: The agent's request time (ns since the epoch): must grow per machine.
    request_time_ns: int
    #: The raw AgentHardwareReport, if the request carried one.
    hardware_report: bytes | None = None


@dataclass(frozen=True)
class HeartbeatResult:
    """What `Queries.record_agent_heartbeats_pending` did with one heartbeat."""

    outcome: HeartbeatOutcome
    #: Accepted heartbeats only: the machine's stored OS installation request
    #: (raw OSInstallationRequest) and its generation, if no report of that
    #: generation (or a later one) is stored. A machine being decommissioned
    #: has the generation (a report on it is stored) but no request to carry.
    installation_request: bytes | None = None
    installation_generation: int | None = None
    #: The same of the machine's requested upgrade (raw UpgradeRequest, its
    #: generation): carried until the upgrader ends it.
    upgrade_request: bytes | None = None
    upgrade_generation: int | None = None

    def with_installation(self, generation: int, request: bytes | None) -> HeartbeatResult:
        """This result carrying the installation request of ``generation``
        (None: the machine is being decommissioned), as read from a row."""
        return dataclasses.replace(
            self,
            installation_request=None if request is None else bytes(request),
            installation_generation=int(generation),
        )

    def with_upgrade(self, generation: int, request: bytes | None) -> HeartbeatResult:
        """This result carrying the upgrade request of ``generation``, as
        `with_installation`."""
        return dataclasses.replace(
            self,
            upgrade_request=None if request is None else bytes(request),
            upgrade_generation=int(generation),
        )


_ACCEPTED = HeartbeatResult(HeartbeatOutcome.ACCEPTED)


class AgentQueries(QueriesBase):
    """A machine's agent: its start, heartbeats, hardware report, and the
    requests its heartbeats carry."""

    async def set_agent_started(
        self, machine_id: uuid.UUID | str, started_at: datetime.datetime, public_key: bytes
    ) -> None:
        """Record that the agent runs on the machine with ``public_key``."""
        if not public_key:
            raise InvalidArgument("public_key must not be empty")
        await self.execute(
            """INSERT INTO machine_agent_started (machine_id, agent_started_at, agent_public_key)
               VALUES (%s, %s, %s)
               ON CONFLICT (machine_id) DO UPDATE
               SET agent_started_at = EXCLUDED.agent_started_at,
                   agent_public_key = EXCLUDED.agent_public_key""",
            (as_uuid(machine_id), check_aware(started_at), bytes(public_key)),
        )

    async def agent_started(self, machine_id: uuid.UUID | str) -> records.AgentStarted | None:
        """The machine's agent-started tag, or None if no agent was started on it."""
        rows = await self.execute(
            f"""SELECT a.machine_id, a.agent_started_at, a.agent_public_key, {PROVIDED_COLUMNS}
                FROM machine_agent_started a
                LEFT JOIN machine_provided p ON p.machine_id = a.machine_id
                WHERE a.machine_id = %s""",
            (as_uuid(machine_id),),
        )
        return agent_started_from_row(rows[0]) if rows else None

    async def authenticate_agent(self, machine_id: uuid.UUID | str, public_key: bytes) -> bool:
        """True if the machine's started agent has exactly ``public_key``."""
        rows = await self.execute(
            """SELECT 1 FROM machine_agent_started
               WHERE machine_id = %s AND agent_public_key = %s""",
            (as_uuid(machine_id), bytes(public_key)),
        )
        return bool(rows)

    async def set_agent_heartbeat(self, machine_id: uuid.UUID | str, at: datetime.datetime) -> None:
        """Record a heartbeat of the machine's agent."""
        await self.execute(
            """INSERT INTO machine_agent_heartbeat (machine_id, agent_heartbeat_at) VALUES (%s, %s)
               ON CONFLICT (machine_id) DO UPDATE
               SET agent_heartbeat_at = EXCLUDED.agent_heartbeat_at""",
            (as_uuid(machine_id), check_aware(at)),
        )

    async def set_hardware_report(self, machine_id: uuid.UUID | str, report: bytes) -> None:
        """Store the agent's (serialized) hardware report of the machine."""
        await self.execute(
            """INSERT INTO machine_hardware_report (machine_id, hardware_report_raw) VALUES (%s, %s)
               ON CONFLICT (machine_id) DO UPDATE
               SET hardware_report_raw = EXCLUDED.hardware_report_raw""",
            (as_uuid(machine_id), bytes(report)),
        )

    async def record_agent_heartbeat(
        self,
        machine_id: uuid.UUID | str,
        public_key: bytes,
        request_time_ns: int,
        hardware_report: bytes | None = None,
    ) -> HeartbeatOutcome:
        """Authenticate and record one heartbeat, at the database's ``now()``.

        Accepted only if ``public_key`` is the key of the machine's started
        agent and ``request_time_ns`` is newer than that of the last accepted
        heartbeat; then the heartbeat (and ``hardware_report``, if given) is
        written. Otherwise nothing is written.
        """
        (outcome,) = await self.record_agent_heartbeats(
            [AgentHeartbeat(as_uuid(machine_id), public_key, request_time_ns, hardware_report)]
        )
        return outcome

    async def record_agent_heartbeats(
        self, beats: Sequence[AgentHeartbeat]
    ) -> list[HeartbeatOutcome]:
        """`record_agent_heartbeat` for several machines in one statement.

        Returns one outcome per beat, in order; each beat is judged on its
        own (one unknown key does not refuse the others). Raises
        `InvalidArgument`, writing nothing, if a machine appears twice (one
        statement cannot order two updates of one row) or a time is out of
        range.
        """
        return [r.outcome for r in await self.record_agent_heartbeats_pending(beats)]

    async def record_agent_heartbeats_pending(
        self, beats: Sequence[AgentHeartbeat]
    ) -> list[HeartbeatResult]:
        """`record_agent_heartbeats`, and for each accepted beat the machine's
        pending OS installation request (one whose generation has no report
        stored yet), in the same statement. Raises as `record_agent_heartbeats`."""
        ids = [as_uuid(b.machine_id) for b in beats]
        if len(set(ids)) != len(ids):
            raise InvalidArgument("a machine appears twice in one heartbeat batch")
        for b in beats:
            t = b.request_time_ns
            if not isinstance(t, int) or not 0 < t < 2**63:
                raise InvalidArgument(f"request time out of range: {t!r}")
        if not beats:
            return []
        rows = await self.execute(
            _RECORD_HEARTBEATS,
            {
                "machine_ids": ids,
                "keys": [bytes(b.public_key) for b in beats],
                "times": [b.request_time_ns for b in beats],
                "reports": [
                    None if b.hardware_report is None else bytes(b.hardware_report) for b in beats
                ],
            },
        )
        # Only the refused and those with a pending request come back (the
        # common case is none).
        results = [_ACCEPTED] * len(beats)
        for ordinal, authenticated, generation, request, upgrade_gen, upgrade in rows:
            before = results[ordinal - 1]
            if generation is not None:
                results[ordinal - 1] = before.with_installation(generation, request)
            elif upgrade_gen is not None:
                results[ordinal - 1] = before.with_upgrade(upgrade_gen, upgrade)
            else:
                results[ordinal - 1] = HeartbeatResult(
                    HeartbeatOutcome.REPLAYED if authenticated else HeartbeatOutcome.UNKNOWN_AGENT
                )
        return results

    async def agent_pending(self, machine_id: uuid.UUID | str) -> HeartbeatResult:
        """What an accepted heartbeat of the machine's agent would be answered
        with now (`record_agent_heartbeats_pending`'s result for it), without
        writing a heartbeat: for an answer held until a request appears."""
        result = _ACCEPTED
        rows = await self.execute(_AGENT_PENDING, (as_uuid(machine_id),))
        if rows:
            [(generation, request)] = rows
            result = result.with_installation(generation, request)
        rows = await self.execute(_AGENT_PENDING_UPGRADE, (as_uuid(machine_id),))
        if rows:
            [(generation, request)] = rows
            result = result.with_upgrade(generation, request)
        return result

    async def machines_with_agent_requests(self) -> set[uuid.UUID]:
        """The machines whose agents have a request to carry (the pending OS
        installation and upgrade requests of machines not being
        decommissioned): what a
        listener on `channels.AGENT_REQUEST` reads when it listens anew."""
        rows = await self.execute(_MACHINES_WITH_AGENT_REQUESTS, ())
        return {machine_id for (machine_id,) in rows}

    async def agent_heartbeat(self, machine_id: uuid.UUID | str) -> datetime.datetime | None:
        """When the machine's agent last heartbeated, or None."""
        rows = await self.execute(
            "SELECT agent_heartbeat_at FROM machine_agent_heartbeat WHERE machine_id = %s",
            (as_uuid(machine_id),),
        )
        return rows[0][0] if rows else None

    async def hardware_report(self, machine_id: uuid.UUID | str) -> bytes | None:
        """The machine's stored (serialized) hardware report, or None."""
        rows = await self.execute(
            "SELECT hardware_report_raw FROM machine_hardware_report WHERE machine_id = %s",
            (as_uuid(machine_id),),
        )
        return bytes(rows[0][0]) if rows else None

    async def delete_agent_started(self, machine_id: uuid.UUID | str) -> None:
        """Forget that an agent runs on the machine (the initializer will start one)."""
        await self.execute(
            "DELETE FROM machine_agent_started WHERE machine_id = %s", (as_uuid(machine_id),)
        )

    async def delete_agent_heartbeat(self, machine_id: uuid.UUID | str) -> None:
        """Forget the machine's last agent heartbeat."""
        await self.execute(
            "DELETE FROM machine_agent_heartbeat WHERE machine_id = %s", (as_uuid(machine_id),)
        )

    async def delete_recovery_request(self, machine_id: uuid.UUID | str) -> None:
        """Forget an operator's request to recover the machine (the recoverer
        does so when it finishes the recovery)."""
        await self.execute(
            "DELETE FROM machine_recovery_request WHERE machine_id = %s", (as_uuid(machine_id),)
        )


def agent_started_from_row(r: Sequence[Any]) -> records.AgentStarted:
    """An `AgentStarted` from (machine_id, started_at, public_key, *provided columns)."""
    return records.AgentStarted(
        machine_id=r[0],
        started_at=r[1],
        public_key=bytes(r[2]),
        provided=provided_from_row(r[3:]) if r[3] is not None else None,
    )
