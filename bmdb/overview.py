"""What an operator asks of the fleet: each machine's state and why, read-only.

One idea: classify machines into operator-facing *states* in SQL, so that the
CLI listings, the web UI and the metrics all say the same thing::

    decommissioned     a tombstone: wiped, released to its provider, kept with
                       its history (`bmdb.actions` decommission); nothing
                       works on it, and its installation and node are what
                       it *was* (``was_install_state``), never counted as
                       installed
    failed             an active backoff of any process (cause and end shown)
    unprovided         no provider tag
    needs-agent-start  provided, no agent started
    started            agent started, no heartbeat yet, within 30 minutes
    heartbeating       last heartbeat within 10 minutes
    silent             agent started, but no heartbeat for 30 minutes after the
                       start or none for 10 minutes (what recovery looks for)

"decommissioned" wins over all (a tombstone's agent tags are gone, so it
would otherwise read as needing an agent start); "failed" wins over the
others: a machine in backoff is hidden from a process, which is what an
operator needs to see first. The 10 and 30 minutes are the
recovery sourcing's thresholds (`bmdb.model.sourcing`).

Beside that state, a machine asked to install an OS has an *installation
state* (`InstallState`, none without a request), from its request of
generation g and the report stored on it::

    installing       no report on g yet (none, or one on an older generation)
    installed        the agent reported success on g (the node's id shown)
    install-failed   the agent reported an error on g (its cause shown)
    install-lost     installed, then the agent found g gone from its disk
                     (emptied or written over since; the cause shown)

The two are separate columns because they answer separate questions (is the
agent alive; is the OS on the machine); a ``state`` filter takes the names
of both (`parse_state_filter`).

A machine an operator holds (`bmdb.actions`) shows who holds it, since
when and why beside its state; `audit` lists the operators' actions.

Every function here reads in one REPEATABLE READ transaction (one to three
statements, one snapshot) through `Connection.transact`, and raises what it
raises (`DatabaseUnavailable`, ...), or `InvalidArgument` for a bad machine
id, state or provider. Nothing here writes.
"""

from __future__ import annotations

import datetime
import functools
import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bmdb._pg import Row
from bmdb.connection import Connection
from bmdb.errors import InvalidArgument
from bmdb.model import (
    AuditRecord,
    HistoryEvent,
    Hold,
    InstallState,
    OSInstallation,
    Process,
    Provider,
    Queries,
    SessionInfo,
    UpgradeState,
    WorkEvent,
    as_uuid,
    node_id,
)

# The history's statement is the model's (`Queries.history`); named here
# too, as the machine page's statements are (bench/web_pages.py binds them).
from bmdb.model.history import HISTORY_SQL as HISTORY_SQL
from bmdb.model.installs import (
    INSTALL_STATE_SQL,
    INSTALLATION_COLUMNS,
    INSTALLATION_WIDTH,
    installation_from_row,
)

if TYPE_CHECKING:
    from common.hwreport import HardwareReport

# The state names live with the rows (the CLI parses them without the
# driver); they are this module's words, so it offers them too.
from bmdb.model.rows import STATE_FILTERS as STATE_FILTERS
from bmdb.model.rows import State as State
from bmdb.model.rows import parse_state_filter as parse_state_filter
from bmdb.transaction import Isolation

#: The state of machine ``m`` given its joined tags p, a, h, dcm and backoff b.
STATE_SQL = """
    CASE WHEN dcm.decommissioned_at IS NOT NULL THEN 'decommissioned'
         WHEN b.until IS NOT NULL THEN 'failed'
         WHEN p.machine_id IS NULL THEN 'unprovided'
         WHEN a.machine_id IS NULL THEN 'needs-agent-start'
         WHEN h.agent_heartbeat_at >= now() - interval '10 minutes' THEN 'heartbeating'
         WHEN h.machine_id IS NULL AND a.agent_started_at >= now() - interval '30 minutes'
              THEN 'started'
         ELSE 'silent' END
"""

# The tags of machine m.
_TAGS = """
    LEFT JOIN machine_provided p ON p.machine_id = m.machine_id
    LEFT JOIN machine_agent_started a ON a.machine_id = m.machine_id
    LEFT JOIN machine_agent_heartbeat h ON h.machine_id = m.machine_id
    LEFT JOIN machine_decommission dcm ON dcm.machine_id = m.machine_id
"""

# The installation state of machine m: none for a tombstone, whose
# installation is gone with its wipe (`WAS_INSTALL_STATE_SQL` keeps it).
_LIVE_INSTALL_STATE_SQL = f"CASE WHEN dcm.decommissioned_at IS NULL THEN {INSTALL_STATE_SQL} END"
WAS_INSTALL_STATE_SQL = f"CASE WHEN dcm.decommissioned_at IS NOT NULL THEN {INSTALL_STATE_SQL} END"

