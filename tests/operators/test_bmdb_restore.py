"""A BMDB backup, the database dropped, the backup restored: the Shepherd resumes
and takes every machine over exactly once.

Two machines are taken over by a first Shepherd, which then stops. A third
is provided and claimed for an agent start by a session of an hour (a
Shepherd killed in the middle of that takeover would leave the same), and
the backup is taken then. The database is dropped, created empty and
restored with ``python -m bmdb restore``; a second Shepherd, over all three
machines, takes over the third only: the restored session does not hold
it, and the two already taken over are not touched again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.parse
from pathlib import Path

import trio
import trio_asyncio

import bmdb
from bmdb import Process
from bmdb.backup import RESTORE_CAUSE
from bmdb.localserver import LocalPostgres
from bmdb.model import Queries
from shepherd.localfleet import FleetMachine, open_fleet
from shepherd.ssh_key import SSHKey
from tests.bmdb.helpers import agent_start_source


async def _cli(url: str, *args: str) -> str:
    with trio.fail_after(120):
        done = await trio.run_process(
            [sys.executable, "-m", "bmdb", "--url", url, *args],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout.decode()


async def _started(url: str) -> int:
    async with bmdb.open_connection(url, max_connections=1) as conn:
        rows = await conn.transact(
            lambda q: q.execute("SELECT count(*) FROM machine_agent_started"),
            isolation=bmdb.Isolation.READ_COMMITTED,
        )
    return int(rows[0][0])


def _machines_file(path: Path, machines: list[FleetMachine]) -> None:
    path.write_text(
        "".join(
            f'[[machine]]\nid = "m-{i}"\naddress = "{m.host}"\nport = {m.port}\n'
            for i, m in enumerate(machines)
        )
    )


async def _shepherd_until(url: str, machines: Path, key: Path, log: Path, started: int) -> None:
    """Run the Shepherd until ``started`` machines have their agent started; stop it."""
    argv = [
        sys.executable, "-m", "shepherd",
        "--bmdb-url", url,
        "--provider", "static",
        "--static-machines-path", str(machines),
        "--ssh-key-path", str(key),
        "--agent-endpoint", "bmaas.example:443",
        "--agent-target-path", "/agent",
        "--metrics-listen", "127.0.0.1:0",  # any free port: the test reads no metrics
    ]  # fmt: skip
    with log.open("ab") as out:
        process = await trio.lowlevel.open_process(
            argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
        try:
            with trio.fail_after(90):
                while await _started(url) < started:
                    assert process.returncode is None, f"the Shepherd exited: see {log}"
                    await trio.sleep(0.2)
            process.send_signal(signal.SIGTERM)
            with trio.fail_after(60):
                assert await process.wait() == 0
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()


async def test_the_shepherd_resumes_after_a_restore_and_takes_each_machine_over_once(
    bmdb_url: str,
    postgres_server: LocalPostgres,
    shepherd_ssh_key: SSHKey,
    tmp_path: Path,
    aio_loop: trio_asyncio.TrioEventLoop,  # the local fleet's asyncssh servers
) -> None:
    key = tmp_path / "id_ed25519"
    key.write_bytes(shepherd_ssh_key.openssh_private)
    key.chmod(0o600)
    machines = tmp_path / "machines.toml"
    log = tmp_path / "shepherd.log"
    backup = tmp_path / "bmdb.dump"
    async with open_fleet(
        tmp_path / "fleet", count=3, authorized_key=shepherd_ssh_key.authorized_key
    ) as fleet:
        _machines_file(machines, fleet.machines[:2])
        await _shepherd_until(bmdb_url, machines, key, log, 2)
        execs = [m.execs for m in fleet.machines]
        assert execs[0] > 0 and execs[0] == execs[1] and execs[2] == 0

        third = fleet.machines[2]
        async with bmdb.open_connection(bmdb_url) as conn:

            async def provide(q: Queries) -> None:
                machine = await q.new_machine()
                await q.add_provided(machine, bmdb.Provider.STATIC, "m-2", third.host)

            await conn.transact(provide)
            async with conn.session("shepherd-initializer", "killed", interval=3600) as old:
                held = await old.work(Process.SHEPHERD_AGENT_START, agent_start_source)
                await _cli(bmdb_url, "backup", "--out", str(backup))
                await held.cancel()

        name = urllib.parse.urlsplit(bmdb_url).path.lstrip("/")
        postgres_server.admin(f'DROP DATABASE "{name}" WITH (FORCE)')
        postgres_server.admin(f'CREATE DATABASE "{name}"')
        out = await _cli(bmdb_url, "restore", "--from", str(backup))
        assert "1 sessions of the backup dropped, 1 work locks canceled" in out

        _machines_file(machines, fleet.machines)
        await _shepherd_until(bmdb_url, machines, key, log, 3)
        # Each machine's takeover ran once: the same commands on each.
        assert [m.execs for m in fleet.machines] == [execs[0]] * 3

    async with bmdb.open_connection(bmdb_url) as conn:

        async def history(q: Queries) -> list[tuple[object, ...]]:
            return await q.execute(
                "SELECT p.provider_id, h.event::text, h.cause FROM work_history h"
                " JOIN machine_provided p USING (machine_id)"
                " WHERE h.process = 'ShepherdAgentStart' ORDER BY h.id"
            )

        rows = await conn.transact(history)
        sessions = await conn.transact(lambda q: q.execute("SELECT count(*) FROM sessions"))
    events = {
        provider_id: [(e, c) for p, e, c in rows if p == provider_id]
        for provider_id in ("m-0", "m-1", "m-2")
    }
    assert events["m-0"] == events["m-1"] == [("Started", None), ("Finished", None)]
    assert events["m-2"] == [
        ("Started", None),
        ("Canceled", RESTORE_CAUSE),
        ("Started", None),
        ("Finished", None),
    ]
    assert sessions[0][0] == 0  # the Shepherd closed its sessions on the way out
