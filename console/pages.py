"""The web UI's pages: each reads one `bmdb.overview` snapshot and renders it.

Each function returns the page as `Html`; it raises what `bmdb.overview`
raises (`InvalidArgument` for bad parameters, `DatabaseUnavailable`, ...)
and `NotFound` for an unknown machine.
"""

from __future__ import annotations

import datetime
import uuid

from bmdb import overview
from bmdb.connection import Connection
from bmdb.errors import BMDBError
from bmdb.model import InstallState, OSInstallation, Provider, WorkEvent
from bmdb.overview import MachineState, State, StateCounts
from common.sshkey import fingerprint
from console.audit import machine_section
from console.counts import CountsCache
from console.errors import CountsUnavailable, NotFound
from console.guidance import next_step
from console.render import (
    Html,
    ago,
    columns,
    duration,
    esc,
    fields,
    link,
    page,
    stacked_bar,
    table,
    url,
)

#: Machines per page unless asked otherwise, and the most one may ask for.
PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _state(state: State | InstallState) -> Html:
    return Html(f'<span class="state-{esc(state)}">{esc(state)}</span>')


def _machine_link(machine_id: uuid.UUID) -> Html:
    return link(f"/machine/{machine_id}", machine_id, **{"class": "mono"})


def node_link(node_id: str) -> Html:
    """A link to the cluster's page of node ``node_id``."""
    return link(f"/cluster/node/{node_id}", node_id, **{"class": "mono"})


def _install(state: InstallState | None, generation: int | None) -> Html:
    """``installed@2`` (the state, styled, and its generation), or ``-``."""
    if state is None:
        return Html('<span class="dim">-</span>')
    return Html(
        f'<span class="state-{esc(state)}" title="generation {esc(generation)}">'
        f"{esc(state)}@{esc(generation)}</span>"
    )


async def machines(
    conn: Connection,
    counts: CountsCache,
    *,
    state: str | None,
    provider: str | None,
    after: str | None,
    limit: int = PAGE_SIZE,
) -> Html:
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
    now = _now()

    by_state = taken.by_state if taken is not None else {}
    by_install = taken.by_install if taken is not None else {}
    filt: list[Html] = [Html('<p class="filters">state: ')]
    filt.append(
        link(
            url("/machines", {"provider": provider}),
            _counted("all", taken.total if taken is not None else None),
            **_on(state is None),
        )
    )
    for s in State:
        filt.append(
            link(
                url("/machines", {"state": s, "provider": provider}),
                _counted(s, by_state.get(s)),
                **_on(state == s),
            )
        )
    filt.append(Html("<br>install: "))
    for i in InstallState:
        filt.append(
            link(
                url("/machines", {"state": i, "provider": provider}),
                _counted(i, by_install.get(i)),
                **_on(state == i),
            )
        )
    filt.append(Html("<br>provider: "))
    filt.append(link(url("/machines", {"state": state}), "all", **_on(provider is None)))
    for p in Provider:
        filt.append(
            link(url("/machines", {"state": state, "provider": p}), p, **_on(provider == p))
        )
    filt.append(Html("</p>"))
    if taken is not None:
        age = Html(
            f'<p class="dim" id="counts-age">counts as of {ago(taken.at, now)}'
            f" (taken at most every {counts.period:g} s; the list below is read now)</p>"
        )
        chart = stacked_bar([(str(s), taken.by_state[s]) for s in State])
    else:
        age = Html(
            f'<p class="state-failed" id="counts-age">counts unavailable: {esc(missing)}'
            " (the next page asks again; the list below is read now)</p>"
        )
        chart = Html("")
    body = table(
        _MACHINE_COLUMNS,
        (_machine_row(m, now) for m in rows),
        empty="no machines",
    )
    pager = [link(url("/machines", {"state": state, "provider": provider}), "first page")]
    if more:
        next_url = url(
            "/machines", {"state": state, "provider": provider, "after": rows[-1].machine_id}
        )
        pager.append(link(next_url, "next page", rel="next", id="next"))
    guide = next_step(taken, rows) if state is None and provider is None and after is None else ""
    content = Html("".join(filt) + age + chart + guide + body + "<p>" + " | ".join(pager) + "</p>")
    title = "Machines" + (f": {state}" if state else "") + (f" of {provider}" if provider else "")
    in_all = f", {taken.total} in all" if taken is not None else ""
    return page(title, content, footer=f"{len(rows)} shown{in_all}")


_MACHINE_COLUMNS = (
    "machine", "state", "install", "node", "provider", "provider id", "address", "heartbeat",
    "work", "backoff ends", "upgrade", "slot", "image", "cause",
)  # fmt: skip


def _image_of(m: MachineState) -> Html:
    """The image the machine runs as far as the BMDB knows: its short digest."""
    if not m.image:
        return Html('<span class="dim">-</span>')
    short = m.image.removeprefix("sha256:")[:12]
    return Html(f'<span class="mono" title="{esc(m.image)}">{esc(short)}</span>')


def _counted(name: str, n: int | None) -> str:
    """A filter's label: its name and its count, if known."""
    return name if n is None else f"{name} ({n})"


def _on(on: bool) -> dict[str, str]:
    return {"class": "on"} if on else {}


def _install_of(m: MachineState) -> Html:
    """The machine's installation; a tombstone's is what it was."""
    if m.was_install_state is not None:
        return Html(f"was {_install(m.was_install_state, m.install_generation)}")
    return _install(m.install_state, m.install_generation)


def _node_of(m: MachineState) -> Html | str:
    """The installed node (linked); a tombstone's node is gone (no link)."""
    if not m.node_id:
        return "-"
    if m.state == State.DECOMMISSIONED:
        return Html(f'was <span class="mono">{esc(m.node_id)}</span>')
    return node_link(m.node_id)


