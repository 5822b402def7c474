"""`Queries`: the typed SQL of the BMDB, one async method per statement.

A `Queries` is bound to one open transaction; it is handed to the functions
given to `Session.transact`, `Session.work` (the work source) and
`Work.finish`. Methods validate their arguments before touching the
database and raise `InvalidArgument` for bad input (the surrounding
transaction is then rolled back, leaving the database as it was).

Sourcing queries (``machines_for_*``) behave differently inside a work
source: there they lock the rows they return with ``FOR UPDATE SKIP
LOCKED`` so that concurrent workers get disjoint machines, and the
agent-start query picks at random among the oldest `SOURCING_WINDOW`
candidates instead of always taking the very oldest, so parallel workers do
not all race for the same first row. See bmdb/work.py for why that is safe.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import functools
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from bmdb import pgerrors
from bmdb._pg import Params, Row
from bmdb.errors import InvalidArgument
from bmdb.model import channels
from bmdb.model import rows as records
from bmdb.model.enums import Process, Provider, ProviderStatus, WorkEvent

#: How many of the oldest candidates a locking agent-start source picks from.
#: Larger than any sane worker count, so that workers rarely pick the same row.
SOURCING_WINDOW = 64

#: Processes that must not run on one machine at the same time as agent start.
_AGENT_PROCESSES = (Process.SHEPHERD_AGENT_START, Process.SHEPHERD_RECOVERY)

# A machine has live work in one of the processes %(busy)s. Work rows of
# sessions past their deadline do not count: their owner is gone.
_LIVE_WORK = """
    EXISTS (SELECT 1 FROM work w JOIN sessions s ON s.session_id = w.session_id
            WHERE w.machine_id = m.machine_id AND w.process = ANY(%(busy)s::process[])
              AND s.session_deadline > now())
"""

#: An operator's action waits for the machine's work to end (see
#: bmdb/actions.py and migration 0008): no process claims it anew meanwhile.
NOT_PENDING = """
    NOT EXISTS (SELECT 1 FROM machine_pending_action pa
                WHERE pa.machine_id = m.machine_id AND pa.until > now())
"""

#: The machine is not held by an operator (see bmdb/actions.py), nor about
#: to be (`NOT_PENDING`), and not asked to be (or already) decommissioned: no
#: process is offered such a machine (the decommissioner has its own source).
NOT_HELD = f"""
    NOT EXISTS (SELECT 1 FROM machine_hold hd WHERE hd.machine_id = m.machine_id)
    AND {NOT_PENDING}
    AND NOT EXISTS (SELECT 1 FROM machine_decommission dc WHERE dc.machine_id = m.machine_id)
"""

_ACTIVE_BACKOFF = """
    EXISTS (SELECT 1 FROM work_backoff b
            WHERE b.machine_id = m.machine_id AND b.process = %(process)s::process
              AND b.until > now())
"""

_PROVIDED_COLUMNS = """
    p.machine_id, p.provider, p.provider_id, p.provider_address, p.provider_location,
    p.provider_status
"""

_AGENT_START_CANDIDATES = f"""
    SELECT m.machine_id, m.machine_created_at FROM machines m
    JOIN machine_provided p ON p.machine_id = m.machine_id
    WHERE NOT m.agent_started
      AND NOT {_LIVE_WORK}
      AND NOT {_ACTIVE_BACKOFF}
      AND {NOT_HELD}
    ORDER BY m.machine_created_at, m.machine_id
"""

_AGENT_START_LIST = f"""
    SELECT {_PROVIDED_COLUMNS} FROM ({_AGENT_START_CANDIDATES} LIMIT %(limit)s) c
    JOIN machine_provided p ON p.machine_id = c.machine_id
    ORDER BY c.machine_created_at, c.machine_id
"""


@functools.lru_cache(maxsize=16)
def agent_start_lock_sql(limit: int) -> str:
    """The locking agent-start source for ``limit`` machines, with every value
    written into the text rather than sent as a parameter.

    Why: it is the hot statement of every claim, and with parameters
    PostgreSQL planned it afresh on every execution (as costly as running
    it, as pg_stat_statements showed during the benchmark), because a
    generic plan must guess ``LIMIT $n``
    and is several times slower, so the planner kept choosing custom plans.
    Without parameters, a prepared statement keeps its one plan. The values
    are integers and enum members of our own, so nothing is quoted from
    outside; the text varies only with ``limit``.
    """
    busy = "'{" + ",".join(_AGENT_PROCESSES) + "}'"
    candidates = _AGENT_START_CANDIDATES.replace("%(busy)s", busy).replace(
        "%(process)s", f"'{Process.SHEPHERD_AGENT_START}'"
    )
    return f"""
    SELECT {_PROVIDED_COLUMNS} FROM ({candidates} LIMIT {max(SOURCING_WINDOW, limit):d}) c
    JOIN machines m ON m.machine_id = c.machine_id
    JOIN machine_provided p ON p.machine_id = c.machine_id
    ORDER BY random()
    LIMIT {limit:d}
    FOR UPDATE OF m SKIP LOCKED
"""


#: Defaults of the recovery source: how long a started agent may stay
#: silent before its first heartbeat, and after its last one, in seconds.
AGENT_FIRST_HEARTBEAT_TIMEOUT = 30 * 60.0
AGENT_HEARTBEAT_TIMEOUT = 10 * 60.0

#: The node id (`rows.node_id`) of the installation report ``orp``'s key.
_NODE_ID_OF_REPORT = (
    f"('{records.NODE_ID_PREFIX}' || encode(substring(orp.node_public_key FROM 1 FOR 16), 'hex'))"
)

_AGENT_STARTED_COLUMNS = "a.machine_id, a.agent_started_at, a.agent_public_key"


@functools.lru_cache(maxsize=16)
def _agent_recovery(
    limit: int, provider: str | None, first: float, last: float, locking: bool
) -> str:
    """The recovery source: machines whose agent started but went silent,
    those an operator asked to recover first, then the longest silent.

    Its cost is that of the candidates it looks at, not of the fleet: the
    silent are found by a range scan of ``machine_agent_started_seen``
    (``agent_seen_floor``, a lower bound on the last sign of life, see
    migration 0007) below the shorter timeout, each checked against its
    exact heartbeat; live machines are below that bound only when a timeout
    is shorter than 5 minutes and a heartbeat interval.

    Built like `agent_start_lock_sql` and for the same reason: every value is
    written into the text (our own integers, floats and enum members), so a
    prepared statement keeps one plan; and a locking source picks at random
    among the first `SOURCING_WINDOW` candidates, so parallel recoverers do
    not all race for the first row.
    """
    busy = "'{" + ",".join(_AGENT_PROCESSES) + "}'"
    provider_join = (
        f"JOIN machine_provided pf ON pf.machine_id = m.machine_id AND pf.provider = '{provider}'"
        if provider is not None
        else ""
    )
    claimable = f"""
          AND NOT {_LIVE_WORK}
          AND NOT {_ACTIVE_BACKOFF}
          AND {NOT_HELD}
    """
    window = max(SOURCING_WINDOW, limit) if locking else limit
    # Two branches in one Append, so that a LIMIT stops the second one early:
    # the (few) operator requests, then the silent in the floor index's order.
    # Each branch has its own LIMIT: a branch is planned on its own, and
    # without one it is planned for all its rows (hash joins over the fleet
    # and a sort, when most machines are silent, as after an outage of the
    # callback server) instead of for the first few in index order.
    candidates = f"""
        (SELECT m.machine_id, 0 AS rank, rr.requested_at AS since FROM machine_recovery_request rr
         JOIN machines m ON m.machine_id = rr.machine_id
         JOIN machine_agent_started a ON a.machine_id = m.machine_id
         {provider_join}
         WHERE m.agent_started {claimable}
         ORDER BY rr.requested_at, rr.machine_id
         LIMIT {window:d})
        UNION ALL
        (SELECT m.machine_id, 1, a.agent_seen_floor FROM machine_agent_started a
         JOIN machines m ON m.machine_id = a.machine_id
         {provider_join}
         WHERE a.agent_seen_floor < now() - interval '{min(first, last):.6f} s'
           -- The exact check, a probe per candidate: as a scalar subquery,
           -- not a join, which the planner could make a hash join over
           -- every heartbeat when it expects many candidates.
           AND coalesce((SELECT h.agent_heartbeat_at < now() - interval '{last:.6f} s'
                         FROM machine_agent_heartbeat h WHERE h.machine_id = a.machine_id),
                        a.agent_started_at < now() - interval '{first:.6f} s')
           AND NOT EXISTS (SELECT 1 FROM machine_recovery_request rr
                           WHERE rr.machine_id = a.machine_id)
           {claimable}
         ORDER BY a.agent_seen_floor, a.machine_id
         LIMIT {window:d})
    """.replace("%(busy)s", busy).replace("%(process)s", f"'{Process.SHEPHERD_RECOVERY}'")
    order = "random()" if locking else "c.rank, c.since, c.machine_id"
    return f"""
    SELECT {_AGENT_STARTED_COLUMNS}, {_PROVIDED_COLUMNS}
    FROM ({candidates} LIMIT {window:d}) c
    JOIN machines m ON m.machine_id = c.machine_id
    JOIN machine_agent_started a ON a.machine_id = c.machine_id
    LEFT JOIN machine_provided p ON p.machine_id = c.machine_id
    ORDER BY {order}
    LIMIT {limit:d}
    {"FOR UPDATE OF m SKIP LOCKED" if locking else ""}