# What the provider last said of machine m: for a tombstone, its release
# (Equinix deletes the device; the static list marks it removed), where
# the stored status is the provider's last listing before the release.
_PROVIDER_STATUS_SQL = """
    CASE WHEN dcm.decommissioned_at IS NULL THEN p.provider_status::text
         WHEN p.provider = 'Equinix' THEN 'deleted'
         ELSE 'removed' END
"""

# The latest-ending active backoff of machine m, two ways. A page visits few
# machines in index order: probe work_backoff's index per machine. The counts
# visit every machine: hash the (few) active backoffs once instead, where
# 50,000 probes cost ten times as much.
_BACKOFF_PROBED = """
    LEFT JOIN LATERAL (
        SELECT b.process, b.until, b.cause FROM work_backoff b
        WHERE b.machine_id = m.machine_id AND b.until > now()
        ORDER BY b.until DESC LIMIT 1) b ON true
"""
_BACKOFF_HASHED = """
    LEFT JOIN (
        SELECT DISTINCT ON (machine_id) machine_id, process, until, cause FROM work_backoff
        WHERE until > now() ORDER BY machine_id, until DESC) b ON b.machine_id = m.machine_id
"""

# The machine's row of the newest upgrade run that lists it (migration
# 0011), probed by machine (few machines have any).
_LATEST_UPGRADE = """
    LEFT JOIN LATERAL (
        SELECT mu.state, mu.slot, mu.agent_slot, mu.running_digest
        FROM machine_upgrade mu JOIN upgrade_run ur ON ur.run_id = mu.run_id
        WHERE mu.machine_id = m.machine_id
        ORDER BY ur.requested_at DESC LIMIT 1) u ON true
"""

# One page of machines in creation order, after the machine %(after)s (keyset
# paging: a page costs the same wherever it is), optionally of one state and
# provider (`machines_sql`). The last failure comes from the history (newest
# 'Failed' row). The filters: (parameter, condition).
_FILTERS = (
    (
        "after",
        "(m.machine_created_at, m.machine_id) > (SELECT machine_created_at, machine_id"
        " FROM machines WHERE machine_id = %(after)s::uuid)",
    ),
    ("provider", "p.provider = %(provider)s::provider"),
    ("state", "v.state = %(state)s::text"),
    ("install_state", "v.install_state = %(install_state)s::text"),
)


def state_prefilter(state: State | None) -> str:
    """A condition on machine m alone that holds exactly for the machines
    in ``state``, or ``true`` (None, or a state without one: `STATE_SQL`
    decides). A page selects its machines by it first, where an index
    serves it, before any machine's other joins are read.

    Why: the ``state`` filter compares the computed state, so a page of
    failed machines read machines in order, each with all its joins, until
    it had 101 failed ones (about 257 ms at 100,000 machines). "failed" is
    an active backoff: a semi-join on work_backoff finds those without
    reading the rest, from either side as PostgreSQL's statistics favour:
    the active backoffs by their end (index ``work_backoff_until``,
    migration 0009) when they are few, the machines in order with a probe
    of work_backoff's primary key each when they are many. The other
    states are most of the fleet or cheap to find in order, so they need
    none. Keep this beside `STATE_SQL`: a state added there that is rare
    wants its condition here."""
    if state == State.FAILED:
        # A tombstone's state is decommissioned whatever its backoff.
        return (
            "EXISTS (SELECT 1 FROM work_backoff fb"
            " WHERE fb.machine_id = m.machine_id AND fb.until > now())"
            " AND NOT EXISTS (SELECT 1 FROM machine_decommission fd"
            " WHERE fd.machine_id = m.machine_id AND fd.decommissioned_at IS NOT NULL)"
        )
    return "true"


