"""Operator actions through ``python -m bmdb``, against a real PostgreSQL:
each action's effect, its audit record, and its refusals (which write nothing)."""

from __future__ import annotations

import datetime
import getpass
import json
import subprocess
import sys
import uuid

import pytest
import trio
import trio.lowlevel

import bmdb
from bmdb import Backoff, Isolation, Process, ProviderStatus, Queries, actions
from bmdb.errors import NothingToDo, WorkConflict
from tests.bmdb.helpers import add_provided_machines, agent_start_source, eventually, source_for
from tests.bmdb.test_cli import cli


async def act(url: str, *args: str) -> tuple[int, str, str]:
    return await cli("--url", url, *args)


async def audit(url: str, *args: str) -> list[dict[str, object]]:
    code, out, err = await act(url, "audit", "--json", *args)
    assert (code, err) == (0, "")
    records: list[dict[str, object]] = json.loads(out)
    return records


async def count(conn: bmdb.Connection, sql: str, *params: object) -> int:
    async def read(q: Queries) -> int:
        rows = await q.execute(sql, params)
        return int(rows[0][0])

    return await conn.transact(read, isolation=Isolation.READ_COMMITTED)


async def claimable(conn: bmdb.Connection, process: Process = Process.SHEPHERD_AGENT_START) -> bool:
    """Whether a session can claim a machine for ``process`` now (released again)."""
    source = agent_start_source if process is Process.SHEPHERD_AGENT_START else source_for(process)
    async with conn.session("test-worker") as sess:
        try:
            work = await sess.work(process, source)
        except NothingToDo:
            return False
        await work.cancel()
        return True


async def test_hold_and_release(bmdb_conn: bmdb.Connection, bmdb_url: str) -> None:
    [mid] = await add_provided_machines(bmdb_conn, 1)
    code, out, err = await act(
        bmdb_url, "hold", str(mid), "--reason", "disk swap, ticket 42", "--operator", "alice"
    )
    assert (code, err) == (0, "")
    assert f"hold machine {mid}: held: no process takes the machine" in out
    assert "by alice: disk swap, ticket 42" in out

    # No process takes it: not the agent-start source, not a generic one.
    assert not await claimable(bmdb_conn)
    assert not await claimable(bmdb_conn, Process.UNIT_TEST_1)
    # And a claim that names it outright is refused by the claim itself.
    async with bmdb_conn.session("test-worker") as sess:

        async def named(q: Queries) -> list[uuid.UUID]:
            return [mid]

        with pytest.raises(WorkConflict, match="held by an operator"):
            await sess.work(Process.UNIT_TEST_1, named)

    # The views say who holds it and why.
    code, out, _ = await act(bmdb_url, "machine", str(mid))
    assert code == 0
    assert "held:" in out and "by alice since" in out and "disk swap, ticket 42" in out
    actions_section = out.split("OPERATOR ACTIONS\n", 1)[1].splitlines()
    assert actions_section[0].split() == ["ID", "AT", "OPERATOR", "ACTION", "REASON", "DETAIL"]
    assert "alice" in actions_section[1] and "hold" in actions_section[1]
    code, out, _ = await act(bmdb_url, "machines")
    header, row = out.splitlines()
    assert row.split()[header.split().index("HELD")] == "alice"
    code, out, _ = await act(bmdb_url, "machines", "--json")
    [listed] = json.loads(out)
    assert (listed["held_by"], listed["held_reason"]) == ("alice", "disk swap, ticket 42")

    # A second hold is refused and writes nothing.
    code, out, err = await act(bmdb_url, "hold", str(mid), "--reason", "again")
    assert code == 1 and out == ""
    assert "already held by alice" in err and len(err.splitlines()) == 1

    # Release: the operator defaults to the OS user.
    code, out, err = await act(bmdb_url, "release", str(mid), "--reason", "disk swapped")
    assert (code, err) == (0, "")
    assert "released the hold of alice" in out
    assert await claimable(bmdb_conn)
    code, _, err = await act(bmdb_url, "release", str(mid), "--reason", "again")
    assert code == 1 and "is not held" in err

    records = await audit(bmdb_url)
    assert [(r["action"], r["operator"], r["reason"]) for r in records] == [
        ("release", getpass.getuser(), "disk swapped"),
        ("hold", "alice", "disk swap, ticket 42"),
    ]
    assert all(r["machine_id"] == str(mid) for r in records)
    assert datetime.datetime.fromisoformat(
        str(records[0]["at"])
    ) >= datetime.datetime.fromisoformat(str(records[1]["at"]))


