"""``python -m shepherd.agent_server --workers 2``: processes sharing the port.

Heartbeats over many connections (spread by the kernel over the workers)
are all accepted and written; a worker killed while agents heartbeat is
started again, and every heartbeat acknowledged before, during and after
is in the BMDB. The workers share one agent session secret: a session one
of them issued is accepted by the other, and by a restarted one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import trio

import bmdb
from bmdb import Queries
from common.net import free_loopback_port
from shepherd.agent import protocol
from shepherd.agent_server.server import COMPONENT
from tests.shepherd.test_agent_server import heartbeater, started_machine

AGENTS = 16


def _children(pid: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.add(int(entry.name))
    return found


async def _live_sessions(conn: bmdb.Connection) -> int:
    async def read(q: Queries) -> int:
        return sum(1 for s in await q.sessions() if s.component == COMPONENT and not s.expired)

    return await conn.transact(read)


async def _stored_times(conn: bmdb.Connection, ids: list[uuid.UUID]) -> dict[uuid.UUID, int]:
    async def read(q: Queries) -> dict[uuid.UUID, int]:
        rows = await q.execute(
            """SELECT machine_id, agent_request_time_ns FROM machine_agent_heartbeat
               WHERE machine_id = ANY(%s)""",
            (ids,),
        )
        return {r[0]: r[1] for r in rows}

    return await conn.transact(read)


async def test_workers_share_the_port_and_a_killed_one_loses_no_acknowledged_heartbeat(
    bmdb_conn: bmdb.Connection, bmdb_url: str
) -> None:
    machines = [await started_machine(bmdb_conn) for _ in range(AGENTS)]
    port = free_loopback_port()
    url = f"http://127.0.0.1:{port}"
    supervisor = await trio.lowlevel.open_process(
        [
            sys.executable,
            "-m",
            "shepherd.agent_server",
            "--bmdb-url",
            bmdb_url,
            "--listen",
            f"127.0.0.1:{port}",
            "--insecure-plain-http",
            "--workers",
            "2",
        ],
        stderr=subprocess.DEVNULL,
    )
    acknowledged: dict[uuid.UUID, int] = {}
    through: set[uuid.UUID] = set()
    refused: list[int] = []
    by_session = 0

    async def agent_loop(mid: uuid.UUID, seed: bytes, rounds: int) -> None:
        nonlocal by_session
        hb = heartbeater(url, str(mid), seed, report=False)
        for _ in range(rounds):
            body, headers = hb.request()
            by_session += protocol.HEADER_SESSION in headers
            try:
                # A connection per request: the kernel spreads them over the workers.
                async with httpx.AsyncClient() as client:
                    response = await client.post(
                        url + protocol.HEARTBEAT_PATH, content=body, headers=headers
                    )
            except httpx.TransportError:
                await trio.sleep(0.1)  # the killed worker's connection: retried
                continue
            if response.status_code == 200:
                acknowledged[mid] = int(headers[protocol.HEADER_TIME])
                through.add(mid)
                # Its session: the next requests, on new connections, reach
                # either worker (also the restarted one), which must accept it.
                hb.accepted(response.content)
            else:
                refused.append(response.status_code)

    try:
        with trio.fail_after(180):
            while await _live_sessions(bmdb_conn) < 2:  # noqa: ASYNC110 (state in Postgres)
                await trio.sleep(0.2)
            workers = _children(supervisor.pid)  # both workers up (their sessions are)
            assert len(workers) == 2
            async with trio.open_nursery() as nursery:
                for mid, seed in machines:
                    nursery.start_soon(agent_loop, mid, seed, 12)
                await trio.sleep(1.0)
                victim = min(workers)
                os.kill(victim, signal.SIGKILL)
            # Restarted: two workers again, the victim not among them.
            while len(after := _children(supervisor.pid)) < 2 or victim in after:  # noqa: ASYNC110
                await trio.sleep(0.2)
            # Every agent gets through after the restart too.
            through.clear()
            async with trio.open_nursery() as nursery:
                for mid, seed in machines:
                    nursery.start_soon(agent_loop, mid, seed, 3)
        # Refusals only as unavailable (a worker stopping), never a wrong
        # answer: no session refused by a worker other than its issuer's.
        assert set(refused) <= {503}
        assert by_session > AGENTS * 8  # most requests (each loop signs its first)
        assert through == {mid for mid, _ in machines}
        stored = await _stored_times(bmdb_conn, [mid for mid, _ in machines])
        for mid, time_ns in acknowledged.items():
            assert stored[mid] >= time_ns
        supervisor.send_signal(signal.SIGTERM)
        with trio.fail_after(60):
            assert await supervisor.wait() == 0
        assert not _children(supervisor.pid)
    finally:
        if supervisor.returncode is None:
            for pid in _children(supervisor.pid):
                os.kill(pid, signal.SIGKILL)
            supervisor.kill()
            await supervisor.wait()
