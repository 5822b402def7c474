"""The agent processes' sources: machines that need an agent started, and
agents gone silent; and a generic source for tests and simple processes.

Sourcing queries (``machines_for_*``) behave differently inside a work
source: there they lock the rows they return with ``FOR UPDATE SKIP
LOCKED`` so that concurrent workers get disjoint machines, and the
agent-start and recovery queries pick at random among the oldest
`SOURCING_WINDOW` candidates instead of always taking the very oldest, so
parallel workers do not all race for the same first row. See bmdb/work.py
for why that is safe. What makes a machine free to claim at all is
`bmdb.model.claimable`'s; the decommissioner's and the upgrader's sources
live with their domains (`bmdb.model.decommission`, `bmdb.model.upgrades`).
"""

from __future__ import annotations

import functools
import uuid

from bmdb.errors import InvalidArgument
from bmdb.model import rows as records
from bmdb.model.agents import AGENT_STARTED_COLUMNS, agent_started_from_row
from bmdb.model.base import QueriesBase
from bmdb.model.checks import check_limit
from bmdb.model.claimable import ACTIVE_BACKOFF, AGENT_PROCESSES, LIVE_WORK, NOT_HELD
from bmdb.model.enums import Process, Provider
from bmdb.model.machines import PROVIDED_COLUMNS, provided_from_row

#: How many of the oldest candidates a locking agent-start source picks from.
#: Larger than any sane worker count, so that workers rarely pick the same row.
SOURCING_WINDOW = 64


_AGENT_START_CANDIDATES = f"""
    SELECT m.machine_id, m.machine_created_at FROM machines m
    JOIN machine_provided p ON p.machine_id = m.machine_id
    WHERE NOT m.agent_started
      AND NOT {LIVE_WORK}
      AND NOT {ACTIVE_BACKOFF}
      AND {NOT_HELD}
    ORDER BY m.machine_created_at, m.machine_id
"""

_AGENT_START_LIST = f"""
    SELECT {PROVIDED_COLUMNS} FROM ({_AGENT_START_CANDIDATES} LIMIT %(limit)s) c
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
    busy = "'{" + ",".join(AGENT_PROCESSES) + "}'"
    candidates = _AGENT_START_CANDIDATES.replace("%(busy)s", busy).replace(
        "%(process)s", f"'{Process.SHEPHERD_AGENT_START}'"
    )
    return f"""
    SELECT {PROVIDED_COLUMNS} FROM ({candidates} LIMIT {max(SOURCING_WINDOW, limit):d}) c
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
    busy = "'{" + ",".join(AGENT_PROCESSES) + "}'"
    provider_join = (
        f"JOIN machine_provided pf ON pf.machine_id = m.machine_id AND pf.provider = '{provider}'"
        if provider is not None
        else ""
    )
    claimable = f"""
          AND NOT {LIVE_WORK}
          AND NOT {ACTIVE_BACKOFF}
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
    SELECT {AGENT_STARTED_COLUMNS}, {PROVIDED_COLUMNS}
    FROM ({candidates} LIMIT {window:d}) c
    JOIN machines m ON m.machine_id = c.machine_id
    JOIN machine_agent_started a ON a.machine_id = c.machine_id
    LEFT JOIN machine_provided p ON p.machine_id = c.machine_id
    ORDER BY {order}
    LIMIT {limit:d}
    {"FOR UPDATE OF m SKIP LOCKED" if locking else ""}
"""


_FOR_PROCESS = f"""
    SELECT m.machine_id FROM machines m
    WHERE NOT {LIVE_WORK}
      AND NOT {ACTIVE_BACKOFF}
      AND {NOT_HELD}
    ORDER BY m.machine_created_at, m.machine_id
    LIMIT %(limit)s
"""

_LOCK_SUFFIX = " FOR UPDATE OF m SKIP LOCKED"


class SourcingQueries(QueriesBase):
    """The agent processes' sources, and a generic one."""

    async def machines_for_agent_start(self, limit: int) -> list[records.MachineProvided]:
        """Provided machines whose agent has not started, without live
        agent-start/recovery work, agent-start backoff or an operator's hold,
        oldest first
        (approximately, among the oldest `SOURCING_WINDOW`, when locking)."""
        if self.locking:
            # Empty parameters, not None: sent as a prepared statement.
            rows = await self.execute(agent_start_lock_sql(check_limit(limit)), ())
        else:
            params = {
                "limit": check_limit(limit),
                "busy": list(AGENT_PROCESSES),
                "process": Process.SHEPHERD_AGENT_START,
            }
            rows = await self.execute(_AGENT_START_LIST, params)
        return [provided_from_row(r) for r in rows]

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
            check_limit(limit),
            None if provider is None else str(Provider.parse(provider)),
            float(first_heartbeat_timeout),
            float(heartbeat_timeout),
            self.locking,
        )
        # Empty parameters, not None: sent as a prepared statement.
        rows = await self.execute(sql, ())
        return [agent_started_from_row(r) for r in rows]

    async def machines_for_process(self, process: Process | str, limit: int) -> list[uuid.UUID]:
        """Any machines without live work or active backoff for ``process``,
        and not held, oldest first. A generic source for tests and simple processes."""
        p = Process.parse(process)
        params = {"limit": check_limit(limit), "busy": [p], "process": p}
        sql = _FOR_PROCESS + (_LOCK_SUFFIX if self.locking else "")
        return [r[0] for r in await self.execute(sql, params)]
