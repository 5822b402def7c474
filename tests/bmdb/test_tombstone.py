"""A tombstone (a decommissioned machine) in every view, against a real
PostgreSQL: its own state ``decommissioned``, never installed nor needing
work, its installation and node as they *were*, the provider's last word
as its status. The machine goes through the decommissioner's own steps
(`Queries.record_node_removal`, `record_wipe`, `record_release`,
`tombstone`) after an operator's ``bmdb decommission``."""

from __future__ import annotations

import datetime
import json
import uuid

import trio

import bmdb
from bmdb import Process, Queries, overview
from bmdb.metrics import fleet_snapshot
from bmdb.model import InstallState, node_id
from bmdb.overview import State
from console import pages
from console.counts import CountsCache
from console.render import render
from tests.bmdb.helpers import add_provided_machines
from tests.bmdb.test_cli import cli

NODE_KEY = bytes(range(32))


async def _installed(conn: bmdb.Connection, count: int) -> list[uuid.UUID]:
    """``count`` provided machines with a started agent and a successful
    installation of generation 1."""
    mids = await add_provided_machines(conn, count)

    async def body(q: Queries) -> None:
        now = datetime.datetime.now(datetime.UTC)
        for i, mid in enumerate(mids):
            await q.set_agent_started(mid, now, b"k" * 32)
            await q.set_agent_heartbeat(mid, now)
            await q.set_os_installation_request(mid, 1, b"req")
            key = bytes([i]) + NODE_KEY[1:]
            await q.record_os_installation_report(mid, 1, b"rep", True, None, key)

    await conn.transact(body)
    return mids


async def _decommission(conn: bmdb.Connection, url: str, mid: uuid.UUID) -> None:
    code, _, err = await cli("--url", url, "decommission", str(mid), "--reason", "retire")
    assert code == 0, err

    async def steps(q: Queries) -> None:
        await q.record_node_removal(mid, node_id(NODE_KEY), "deleted")
        await q.record_wipe(mid, "stopped 1 process(es)")
        await q.record_release(mid, f"static machine {mid} marked removed in the BMDB")
        await q.tombstone(mid)

    await conn.transact(steps)


async def test_a_tombstone_reads_as_decommissioned_in_every_view(
    bmdb_conn: bmdb.Connection, bmdb_url: str
) -> None:
    live, dead = await _installed(bmdb_conn, 2)
    await _decommission(bmdb_conn, bmdb_url, dead)

    # The listing: its own state, no installation, what it was beside it.
    [m] = [m for m in await overview.machines(bmdb_conn) if m.machine_id == dead]
    assert m.state is State.DECOMMISSIONED
    assert m.install_state is None and m.was_install_state is InstallState.INSTALLED
    assert m.provider_status == "removed"
    assert overview.MachineState.from_json(json.loads(json.dumps(m.to_json()))) == m

    # Filters in SQL: the tombstone under decommissioned only.
    async def ids(state: str) -> set[uuid.UUID]:
        return {x.machine_id for x in await overview.machines(bmdb_conn, state=state)}

    assert await ids("decommissioned") == {dead}
    assert await ids("installed") == {live}
    assert await ids("needs-agent-start") == set()
    assert await ids("heartbeating") == {live}

    # Counts per state (the CLI's, the web UI's).
    counts = await overview.state_counts(bmdb_conn)
    assert counts.by_state[State.DECOMMISSIONED] == 1
    assert counts.by_state[State.NEEDS_AGENT_START] == 0
    assert counts.by_install[InstallState.INSTALLED] == 1
    assert counts.total == 2

    # Metrics.
    snapshot = await fleet_snapshot(bmdb_conn)
    assert snapshot.installation == {"installed": 1}
    assert snapshot.decommissioned == 1

    # No source offers it (agent start, recovery, any process).
    async def sources(q: Queries) -> list[object]:
        found: list[object] = [m.machine_id for m in await q.machines_for_agent_start(10)]
        found += [m.machine_id for m in await q.machines_for_agent_recovery(10)]
        for process in Process:
            found += await q.machines_for_process(process, 10)
        return found

    assert dead not in await bmdb_conn.transact(sources)

    # The CLI, as table and JSON, and the machine's page.
    code, out, err = await cli("--url", bmdb_url, "machines", "--state", "decommissioned")
    assert code == 0, err
    header, row = out.splitlines()
    # One token a column (a script may split the table on whitespace).
    columns = dict(zip(header.split(), row.split(), strict=False))
    assert columns["MACHINE"] == str(dead) and columns["STATE"] == "decommissioned"
    assert columns["INSTALL"] == "was:installed@1"
    assert columns["NODE"] == f"was:{node_id(bytes([1]) + NODE_KEY[1:])}"
    assert columns["HELD"] == "decommission:decommissioned"
    code, out, err = await cli("--url", bmdb_url, "machines", "--state", "installed", "--json")
    assert code == 0, err
    assert [x["machine_id"] for x in json.loads(out)] == [str(live)]
    code, out, err = await cli("--url", bmdb_url, "machines", "--state", "needs-agent-start")
    assert code == 0 and str(dead) not in out
    code, out, err = await cli("--url", bmdb_url, "machine", str(dead))
    assert code == 0, err
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    assert fields["state"].strip() == "decommissioned"
    assert fields["provider status"].strip() == "removed"

    # The web UI: the list filtered on the state, its filter link and count.
    async with trio.open_nursery() as nursery:
        cache = CountsCache(bmdb_conn, nursery)
        html = render(
            await pages.machines(
                bmdb_conn, cache, state="decommissioned", provider=None, after=None
            )
        )
    assert str(dead) in html and str(live) not in html and "was " in html
    assert "decommissioned (1)" in html and "installed (1)" in html
    html = render(await pages.machine(bmdb_conn, str(dead)))
    assert "decommissioned" in html and "removed" in html and "Running" not in html
