"""Fifty real agents survive a restart of the callback server.

The agents are real agent processes (the uploaded script, detached and
heartbeating, started as the initializer starts them but without SSH, which
the end-to-end tests cover): 50 python3 processes are light enough for the
2-core test machine. The server goes away for a few seconds and comes back
on the same port; every agent's heartbeats must resume by themselves, the
restarted server having refused their sessions (it has a new secret).
"""

from __future__ import annotations

import datetime
import functools
import logging
import uuid
from pathlib import Path

import pytest
import trio

import bmdb
from bmdb import Queries
from shepherd.agent_server import AgentServerConfig, run_agent_server
from shepherd.agent_server.server import port_of
from shepherd.localfleet import agent_pid
from tests.shepherd.agents import kill_agent, start_agent_process
from tests.shepherd.helpers import provide

logger = logging.getLogger("tests.heartbeat_restart")

AGENTS = 50
INTERVAL = 1.0
BACKOFF_CAP = 3.0
DOWNTIME = 4.0


async def _heartbeats(conn: bmdb.Connection, ids: list[uuid.UUID]) -> dict[uuid.UUID, object]:
    async def read(q: Queries) -> dict[uuid.UUID, object]:
        return {mid: await q.agent_heartbeat(mid) for mid in ids}

    return await conn.transact(read)


@pytest.mark.slow
async def test_fifty_agents_recover_from_a_server_restart(
    bmdb_conn: bmdb.Connection, tmp_path: Path
) -> None:
    ids = list((await provide(bmdb_conn, [f"m-{i}" for i in range(AGENTS)])).values())
    targets = [tmp_path / f"machine-{i}" / "agent" for i in range(AGENTS)]
    try:
        async with trio.open_nursery() as outer:
            # First run of the server; its port is kept for the second.
            scope = trio.CancelScope()
            port: list[int] = []

            async def serve(listen: str, scope: trio.CancelScope) -> None:
                with scope:
                    config = AgentServerConfig(listen=listen)
                    async with trio.open_nursery() as n:
                        binds = await n.start(
                            lambda task_status: run_agent_server(
                                bmdb_conn, config, task_status=task_status
                            )
                        )
                        port.append(port_of(binds[0]))

            outer.start_soon(serve, "127.0.0.1:0", scope)
            with trio.fail_after(30):
                while not port:  # noqa: ASYNC110 (set by the server task)
                    await trio.sleep(0.01)
            endpoint = f"http://127.0.0.1:{port[0]}"

            keys = []
            for target, mid in zip(targets, ids, strict=True):
                start = functools.partial(
                    start_agent_process,
                    target,
                    str(mid),
                    endpoint,
                    interval=INTERVAL,
                    cap=BACKOFF_CAP,
                )
                keys.append(await trio.to_thread.run_sync(start))

            async def record(q: Queries) -> None:
                now = datetime.datetime.now(datetime.UTC)
                for mid, key in zip(ids, keys, strict=True):
                    await q.set_agent_started(mid, now, key)

            await bmdb_conn.transact(record)
            assert all(agent_pid(t) is not None for t in targets)

            async def all_after(moment: datetime.datetime) -> dict[uuid.UUID, object]:
                with trio.fail_after(120):
                    while True:
                        beats = await _heartbeats(bmdb_conn, ids)
                        late = [
                            m
                            for m, at in beats.items()
                            if not isinstance(at, datetime.datetime) or at <= moment
                        ]
                        if not late:
                            return beats
                        await trio.sleep(0.2)

            await all_after(datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=1))

            scope.cancel()
            down = datetime.datetime.now(datetime.UTC)
            await trio.sleep(DOWNTIME)
            up = datetime.datetime.now(datetime.UTC)
            second = trio.CancelScope()
            outer.start_soon(serve, f"127.0.0.1:{port[0]}", second)
            beats = await all_after(up)
            # Figures for the report (not asserted: the machine is shared).
            gaps = [
                (at - up).total_seconds()
                for at in beats.values()
                if isinstance(at, datetime.datetime)
            ]
            logger.warning(
                "server down %.1fs; all %d agents back within %.2fs of its restart "
                "(backoff cap %.0fs)",
                (up - down).total_seconds(),
                AGENTS,
                max(gaps),
                BACKOFF_CAP,
            )
            assert all(agent_pid(t) is not None for t in targets)
            # Each agent heartbeated with a session before the restart, which
            # the restarted server (a new secret) refused; it signed again.
            for target in targets:
                log = target.with_name(target.name + ".log").read_text()
                assert "session refused, signing again" in log, log
            second.cancel()
    finally:
        for target in targets:
            kill_agent(target)