"""


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
_RECORD_HEARTBEATS = """
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
           CASE WHEN NOT EXISTS (SELECT 1 FROM machine_decommission dc
                                 WHERE dc.machine_id = r.machine_id)
                THEN q.os_installation_request_raw END,
           NULL::bigint, NULL::bytea
    FROM req r
    JOIN beat b ON b.machine_id = r.machine_id
    JOIN machine_os_installation_request q ON q.machine_id = r.machine_id
    WHERE NOT EXISTS (SELECT 1 FROM machine_os_installation_report p
                      WHERE p.machine_id = q.machine_id AND p.generation >= q.generation)
    UNION ALL
    SELECT r.ord, true, NULL::bigint, NULL::bytea, u.generation,
           CASE WHEN NOT EXISTS (SELECT 1 FROM machine_decommission dc
                                 WHERE dc.machine_id = r.machine_id)
                THEN u.request_raw END
    FROM req r
    JOIN beat b ON b.machine_id = r.machine_id
    JOIN LATERAL (
        SELECT mu.generation, mu.request_raw FROM machine_upgrade mu
        WHERE mu.machine_id = r.machine_id
          AND mu.request_raw IS NOT NULL AND mu.state IN ('pending', 'requested')
          AND (mu.state = 'requested'
               OR EXISTS (SELECT 1 FROM upgrade_run ur
                          WHERE ur.run_id = mu.run_id AND ur.finished_at IS NULL))
        ORDER BY mu.state = 'requested' DESC LIMIT 1) u ON true
"""


# A machine's pending request as `_RECORD_HEARTBEATS` reads it, alone.
_AGENT_PENDING = """
    SELECT q.generation,
           CASE WHEN NOT EXISTS (SELECT 1 FROM machine_decommission dc
                                 WHERE dc.machine_id = q.machine_id)
                THEN q.os_installation_request_raw END
    FROM machine_os_installation_request q
    WHERE q.machine_id = %s
      AND NOT EXISTS (SELECT 1 FROM machine_os_installation_report p
                      WHERE p.machine_id = q.machine_id AND p.generation >= q.generation)
"""

# A machine's carried upgrade request as `_RECORD_HEARTBEATS` reads it, alone.
_AGENT_PENDING_UPGRADE = """
    SELECT mu.generation,
           CASE WHEN NOT EXISTS (SELECT 1 FROM machine_decommission dc
                                 WHERE dc.machine_id = mu.machine_id)
                THEN mu.request_raw END
    FROM machine_upgrade mu
    WHERE mu.machine_id = %s
      AND mu.request_raw IS NOT NULL AND mu.state IN ('pending', 'requested')
      AND (mu.state = 'requested'
           OR EXISTS (SELECT 1 FROM upgrade_run ur
                      WHERE ur.run_id = mu.run_id AND ur.finished_at IS NULL))
    ORDER BY mu.state = 'requested' DESC LIMIT 1
"""

_MACHINES_WITH_AGENT_REQUESTS = """
    SELECT q.machine_id FROM machine_os_installation_request q
    WHERE NOT EXISTS (SELECT 1 FROM machine_os_installation_report p
                      WHERE p.machine_id = q.machine_id AND p.generation >= q.generation)
      AND NOT EXISTS (SELECT 1 FROM machine_decommission dc WHERE dc.machine_id = q.machine_id)
    UNION
    SELECT mu.machine_id FROM machine_upgrade mu
    WHERE mu.request_raw IS NOT NULL AND mu.state IN ('pending', 'requested')
      AND (mu.state = 'requested'
           OR EXISTS (SELECT 1 FROM upgrade_run ur
                      WHERE ur.run_id = mu.run_id AND ur.finished_at IS NULL))
      AND NOT EXISTS (SELECT 1 FROM machine_decommission dc WHERE dc.machine_id = mu.machine_id)
"""

# The agent callback server is told that a machine's agent has an upgrade
# request to carry (`channels.AGENT_REQUEST`), as for an installation.
_NOTIFY_AGENT_REQUEST = f"SELECT pg_notify('{channels.AGENT_REQUEST}', %s::text)"


_FOR_PROCESS = f"""
    SELECT m.machine_id FROM machines m
    WHERE NOT {_LIVE_WORK}
      AND NOT {_ACTIVE_BACKOFF}
      AND {NOT_HELD}
    ORDER BY m.machine_created_at, m.machine_id
    LIMIT %(limit)s
