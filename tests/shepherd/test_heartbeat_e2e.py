"""Heartbeats end to end: the real agent, started by the initializer over real
OpenSSH, heartbeating over TLS to the real callback server; and the recoverer
bringing a killed agent back."""

from __future__ import annotations

import datetime
import os
import signal
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest
import trio

import bmdb
from bmdb import Backoff, Process, Queries, WorkEvent
from shepherd.agent_bundle import agent_zipapp
from shepherd.agent_server import AgentServerConfig, run_agent_server
from shepherd.agent_server.server import port_of
from shepherd.agent_start import AgentConfig
from shepherd.control_loop import Processor, run_control_loop
from shepherd.initializer import Initializer
from shepherd.localfleet import agent_pid
from shepherd.localsshd import Sshd
from shepherd.proto.agent_callback import AgentHardwareReport
from shepherd.providers import Machine
from shepherd.providers.static import StaticProvider
from shepherd.rate_limit import Rate, RateLimiter
from shepherd.recoverer import Recoverer
from shepherd.ssh import SSHClient
from shepherd.ssh_key import SSHKey
from tests.shepherd.agents import host_macs, kill_agent, make_tls
from tests.shepherd.helpers import provide

INTERVAL = 0.5
T = TypeVar("T")


@dataclass
class Setup:
    conn: bmdb.Connection
    machine_id: uuid.UUID
    target: Path
    initializer: Initializer
    nursery: trio.Nursery

    async def heartbeat(self) -> datetime.datetime | None:
        async def read(q: Queries) -> datetime.datetime | None:
            return await q.agent_heartbeat(self.machine_id)

        return await self.conn.transact(read)

    async def report(self) -> bytes | None:
        async def read(q: Queries) -> bytes | None:
            return await q.hardware_report(self.machine_id)

        return await self.conn.transact(read)

    async def history(self) -> list[tuple[Process, WorkEvent]]:
        async def read(q: Queries) -> list[tuple[Process, WorkEvent]]:
            return [(h.process, h.event) for h in await q.history(self.machine_id)]

        return await self.conn.transact(read)

    def run_loop(self, processor: Processor[T]) -> None:
        self.nursery.start_soon(
            lambda: run_control_loop(
                self.conn,
                processor,
                parallelism=1,
                limiter=RateLimiter(Rate(0.05, 4)),
                session_interval=10.0,
            )
        )


async def wait_for(condition: Callable[[], Awaitable[bool]]) -> None:
    with trio.fail_after(120):
        while not await condition():  # noqa: ASYNC110 (the state is in Postgres)
            await trio.sleep(0.1)


@pytest.fixture
async def setup(
    aio_loop: object,  # asyncssh, in the initializer, runs on trio-asyncio
    bmdb_conn: bmdb.Connection,
    sshd: Sshd,
    shepherd_ssh_key: SSHKey,
    tmp_path: Path,
    nursery: trio.Nursery,
) -> AsyncIterator[Setup]:
    tls = make_tls(tmp_path / "tls")
    config = AgentServerConfig(listen="127.0.0.1:0", certfile=tls.certfile, keyfile=tls.keyfile)
    binds = await nursery.start(
        lambda task_status: run_agent_server(bmdb_conn, config, task_status=task_status)
    )
    assert binds[0].startswith("https://")
    ids = await provide(bmdb_conn, ["m-1"])
    target = sshd.root / "agent"
    agent = AgentConfig(
        executable=agent_zipapp(),
        target_path=str(target),
        endpoint=f"https://127.0.0.1:{port_of(binds[0])}",
        endpoint_ca_certificate=tls.ca_der,
        ssh_connect_timeout=5.0,
        ssh_exec_timeout=30.0,
        heartbeat_interval=INTERVAL,
        heartbeat_backoff_cap=2.0,
    )
    provider = StaticProvider([Machine("m-1", sshd.host, sshd.port)])
    ssh = SSHClient(shepherd_ssh_key, username="root", connect_timeout=5.0)
    try:
        yield Setup(bmdb_conn, ids["m-1"], target, Initializer(provider, ssh, agent), nursery)
    finally:
        nursery.cancel_scope.cancel()
        kill_agent(target)


async def test_agent_started_over_openssh_heartbeats_over_tls(setup: Setup) -> None:
    setup.run_loop(setup.initializer)

    async def reported() -> bool:
        return await setup.report() is not None

    await wait_for(reported)
    first = await setup.heartbeat()
    assert first is not None

    async def advanced() -> bool:
        later = await setup.heartbeat()
        return later is not None and later > first

    await wait_for(advanced)
    # The SSH session ended (the takeover finished) while the agent lives on.
    assert (Process.SHEPHERD_AGENT_START, WorkEvent.FINISHED) in await setup.history()
    assert agent_pid(setup.target) is not None
    raw = await setup.report()
    assert raw is not None
    report = AgentHardwareReport.parse(raw).report
    assert report is not None and report.memory_installed_bytes > 0
    assert {n.mac for n in report.network_interface} == host_macs()


async def test_killed_agent_is_recovered_and_heartbeats_resume(setup: Setup) -> None:
    recoverer = Recoverer(
        setup.initializer.provider,
        first_heartbeat_timeout=120.0,
        heartbeat_timeout=3.0,
        backoff=Backoff(initial=1, maximum=2, exponent=1.2),
    )
    setup.run_loop(setup.initializer)
    setup.run_loop(recoverer)

    async def beating() -> bool:
        return await setup.heartbeat() is not None

    await wait_for(beating)
    first_pid = agent_pid(setup.target)
    assert first_pid is not None
    os.kill(first_pid, signal.SIGKILL)

    async def restarted() -> bool:
        pid = agent_pid(setup.target)
        return pid is not None and pid != first_pid and await setup.heartbeat() is not None

    await wait_for(restarted)
    # The story, in order: started, went silent, recovered, started again.
    assert await setup.history() == [
        (Process.SHEPHERD_AGENT_START, WorkEvent.STARTED),
        (Process.SHEPHERD_AGENT_START, WorkEvent.FINISHED),
        (Process.SHEPHERD_RECOVERY, WorkEvent.STARTED),
        (Process.SHEPHERD_RECOVERY, WorkEvent.FINISHED),
        (Process.SHEPHERD_AGENT_START, WorkEvent.STARTED),
        (Process.SHEPHERD_AGENT_START, WorkEvent.FINISHED),
    ]

    # The machine kept its identity: the same key file, the same key.
    async def key(q: Queries) -> bytes | None:
        started = await q.agent_started(setup.machine_id)
        return started.public_key if started else None

    assert await setup.conn.transact(key) is not None