async def test_retry_now_ends_a_backoff(bmdb_conn: bmdb.Connection, bmdb_url: str) -> None:
    [mid] = await add_provided_machines(bmdb_conn, 1)
    code, _, err = await act(bmdb_url, "retry-now", str(mid), "--reason", "nothing to end")
    assert code == 1 and "has no active backoff" in err
    async with bmdb_conn.session("test-worker") as sess:
        work = await sess.work(Process.SHEPHERD_AGENT_START, agent_start_source)
        await work.fail("no route to host", Backoff(initial=3600, maximum=3600, exponent=1))
    assert not await claimable(bmdb_conn)

    code, out, err = await act(
        bmdb_url, "retry-now", str(mid), "--reason", "route fixed", "--process",
        "ShepherdAgentStart",
    )  # fmt: skip
    assert (code, err) == (0, "")
    assert "ended backoff of ShepherdAgentStart" in out and "cause: no route to host" in out
    assert await claimable(bmdb_conn)
    # The interval is kept (the next failure grows from it), the end is now.
    assert (
        await count(
            bmdb_conn,
            "SELECT count(*) FROM work_backoff WHERE machine_id = %s AND until <= now()"
            " AND last_interval_seconds = 3600",
            mid,
        )
        == 1
    )
    [record] = await audit(bmdb_url, "--machine", str(mid))
    assert record["action"] == "retry-now" and record["reason"] == "route fixed"
    assert "ended backoff of ShepherdAgentStart" in str(record["detail"])
    code, _, err = await act(bmdb_url, "retry-now", str(mid), "--reason", "twice")
    assert code == 1 and "has no active backoff" in err


async def test_forget_host_key(bmdb_conn: bmdb.Connection, bmdb_url: str) -> None:
    [mid] = await add_provided_machines(bmdb_conn, 1)
    code, _, err = await act(bmdb_url, "forget-host-key", str(mid), "--reason", "none yet")
    assert code == 1 and "has no pinned SSH host key" in err

    async def pin(q: Queries) -> None:
        await q.set_ssh_host_key(mid, b"\x00\x00\x00\x0bssh-ed25519 old key")

    await bmdb_conn.transact(pin)
    code, out, err = await act(
        bmdb_url, "forget-host-key", str(mid), "--reason", "reinstalled from scratch"
    )
    assert (code, err) == (0, "")
    assert "forgot SSH host key SHA256:" in out and "the next takeover pins" in out
    assert await count(bmdb_conn, "SELECT count(*) FROM machine_ssh_host_key") == 0
    [record] = await audit(bmdb_url)
    assert record["action"] == "forget-host-key"


async def test_recover_now(bmdb_conn: bmdb.Connection, bmdb_url: str) -> None:
    [mid] = await add_provided_machines(bmdb_conn, 1)
    code, _, err = await act(bmdb_url, "recover-now", str(mid), "--reason", "no agent")
    assert code == 1 and "has no started agent" in err

    async def start_and_beat(q: Queries) -> None:
        await q.set_agent_started(mid, datetime.datetime.now(datetime.UTC), b"k" * 32)
        await q.record_agent_heartbeat(mid, b"k" * 32, 1)

    await bmdb_conn.transact(start_and_beat)

    async def recovery_candidates(q: Queries) -> list[uuid.UUID]:
        return [a.machine_id for a in await q.machines_for_agent_recovery(10)]

    # Heartbeating: recovery does not want it...
    assert await bmdb_conn.transact(recovery_candidates) == []
    code, out, err = await act(bmdb_url, "recover-now", str(mid), "--reason", "agent wedged")
    assert (code, err) == (0, "")
    assert "recovery requested" in out
    # ...until an operator asks.
    assert await bmdb_conn.transact(recovery_candidates) == [mid]
    code, out, _ = await act(bmdb_url, "machine", str(mid))
    assert f"recovery requested:      by {getpass.getuser()} at" in out
    code, _, err = await act(bmdb_url, "recover-now", str(mid), "--reason", "twice")
    assert code == 1 and "already requested" in err
    # What the recoverer's finish does clears the request with the tags.

    async def recovered(q: Queries) -> None:
        await q.delete_agent_started(mid)
        await q.delete_agent_heartbeat(mid)
        await q.delete_recovery_request(mid)

    await bmdb_conn.transact(recovered)
    assert await count(bmdb_conn, "SELECT count(*) FROM machine_recovery_request") == 0