"""

_LOCK_SUFFIX = " FOR UPDATE OF m SKIP LOCKED"


class Executor(Protocol):
    """What `Queries` runs its statements on: an open transaction, and the
    role it runs as (named in errors about privileges)."""

    async def execute(self, query: str, params: Params | None = None) -> list[Row]: ...

    @property
    def user(self) -> str: ...


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


_ACCEPTED = HeartbeatResult(HeartbeatOutcome.ACCEPTED)


class Queries:
    """The BMDB's statements, run in the transaction of ``pg``.

    ``locking`` is set by `Session.work` for its source function: sourcing
    queries then lock what they return (see the module docstring).
    """

    def __init__(self, pg: Executor, *, locking: bool = False) -> None:
        self._pg = pg
        self.locking = locking

    async def execute(self, sql: str, params: Params | None = None) -> list[Row]:
        """Run one raw statement in this transaction and return its rows.

        For the BMDB's own session and work statements, and for tools and
        tests that need a statement no method offers; prefer the methods.
        Database errors are raised as `BMDBError`s (see
        `bmdb.pgerrors.as_bmdb_error`), except serialization failures, which the
        surrounding transaction retries.
        """
        try:
            return await self._pg.execute(sql, params)
        except Exception as e:
            translated = pgerrors.as_bmdb_error(e, role=self._pg.user)
            if translated is None or translated is e:
                raise
            raise translated from e

    # Machines and their tags.

    async def new_machine(self) -> uuid.UUID:
        """Create a machine without tags and return its id."""
        rows = await self.execute("INSERT INTO machines DEFAULT VALUES RETURNING machine_id")
        machine_id: uuid.UUID = rows[0][0]
        return machine_id

    async def add_provided(
        self,
        machine_id: uuid.UUID | str,
        provider: Provider | str,
        provider_id: str,
        address: str | None = None,
        location: str | None = None,
        status: ProviderStatus | str = ProviderStatus.UNKNOWN,
    ) -> None:
        """Tag a machine as supplied by ``provider`` under ``provider_id``.

        Raises `InvalidArgument` for an unknown machine, an empty provider id,
        or a provider id already used by another machine of that provider.
        """
        if not provider_id:
            raise InvalidArgument("provider_id must not be empty")
        await self.execute(
            """INSERT INTO machine_provided (machine_id, provider, provider_id, provider_address,
                   provider_location, provider_status)
               VALUES (%s, %s, %s, %s, %s, %s)""",
            (
                as_uuid(machine_id),
                Provider.parse(provider),
                provider_id,
                address,
                location,
                ProviderStatus.parse(status),
            ),
        )

    async def update_provided(
        self,
        machine_id: uuid.UUID | str,
        address: str | None,
        location: str | None,
        status: ProviderStatus | str,
    ) -> bool:
        """Refresh what the provider says about a machine. Returns False if the
        machine has no provider tag."""
        rows = await self.execute(
            """UPDATE machine_provided
               SET provider_address = %s, provider_location = %s, provider_status = %s
               WHERE machine_id = %s RETURNING 1""",
            (address, location, ProviderStatus.parse(status), as_uuid(machine_id)),
        )
        return bool(rows)

    async def provided_by_provider(self, provider: Provider | str) -> list[records.MachineProvided]:
        """Every machine of ``provider``, by provider id."""
        rows = await self.execute(
            f"SELECT {_PROVIDED_COLUMNS} FROM machine_provided p WHERE p.provider = %s"
            " ORDER BY p.provider_id",
            (Provider.parse(provider),),
        )
        return [_provided(r) for r in rows]

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
            (as_uuid(machine_id), _aware(started_at), bytes(public_key)),
        )

    async def agent_started(self, machine_id: uuid.UUID | str) -> records.AgentStarted | None:
        """The machine's agent-started tag, or None if no agent was started on it."""
        rows = await self.execute(
            f"""SELECT a.machine_id, a.agent_started_at, a.agent_public_key, {_PROVIDED_COLUMNS}
                FROM machine_agent_started a
                LEFT JOIN machine_provided p ON p.machine_id = a.machine_id
                WHERE a.machine_id = %s""",
            (as_uuid(machine_id),),
        )
        return _agent_started(rows[0]) if rows else None

    async def set_agent_heartbeat(self, machine_id: uuid.UUID | str, at: datetime.datetime) -> None:
        """Record a heartbeat of the machine's agent."""
        await self.execute(
            """INSERT INTO machine_agent_heartbeat (machine_id, agent_heartbeat_at) VALUES (%s, %s)
               ON CONFLICT (machine_id) DO UPDATE
               SET agent_heartbeat_at = EXCLUDED.agent_heartbeat_at""",
            (as_uuid(machine_id), _aware(at)),
        )

    async def set_hardware_report(self, machine_id: uuid.UUID | str, report: bytes) -> None:
        """Store the agent's (serialized) hardware report of the machine."""
        await self.execute(
            """INSERT INTO machine_hardware_report (machine_id, hardware_report_raw) VALUES (%s, %s)
               ON CONFLICT (machine_id) DO UPDATE
               SET hardware_report_raw = EXCLUDED.hardware_report_raw""",
            (as_uuid(machine_id), bytes(report)),
        )

    async def set_os_installation_request(
        self,
        machine_id: uuid.UUID | str,
        generation: int,
        request: bytes,
        *,
        root_device: str | None = None,
        image_digest: str | None = None,
        node_address: str | None = None,
    ) -> bool:
        """Ask the machine's agent to install an OS: store the serialized
        OSInstallationRequest ``request`` of ``generation``, with the fields
        the views show beside it (the BMDB does not decode the bytes).

        Written only if ``generation`` is newer than the stored request's
        (or none is stored): a request's generation never goes back, so an
        agent that saw generation g never sees another request named g.
        Returns whether it was written; written, a notification on
        `channels.AGENT_REQUEST` names the machine when the transaction
        commits. `InvalidArgument` for a generation
        below 1 or texts PostgreSQL cannot store (NUL) or over
        `MAX_INSTALLATION_TEXT` characters. ``shepherd install`` calls this,
        with every field; a field left out shows as unknown in the views.
        """
        if not isinstance(generation, int) or not 0 < generation < 2**63:
            raise InvalidArgument(f"generation must be a positive integer, got {generation!r}")
        texts = {
            "root_device": root_device,
            "image_digest": image_digest,
            "node_address": node_address,
        }
        for name, value in texts.items():
            if value is not None:
                _check_text(name, value)
        # Written, the agent callback server is told (`channels.AGENT_REQUEST`):
        # it answers the agent's held heartbeat with it at once.
        rows = await self.execute(
            f"""WITH w AS (
                   INSERT INTO machine_os_installation_request AS r
                       (machine_id, generation, os_installation_request_raw,
                        root_device, image_digest, node_address, requested_at)
                   VALUES (%s, %s, %s, %s, %s, %s, now())
                   ON CONFLICT (machine_id) DO UPDATE
                   SET generation = EXCLUDED.generation,
                       os_installation_request_raw = EXCLUDED.os_installation_request_raw,
                       root_device = EXCLUDED.root_device,
                       image_digest = EXCLUDED.image_digest,
                       node_address = EXCLUDED.node_address,
                       requested_at = EXCLUDED.requested_at
                   WHERE r.generation < EXCLUDED.generation
                   RETURNING machine_id)
               SELECT pg_notify('{channels.AGENT_REQUEST}', machine_id::text) FROM w""",
            (
                as_uuid(machine_id),
                generation,
                bytes(request),
                root_device,
                image_digest,
                node_address,
            ),
        )
        return bool(rows)

    async def os_installation(self, machine_id: uuid.UUID | str) -> records.OSInstallation | None:
        """The machine's installation request and the report on it, or None
        if it has no request."""
        rows = await self.execute(
            f"SELECT {INSTALLATION_COLUMNS} FROM machine_os_installation_request oq "
            "LEFT JOIN machine_os_installation_report orp ON orp.machine_id = oq.machine_id "
            "WHERE oq.machine_id = %s",
            (as_uuid(machine_id),),
        )
        return installation_from_row(rows[0]) if rows else None

    async def installation_target(
        self, machine_id: uuid.UUID | str
    ) -> records.InstallationTarget | None:
        """What deciding an installation of the machine needs: its provider
        address, stored hardware report, current installation and an
        operator's hold; None if there is no such machine."""
        rows = await self.execute(
            f"""SELECT m.machine_id, p.provider_address, hw.hardware_report_raw,
                       oq.machine_id IS NOT NULL, {INSTALLATION_COLUMNS},
                       (SELECT hd.held_by || ': ' || hd.reason FROM machine_hold hd
                        WHERE hd.machine_id = m.machine_id),
                       EXISTS (SELECT 1 FROM machine_decommission dc
                               WHERE dc.machine_id = m.machine_id)
                FROM machines m
                LEFT JOIN machine_provided p ON p.machine_id = m.machine_id
                LEFT JOIN machine_hardware_report hw ON hw.machine_id = m.machine_id
                LEFT JOIN machine_os_installation_request oq ON oq.machine_id = m.machine_id
                LEFT JOIN machine_os_installation_report orp ON orp.machine_id = m.machine_id
                WHERE m.machine_id = %s""",
            (as_uuid(machine_id),),
        )
        if not rows:
            return None
        r = rows[0]
        return records.InstallationTarget(
            machine_id=r[0],
            address=r[1],
            hardware_report=None if r[2] is None else bytes(r[2]),
            installation=installation_from_row(r[4 : 4 + INSTALLATION_WIDTH]) if r[3] else None,
            held=r[4 + INSTALLATION_WIDTH],
            decommissioned=r[5 + INSTALLATION_WIDTH],
        )

    async def set_os_installation_report(
        self, machine_id: uuid.UUID | str, generation: int, report: bytes
    ) -> None:
        """Store raw report bytes as the report on ``generation``, whatever is
        requested, and without the outcome: the views show such a report as
        not (yet) telling anything (installing). For tests and tools that
        need a report as it is; the agent callback server stores reports
        with `record_os_installation_report`. Notifies as that does."""
        await self.execute(
            f"""WITH w AS (
                   INSERT INTO machine_os_installation_report
                       (machine_id, generation, os_installation_report_raw) VALUES (%s, %s, %s)
                   ON CONFLICT (machine_id) DO UPDATE
                   SET generation = EXCLUDED.generation,
                       os_installation_report_raw = EXCLUDED.os_installation_report_raw,
                       success = NULL, cause = NULL, node_public_key = NULL,
                       reported_at = now(), checked_at = NULL, lost_cause = NULL
                   RETURNING machine_id)
               SELECT pg_notify('{channels.INSTALL_REPORT}', machine_id::text) FROM w""",
            (as_uuid(machine_id), int(generation), bytes(report)),
        )

    async def record_os_installation_report(
        self,
        machine_id: uuid.UUID | str,
        generation: int,
        raw: bytes,
        success: bool,
        cause: str | None,
        node_public_key: bytes | None,
    ) -> bool:
        """Store an agent's report on its OS installation; what the agent
        callback server calls when a heartbeat carries an OSInstallationReport.

        Stored only if ``generation`` is the one currently requested of the
        machine (a report on an older request, or on one never made, is
        dropped): returns whether it was stored (a notification on
        `channels.INSTALL_REPORT` then names the machine when the
        transaction commits). The request row is read
        with FOR SHARE, so a new request written at the same time either
        waits for this statement or makes it store nothing. A second report
        on the same generation replaces the first (an agent that restarted
        reports its recorded outcome again).

        ``raw`` is the serialized OSInstallationReport; ``success``,
        ``cause`` (required on failure, absent on success) and
        ``node_public_key`` (32 raw Ed25519 bytes, on success; may be None)
        are its fields, decoded by the caller, for the views.
        `InvalidArgument` (nothing written) for a combination that is not a
        report, a key that is not 32 bytes, or a cause PostgreSQL cannot
        store (NUL) or over `MAX_INSTALLATION_TEXT` characters: the caller
        cuts an agent's cause to that length first.
        """
        if not isinstance(generation, int) or not 0 < generation < 2**63:
            raise InvalidArgument(f"generation must be a positive integer, got {generation!r}")
        if success:
            if cause is not None:
                raise InvalidArgument("a successful installation report has no cause")
            if node_public_key is not None and len(node_public_key) != 32:
                raise InvalidArgument(
                    f"node public key is {len(node_public_key)} bytes, want 32 (raw Ed25519)"
                )
        else:
            if cause is None:
                raise InvalidArgument("a failed installation report needs a cause")
            if node_public_key is not None:
                raise InvalidArgument("a failed installation report has no node public key")
            _check_text("cause", cause)
        # Stored, the approver is told (`channels.INSTALL_REPORT`).
        rows = await self.execute(
            f"""WITH w AS (
                   INSERT INTO machine_os_installation_report AS o
                       (machine_id, generation, os_installation_report_raw,
                        success, cause, node_public_key, reported_at)
                   SELECT r.machine_id, r.generation, %s, %s, %s, %s, now()
                   FROM machine_os_installation_request r
                   WHERE r.machine_id = %s AND r.generation = %s
                   FOR SHARE OF r
                   ON CONFLICT (machine_id) DO UPDATE
                   SET generation = EXCLUDED.generation,
                       os_installation_report_raw = EXCLUDED.os_installation_report_raw,
                       success = EXCLUDED.success,
                       cause = EXCLUDED.cause,
                       node_public_key = EXCLUDED.node_public_key,
                       reported_at = EXCLUDED.reported_at,
                       checked_at = NULL,
                       lost_cause = NULL
                   RETURNING machine_id)
               SELECT pg_notify('{channels.INSTALL_REPORT}', machine_id::text) FROM w""",
            (
                bytes(raw),
                bool(success),
                cause,
                None if node_public_key is None else bytes(node_public_key),
                as_uuid(machine_id),
                generation,
            ),
        )
        return bool(rows)

    async def record_installation_check(
        self,
        machine_id: uuid.UUID | str,
        generation: int,
        node_public_key: bytes | None,
        lost_cause: str | None,
    ) -> bool:
        """Store what an agent found of the generation it installed, reported
        unasked after the install's own report (migration 0010): still there
        (``node_public_key``, the node's key again) or gone (``lost_cause``,
        exactly one of the two). Stored only on the machine's current
        generation, and only if its report is a success of that same key
        (a check cannot turn a failed install into an installed one, nor
        name another node); returns whether it was stored. `InvalidArgument`
        for neither or both, a key that is not 32 bytes, a cause PostgreSQL
        cannot store or over `MAX_INSTALLATION_TEXT` characters."""
        if not isinstance(generation, int) or not 0 < generation < 2**63:
            raise InvalidArgument(f"generation must be a positive integer, got {generation!r}")
        if (node_public_key is None) == (lost_cause is None):
            raise InvalidArgument("an installation check is a node key or a cause, not both")
        if node_public_key is not None and len(node_public_key) != 32:
            raise InvalidArgument(
                f"node public key is {len(node_public_key)} bytes, want 32 (raw Ed25519)"
            )
        if lost_cause is not None:
            _check_text("cause", lost_cause)
        rows = await self.execute(
            """UPDATE machine_os_installation_report o
               SET checked_at = now(), lost_cause = %s
               FROM machine_os_installation_request r
               WHERE o.machine_id = %s AND o.generation = %s AND o.success
                 AND r.machine_id = o.machine_id AND r.generation = o.generation
                 AND (%s::bytea IS NULL OR o.node_public_key = %s::bytea)
               RETURNING 1""",
            (
                lost_cause,
                as_uuid(machine_id),
                generation,
                None if node_public_key is None else bytes(node_public_key),
                None if node_public_key is None else bytes(node_public_key),
            ),
        )
        return bool(rows)

    async def authenticate_agent(self, machine_id: uuid.UUID | str, public_key: bytes) -> bool:
        """True if the machine's started agent has exactly ``public_key``."""
        rows = await self.execute(
            """SELECT 1 FROM machine_agent_started
               WHERE machine_id = %s AND agent_public_key = %s""",
            (as_uuid(machine_id), bytes(public_key)),
        )
        return bool(rows)

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
                results[ordinal - 1] = dataclasses.replace(
                    before,
                    installation_request=None if request is None else bytes(request),
                    installation_generation=int(generation),
                )
            elif upgrade_gen is not None:
                results[ordinal - 1] = dataclasses.replace(
                    before,
                    upgrade_request=None if upgrade is None else bytes(upgrade),
                    upgrade_generation=int(upgrade_gen),
                )
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
            result = dataclasses.replace(
                result,
                installation_request=None if request is None else bytes(request),
                installation_generation=int(generation),
            )
        rows = await self.execute(_AGENT_PENDING_UPGRADE, (as_uuid(machine_id),))
        if rows:
            [(generation, request)] = rows
            result = dataclasses.replace(
                result,
                upgrade_request=None if request is None else bytes(request),
                upgrade_generation=int(generation),
            )
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

    async def machines_for_decommission(self, limit: int) -> list[records.DecommissionTarget]:
        """Machines an operator asked to decommission, not done yet, without
        live work of the agent processes or the decommissioner, backoff of
        the decommissioner or a hold; oldest request first (locking what it
        returns inside a work source)."""
        busy = [*_AGENT_PROCESSES, Process.SHEPHERD_DECOMMISSION]
        rows = await self.execute(
            f"""SELECT {_PROVIDED_COLUMNS}, k.public_key, dc.wiped_at IS NOT NULL,
                       dc.released_at IS NOT NULL, orp.node_public_key,
                       dc.node_id IS NOT DISTINCT FROM {_NODE_ID_OF_REPORT}
                FROM machines m
                JOIN machine_decommission dc ON dc.machine_id = m.machine_id
                LEFT JOIN machine_provided p ON p.machine_id = m.machine_id
                LEFT JOIN machine_ssh_host_key k ON k.machine_id = m.machine_id
                LEFT JOIN machine_os_installation_request oq ON oq.machine_id = m.machine_id
                LEFT JOIN machine_os_installation_report orp
                  ON orp.machine_id = m.machine_id AND orp.generation = oq.generation
                 AND orp.success
                WHERE dc.decommissioned_at IS NULL
                  AND NOT {_LIVE_WORK}
                  AND NOT {_ACTIVE_BACKOFF}
                  AND NOT EXISTS (SELECT 1 FROM machine_hold hd WHERE hd.machine_id = m.machine_id)
                  AND {NOT_PENDING}
                ORDER BY dc.requested_at, m.machine_id
                LIMIT %(limit)s {"FOR UPDATE OF m SKIP LOCKED" if self.locking else ""}""",
            {"limit": _limit(limit), "busy": busy, "process": Process.SHEPHERD_DECOMMISSION},
        )
        return [
            records.DecommissionTarget(
                machine_id=r[0],
                provided=_provided(r[:6]) if r[1] is not None else None,
                host_key=None if r[6] is None else bytes(r[6]),
                wiped=r[7],
                released=r[8],
                node_public_key=None if r[9] is None else bytes(r[9]),
                node_removed=r[10],
            )
            for r in rows
        ]

    async def record_node_removal(
        self, machine_id: uuid.UUID | str, node_id: str, detail: str
    ) -> None:
        """Store that the cluster node ``node_id`` the machine ran was removed
        from its cluster (``detail``: what changed). Usually before its wipe;
        after it for a node whose install report came in meanwhile (see
        `unremoved_node_key`), whose removal is then added to the first."""
        _check_text("node id", node_id)
        _check_text("node removal", detail)
        await self.execute(
            """UPDATE machine_decommission
               SET node_id = %(node)s, node_removed_at = now(),
                   node_removal = CASE WHEN node_removal IS NULL THEN %(detail)s
                                       ELSE node_removal || '; then ' || %(detail)s END
               WHERE machine_id = %(machine)s AND decommissioned_at IS NULL""",
            {"node": node_id, "detail": detail, "machine": as_uuid(machine_id)},
        )

    async def unremoved_node_key(self, machine_id: uuid.UUID | str) -> bytes | None:
        """The node key of the machine's current successful installation
        report, unless that node's removal from its cluster is recorded.

        Read by the decommissioner once the machine is wiped: a report the
        agent stored after the decommissioner's source had read none names a
        node the cluster still lists (dead now)."""
        rows = await self.execute(
            f"""SELECT orp.node_public_key
                FROM machine_decommission dc
                JOIN machine_os_installation_request oq ON oq.machine_id = dc.machine_id
                JOIN machine_os_installation_report orp
                  ON orp.machine_id = oq.machine_id AND orp.generation = oq.generation
                 AND orp.success AND orp.node_public_key IS NOT NULL
                WHERE dc.machine_id = %s
                  AND dc.node_id IS DISTINCT FROM {_NODE_ID_OF_REPORT}""",
            (as_uuid(machine_id),),
        )
        return bytes(rows[0][0]) if rows else None

    async def record_wipe(self, machine_id: uuid.UUID | str, report: str) -> None:
        """Store the agent's wipe report on a machine being decommissioned."""
        _check_text("wipe report", report)
        await self.execute(
            """UPDATE machine_decommission SET wiped_at = now(), wipe_report = %s
               WHERE machine_id = %s AND decommissioned_at IS NULL""",
            (report, as_uuid(machine_id)),
        )

    async def record_release(self, machine_id: uuid.UUID | str, detail: str) -> None:
        """Store the provider's line on releasing a wiped machine."""
        _check_text("release detail", detail)
        await self.execute(
            """UPDATE machine_decommission SET released_at = now(), release_detail = %s
               WHERE machine_id = %s AND decommissioned_at IS NULL""",
            (detail, as_uuid(machine_id)),
        )

    async def tombstone(self, machine_id: uuid.UUID | str) -> None:
        """Mark a wiped and released machine decommissioned: a tombstone, kept
        with its history, offered to no process. Its agent tags go (the
        agent's key was wiped). `InvalidArgument` unless wiped and released."""
        mid = as_uuid(machine_id)
        rows = await self.execute(
            """UPDATE machine_decommission SET decommissioned_at = now()
               WHERE machine_id = %s AND released_at IS NOT NULL AND decommissioned_at IS NULL
               RETURNING 1""",
            (mid,),
        )
        if not rows:
            raise InvalidArgument(f"machine {mid} is not wiped and released, or done already")
        await self.delete_agent_started(mid)
        await self.delete_agent_heartbeat(mid)

    async def decommissioned_provider_ids(self, provider: Provider | str) -> set[str]:
        """Provider ids of ``provider``'s machines being or done decommissioned
        (the provisioner neither counts nor adds them again)."""
        rows = await self.execute(
            """SELECT p.provider_id FROM machine_provided p
               JOIN machine_decommission dc ON dc.machine_id = p.machine_id
               WHERE p.provider = %s""",
            (Provider.parse(provider),),
        )
        return {r[0] for r in rows}

    async def delete_recovery_request(self, machine_id: uuid.UUID | str) -> None:
        """Forget an operator's request to recover the machine (the recoverer
        does so when it finishes the recovery)."""
        await self.execute(
            "DELETE FROM machine_recovery_request WHERE machine_id = %s", (as_uuid(machine_id),)
        )

    async def get_ssh_host_key(self, machine_id: uuid.UUID | str) -> bytes | None:
        """The SSH host key first seen on the machine, if any."""
        rows = await self.execute(
            "SELECT public_key FROM machine_ssh_host_key WHERE machine_id = %s",
            (as_uuid(machine_id),),
        )
        return bytes(rows[0][0]) if rows else None

    async def set_ssh_host_key(self, machine_id: uuid.UUID | str, key: bytes) -> None:
        """Record (or replace) the machine's trusted SSH host key."""
        if not key:
            raise InvalidArgument("key must not be empty")
        await self.execute(
            """INSERT INTO machine_ssh_host_key (machine_id, public_key) VALUES (%s, %s)
               ON CONFLICT (machine_id) DO UPDATE
               SET public_key = EXCLUDED.public_key, first_seen = now()""",
            (as_uuid(machine_id), bytes(key)),
        )

    # Rolling upgrades (migration 0011).

    async def running_upgrade_run(self) -> records.UpgradeRun | None:
        """The run not finished yet, if any (there is at most one); locked
        FOR UPDATE, so that deciding against it (a new run, a machine's turn)
        is one at a time."""
        rows = await self.execute(
            f"SELECT {_RUN_COLUMNS} FROM upgrade_run r WHERE r.finished_at IS NULL FOR UPDATE"
        )
        return _upgrade_run(rows[0]) if rows else None

    async def create_upgrade_run(
        self,
        *,
        image_digest: str,
        os_image: bytes,
        max_unavailable: int,
        health_timeout: int,
        requested_by: str,
        machines: Sequence[records.UpgradePlanEntry],
    ) -> records.UpgradeRun:
        """Start a run of ``machines`` (all pending). `InvalidArgument` (nothing
        written) while another run is not finished, for no machines, a machine
        listed twice, or values out of range (the table's CHECKs say which)."""
        if not machines:
            raise InvalidArgument("an upgrade run needs at least one machine")
        if len({m.machine_id for m in machines}) != len(machines):
            raise InvalidArgument("a machine is listed twice")
        _check_text("requested by", requested_by)
        running = await self.running_upgrade_run()
        if running is not None:
            raise InvalidArgument(
                f"upgrade run {running.run_id} (to {running.image_digest}) is not finished: "
                "one run at a time"
            )
        rows = await self.execute(
            f"""INSERT INTO upgrade_run AS r (image_digest, os_image_raw, max_unavailable,
                                         health_timeout_seconds, requested_by)
                VALUES (%s, %s, %s, %s, %s) RETURNING {_RUN_COLUMNS}""",
            (image_digest, bytes(os_image), max_unavailable, health_timeout, requested_by),
        )
        run = _upgrade_run(rows[0])
        await self.execute(
            """INSERT INTO machine_upgrade
                   (run_id, machine_id, phase, position, root_device, from_digest)
               SELECT %(run)s, * FROM unnest(%(ids)s::uuid[], %(phases)s::smallint[],
                                             %(positions)s::integer[], %(devices)s::text[],
                                             %(digests)s::text[])""",
            {
                "run": run.run_id,
                "ids": [m.machine_id for m in machines],
                "phases": [m.phase for m in machines],
                "positions": [m.position for m in machines],
                "devices": [m.root_device for m in machines],
                "digests": [m.from_digest for m in machines],
            },
        )
        return run

    async def installed_machine_ids(self) -> list[uuid.UUID]:
        """Machines whose current installation succeeded with a node key and
        that are not (being) decommissioned, oldest first."""
        rows = await self.execute(
            """SELECT m.machine_id FROM machines m
               JOIN machine_os_installation_request oq ON oq.machine_id = m.machine_id
               JOIN machine_os_installation_report orp
                 ON orp.machine_id = oq.machine_id AND orp.generation = oq.generation
                AND orp.success AND orp.node_public_key IS NOT NULL
               WHERE NOT EXISTS (SELECT 1 FROM machine_decommission dc
                                 WHERE dc.machine_id = m.machine_id)
               ORDER BY m.machine_created_at, m.machine_id"""
        )
        return [r[0] for r in rows]

    async def append_audit(
        self, operator: str, action: str, machine_id: uuid.UUID | None, reason: str, detail: str
    ) -> int:
        """Append an audit record (for actions not on one machine's row, such as
        an upgrade run); its id. The table's CHECKs refuse an empty operator or
        reason and an action name that is not lower-case words."""
        for name, value in (("operator", operator), ("reason", reason), ("detail", detail)):
            _check_text(name, value)
        rows = await self.execute(
            """INSERT INTO audit_log (operator, action, machine_id, reason, detail)
               VALUES (%s, %s, %s, %s, %s) RETURNING id""",
            (operator, action, machine_id, reason, detail),
        )
        return int(rows[0][0])

    async def upgrade_runs(self, limit: int = 20) -> list[records.UpgradeRun]:
        """The newest runs, newest first."""
        rows = await self.execute(
            f"SELECT {_RUN_COLUMNS} FROM upgrade_run r ORDER BY r.requested_at DESC LIMIT %s",
            (_limit(limit),),
        )
        return [_upgrade_run(r) for r in rows]

    async def upgrade_run(self, run_id: uuid.UUID | str) -> records.UpgradeRun | None:
        rows = await self.execute(
            f"SELECT {_RUN_COLUMNS} FROM upgrade_run r WHERE r.run_id = %s", (as_uuid(run_id),)
        )
        return _upgrade_run(rows[0]) if rows else None

    async def upgrade_run_age(self, run_id: uuid.UUID | str) -> float | None:
        """Seconds since the run was made, by the database's clock (None: no such run)."""
        rows = await self.execute(
            """SELECT extract(epoch FROM now() - requested_at)::float8
               FROM upgrade_run WHERE run_id = %s""",
            (as_uuid(run_id),),
        )
        return float(rows[0][0]) if rows else None

    async def upgrade_machines(
        self, run_id: uuid.UUID | str
    ) -> list[tuple[records.MachineUpgrade, bytes | None]]:
        """The machines of a run in their order, each with the node key of its
        current successful installation report."""
        rows = await self.execute(
            f"""SELECT {_MACHINE_UPGRADE_COLUMNS}, orp.node_public_key
                FROM machine_upgrade mu
                LEFT JOIN machine_os_installation_request oq ON oq.machine_id = mu.machine_id
                LEFT JOIN machine_os_installation_report orp
                  ON orp.machine_id = oq.machine_id AND orp.generation = oq.generation
                 AND orp.success
                WHERE mu.run_id = %s
                ORDER BY mu.phase, mu.position, mu.machine_id""",
            (as_uuid(run_id),),
        )
        return [(_machine_upgrade(r), None if r[-1] is None else bytes(r[-1])) for r in rows]

    async def machine_upgrade(
        self, run_id: uuid.UUID | str, machine_id: uuid.UUID | str
    ) -> tuple[records.MachineUpgrade, bytes | None, float | None] | None:
        """One machine of a run: its row, its node key (as `upgrade_machines`),
        and the seconds since its upgrade was requested, by the database's
        clock (None while pending)."""
        rows = await self.execute(
            f"""SELECT {_MACHINE_UPGRADE_COLUMNS}, orp.node_public_key,
                       extract(epoch FROM now() - mu.requested_at)::float8
                FROM machine_upgrade mu
                LEFT JOIN machine_os_installation_request oq ON oq.machine_id = mu.machine_id
                LEFT JOIN machine_os_installation_report orp
                  ON orp.machine_id = oq.machine_id AND orp.generation = oq.generation
                 AND orp.success
                WHERE mu.run_id = %s AND mu.machine_id = %s""",
            (as_uuid(run_id), as_uuid(machine_id)),
        )
        if not rows:
            return None
        r = rows[0]
        return _machine_upgrade(r[:-2]), None if r[-2] is None else bytes(r[-2]), r[-1]

    async def latest_upgrades(self) -> dict[uuid.UUID, records.MachineUpgrade]:
        """Each machine's row of the newest run that lists it (for the views)."""
        rows = await self.execute(
            f"""SELECT DISTINCT ON (mu.machine_id) {_MACHINE_UPGRADE_COLUMNS}
                FROM machine_upgrade mu JOIN upgrade_run r ON r.run_id = mu.run_id
                ORDER BY mu.machine_id, r.requested_at DESC"""
        )
        return {row.machine_id: row for row in map(_machine_upgrade, rows)}

    async def machines_for_upgrade(self, limit: int) -> list[records.UpgradeTarget]:
        """Machines of the running run whose turn it may be: those requested
        already (a worker died while upgrading them: taken up again first),
        then pending ones of the lowest phase that has any not done, while
        fewer than the run allows are requested (phase 0: max_unavailable;
        consensus phases: one); without live upgrade work, upgrade backoff
        or a hold. The upgrader checks the cluster's own view before it
        requests one (the order here is what it last saw)."""
        busy = [Process.SHEPHERD_UPGRADE]
        rows = await self.execute(
            f"""SELECT {_RUN_COLUMNS}, {_MACHINE_UPGRADE_COLUMNS}, orp.node_public_key
                FROM machine_upgrade mu
                JOIN upgrade_run r ON r.run_id = mu.run_id AND r.finished_at IS NULL
                JOIN machines m ON m.machine_id = mu.machine_id
                LEFT JOIN machine_os_installation_request oq ON oq.machine_id = mu.machine_id
                LEFT JOIN machine_os_installation_report orp
                  ON orp.machine_id = oq.machine_id AND orp.generation = oq.generation
                 AND orp.success
                WHERE mu.state IN ('pending', 'requested')
                  AND NOT {_LIVE_WORK}
                  AND NOT {_ACTIVE_BACKOFF}
                  AND {NOT_HELD}
                  AND (mu.state = 'requested' OR (
                      NOT EXISTS (SELECT 1 FROM machine_upgrade o
                                  WHERE o.run_id = mu.run_id AND o.phase < mu.phase
                                    AND o.state IN ('pending', 'requested'))
                      AND (SELECT count(*) FROM machine_upgrade o
                           WHERE o.run_id = mu.run_id AND o.state = 'requested')
                          < CASE WHEN mu.phase = 0 THEN r.max_unavailable ELSE 1 END))
                ORDER BY mu.state = 'requested' DESC, mu.phase, mu.position, mu.machine_id
                LIMIT %(limit)s {"FOR UPDATE OF m SKIP LOCKED" if self.locking else ""}""",
            {"limit": _limit(limit), "busy": busy, "process": Process.SHEPHERD_UPGRADE},
        )
        n = len(_RUN_FIELDS)
        return [
            records.UpgradeTarget(
                run=_upgrade_run(r[:n]),
                machine=_machine_upgrade(r[n:-1]),
                node_public_key=None if r[-1] is None else bytes(r[-1]),
            )
            for r in rows
        ]

    async def next_upgrade_generation(self, machine_id: uuid.UUID | str) -> int:
        """One more than the machine's last upgrade generation (1 for its first)."""
        rows = await self.execute(
            "SELECT coalesce(max(generation), 0) + 1 FROM machine_upgrade WHERE machine_id = %s",
            (as_uuid(machine_id),),
        )
        return int(rows[0][0])

    async def write_upgrade(
        self,
        run_id: uuid.UUID | str,
        machine_id: uuid.UUID | str,
        generation: int,
        request: bytes,
    ) -> bool:
        """Ask the pending machine of the running run to write the new image
        to its inactive slot: its agent is carried ``request`` (of
        ``generation``, not activating) while the run runs; the machine stays
        pending (it takes no node down). Whether it was pending without one."""
        rows = await self.execute(
            """UPDATE machine_upgrade mu
               SET generation = %s, request_raw = %s, updated_at = now()
               FROM upgrade_run r
               WHERE r.run_id = mu.run_id AND r.finished_at IS NULL
                 AND mu.run_id = %s AND mu.machine_id = %s
                 AND mu.state = 'pending' AND mu.generation IS NULL
               RETURNING 1""",
            (generation, bytes(request), as_uuid(run_id), as_uuid(machine_id)),
        )
        if rows:
            await self.execute(_NOTIFY_AGENT_REQUEST, (str(as_uuid(machine_id)),))
        return bool(rows)

    async def request_upgrade(
        self,
        run_id: uuid.UUID | str,
        machine_id: uuid.UUID | str,
        generation: int,
        request: bytes,
    ) -> str | None:
        """Make the pending machine's upgrade requested (its agent is carried
        ``request`` of ``generation`` from now on); None if done, else why not:
        the run is finished, the machine not pending, or the run has as many
        requested as it allows (its row locked first: one decision at a time)."""
        run = await self.running_upgrade_run()
        if run is None or run.run_id != as_uuid(run_id):
            return "the run is finished"
        rows = await self.execute(
            """SELECT (SELECT phase FROM machine_upgrade
                       WHERE run_id = %(run)s AND machine_id = %(machine)s AND state = 'pending'),
                      count(*) FILTER (WHERE state = 'requested')
               FROM machine_upgrade WHERE run_id = %(run)s""",
            {"run": run.run_id, "machine": as_uuid(machine_id)},
        )
        phase, requested = rows[0]
        if phase is None:
            return "the machine is not pending in this run"
        allowed = run.max_unavailable if phase == 0 else 1
        if requested >= allowed:
            return f"{requested} machine(s) of the run are being upgraded (at most {allowed})"
        await self.execute(
            """UPDATE machine_upgrade
               SET state = 'requested', generation = %s, request_raw = %s, requested_at = now(),
                   detail = NULL, updated_at = now()
               WHERE run_id = %s AND machine_id = %s""",
            (generation, bytes(request), run.run_id, as_uuid(machine_id)),
        )
        await self.execute(_NOTIFY_AGENT_REQUEST, (str(as_uuid(machine_id)),))
        return None

    async def set_upgrade_order(
        self, run_id: uuid.UUID | str, order: Sequence[tuple[uuid.UUID, int, int]]
    ) -> None:
        """Store each machine's (phase, position), as the cluster now says."""
        await self.execute(
            """UPDATE machine_upgrade mu SET phase = o.phase, position = o.position
               FROM unnest(%(ids)s::uuid[], %(phases)s::smallint[], %(positions)s::integer[])
                    AS o(machine_id, phase, position)
               WHERE mu.run_id = %(run)s AND mu.machine_id = o.machine_id""",
            {
                "run": as_uuid(run_id),
                "ids": [o[0] for o in order],
                "phases": [o[1] for o in order],
                "positions": [o[2] for o in order],
            },
        )

    async def note_upgrade(
        self, run_id: uuid.UUID | str, machine_id: uuid.UUID | str, detail: str
    ) -> None:
        """Say why the machine's upgrade waits, or where it is (for the views)."""
        _check_text("detail", detail)
        await self.execute(
            """UPDATE machine_upgrade SET detail = %s, updated_at = now()
               WHERE run_id = %s AND machine_id = %s""",
            (detail, as_uuid(run_id), as_uuid(machine_id)),
        )

    async def end_machine_upgrade(
        self,
        run_id: uuid.UUID | str,
        machine_id: uuid.UUID | str,
        state: records.UpgradeState,
        detail: str,
        *,
        slot: str | None = None,
        running_digest: str | None = None,
    ) -> records.UpgradeRun | None:
        """End the machine's upgrade in ``state`` (a final one). Not upgraded:
        the run stops with the cause. Upgraded and the last: the run is
        finished. Returns the run as it is after."""
        if not records.UpgradeState(state).final:
            raise InvalidArgument(f"{state} is not a final upgrade state")
        _check_text("detail", detail)
        run, machine = as_uuid(run_id), as_uuid(machine_id)
        await self.execute(
            """UPDATE machine_upgrade
               SET state = %s, detail = %s, slot = %s, running_digest = %s, updated_at = now()
               WHERE run_id = %s AND machine_id = %s AND state IN ('pending', 'requested')""",
            (str(state), detail, slot, running_digest, run, machine),
        )
        if state is records.UpgradeState.UPGRADED:
            await self.execute(
                """UPDATE upgrade_run SET finished_at = now()
                   WHERE run_id = %(run)s AND finished_at IS NULL
                     AND NOT EXISTS (SELECT 1 FROM machine_upgrade WHERE run_id = %(run)s
                                     AND state IN ('pending', 'requested'))""",
                {"run": run},
            )
        else:
            cause = f"machine {machine} {state}: {detail}"[:MAX_INSTALLATION_TEXT]
            await self.execute(
                """UPDATE upgrade_run SET finished_at = now(), stop_cause = %s
                   WHERE run_id = %s AND finished_at IS NULL""",
                (cause, run),
            )
        return await self.upgrade_run(run)

    async def stop_upgrade_run(self, run_id: uuid.UUID | str, cause: str) -> bool:
        """Stop a running run (an operator's stop): no machine is requested from
        now on; a machine being upgraded ends as its agent and node make it.
        Whether it was running."""
        _check_text("cause", cause)
        rows = await self.execute(
            """UPDATE upgrade_run SET finished_at = now(), stop_cause = %s
               WHERE run_id = %s AND finished_at IS NULL RETURNING 1""",
            (cause, as_uuid(run_id)),
        )
        return bool(rows)

    async def record_upgrade_report(
        self,
        machine_id: uuid.UUID | str,
        generation: int,
        state: str,
        detail: str,
        slot: str,
    ) -> bool:
        """Store an agent's UpgradeReport on the machine's upgrade of
        ``generation``, requested or (its write) pending; else nothing: False."""
        if not isinstance(generation, int) or not 0 < generation < 2**63:
            raise InvalidArgument(f"generation must be a positive integer, got {generation!r}")
        for name, value in (("state", state), ("detail", detail), ("slot", slot)):
            _check_text(name, value)
        rows = await self.execute(
            """UPDATE machine_upgrade
               SET agent_state = %s, agent_detail = %s, agent_slot = %s,
                   agent_reported_at = now(), updated_at = now()
               WHERE machine_id = %s AND state IN ('pending', 'requested') AND generation = %s
               RETURNING 1""",
            (state, detail, slot, as_uuid(machine_id), generation),
        )
        return bool(rows)

    # Sourcing.

    async def machines_for_agent_start(self, limit: int) -> list[records.MachineProvided]:
        """Provided machines whose agent has not started, without live
        agent-start/recovery work, agent-start backoff or an operator's hold,
        oldest first
        (approximately, among the oldest `SOURCING_WINDOW`, when locking)."""
        if self.locking:
            # Empty parameters, not None: sent as a prepared statement.
            rows = await self.execute(agent_start_lock_sql(_limit(limit)), ())
        else:
            params = {
                "limit": _limit(limit),
                "busy": list(_AGENT_PROCESSES),
                "process": Process.SHEPHERD_AGENT_START,
            }
            rows = await self.execute(_AGENT_START_LIST, params)
        return [_provided(r) for r in rows]

    async def machines_for_agent_recovery(
        self,
        limit: int,
        *,
        provider: Provider | str | None = None,
        first_heartbeat_timeout: float = AGENT_FIRST_HEARTBEAT_TIMEOUT,
        heartbeat_timeout: float = AGENT_HEARTBEAT_TIMEOUT,
    ) -> list[records.AgentStarted]:
        """Machines (of ``provider``, if given) whose agent started but went
        silent: no heartbeat ``first_heartbeat_timeout`` seconds after the
        start, or the last heartbeat older than ``heartbeat_timeout``, or an
        operator asked for its recovery (``bmdb recover-now``); without
        live agent work, recovery backoff or an operator's hold. Operator
        requests first (oldest request first), then the longest silent (by
        the last sign of life rounded down to 5 minutes, then machine id);
        approximately, among the first `SOURCING_WINDOW`, when locking."""
        for name, value in (
            ("first_heartbeat_timeout", first_heartbeat_timeout),
            ("heartbeat_timeout", heartbeat_timeout),
        ):
            if not isinstance(value, int | float) or not 0 < value < 10**9:
                raise InvalidArgument(f"{name} must be a positive number of seconds, got {value!r}")
        sql = _agent_recovery(
            _limit(limit),
            None if provider is None else str(Provider.parse(provider)),
            float(first_heartbeat_timeout),
            float(heartbeat_timeout),
            self.locking,
        )
        # Empty parameters, not None: sent as a prepared statement.
        rows = await self.execute(sql, ())
        return [_agent_started(r) for r in rows]

    async def machines_for_process(self, process: Process | str, limit: int) -> list[uuid.UUID]:
        """Any machines without live work or active backoff for ``process``,
        and not held, oldest first. A generic source for tests and simple processes."""
        p = Process.parse(process)
        params = {"limit": _limit(limit), "busy": [p], "process": p}
        sql = _FOR_PROCESS + (_LOCK_SUFFIX if self.locking else "")
        return [r[0] for r in await self.execute(sql, params)]

    # Introspection.

    async def history(self, machine_id: uuid.UUID | str) -> list[records.HistoryEvent]:
        """The machine's work history, oldest first."""
        rows = await self.execute(
            """SELECT machine_id, process, event, at, session_id, cause FROM work_history
               WHERE machine_id = %s ORDER BY id""",
            (as_uuid(machine_id),),
        )
        return [
            records.HistoryEvent(
                machine_id=r[0],
                process=Process(r[1]),
                event=WorkEvent(r[2]),
                at=r[3],
                session_id=r[4],
                cause=r[5],
            )
            for r in rows
        ]

    async def sessions(self) -> list[records.SessionInfo]:
        """Every session row, including expired ones not yet collected."""
        rows = await self.execute(
            """SELECT session_id, session_component_name, session_runtime_info,
                      session_created_at, session_interval_seconds, session_deadline,
                      session_deadline <= now()
               FROM sessions ORDER BY session_created_at, session_id"""
        )
        return [records.SessionInfo(*r) for r in rows]

    async def work(self) -> list[records.WorkInfo]:
        """Every work row (live or stale)."""
        rows = await self.execute("SELECT machine_id, process, session_id FROM work ORDER BY 1, 2")
        return [records.WorkInfo(r[0], Process(r[1]), r[2]) for r in rows]

    async def machines(self, limit: int = 1000) -> list[records.MachineSummary]:
        """Machines with their tags, oldest first."""
        rows = await self.execute(
            f"""SELECT m.machine_id, m.machine_created_at, a.agent_started_at,
                       h.agent_heartbeat_at, r.machine_id IS NOT NULL,
                       ARRAY(SELECT w.process::text FROM work w
                             WHERE w.machine_id = m.machine_id ORDER BY 1),
                       p.machine_id IS NOT NULL, {_PROVIDED_COLUMNS}
                FROM machines m
                LEFT JOIN machine_provided p ON p.machine_id = m.machine_id
                LEFT JOIN machine_agent_started a ON a.machine_id = m.machine_id
                LEFT JOIN machine_agent_heartbeat h ON h.machine_id = m.machine_id
                LEFT JOIN machine_hardware_report r ON r.machine_id = m.machine_id
                ORDER BY m.machine_created_at, m.machine_id
                LIMIT %s""",
            (_limit(limit),),
        )
        return [
            records.MachineSummary(
                machine_id=r[0],
                created_at=r[1],
                agent_started_at=r[2],
                agent_heartbeat_at=r[3],
                has_hardware_report=r[4],
                work=tuple(Process(w) for w in r[5]),
                provided=_provided(r[7:]) if r[6] else None,
            )
            for r in rows
        ]