def _compose(conditions: Sequence[str], limit: str, prefilter: str = "true") -> str:
    """A page of machines with ``conditions`` (one per `_FILTERS` entry),
    ``limit`` and ``prefilter`` (`state_prefilter`: exactly the state's
    machines)."""
    after, provider, state, install_state = conditions
    machines = "machines"
    if prefilter != "true" and provider == "true":
        # The page's machines first, in order, by the prefilter alone (exact
        # for the states that have one): the joins below then read a page,
        # not every machine in the state.
        machines = f"""(SELECT m.* FROM machines m WHERE {after} AND {prefilter}
                       ORDER BY m.machine_created_at, m.machine_id {limit})"""
        # Those are the state's machines already: asked again below, the
        # condition would be a second semi-join over the same backoffs.
        prefilter = "true"
    return f"""
SELECT * FROM (
    SELECT m.machine_id, m.machine_created_at, p.provider, p.provider_id, p.provider_address,
           {_PROVIDER_STATUS_SQL} AS provider_status, a.agent_started_at, h.agent_heartbeat_at,
           b.process AS backoff_process, b.until, b.cause AS backoff_cause,
           f.at AS failed_at, f.process AS failed_process, f.cause AS failed_cause,
           ARRAY(SELECT w.process::text FROM work w JOIN sessions s ON s.session_id = w.session_id
                 WHERE w.machine_id = m.machine_id AND s.session_deadline > now()
                 ORDER BY 1) AS work,
           {STATE_SQL} AS state,
           oq.generation AS install_generation,
           {_LIVE_INSTALL_STATE_SQL} AS install_state,
           CASE WHEN orp.generation = oq.generation
                THEN coalesce(orp.lost_cause, orp.cause) END AS install_cause,
           CASE WHEN orp.generation = oq.generation AND orp.success
                THEN orp.node_public_key END AS node_public_key,
           hd.held_by, hd.held_at, hd.reason AS held_reason,
           CASE WHEN dcm.machine_id IS NULL THEN NULL
                WHEN dcm.decommissioned_at IS NOT NULL THEN 'decommissioned'
                WHEN dcm.released_at IS NOT NULL THEN 'released'
                WHEN dcm.wiped_at IS NOT NULL THEN 'wiped'
                ELSE 'requested' END AS decommission,
           {WAS_INSTALL_STATE_SQL} AS was_install_state,
           u.state AS upgrade_state,
           coalesce(u.slot, u.agent_slot) AS slot,
           coalesce(u.running_digest, oq.image_digest) AS image
    FROM {machines} m
    {_TAGS}
    LEFT JOIN machine_hold hd ON hd.machine_id = m.machine_id
    LEFT JOIN machine_os_installation_request oq ON oq.machine_id = m.machine_id
    LEFT JOIN machine_os_installation_report orp ON orp.machine_id = m.machine_id
    {_BACKOFF_PROBED}
    LEFT JOIN LATERAL (
        SELECT x.at, x.process, x.cause FROM work_history x
        WHERE x.machine_id = m.machine_id AND x.event = 'Failed'
        ORDER BY x.id DESC LIMIT 1) f ON true
    {_LATEST_UPGRADE}
    WHERE {after}
      AND {provider}
      AND {prefilter}
) v
WHERE {state}
  AND {install_state}
ORDER BY v.machine_created_at, v.machine_id
{limit}
"""


def machines_sql(params: Mapping[str, Any]) -> str:
    """The statement of a page of machines for ``params`` (`machines_params`):
    only the filters given, and the (validated) limit written in.

    Why: PostgreSQL plans a prepared statement on every call (a custom plan:
    15 to 30 ms at 100,000 machines for this join) until it takes a generic
    plan, planned once; and the generic plan of an ``x IS NULL OR ...``
    filter or of ``LIMIT $n`` (taken as a tenth of the rows) sorts the whole
    fleet (100 to 270 ms). One text per combination of filters and page
    size has a generic plan as good as the custom one. Texts stay few (16
    combinations, a few page sizes); the driver prepares at most
    `bmdb._pg.MAX_PREPARED` per connection in any case."""
    state = None if params["state"] is None else State(params["state"])
    return _machines_sql(
        tuple(params[name] is not None for name, _ in _FILTERS), int(params["limit"]), state
    )


@functools.lru_cache(maxsize=64)
def _machines_sql(given: tuple[bool, ...], limit: int | None, state: State | None = None) -> str:
    """The filters ``given`` (in `_FILTERS` order), LIMIT ``limit`` (None:
    none), the `state_prefilter` of ``state``."""
    return _compose(
        [cond if on else "true" for on, (_, cond) in zip(given, _FILTERS, strict=True)],
        "" if limit is None else f"LIMIT {limit:d}",
        state_prefilter(state),
    )


