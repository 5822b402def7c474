"""The local fleet: machines that go away take their detached agents along."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import trio
import trio_asyncio

from shepherd.localfleet import (
    agent_pid,
    first_node_address,
    kill_unreaped,
    loopback_addresses,
    open_fleet,
)
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


async def test_each_machine_has_its_own_loopback_address_and_a_disk(
    tmp_path: Path,
    aio_loop: trio_asyncio.TrioEventLoop,
    shepherd_ssh_key: SSHKey,
) -> None:
    async with open_fleet(
        tmp_path / "fleet", count=3, authorized_key=shepherd_ssh_key.authorized_key
    ) as fleet:
        assert [m.host for m in fleet.machines] == ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
        for machine in fleet.machines:
            assert (machine.root / "root" / "disks" / "disk0").is_dir()
            # Its SSH server listens on its own address.
            stream = await trio.open_tcp_stream(machine.host, machine.port)
            assert (await stream.receive_some(4)).startswith(b"SSH-")
            await stream.aclose()


def test_loopback_addresses_go_on_past_255() -> None:
    assert loopback_addresses(3, first=254) == ["127.0.0.254", "127.0.0.255", "127.0.1.0"]
    with pytest.raises(ValueError, match="no 2 loopback addresses"):
        loopback_addresses(2, first=0)


def test_a_block_is_a_slash_16_of_its_own_with_the_first_node_beside_the_machines() -> None:
    assert loopback_addresses(2, block=3) == ["127.3.0.2", "127.3.0.3"]
    assert first_node_address() == "127.0.1.1"
    assert first_node_address(3) == "127.3.1.1"
    assert first_node_address(3) not in loopback_addresses(254, block=3)
    for bad in (-1, 256):
        with pytest.raises(ValueError, match=f"loopback block {bad} is not in 0-255"):
            loopback_addresses(1, block=bad)
        with pytest.raises(ValueError, match=f"loopback block {bad} is not in 0-255"):
            first_node_address(bad)


def test_a_command_is_killed_without_being_reaped_under_the_watcher() -> None:
    """`localfleet.kill_unreaped` signals, never reaps: an exited child stays
    for its watcher to reap (asyncio's Process.kill() polls through Popen,
    which reaps a child that just exited, and trio_asyncio's watcher then
    fails with ChildProcessError and ends the loop)."""
    import subprocess

    child = subprocess.Popen(["true"])
    try:
        stat = Path(f"/proc/{child.pid}/stat")
        deadline = time.monotonic() + 30
        while stat.read_text().rpartition(")")[2].split()[0] != "Z":
            assert time.monotonic() < deadline, "the child never exited"
            time.sleep(0.01)

        class Exited:  # what asyncio's Process shows before its watcher reaped
            pid = child.pid
            returncode = None

        kill_unreaped(Exited())  # type: ignore[arg-type]
        # Still ours to reap: the watcher's waitpid would not fail.
        assert os.waitpid(child.pid, 0)[0] == child.pid
    finally:
        child.returncode = 0  # reaped above; keep Popen from reaping again