def as_uuid(value: uuid.UUID | str) -> uuid.UUID:
    """``value`` as a UUID; `InvalidArgument` if it is not one."""
    if isinstance(value, uuid.UUID):
        return value
    if isinstance(value, str):
        try:
            return uuid.UUID(value)
        except ValueError:
            pass
    raise InvalidArgument(f"not a machine id (UUID): {value!r}")


#: Longest text stored with an installation request or report (characters).
MAX_INSTALLATION_TEXT = 4096


def _check_text(name: str, value: str) -> None:
    if not isinstance(value, str):
        raise InvalidArgument(f"{name} must be text, got {type(value).__name__}")
    if "\x00" in value:
        raise InvalidArgument(f"{name} holds a NUL character, which PostgreSQL cannot store")
    if len(value) > MAX_INSTALLATION_TEXT:
        raise InvalidArgument(f"{name} is over {MAX_INSTALLATION_TEXT} characters")


#: The installation state of a machine given its request oq and report orp
#: (NULL without a request); as `bmdb.model.OSInstallation.state` says.
INSTALL_STATE_SQL = """
    CASE WHEN oq.machine_id IS NULL THEN NULL
         WHEN orp.generation IS DISTINCT FROM oq.generation OR orp.success IS NULL
              THEN 'installing'
         WHEN orp.success AND orp.lost_cause IS NOT NULL THEN 'install-lost'
         WHEN orp.success THEN 'installed'
         ELSE 'install-failed' END
"""