async def test_forget_machine(bmdb_conn: bmdb.Connection, bmdb_url: str) -> None:
    await add_provided_machines(bmdb_conn, 2)
    async with bmdb_conn.session("test-worker") as sess:
        work = await sess.work(Process.SHEPHERD_AGENT_START, agent_start_source)
        await work.fail("gone", Backoff(initial=60, maximum=60, exponent=1))
    failed = work.machine_id
    code, _, err = await act(bmdb_url, "forget-machine", str(failed), "--reason", "listed")
    assert code == 1 and "has provider status Unknown" in err and "Missing" in err

    async def missing(q: Queries) -> None:
        await q.update_provided(failed, None, None, ProviderStatus.MISSING)

    await bmdb_conn.transact(missing)
    code, out, err = await act(
        bmdb_url, "forget-machine", str(failed), "--reason", "device deleted at Equinix"
    )
    assert (code, err) == (0, "")
    assert "deleted the machine (Static:static-" in out and "2 history entries" in out
    assert (
        await count(bmdb_conn, "SELECT count(*) FROM machines WHERE machine_id = %s", failed) == 0
    )
    assert (
        await count(bmdb_conn, "SELECT count(*) FROM work_history WHERE machine_id = %s", failed)
        == 0
    )
    # The other machine is untouched; the audit record outlives the machine.
    assert await count(bmdb_conn, "SELECT count(*) FROM machines") == 1
    [record] = await audit(bmdb_url, "--machine", str(failed))
    assert record["action"] == "forget-machine" and record["reason"] == "device deleted at Equinix"
    code, _, err = await act(bmdb_url, "machine", str(failed))
    assert code == 1 and "forget-machine" in err and f"audit --machine {failed}" in err


