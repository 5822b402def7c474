"""``python -m shepherd --metrics-listen``: after a run against local machines,
the exposition parses and its counters say what the BMDB history says."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import trio
import trio_asyncio
from prometheus_client.parser import text_string_to_metric_families

import bmdb
from bmdb import Isolation
from bmdb.model import Queries
from common.net import free_loopback_port
from shepherd.localfleet import open_fleet
from shepherd.ssh_key import SSHKey

GOOD = 3
DEAD = 2


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """Every sample by (name, labels); raises if the text is not valid exposition."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


async def _history(conn: bmdb.Connection) -> dict[str, int]:
    async def body(q: Queries) -> list[tuple[object, ...]]:
        return await q.execute(
            "SELECT event::text, count(*) FROM work_history"
            " WHERE process = 'ShepherdAgentStart' GROUP BY 1"
        )

    rows = await conn.transact(body, isolation=Isolation.READ_COMMITTED)
    return {str(r[0]): int(str(r[1])) for r in rows}


async def _initializer_sessions(conn: bmdb.Connection) -> int:
    async def body(q: Queries) -> int:
        rows = await q.execute(
            "SELECT count(*) FROM sessions WHERE session_component_name = 'shepherd-initializer'"
        )
        return int(rows[0][0])

    return await conn.transact(body, isolation=Isolation.READ_COMMITTED)


async def test_metrics_after_an_initializer_run_match_the_history(
    bmdb_conn: bmdb.Connection,
    bmdb_url: str,
    shepherd_ssh_key: SSHKey,
    tmp_path: Path,
    aio_loop: trio_asyncio.TrioEventLoop,  # the local fleet's asyncssh servers
) -> None:
    dead_ports = [free_loopback_port() for _ in range(DEAD)]  # nothing listens there
    async with open_fleet(
        tmp_path / "fleet", count=GOOD, authorized_key=shepherd_ssh_key.authorized_key
    ) as fleet:
        entries = [(m.host, m.port) for m in fleet.machines] + [
            ("127.0.0.1", p) for p in dead_ports
        ]
        machines = tmp_path / "machines.toml"
        machines.write_text(
            "".join(
                f'[[machine]]\nid = "m-{i}"\naddress = "{host}"\nport = {port}\n'
                for i, (host, port) in enumerate(entries)
            )
        )
        key = tmp_path / "id_ed25519"
        key.write_bytes(shepherd_ssh_key.openssh_private)
        key.chmod(0o600)
        metrics_port = free_loopback_port()
        argv = [
            sys.executable, "-m", "shepherd",
            "--bmdb-url", bmdb_url,
            "--provider", "static",
            "--static-machines-path", str(machines),
            "--ssh-key-path", str(key),
            "--agent-endpoint", "bmaas.example:443",
            "--agent-target-path", "/agent",
            "--initializer-parallelism", "2",
            "--metrics-listen", f"127.0.0.1:{metrics_port}",
            "--metrics-fleet-period", "200ms",
        ]  # fmt: skip
        log = tmp_path / "shepherd.log"
        with log.open("wb") as out:
            process = await trio.lowlevel.open_process(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
            try:
                samples = await _scrape_when_settled(bmdb_conn, metrics_port)
                history = await _history(bmdb_conn)
                sessions = await _initializer_sessions(bmdb_conn)
                process.send_signal(signal.SIGTERM)
                with trio.fail_after(60):
                    assert await process.wait() == 0
            finally:
                if process.returncode is None:
                    process.kill()
                    await process.wait()

    assert history == {"Started": GOOD + DEAD, "Finished": GOOD, "Failed": DEAD}
    component = {"component": "shepherd-initializer", "process": "ShepherdAgentStart"}
    assert value(samples, "bmdb_work_started_total", **component) == history["Started"]
    for result in ("Finished", "Failed"):
        finished = value(samples, "bmdb_work_finished_total", **component, result=result)
        assert finished == history[result], result
    assert value(samples, "bmdb_work_finished_total", **component, result="Canceled") == 0
    assert (
        value(samples, "bmdb_sessions_started_total", component="shepherd-initializer")
        == sessions
        == 2
    )
    worked = value(
        samples,
        "shepherd_control_loop_iterations_total",
        component="shepherd-initializer",
        outcome="worked",
    )
    assert worked == history["Started"]
    assert value(samples, "bmdb_transactions_executed_total", connection="shepherd") > 0
    assert value(samples, "bmdb_fleet_machines") == GOOD + DEAD
    assert value(samples, "bmdb_fleet_machines_provided") == GOOD + DEAD
    assert value(samples, "bmdb_fleet_machines_agent_started") == GOOD
    assert value(samples, "bmdb_fleet_backoffs_active", process="ShepherdAgentStart") == DEAD
    assert value(samples, "bmdb_fleet_work_active", process="ShepherdAgentStart") == 0
    for state in ("installing", "installed", "install-failed"):
        assert value(samples, "bmdb_fleet_machines_installation", state=state) == 0
    # Bounded labels: nothing is labelled by machine (state: installation states).
    labels = {k for (_, ls) in samples for k, _ in ls}
    assert labels <= {"component", "connection", "process", "result", "outcome", "state"}


async def _scrape_when_settled(conn: bmdb.Connection, port: int) -> Samples:
    """Scrape until every machine is started or in backoff and the counters
    have caught up with the history (or 90 s passed: the caller's asserts then
    say what differs); the last scrape."""
    samples: Samples = {}
    async with httpx.AsyncClient() as client:
        with trio.move_on_after(90):
            while True:
                try:
                    r = await client.get(f"http://127.0.0.1:{port}/metrics")
                except httpx.TransportError:
                    await trio.sleep(0.2)  # not listening yet
                    continue
                assert r.status_code == 200
                samples = parse(r.text)
                settled = (
                    value(samples, "bmdb_fleet_machines_agent_started") == GOOD
                    and value(samples, "bmdb_fleet_backoffs_active", process="ShepherdAgentStart")
                    == DEAD
                )
                labels = {"component": "shepherd-initializer", "process": "ShepherdAgentStart"}
                counted = {
                    "Started": value(samples, "bmdb_work_started_total", **labels),
                    **{
                        result: value(samples, "bmdb_work_finished_total", **labels, result=result)
                        for result in ("Finished", "Failed")
                    },
                }
                if settled and counted == await _history(conn):
                    return samples
                await trio.sleep(0.2)
    return samples