#: The columns `installation_from_row` reads, of request ``oq`` and report ``orp``.
INSTALLATION_COLUMNS = """
    oq.generation, oq.root_device, oq.image_digest, oq.node_address, oq.requested_at,
    orp.generation, orp.success, orp.cause, orp.node_public_key, orp.reported_at,
    orp.lost_cause, orp.checked_at
"""
#: How many they are.
INSTALLATION_WIDTH = 12


def installation_from_row(r: Sequence[Any]) -> records.OSInstallation:
    """An `OSInstallation` from the `INSTALLATION_COLUMNS` of a row."""
    return records.OSInstallation(
        generation=r[0],
        root_device=r[1],
        image_digest=r[2],
        node_address=r[3],
        requested_at=r[4],
        report_generation=r[5],
        success=r[6],
        cause=r[7],
        node_public_key=None if r[8] is None else bytes(r[8]),
        reported_at=r[9],
        lost_cause=r[10],
        checked_at=r[11],
    )


def _limit(limit: int) -> int:
    if not isinstance(limit, int) or limit < 1:
        raise InvalidArgument(f"limit must be a positive integer, got {limit!r}")
    return limit


def _aware(at: datetime.datetime) -> datetime.datetime:
    if not isinstance(at, datetime.datetime) or at.tzinfo is None:
        raise InvalidArgument(f"need a timezone-aware datetime, got {at!r}")
    return at


