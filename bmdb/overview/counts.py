"""How many machines are in each state: one snapshot of the whole fleet
(or of one provider's machines), for the web UI's counts (`console.counts`).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

from bmdb._pg import Row
from bmdb.connection import Connection
from bmdb.model import InstallState, Provider, Queries
from bmdb.overview.states import (
    BACKOFF_HASHED,
    LIVE_INSTALL_STATE_SQL,
    STATE_SQL,
    TAGS,
    State,
)
from bmdb.transaction import Isolation

# How many machines are in each state (of one provider, or all), as one row
# of filtered counts in `State` order, then in `InstallState` order, then the
# snapshot's time: a plain aggregate, where GROUP BY on the CASE made the
# planner expect 50,000 groups and sort them. It reads every machine (a
# fleet scan): the web UI runs it at most once per period (`console.counts`).
STATE_COUNTS_SQL = f"""
SELECT {", ".join(f"count(*) FILTER (WHERE state = '{s}')" for s in State)},
       {", ".join(f"count(*) FILTER (WHERE install_state = '{s}')" for s in InstallState)},
       now()
FROM (SELECT {STATE_SQL} AS state, {LIVE_INSTALL_STATE_SQL} AS install_state
      FROM machines m
      {TAGS}
      LEFT JOIN machine_os_installation_request oq ON oq.machine_id = m.machine_id
      LEFT JOIN machine_os_installation_report orp ON orp.machine_id = m.machine_id
      {BACKOFF_HASHED}
      WHERE %(provider)s::provider IS NULL OR p.provider = %(provider)s::provider) v
"""


@dataclass(frozen=True)
class StateCounts:
    """How many machines are in each state, and in each installation state
    (machines without a request are in none), of one snapshot."""

    by_state: dict[State, int]
    by_install: dict[InstallState, int]
    #: The database's clock at the snapshot: what the counts are "as of".
    at: datetime.datetime

    @property
    def total(self) -> int:
        """Every machine counted (each is in exactly one `State`)."""
        return sum(self.by_state.values())


async def state_counts(conn: Connection, *, provider: Provider | str | None = None) -> StateCounts:
    """The counts per state of every machine, or of ``provider``'s (one
    statement that reads the whole fleet: see `console.counts` for how the
    web UI keeps its cost down)."""
    params = {"provider": None if provider is None else Provider.parse(str(provider))}

    async def body(q: Queries) -> list[Row]:
        return await q.execute(STATE_COUNTS_SQL, params)

    [row] = await conn.transact(body, isolation=Isolation.REPEATABLE_READ)
    installs = len(State) + len(InstallState)
    return StateCounts(
        by_state=dict(zip(State, row[: len(State)], strict=True)),
        by_install=dict(zip(InstallState, row[len(State) : installs], strict=True)),
        at=row[installs],
    )
