"""The web UI's BMDB pages: each reads one `bmdb.overview` snapshot and says
what to show of it (a `Page` of ``templates/machines.html``,
``machine.html`` or ``sessions.html``).

Each function returns the `Page`; it raises what `bmdb.overview` raises
(`InvalidArgument` for bad parameters, `DatabaseUnavailable`, ...) and
`NotFound` for an unknown machine.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

from bmdb import overview
from bmdb.connection import Connection
from bmdb.errors import BMDBError
from bmdb.model import InstallState, Provider, WorkEvent
from bmdb.overview import State, StateCounts
from common.sshkey import fingerprint
from console.charts import columns, stacked_bar
from console.counts import CountsCache
from console.errors import CountsUnavailable, NotFound
from console.guidance import ADD_MACHINES, next_step
from console.render import Page, url

#: Machines per page unless asked otherwise, and the most one may ask for.
PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


@dataclass(frozen=True)
class Filter:
    """A filter link of the machines list: where it goes, its label, and
    whether it is the filter shown."""

    href: str
    text: str
    on: bool


async def machines(
    conn: Connection,
    counts: CountsCache,
    *,
    state: str | None,
    provider: str | None,
    after: str | None,
    limit: int = PAGE_SIZE,
) -> Page:
    """The machines list: state counts (filter links) from ``counts``, as
    of when they were taken, and a page of machines read now. A count query
    that fails leaves the rows and says why the counts are missing."""
    # Checked before a count query may start: bad input costs no fleet scan.
    params = overview.machines_params(limit=limit + 1, state=state, provider=provider, after=after)
    # Asked first, so that a count query this page needs runs beside its rows.
    pending = counts.fetch(params["provider"])
    rows = await overview.machines(
        conn, limit=limit + 1, state=state, provider=provider, after=after
    )
    taken: StateCounts | None = None
    missing = ""
    try:
        taken = await pending.wait()
    except (BMDBError, CountsUnavailable) as e:
        missing = str(e)
    more = len(rows) > limit
    rows = rows[:limit]

    by_state = taken.by_state if taken is not None else {}
    by_install = taken.by_install if taken is not None else {}
    filters = [
        (
            "state",
            [
                Filter(
                    url("/machines", {"provider": provider}),
                    _counted("all", taken.total if taken is not None else None),
                    state is None,
                ),
                *(
                    Filter(
                        url("/machines", {"state": s, "provider": provider}),
                        _counted(s, by_state.get(s)),
                        state == s,
                    )
                    for s in State
                ),
            ],
        ),
        (
            "install",
            [
                Filter(
                    url("/machines", {"state": i, "provider": provider}),
                    _counted(i, by_install.get(i)),
                    state == i,
                )
                for i in InstallState
            ],
        ),
        (
            "provider",
            [
                Filter(url("/machines", {"state": state}), "all", provider is None),
                *(
                    Filter(url("/machines", {"state": state, "provider": p}), p, provider == p)
                    for p in Provider
                ),
            ],
        ),
    ]
    first = url("/machines", {"state": state, "provider": provider})
    next_page = (
        url("/machines", {"state": state, "provider": provider, "after": rows[-1].machine_id})
        if more
        else None
    )
    unfiltered = state is None and provider is None and after is None
    title = "Machines" + (f": {state}" if state else "") + (f" of {provider}" if provider else "")
    in_all = f", {taken.total} in all" if taken is not None else ""
    return Page(
        "machines.html",
        title,
        {
            "filters": filters,
            "counts": taken,
            "period": counts.period,
            "missing": missing,
            "bar": stacked_bar([(str(s), taken.by_state[s]) for s in State]) if taken else None,
            "guide": next_step(taken, rows) if unfiltered else None,
            "add_machines": ADD_MACHINES,
            "columns": _MACHINE_COLUMNS,
            "rows": rows,
            "now": _now(),
            "first": first,
            "next": next_page,
        },
        footer=f"{len(rows)} shown{in_all}",
    )


_MACHINE_COLUMNS = (
    "machine", "state", "install", "node", "provider", "provider id", "address", "heartbeat",
    "work", "backoff ends", "upgrade", "slot", "image", "cause",
)  # fmt: skip


def _counted(name: str, n: int | None) -> str:
    """A filter's label: its name and its count, if known."""
    return name if n is None else f"{name} ({n})"


async def machine(conn: Connection, machine_id: str) -> Page:
    """Everything about one machine: tags, work, backoffs, history."""
    d = await overview.machine(conn, machine_id)
    if d is None:
        raise NotFound(f"no machine {machine_id}")
    host_key = fingerprint(d.ssh_host_key) if d.ssh_host_key else None
    return Page("machine.html", f"Machine {d.summary.machine_id}", {"d": d, "host_key": host_key})


async def sessions(conn: Connection) -> Page:
    """Sessions, and work outcomes per hour over the last day."""
    act = await overview.activity(conn)
    now = _now()
    hours = [
        (now - datetime.timedelta(hours=h)).replace(minute=0, second=0, microsecond=0)
        for h in range(23, -1, -1)
    ]
    index = {h: i for i, h in enumerate(hours)}
    events = (WorkEvent.FINISHED, WorkEvent.FAILED, WorkEvent.CANCELED)
    series = {str(e): [0] * len(hours) for e in events}
    for hour, event, count in act.outcomes:
        i = index.get(hour.astimezone(datetime.UTC))
        if i is not None:
            series[str(event)][i] += count
    return Page(
        "sessions.html",
        "Sessions",
        {
            "outcomes": columns([h.strftime("%H:00") for h in hours], series),
            "sessions": act.sessions,
            "now": now,
        },
        footer=f"{len(act.sessions)} sessions",
    )