def _machine_row(m: MachineState, now: datetime.datetime) -> tuple[object, ...]:
    return (
        _machine_link(m.machine_id),
        _state(m.state),
        _install_of(m),
        _node_of(m),
        m.provider or "-",
        m.provider_id or "-",
        m.address or "-",
        ago(m.agent_heartbeat_at, now),
        ", ".join(m.work) or "-",
        ago(m.backoff_until, now) if m.backoff_until else "-",
        m.upgrade_state or "-",
        (m.slot or "-").upper(),
        _image_of(m),
        m.cause or "",
    )


async def machine(conn: Connection, machine_id: str) -> Html:
    """Everything about one machine: tags, work, backoffs, history."""
    d = await overview.machine(conn, machine_id)
    if d is None:
        raise NotFound(f"no machine {machine_id}")
    m, now = d.summary, d.now
    tags = fields(
        [
            ("state", _state(m.state)),
            ("install", _install_of(m)),
            ("upgrade", m.upgrade_state or "-"),
            ("slot", (m.slot or "-").upper()),
            ("image", _image_of(m)),
            ("created", ago(m.created_at, now)),
            ("provider", m.provider or "-"),
            ("provider id", m.provider_id or "-"),
            ("address", m.address or "-"),
            ("location", d.location or "-"),
            ("provider status", m.provider_status or "-"),
            ("agent started", ago(m.agent_started_at, now)),
            ("agent public key", d.agent_public_key.hex() if d.agent_public_key else "-"),
            ("heartbeat", ago(m.agent_heartbeat_at, now)),
            (
                "hardware report",
                f"{d.hardware_report_bytes} bytes" if d.hardware_report_bytes is not None else "-",
            ),
            ("SSH host key", fingerprint(d.ssh_host_key) if d.ssh_host_key else "-"),
            ("SSH host key first seen", ago(d.ssh_host_key_first_seen, now)),
            ("last failure", ago(m.failed_at, now)),
            ("last failure cause", m.failed_cause or "-"),
        ]
    )
    work = table(
        ("process", "session", "component", "lock"),
        ((w.process, w.session_id, w.component, "live" if w.live else "dead") for w in d.work),
        empty="no work",
    )
    backoffs = table(
        ("process", "until", "time left", "interval", "cause"),
        (
            (
                b.process,
                ago(b.until, now),
                duration_left(b.until, now) if b.active else "over",
                f"{b.interval_seconds}s",
                b.cause,
            )
            for b in d.backoffs
        ),
        empty="no backoff",
    )
    history = table(
        ("at", "process", "event", "session", "cause"),
        (
            (ago(e.at, now), e.process, _event(e.event), e.session_id or "-", e.cause or "")
            for e in d.history
        ),
        empty="no history",
    )
    body = Html(
        f"{tags}<h2>OS installation</h2>{_installation(d.installation, now)}"
        f"<h2>Work</h2>{work}<h2>Backoff</h2>{backoffs}"
        f"<h2>History ({len(d.history)})</h2>{history}{machine_section(d)}"
    )
    return page(f"Machine {m.machine_id}", body)


def duration_left(until: datetime.datetime, now: datetime.datetime) -> str:
    return duration(max(0.0, (until - now).total_seconds()))


def _gen(n: int | None) -> str:
    return "-" if n is None else f"generation {n}"


def _installation(i: OSInstallation | None, now: datetime.datetime) -> Html:
    """The request of the current generation and the report on it; the
    installed node links to its page in the cluster views."""
    if i is None:
        return Html('<p class="dim">never asked to install an OS</p>')
    items: list[tuple[str, object]] = [
        ("state", _install(i.state, i.generation)),
        ("generation", i.generation),
        ("requested", ago(i.requested_at, now)),
        ("root device", i.root_device or "-"),
        ("image", i.image_digest or "-"),
        ("node address", i.node_address or "-"),
    ]
    if i.reported:
        items += [
            ("reported", ago(i.reported_at, now)),
            (
                "outcome",
                "success" if i.success else Html('<span class="state-failed">error</span>'),
            ),
        ]
        if i.success:
            node = i.node_id
            items.append(("node", node_link(node) if node else "- (no key reported)"))
            if i.node_public_key is not None:
                items.append(
                    (
                        "node public key",
                        Html(f'<span class="mono">{esc(i.node_public_key.hex())}</span>'),
                    )
                )
        else:
            items.append(("cause", Html(f'<span class="state-failed">{esc(i.cause)}</span>')))
    else:
        items.append(
            ("last report", _gen(i.report_generation) if i.report_generation else "none yet")
        )
    return fields(items)


def _event(event: WorkEvent) -> Html:
    return (
        Html(f'<span class="state-failed">{esc(event)}</span>') if event == "Failed" else esc(event)
    )


async def sessions(conn: Connection) -> Html:
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
    chart = columns([h.strftime("%H:00") for h in hours], series)
    rows = table(
        ("session", "component", "runtime", "created", "interval", "deadline", "state", "work"),
        (
            (
                s.session_id,
                s.component,
                s.runtime_info,
                ago(s.created_at, now),
                f"{s.interval:g}s",
                ago(s.deadline, now),
                "expired" if s.expired else "live",
                s.work,
            )
            for s in act.sessions
        ),
        empty="no sessions",
    )
    body = Html(f"<h2>Work outcomes, last 24 hours</h2>{chart}<h2>Sessions</h2>{rows}")
    return page("Sessions", body, footer=f"{len(act.sessions)} sessions")
