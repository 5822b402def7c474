"""The local fleet: machines that go away take their detached agents along."""

from __future__ import annotations

from pathlib import Path

import trio
import trio_asyncio

from shepherd.localfleet import agent_pid, open_fleet
from shepherd.ssh_key import SSHKey
from tests.shepherd.agents import kill_agent, start_agent_process


async def test_closing_the_fleet_stops_the_agents_its_machines_run(
    tmp_path: Path,
    aio_loop: trio_asyncio.TrioEventLoop,  # the fleet's asyncssh servers
    shepherd_ssh_key: SSHKey,
) -> None:
    targets: list[Path] = []
    try:
        async with open_fleet(
            tmp_path / "fleet", count=2, authorized_key=shepherd_ssh_key.authorized_key
        ) as fleet:
            for machine in fleet.machines:
                target = machine.root / "root" / "agent"
                # Nobody listens there: the agent keeps trying, with backoff.
                start_agent_process(target, "m", "http://127.0.0.1:9/", interval=10, cap=60)
                targets.append(target)
            assert all(agent_pid(t) is not None for t in targets)
        with trio.fail_after(30):
            while any(agent_pid(t) is not None for t in targets):  # noqa: ASYNC110
                await trio.sleep(0.05)
    finally:
        for target in targets:
            kill_agent(target)