# How many machines are in each state (of one provider, or all), as one row
# of filtered counts in `State` order, then in `InstallState` order, then the
# snapshot's time: a plain aggregate, where GROUP BY on the CASE made the
# planner expect 50,000 groups and sort them. It reads every machine (a
# fleet scan): the web UI runs it at most once per period (`console.counts`).
STATE_COUNTS_SQL = f"""
SELECT {", ".join(f"count(*) FILTER (WHERE state = '{s}')" for s in State)},
       {", ".join(f"count(*) FILTER (WHERE install_state = '{s}')" for s in InstallState)},
       now()
FROM (SELECT {STATE_SQL} AS state, {_LIVE_INSTALL_STATE_SQL} AS install_state
      FROM machines m
      {_TAGS}
      LEFT JOIN machine_os_installation_request oq ON oq.machine_id = m.machine_id
      LEFT JOIN machine_os_installation_report orp ON orp.machine_id = m.machine_id
      {_BACKOFF_HASHED}
      WHERE %(provider)s::provider IS NULL OR p.provider = %(provider)s::provider) v
"""


@dataclass(frozen=True)
class MachineState:
    """One line of the machines listing."""

    machine_id: uuid.UUID
    created_at: datetime.datetime
    state: State
    provider: Provider | None
    provider_id: str | None
    address: str | None
    provider_status: str | None
    agent_started_at: datetime.datetime | None
    agent_heartbeat_at: datetime.datetime | None
    #: The active backoff ending last, if any.
    backoff_process: Process | None
    backoff_until: datetime.datetime | None
    backoff_cause: str | None
    #: The newest failure in the history, if any (its backoff may be over).
    failed_at: datetime.datetime | None
    failed_process: Process | None
    failed_cause: str | None
    #: Processes with live work on the machine now.
    work: tuple[Process, ...]
    #: The installation state, None if no installation was ever requested.
    install_state: InstallState | None
    #: The requested generation.
    install_generation: int | None
    #: The agent's cause, when the requested generation failed.
    install_cause: str | None
    #: The installed node's id (``metropolis-`` + hex), when installed.
    node_id: str | None
    #: An operator's hold (who, since when, why): no process takes the
    #: machine meanwhile. None if not held.
    hold: Hold | None = None
    #: How far a decommission got: requested, wiped, released, or
    #: decommissioned (a tombstone); None if none was asked for.
    decommission: str | None = None
    #: A tombstone's installation state before it was decommissioned
    #: (``install_state`` is None then); None for any other machine.
    was_install_state: InstallState | None = None
    #: Its state in the newest upgrade run that lists it, if any.
    upgrade_state: UpgradeState | None = None
    #: The disk slot its node runs from, as its last upgrade left it (the
    #: cluster's view at its end, or its agent's report while it goes).
    slot: str | None = None
    #: The image it runs as far as the BMDB knows: the node's digest at the
    #: end of its last upgrade, else the one its installation asked for.
    image: str | None = None

    @property
    def cause(self) -> str | None:
        """Why the machine is in trouble: an active backoff's cause, else a
        failed installation's, else the last work failure's."""
        return self.backoff_cause or self.install_cause or self.failed_cause

    def to_json(self) -> dict[str, Any]:
        """Plain JSON types (ids and times as strings); `from_json` reverses it."""
        return {
            "machine_id": str(self.machine_id),
            "created_at": _iso(self.created_at),
            "state": str(self.state),
            "provider": self.provider and str(self.provider),
            "provider_id": self.provider_id,
            "address": self.address,
            "provider_status": self.provider_status,
            "agent_started_at": _iso(self.agent_started_at),
            "agent_heartbeat_at": _iso(self.agent_heartbeat_at),
            "backoff_process": self.backoff_process and str(self.backoff_process),
            "backoff_until": _iso(self.backoff_until),
            "backoff_cause": self.backoff_cause,
            "failed_at": _iso(self.failed_at),
            "failed_process": self.failed_process and str(self.failed_process),
            "failed_cause": self.failed_cause,
            "work": [str(w) for w in self.work],
            "install_state": self.install_state and str(self.install_state),
            "install_generation": self.install_generation,
            "install_cause": self.install_cause,
            "node_id": self.node_id,
            "held_by": self.hold and self.hold.held_by,
            "held_at": self.hold and _iso(self.hold.held_at),
            "held_reason": self.hold and self.hold.reason,
            "decommission": self.decommission,
            "was_install_state": self.was_install_state and str(self.was_install_state),
            "upgrade_state": self.upgrade_state and str(self.upgrade_state),
            "slot": self.slot,
            "image": self.image,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> MachineState:
        def opt(kind: Any, key: str) -> Any:
            return None if d[key] is None else kind(d[key])

        return cls(
            machine_id=uuid.UUID(d["machine_id"]),
            created_at=datetime.datetime.fromisoformat(d["created_at"]),
            state=State(d["state"]),
            provider=opt(Provider, "provider"),
            provider_id=d["provider_id"],
            address=d["address"],
            provider_status=d["provider_status"],
            agent_started_at=opt(datetime.datetime.fromisoformat, "agent_started_at"),
            agent_heartbeat_at=opt(datetime.datetime.fromisoformat, "agent_heartbeat_at"),
            backoff_process=opt(Process, "backoff_process"),
            backoff_until=opt(datetime.datetime.fromisoformat, "backoff_until"),
            backoff_cause=d["backoff_cause"],
            failed_at=opt(datetime.datetime.fromisoformat, "failed_at"),
            failed_process=opt(Process, "failed_process"),
            failed_cause=d["failed_cause"],
            work=tuple(Process(w) for w in d["work"]),
            install_state=opt(InstallState, "install_state"),
            install_generation=d["install_generation"],
            install_cause=d["install_cause"],
            node_id=d["node_id"],
            hold=None
            if d.get("held_by") is None
            else Hold(
                d["held_by"], datetime.datetime.fromisoformat(d["held_at"]), d["held_reason"]
            ),
            decommission=d.get("decommission"),
            was_install_state=opt(InstallState, "was_install_state")
            if "was_install_state" in d
            else None,
            upgrade_state=opt(UpgradeState, "upgrade_state") if "upgrade_state" in d else None,
            slot=d.get("slot"),
            image=d.get("image"),
        )


def _iso(at: datetime.datetime | None) -> str | None:
    return at.isoformat() if at else None


# The enums of a row, by their text in the database: a page decodes 101
# rows, and calling an enum class costs ten times a dict lookup.
_STATES = {str(s): s for s in State}
_INSTALL_STATES = {str(s): s for s in InstallState}
_UPGRADE_STATES = {str(s): s for s in UpgradeState}
_PROVIDERS = {str(p): p for p in Provider}
_PROCESSES = {str(p): p for p in Process}


def _machine_state(r: Row) -> MachineState:
    return MachineState(
        machine_id=r[0],
        created_at=r[1],
        provider=_PROVIDERS[r[2]] if r[2] else None,
        provider_id=r[3],
        address=r[4],
        provider_status=r[5],
        agent_started_at=r[6],
        agent_heartbeat_at=r[7],
        backoff_process=_PROCESSES[r[8]] if r[8] else None,
        backoff_until=r[9],
        backoff_cause=r[10],
        failed_at=r[11],
        failed_process=_PROCESSES[r[12]] if r[12] else None,
        failed_cause=r[13],
        work=tuple(_PROCESSES[w] for w in r[14]),
        state=_STATES[r[15]],
        install_generation=r[16],
        install_state=_INSTALL_STATES[r[17]] if r[17] else None,
        install_cause=r[18],
        node_id=None if r[19] is None else node_id(bytes(r[19])),
        hold=None if r[20] is None else Hold(r[20], r[21], r[22]),
        decommission=r[23],
        was_install_state=_INSTALL_STATES[r[24]] if r[24] else None,
        upgrade_state=_UPGRADE_STATES[r[25]] if r[25] else None,
        slot=r[26],
        image=r[27],
    )


#: How many columns of a row `_machine_state` reads.
_SUMMARY_COLUMNS = 28


def machines_params(
    *,
    limit: int,
    state: State | InstallState | str | None = None,
    provider: Provider | str | None = None,
    after: uuid.UUID | str | None = None,
) -> dict[str, Any]:
    """Validated parameters of `machines_sql` (also used by the benchmark).
    ``state`` is a `State` or an `InstallState` (`parse_state_filter`)."""
    if not isinstance(limit, int) or limit < 1:
        raise InvalidArgument(f"limit must be a positive integer, got {limit!r}")
    chosen = None if state is None else parse_state_filter(str(state))
    return {
        "limit": limit,
        "state": str(chosen) if isinstance(chosen, State) else None,
        "install_state": str(chosen) if isinstance(chosen, InstallState) else None,
        "provider": None if provider is None else Provider.parse(str(provider)),
        "after": None if after is None else as_uuid(after),
    }


async def machine_ids(
    q: Queries, *, limit: int, state: State | InstallState | str | None = None
) -> list[uuid.UUID]:
    """Up to ``limit`` machine ids in ``state``, oldest first, read in the
    caller's transaction (``shepherd install --state`` chooses with this)."""
    params = machines_params(limit=limit, state=state)
    rows = await q.execute(machines_sql(params), params)
    return [r[0] for r in rows]


async def machines(
    conn: Connection,
    *,
    limit: int = 1000,
    state: State | InstallState | str | None = None,
    provider: Provider | str | None = None,
    after: uuid.UUID | str | None = None,
) -> list[MachineState]:
    """Up to ``limit`` machines in creation order after machine ``after``,
    optionally only those in ``state`` and of ``provider``."""
    params = machines_params(limit=limit, state=state, provider=provider, after=after)

    sql = machines_sql(params)

    async def body(q: Queries) -> list[Row]:
        return await q.execute(sql, params)

    return [
        _machine_state(r) for r in await conn.transact(body, isolation=Isolation.REPEATABLE_READ)
    ]


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


@dataclass(frozen=True)
class WorkRow:
    """A work lock on the machine, with its session."""

    process: Process
    session_id: uuid.UUID
    component: str
    live: bool


@dataclass(frozen=True)
class BackoffRow:
    """A stored backoff of the machine (possibly over already)."""

    process: Process
    until: datetime.datetime
    cause: str
    interval_seconds: int
    active: bool


@dataclass(frozen=True)
class MachineDetail:
    """Everything the BMDB knows about one machine."""

    summary: MachineState
    location: str | None
    agent_public_key: bytes | None
    hardware_report_bytes: int | None
    os_installation_request_generation: int | None
    os_installation_report_generation: int | None
    ssh_host_key: bytes | None
    ssh_host_key_first_seen: datetime.datetime | None
    #: The installation request and the report on it, None without a request.
    installation: OSInstallation | None
    work: tuple[WorkRow, ...]
    backoffs: tuple[BackoffRow, ...]
    history: tuple[HistoryEvent, ...]
    #: The database's clock when this was read (for "time left").
    now: datetime.datetime
    #: Operators' actions on the machine, oldest first (`bmdb.actions`).
    audit: tuple[AuditRecord, ...] = ()
    #: Who asked for a recovery not done yet (``recover-now``), and when.
    recovery_requested_by: str | None = None
    recovery_requested_at: datetime.datetime | None = None
    #: How far a requested decommission got, in one line; None if none was.
    decommission: str | None = None
    #: The stored hardware report decoded (`common.hwreport`); None without
    #: one, or when it does not decode.
    hardware: HardwareReport | None = None
    #: Why a stored report is not in `hardware`: it does not decode (old,
    #: cut short, hostile), or is larger than `MAX_HARDWARE_REPORT`.
    hardware_unreadable: str | None = None


#: Largest stored hardware report read and decoded, bytes: four times the
#: largest heartbeat the agent callback server takes (256 KiB), so that a
#: report any server stored is read, and a row written otherwise cannot make
#: a page read a gigabyte.
MAX_HARDWARE_REPORT = 1024 * 1024


# One machine: its `machines_sql` line and every other tag, its work and
# backoffs as JSON arrays (one row, however many of them).
DETAIL_SQL = f"""
SELECT v.*, p.provider_location, a.agent_public_key, octet_length(r.hardware_report_raw),
       oq.generation, orp.generation, k.public_key, k.first_seen,
       oq.machine_id IS NOT NULL, {INSTALLATION_COLUMNS},
       (SELECT coalesce(json_agg(json_build_array(w.process, w.session_id,
                                                  s.session_component_name,
                                                  s.session_deadline > now())
                                 ORDER BY w.process), '[]')
        FROM work w JOIN sessions s ON s.session_id = w.session_id
        WHERE w.machine_id = v.machine_id),
       (SELECT coalesce(json_agg(json_build_array(b.process, b.until, b.cause,
                                                  b.last_interval_seconds, b.until > now())
                                 ORDER BY b.process), '[]')
        FROM work_backoff b WHERE b.machine_id = v.machine_id),
       now(), rr.requested_by, rr.requested_at,
       CASE WHEN dc.machine_id IS NULL THEN NULL
            WHEN dc.decommissioned_at IS NOT NULL
                 THEN 'decommissioned (a tombstone) at ' || dc.decommissioned_at
                      || coalesce('; node ' || dc.node_id || ' ' || dc.node_removal, '')
                      || '; wiped: ' || dc.wipe_report || '; ' || dc.release_detail
            WHEN dc.released_at IS NOT NULL THEN 'released: ' || dc.release_detail
            WHEN dc.wiped_at IS NOT NULL THEN 'wiped at ' || dc.wiped_at || ': ' || dc.wipe_report
            WHEN dc.node_removed_at IS NOT NULL
                 THEN 'node ' || dc.node_id || ' at ' || dc.node_removed_at || ': '
                      || dc.node_removal || '; not wiped yet'
            ELSE 'requested by ' || dc.requested_by || ' at ' || dc.requested_at
                 || ' (' || dc.reason || '), not wiped yet' END,
       CASE WHEN octet_length(r.hardware_report_raw) <= %(max_report)s
            THEN r.hardware_report_raw END
FROM ({_machines_sql((False,) * len(_FILTERS), None)}) v
LEFT JOIN machine_provided p ON p.machine_id = v.machine_id
LEFT JOIN machine_agent_started a ON a.machine_id = v.machine_id
LEFT JOIN machine_hardware_report r ON r.machine_id = v.machine_id
LEFT JOIN machine_os_installation_request oq ON oq.machine_id = v.machine_id
LEFT JOIN machine_os_installation_report orp ON orp.machine_id = v.machine_id
LEFT JOIN machine_ssh_host_key k ON k.machine_id = v.machine_id
LEFT JOIN machine_recovery_request rr ON rr.machine_id = v.machine_id
LEFT JOIN machine_decommission dc ON dc.machine_id = v.machine_id
WHERE v.machine_id = %(machine)s
"""

#: Operators' actions, newest first, optionally of one machine, before an id.
AUDIT_SQL = """
SELECT id, at, operator, action, machine_id, reason, detail FROM audit_log
WHERE (%(machine)s::uuid IS NULL OR machine_id = %(machine)s::uuid)
  AND (%(before)s::bigint IS NULL OR id < %(before)s::bigint)
ORDER BY id DESC
LIMIT %(limit)s
"""


def detail_params(machine_id: uuid.UUID) -> dict[str, object]:
    """`DETAIL_SQL`'s parameters for one machine."""
    return {"machine": machine_id, "max_report": MAX_HARDWARE_REPORT}


async def machine(conn: Connection, machine_id: uuid.UUID | str) -> MachineDetail | None:
    """Everything about one machine (three statements, one snapshot), or None
    if there is no such machine. `InvalidArgument` if ``machine_id`` is not a UUID."""
    mid = as_uuid(machine_id)
    params = detail_params(mid)
    audit_params = {"machine": mid, "before": None, "limit": MAX_AUDIT}

    async def body(q: Queries) -> tuple[list[Row], list[HistoryEvent], list[Row]]:
        return (
            await q.execute(DETAIL_SQL, params),
            await q.history(mid),
            await q.execute(AUDIT_SQL, audit_params),
        )

    rows, history, audit_rows = await conn.transact(body, isolation=Isolation.REPEATABLE_READ)
    if not rows:
        return None
    r = rows[0]
    extra = r[_SUMMARY_COLUMNS:]
    installation = installation_from_row(extra[8 : 8 + INSTALLATION_WIDTH]) if extra[7] else None
    extra = extra[:7] + extra[8 + INSTALLATION_WIDTH :]
    hardware, unreadable = _hardware(extra[2], extra[13])
    return MachineDetail(
        summary=_machine_state(r[:_SUMMARY_COLUMNS]),
        location=extra[0],
        agent_public_key=None if extra[1] is None else bytes(extra[1]),
        hardware_report_bytes=extra[2],
        os_installation_request_generation=extra[3],
        os_installation_report_generation=extra[4],
        ssh_host_key=None if extra[5] is None else bytes(extra[5]),
        ssh_host_key_first_seen=extra[6],
        installation=installation,
        work=tuple(WorkRow(Process(w[0]), uuid.UUID(w[1]), w[2], w[3]) for w in _json(extra[7])),
        backoffs=tuple(
            BackoffRow(Process(b[0]), datetime.datetime.fromisoformat(b[1]), b[2], b[3], b[4])
            for b in _json(extra[8])
        ),
        history=tuple(history),
        now=extra[9],
        audit=tuple(AuditRecord(*a) for a in reversed(audit_rows)),
        recovery_requested_by=extra[10],
        recovery_requested_at=extra[11],
        decommission=extra[12],
        hardware=hardware,
        hardware_unreadable=unreadable,
    )


def _hardware(size: int | None, raw: bytes | None) -> tuple[HardwareReport | None, str | None]:
    """A stored report of ``size`` bytes (``raw`` if read) decoded, or why not."""
    # Imported here: only a machine's detail decodes a report.
    from common.hwreport import decode

    if size is None:
        return None, None
    if raw is None:
        return None, f"{size} bytes, over the {MAX_HARDWARE_REPORT} this view reads"
    try:
        return decode(bytes(raw)), None
    except ValueError as exc:
        return None, f"{exc} ({size} bytes)"


#: The most audit records one call returns (a machine's page shows its newest).
MAX_AUDIT = 1000


async def audit(
    conn: Connection,
    *,
    machine: uuid.UUID | str | None = None,
    limit: int = 100,
    before: int | None = None,
) -> list[AuditRecord]:
    """Operators' actions, newest first: up to ``limit`` (at most
    `MAX_AUDIT`) records with an id below ``before``, of one machine or all
    (a forgotten machine's records included)."""
    if not isinstance(limit, int) or not 1 <= limit <= MAX_AUDIT:
        raise InvalidArgument(f"limit must be 1 to {MAX_AUDIT}, got {limit!r}")
    if before is not None and (not isinstance(before, int) or before < 1):
        raise InvalidArgument(f"before must be a positive record id, got {before!r}")
    params = {
        "machine": None if machine is None else as_uuid(machine),
        "before": before,
        "limit": limit,
    }

    async def body(q: Queries) -> list[Row]:
        return await q.execute(AUDIT_SQL, params)

    rows = await conn.transact(body, isolation=Isolation.REPEATABLE_READ)
    return [AuditRecord(*r) for r in rows]


#: The machines whose current installation succeeded with one of the node
#: keys %(keys)s (a report on an older generation names no node any more).
NODE_MACHINES_SQL = """
SELECT orp.node_public_key, orp.machine_id FROM machine_os_installation_report orp
JOIN machine_os_installation_request oq
  ON oq.machine_id = orp.machine_id AND oq.generation = orp.generation
WHERE orp.success AND orp.node_public_key = ANY(%(keys)s::bytea[])
ORDER BY orp.machine_id
"""

#: The most node keys `machines_of_nodes` looks up at once.
MAX_NODE_KEYS = 10_000


async def machines_of_nodes(
    conn: Connection, public_keys: Sequence[bytes]
) -> dict[bytes, tuple[uuid.UUID, ...]]:
    """The machines installed with each of the nodes ``public_keys`` (raw
    Ed25519 keys, as the install reports carry them), by key; a key no
    current report names is absent. Normally one machine per key: two
    means two agents reported the same node, which the views show as is.
    `InvalidArgument` for more than `MAX_NODE_KEYS` keys or a key that is
    not 32 bytes."""
    keys = [bytes(k) for k in public_keys]
    if len(keys) > MAX_NODE_KEYS:
        raise InvalidArgument(f"at most {MAX_NODE_KEYS} node keys at once, got {len(keys)}")
    if any(len(k) != 32 for k in keys):
        raise InvalidArgument("a node public key is 32 bytes")
    if not keys:
        return {}

    async def body(q: Queries) -> list[Row]:
        return await q.execute(NODE_MACHINES_SQL, {"keys": keys})

    found: dict[bytes, tuple[uuid.UUID, ...]] = {}
    for key, machine_id in await conn.transact(body, isolation=Isolation.REPEATABLE_READ):
        found[bytes(key)] = (*found.get(bytes(key), ()), machine_id)
    return found


def _json(value: Any) -> Sequence[Any]:
    # psycopg loads json columns already; a str means a text loader was used.
    loaded = json.loads(value) if isinstance(value, str) else value
    assert isinstance(loaded, list)
    return loaded


_SESSIONS_SQL = """
SELECT session_id, session_component_name, session_runtime_info, session_created_at,
       session_interval_seconds, session_deadline, session_deadline <= now(),
       (SELECT count(*) FROM work w WHERE w.session_id = s.session_id)
FROM sessions s ORDER BY session_created_at, session_id
"""

# Work outcomes per hour over the last day (the history has no index on
# `at`: this scans it, fine for a page an operator opens now and then).
_OUTCOMES_SQL = """
SELECT date_trunc('hour', at), event, count(*) FROM work_history
WHERE at > now() - interval '24 hours' AND event <> 'Started'
GROUP BY 1, 2 ORDER BY 1, 2
"""


@dataclass(frozen=True, slots=True)
class SessionRow(SessionInfo):
    """A session and how many work locks it holds."""

    work: int


@dataclass(frozen=True)
class Activity:
    """Sessions, and work outcomes (Finished, Failed, Canceled) per hour."""

    sessions: list[SessionRow]
    #: (hour, event, count), oldest first.
    outcomes: list[tuple[datetime.datetime, WorkEvent, int]]


async def activity(conn: Connection) -> Activity:
    """Every session and the last 24 hours' work outcomes (two statements, one snapshot)."""

    async def body(q: Queries) -> tuple[list[Row], list[Row]]:
        return await q.execute(_SESSIONS_SQL), await q.execute(_OUTCOMES_SQL)

    sessions, outcomes = await conn.transact(body, isolation=Isolation.REPEATABLE_READ)
    return Activity(
        sessions=[SessionRow(*r) for r in sessions],
        outcomes=[(r[0], WorkEvent(r[1]), r[2]) for r in outcomes],
    )