def _agent_started(r: Sequence[Any]) -> records.AgentStarted:
    """An `AgentStarted` from (machine_id, started_at, public_key, *provided columns)."""
    return records.AgentStarted(
        machine_id=r[0],
        started_at=r[1],
        public_key=bytes(r[2]),
        provided=_provided(r[3:]) if r[3] is not None else None,
    )


def _provided(r: Sequence[Any]) -> records.MachineProvided:
    return records.MachineProvided(
        machine_id=r[0],
        provider=Provider(r[1]),
        provider_id=r[2],
        address=r[3],
        location=r[4],
        status=ProviderStatus(r[5]),
    )


_RUN_FIELDS = (
    "run_id", "image_digest", "os_image_raw", "max_unavailable", "health_timeout_seconds",
    "requested_by", "requested_at", "finished_at", "stop_cause",
)  # fmt: skip
#: The columns `_upgrade_run` reads, of run ``r``.
_RUN_COLUMNS = ", ".join(f"r.{name}" for name in _RUN_FIELDS)

_MACHINE_UPGRADE_FIELDS = (
    "run_id", "machine_id", "state", "phase", "position", "root_device", "from_digest",
    "generation", "requested_at", "slot", "running_digest", "detail", "agent_state",
    "agent_detail", "agent_slot", "agent_reported_at", "updated_at",
)  # fmt: skip
#: The columns `_machine_upgrade` reads, of machine upgrade ``mu``.
_MACHINE_UPGRADE_COLUMNS = ", ".join(f"mu.{name}" for name in _MACHINE_UPGRADE_FIELDS)


def _upgrade_run(r: Sequence[Any]) -> records.UpgradeRun:
    return records.UpgradeRun(
        run_id=r[0],
        image_digest=r[1],
        os_image=bytes(r[2]),
        max_unavailable=r[3],
        health_timeout=r[4],
        requested_by=r[5],
        requested_at=r[6],
        finished_at=r[7],
        stop_cause=r[8],
    )


def _machine_upgrade(r: Sequence[Any]) -> records.MachineUpgrade:
    return records.MachineUpgrade(
        run_id=r[0],
        machine_id=r[1],
        state=records.UpgradeState(r[2]),
        phase=r[3],
        position=r[4],
        root_device=r[5],
        from_digest=r[6],
        generation=r[7],
        requested_at=r[8],
        slot=r[9],
        running_digest=r[10],
        detail=r[11],
        agent_state=r[12],
        agent_detail=r[13],
        agent_slot=r[14],
        agent_reported_at=r[15],
        updated_at=r[16],
    )
