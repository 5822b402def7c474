"""``python -m bmdb machines`` / ``machine``: states, causes, backoff ends, as in the DB."""

from __future__ import annotations

import json
import uuid

import bmdb
from bmdb import _pg, overview
from bmdb.overview import MachineState, State
from tests.bmdb.test_cli import cli
from tests.operators.populate import HTML_CAUSE, populate


async def _backoff_until(url: str) -> dict[uuid.UUID, str]:
    pg = await _pg.PgConnection.connect(url)
    try:
        rows = await pg.execute("SELECT machine_id, until FROM work_backoff")
    finally:
        await pg.close()
    return {r[0]: r[1].isoformat() for r in rows}


async def test_json_states_and_backoff_match_the_database(
    bmdb_conn: bmdb.Connection, bmdb_url: str
) -> None:
    fleet = await populate(bmdb_conn)
    code, out, err = await cli("--url", bmdb_url, "machines", "--json")
    assert (code, err) == (0, "")
    listed = json.loads(out)
    by_id = {uuid.UUID(m["machine_id"]): m for m in listed}
    assert len(by_id) == 7
    for state, mid in fleet.ids.items():
        assert by_id[mid]["state"] == state, (state, by_id[mid])
    assert by_id[fleet.html_machine]["state"] == "failed"

    until = await _backoff_until(bmdb_url)
    assert set(until) == {fleet.ids[State.FAILED], fleet.html_machine}
    for mid, at in until.items():
        assert by_id[mid]["backoff_until"] == at
        assert by_id[mid]["backoff_process"] == "ShepherdAgentStart"
    assert by_id[fleet.ids[State.FAILED]]["failed_cause"] == "no route to host"
    assert by_id[fleet.html_machine]["backoff_cause"] == HTML_CAUSE

    # Round trip: the JSON is exactly what the library returns.
    direct = await overview.machines(bmdb_conn)
    assert [MachineState.from_json(m) for m in listed] == direct
    assert [m.to_json() for m in direct] == listed


async def test_filters(bmdb_conn: bmdb.Connection, bmdb_url: str) -> None:
    fleet = await populate(bmdb_conn)
    code, out, _ = await cli("--url", bmdb_url, "machines", "--state", "failed", "--json")
    assert code == 0
    assert {m["machine_id"] for m in json.loads(out)} == {
        str(fleet.ids[State.FAILED]),
        str(fleet.html_machine),
    }
    code, out, _ = await cli("--url", bmdb_url, "machines", "--provider", "Static", "--json")
    assert code == 0
    assert str(fleet.ids[State.UNPROVIDED]) not in {m["machine_id"] for m in json.loads(out)}
    assert len(json.loads(out)) == 6
    code, out, _ = await cli("--url", bmdb_url, "machines", "--state", "silent")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == [
        "MACHINE", "STATE", "INSTALL", "NODE", "PROVIDED", "ADDRESS", "HEARTBEAT", "WORK",
        "BACKOFF", "HELD", "UPGRADE", "SLOT", "IMAGE", "CAUSE",
    ]  # fmt: skip
    assert len(lines) == 2 and lines[1].startswith(f"{fleet.ids[State.SILENT]}  silent")
    # Paging: after the first machine, the rest.
    first = fleet.ids[State.FAILED]
    code, out, _ = await cli("--url", bmdb_url, "machines", "--after", str(first), "--json")
    assert json.loads(out)[0]["machine_id"] == str(fleet.ids[State.NEEDS_AGENT_START])
    code, _, err = await cli("--url", bmdb_url, "machines", "--state", "bogus")
    assert code == 2 and "invalid choice" in err


async def test_table_shows_cause_and_time_left(bmdb_conn: bmdb.Connection, bmdb_url: str) -> None:
    fleet = await populate(bmdb_conn)
    code, out, _ = await cli("--url", bmdb_url, "machines", "--state", "failed")
    assert code == 0
    [_, failed, html] = out.splitlines()
    assert failed.startswith(f"{fleet.ids[State.FAILED]}  failed")
    assert failed.endswith("no route to host")
    assert "(59m" in failed or "(1h00m" in failed  # an hour of backoff, just begun
    # The cause's line break is shown, not obeyed.
    assert html.endswith("& more\\nsecond line")


async def test_machine_shows_everything(bmdb_conn: bmdb.Connection, bmdb_url: str) -> None:
    fleet = await populate(bmdb_conn)
    mid = fleet.ids[State.FAILED]
    code, out, err = await cli("--url", bmdb_url, "machine", str(mid))
    assert (code, err) == (0, "")
    assert "machine:" in out and str(mid) in out
    assert "state:" in out and "failed" in out
    assert "last failure cause:      no route to host" in out
    history = out.split("HISTORY\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert [line.split()[2] for line in history[1:]] == ["Started", "Failed"]
    backoff = out.split("BACKOFF\n", 1)[1].splitlines()[1]
    assert "ShepherdAgentStart" in backoff and "3600s" in backoff and "active" in backoff

    code, out, _ = await cli("--url", bmdb_url, "machine", str(mid), "--json")
    detail = json.loads(out)
    assert detail["machine_id"] == str(mid)
    assert [e["event"] for e in detail["history"]] == ["Started", "Failed"]
    assert detail["backoffs"][0]["interval_seconds"] == 3600
    assert detail["backoffs"][0]["until"] == (await _backoff_until(bmdb_url))[mid]

    code, _, err = await cli("--url", bmdb_url, "machine", str(uuid.uuid4()))
    assert code == 1 and err.startswith("bmdb: error: no machine")
