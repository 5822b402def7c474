"""The machines listing: a page of machines, each with its state and why,
as ``bmdb machines``, the web UI's list and ``shepherd install --state``
read it.

A page is one statement (`machines_sql`) in creation order after a
machine (keyset paging), optionally of one state and one provider, with
one text per combination of filters so that PostgreSQL keeps a good
generic plan; each row becomes a `MachineState` (`to_json`/`from_json`
for the CLI's JSON). The states are `bmdb.overview.states`'.
"""

from __future__ import annotations

import datetime
import functools
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bmdb._pg import Row
from bmdb.connection import Connection
from bmdb.errors import InvalidArgument
from bmdb.model import (
    Hold,
    InstallState,
    Process,
    Provider,
    Queries,
    UpgradeState,
    as_uuid,
    node_id,
)
from bmdb.overview.states import (
    BACKOFF_PROBED,
    LIVE_INSTALL_STATE_SQL,
    STATE_SQL,
    TAGS,
    WAS_INSTALL_STATE_SQL,
    State,
    parse_state_filter,
    state_prefilter,
)
from bmdb.transaction import Isolation

# What the provider last said of machine m: for a tombstone, its release
# (Equinix deletes the device; the static list marks it removed), where
# the stored status is the provider's last listing before the release.
_PROVIDER_STATUS_SQL = """
    CASE WHEN dcm.decommissioned_at IS NULL THEN p.provider_status::text
         WHEN p.provider = 'Equinix' THEN 'deleted'
         ELSE 'removed' END
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
           {LIVE_INSTALL_STATE_SQL} AS install_state,
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
    {TAGS}
    LEFT JOIN machine_hold hd ON hd.machine_id = m.machine_id
    LEFT JOIN machine_os_installation_request oq ON oq.machine_id = m.machine_id
    LEFT JOIN machine_os_installation_report orp ON orp.machine_id = m.machine_id
    {BACKOFF_PROBED}
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


def all_machines_sql() -> str:
    """The listing's statement without a filter or a limit: a machine's page
    (`bmdb.overview.detail`) picks its line from it."""
    return _machines_sql((False,) * len(_FILTERS), None)


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


def machine_state_from_row(r: Row) -> MachineState:
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
SUMMARY_COLUMNS = 28


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
        machine_state_from_row(r)
        for r in await conn.transact(body, isolation=Isolation.REPEATABLE_READ)
    ]