async def test_an_action_on_a_machine_under_work_is_refused_or_waits(
    bmdb_conn: bmdb.Connection, bmdb_url: str
) -> None:
    [mid] = await add_provided_machines(bmdb_conn, 1)
    async with bmdb_conn.session("shepherd-initializer") as sess:
        work = await sess.work(Process.SHEPHERD_AGENT_START, agent_start_source)
        code, out, err = await act(bmdb_url, "hold", str(mid), "--reason", "maintenance")
        assert code == 75 and out == ""  # try again (common.exitcodes)
        assert f"machine {mid} is under work: ShepherdAgentStart by shepherd-initializer" in err
        assert "nothing changed" in err and "--wait" in err
        assert await count(bmdb_conn, "SELECT count(*) FROM machine_hold") == 0
        assert await audit(bmdb_url) == []

        # With --wait, the hold waits for the work, then takes effect.
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "bmdb", "--url", bmdb_url, "hold", str(mid),
             "--reason", "maintenance", "--wait", "120"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        assert proc.stdout is not None and proc.stderr is not None
        err = ""
        with trio.fail_after(60):
            while "waiting up to" not in err:
                chunk = await proc.stderr.receive_some()
                assert chunk, f"the CLI ended without waiting: {err!r}"
                err += chunk.decode()
        assert f"machine {mid} is under work" in err
        await trio.sleep(0.5)
        assert proc.poll() is None  # still waiting: the work is live
        await work.finish()
        out = ""
        with trio.fail_after(60):
            while chunk := await proc.stdout.receive_some():
                out += chunk.decode()
            assert await proc.wait() == 0
        assert "held:" in out
        # The finished work came first, the hold after it.

        async def order(q: Queries) -> list[str]:
            rows = await q.execute(
                """SELECT 'work ' || event FROM work_history WHERE machine_id = %(m)s
                   UNION ALL SELECT 'audit ' || action FROM audit_log WHERE machine_id = %(m)s""",
                {"m": mid},
            )
            return [r[0] for r in rows]

        assert sorted(await bmdb_conn.transact(order)) == [
            "audit hold", "work Finished", "work Started"
        ]  # fmt: skip
        # And no process can take the held machine now.
        with pytest.raises(NothingToDo):
            await sess.work(Process.SHEPHERD_RECOVERY, source_for(Process.SHEPHERD_RECOVERY))

    # Waiting is bounded: a machine that stays under work is refused after it.
    async with bmdb_conn.session("shepherd-recoverer") as sess:
        await act(bmdb_url, "release", str(mid), "--reason", "done")
        work = await sess.work(Process.SHEPHERD_RECOVERY, source_for(Process.SHEPHERD_RECOVERY))
        code, _, err = await act(
            bmdb_url, "forget-host-key", str(mid), "--reason", "x", "--wait", "0.5"
        )
        assert code == 75 and "still under work after waiting 0.5s" in err  # try again
        await work.cancel()


async def test_bad_input_is_one_line_and_writes_nothing(
    bmdb_conn: bmdb.Connection, bmdb_url: str
) -> None:
    [mid] = await add_provided_machines(bmdb_conn, 1)
    code, _, err = await act(bmdb_url, "hold", str(mid))
    assert code == 2 and "--reason" in err
    for args, message in [
        (["hold", str(mid), "--reason", "   "], "reason must not be empty"),
        (["hold", str(mid), "--reason", "two\nlines"], "one line of printable characters"),
        (["hold", str(mid), "--reason", "r", "--operator", ""], "operator name must not be empty"),
        (["hold", str(mid), "--reason", "x" * 1001], "reason is over 1000 characters"),
        (["hold", "not-a-uuid", "--reason", "r"], "not a machine id"),
        (["hold", str(uuid.uuid4()), "--reason", "r"], "no machine"),
        (["hold", str(mid), "--reason", "r", "--wait", "-1"], "wait must be a non-negative"),
    ]:
        code, out, err = await act(bmdb_url, *args)
        assert (code, out) == (1, ""), args
        assert message in err and len(err.splitlines()) == 1, (args, err)
    assert await audit(bmdb_url) == []
    assert await count(bmdb_conn, "SELECT count(*) FROM machine_hold") == 0


@pytest.mark.parametrize("action", ["hold", "decommission", "recover-now"])
async def test_a_waiting_action_is_never_starved_by_busy_workers(
    bmdb_conn: bmdb.Connection, action: str
) -> None:
    """Four workers of two processes claim and release one machine back to
    back, so that it is almost never free, while an operator's action waits for its work:
    the action lands (no new claim once it is pending, so the work in
    progress is the last) and, for a hold or a decommission, when it
    commits no work is live and no claim succeeds after it. Before pending
    actions (migration 0008) a hold waited out its wait without finding a
    free moment."""
    [mid] = await add_provided_machines(bmdb_conn, 1)
    if action == "recover-now":

        async def started(q: Queries) -> None:
            await q.set_agent_started(mid, datetime.datetime.now(datetime.UTC), b"k" * 32)

        await bmdb_conn.transact(started)
    landed = trio.Event()
    claims_after = 0
    claims = 0

    async def worker(n: int) -> None:
        nonlocal claims, claims_after
        # Two workers per process: while one's work ends, the other
        # process's work most likely goes on.
        process = (Process.UNIT_TEST_1, Process.UNIT_TEST_2)[n % 2]
        async with bmdb_conn.session(f"worker-{n}") as sess:
            while not landed.is_set():
                try:
                    work = await sess.work(process, source_for(process))
                except (NothingToDo, WorkConflict):
                    await trio.sleep(0.001)
                    continue
                claims += 1
                if landed.is_set():
                    claims_after += 1
                await trio.sleep(0.01)
                await work.cancel()

    async with trio.open_nursery() as nursery:
        for n in range(4):
            nursery.start_soon(worker, n)
        with trio.fail_after(30):
            while claims < 10:  # noqa: ASYNC110 (counted by the workers)
                await trio.sleep(0.01)
        busy_seen: list[actions.MachineBusy] = []
        record = await actions.act(
            bmdb_conn, action, mid, operator="op", reason="stress", wait=20,
            on_wait=busy_seen.append,
        )  # fmt: skip
        landed.set()
        live = await count(
            bmdb_conn,
            """SELECT count(*) FROM work w JOIN sessions s USING (session_id)
               WHERE w.machine_id = %s AND s.session_deadline > now()""",
            mid,
        )
    assert record.action == action
    assert busy_seen, "the action never had to wait: the test proved nothing"
    if action != "recover-now":
        # A hold or a decommission keeps every process away from now on (a
        # recovery request leaves other processes free to claim the machine).
        assert live == 0
        assert claims_after == 0
    # The pending row went with the action.
    assert await count(bmdb_conn, "SELECT count(*) FROM machine_pending_action") == 0


async def test_a_killed_waiter_blocks_new_work_only_until_its_wait_ends(
    bmdb_conn: bmdb.Connection, bmdb_url: str
) -> None:
    """A waiting CLI killed outright cannot delete its pending row: claims
    stay refused while it is unexpired, and succeed again once the wait it
    asked for is over; a waiter that gives up deletes its row at once."""
    [mid] = await add_provided_machines(bmdb_conn, 1)
    source = source_for(Process.UNIT_TEST_1)
    async with bmdb_conn.session("busy") as sess:
        work = await sess.work(Process.UNIT_TEST_1, source)
        # Gives up: its row goes with it.
        code, _, err = await act(bmdb_url, "hold", str(mid), "--reason", "x", "--wait", "0.5")
        assert code == 75 and "still under work after waiting 0.5s" in err
        assert await count(bmdb_conn, "SELECT count(*) FROM machine_pending_action") == 0
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "bmdb", "--url", bmdb_url, "hold", str(mid),
             "--reason", "killed", "--wait", "3"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:

            async def pending() -> bool:
                return await count(bmdb_conn, "SELECT count(*) FROM machine_pending_action") == 1

            await eventually(pending)
        finally:
            proc.kill()
            await proc.wait()
        await work.cancel()
    # The row is still there, unexpired: nobody claims the machine anew.
    assert await count(
        bmdb_conn, "SELECT count(*) FROM machine_pending_action WHERE until > now()"
    ) == 1  # fmt: skip
    assert not await claimable(bmdb_conn, Process.UNIT_TEST_1)
    # Once the wait it asked for is over, the machine is offered again.

    async def offered() -> bool:
        return await claimable(bmdb_conn, Process.UNIT_TEST_1)

    await eventually(offered)
    assert await count(bmdb_conn, "SELECT count(*) FROM machine_hold") == 0


def test_without_an_os_user_name_the_cli_asks_for_operator(
    bmdb_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async def one_machine() -> uuid.UUID:
        async with bmdb.open_connection(bmdb_url) as conn:
            [mid] = await add_provided_machines(conn, 1)
            return mid

    mid = trio.run(one_machine)

    def nobody() -> str:
        raise OSError("No username set in the environment")

    monkeypatch.setattr(getpass, "getuser", nobody)
    from bmdb.__main__ import main

    assert main(["--url", bmdb_url, "hold", str(mid), "--reason", "r"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and "give --operator NAME" in err and len(err.splitlines()) == 1
    assert main(["--url", bmdb_url, "hold", str(mid), "--reason", "r", "--operator", "eve"]) == 0
    assert "by eve: r" in capsys.readouterr().out
