"""The Shepherd's whole path on real machines (systemd-nspawn, loop-device disks).

One run of `shepherd.realfleet` for the module (`real_thread.RealThread`):
three Debian machines with a NIC of their own and a 256 MiB loop disk,
powered through a Redfish BMC; the Shepherd's agent server, image server,
initializer, approver and decommissioner, and a cluster's first node on the
host's bridge address. The tests build on each other, in file order (one
xdist group): the takeover's hardware reports; ``shepherd install`` onto
each machine's disk and nodes that run under the machine's own systemd,
approved, two of them voters; a reboot from inside and a power reset
through the BMC, after which node, roles, etcd member and agent come back
by themselves; a disk emptied behind the Shepherd's back, reported by the
agent and installed again; a decommission that wipes the disk for real,
read back whole. Then stopping leaves nothing behind.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import trio
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import bmdb
from bmdb.model import InstallState, OSInstallation, Queries
from common import hwreport
from metropolis.consensus.client import Client, Member
from metropolis.consensus.process import SOCKET_NAME
from metropolis.owner import NodeRow
from shepherd.agent import bootentry, bootrecord
from shepherd.agent.unit import AGENT_UNIT
from shepherd.proto.agent_callback import AgentHardwareReport
from shepherd.providers.base import PowerState
from shepherd.providers.redfish import Credentials, RedfishClient
from tests.shepherd.nspawn.fleet_thread import skip_unless_possible
from tests.shepherd.nspawn.real_thread import RealThread

MACHINES = 3
#: Bound on each wait below (a machine's boot, a node's start, a report).
BOUND = 120.0
NODE_KEY = "/var/lib/metropolis/metropolis/data/node/credentials/key.pem"


@pytest.fixture(scope="module")
def rig(module_bmdb_url: str, node_image: Path) -> Iterator[RealThread]:
    skip_unless_possible()
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="rp-", dir="/tmp"))  # short: etcd's socket
    thread = RealThread(folder, module_bmdb_url, node_image, MACHINES)
    thread.start()
    try:
        yield thread
    finally:
        thread.stop()
        subprocess.run(["rm", "-rf", str(folder)], check=False)


async def until(check: Callable[[], Awaitable[bool]], within: float = BOUND) -> None:
    with trio.fail_after(within):
        while not await check():  # noqa: ASYNC110
            await trio.sleep(0.3)


async def installation(url: str, machine_id: uuid.UUID) -> OSInstallation | None:
    async with bmdb.open_connection(url) as conn:

        async def body(q: Queries) -> OSInstallation | None:
            return await q.os_installation(machine_id)

        return await conn.transact(body)


async def reported(url: str, machine_id: uuid.UUID, generation: int) -> OSInstallation:
    got: OSInstallation | None = None

    async def check() -> bool:
        nonlocal got
        got = await installation(url, machine_id)
        return got is not None and got.generation == generation and got.reported

    await until(check)
    assert got is not None
    return got


async def nodes(rig: RealThread) -> dict[str, NodeRow]:
    async with rig.fleet.first.access.open() as owner:
        return {row.address: row for row in await owner.nodes() if row.address}


async def members(rig: RealThread) -> list[Member]:
    async with Client(rig.fleet.first.root.ephemeral.consensus / SOCKET_NAME) as etcd:
        found: list[Member] = await etcd.member_list()
        return found


async def ticket(rig: RealThread) -> str:
    async with rig.fleet.first.access.open() as owner:
        return (await owner.ticket()).hex()


async def cli(*argv: str) -> str:
    done = await trio.run_process(
        [sys.executable, "-m", *argv], capture_stdout=True, capture_stderr=True, check=False
    )
    assert done.returncode == 0, (argv, done.stdout, done.stderr)
    return done.stdout.decode()


def healthy(row: NodeRow | None) -> bool:
    return row is not None and row.state == "UP" and row.health == "HEALTHY"


async def node_unit(rig: RealThread, index: int) -> dict[str, str]:
    shown = (
        await rig.sh(index, f"systemctl show -p ActiveState,MainPID {bootentry.NODE_UNIT}")
    ).stdout
    return dict(line.split("=", 1) for line in shown.split())


async def test_each_machine_reports_its_own_nic_and_loop_disk(rig: RealThread) -> None:
    real = rig.fleet
    async with bmdb.open_connection(rig.bmdb_url) as conn:
        for index, machine_id in enumerate(real.ids):

            async def body(q: Queries, m: uuid.UUID = machine_id) -> bytes | None:
                return await q.hardware_report(m)

            raw = await conn.transact(body)
            assert raw is not None
            report = AgentHardwareReport.parse(raw).report
            assert report is not None
            link = real.machines.machines[index].spec.link
            assert [n.mac.hex(":") for n in report.network_interface] == [link.mac]
            disk = real.machines.disks[index]
            # Its own loop disk, by kernel name: not the host's disks, not
            # the other machines' loop devices (all in its /sys/block).
            assert {d.serial_number: d.capacity_bytes for d in report.block_device} == {
                disk.name: disk.size
            }
            # Readable by the operator: the disk by the name --root-device
            # takes, the NIC by its MAC (`common.hwreport`).
            shown = json.loads(
                await cli("bmdb", "--url", rig.bmdb_url, "machine", "--json", str(machine_id))
            )["hardware_report"]
            assert [(d["name"], d["capacity_bytes"]) for d in shown["disks"]] == [
                (disk.name, disk.size)
            ]
            assert [n["mac"] for n in shown["nics"]] == [link.mac]
            text = await cli("bmdb", "--url", rig.bmdb_url, "machine", str(machine_id))
            assert f"{disk.name}: {hwreport.size(disk.size)}," in text, text
            assert f"nic:                     {link.mac}: " in text, text


async def test_shepherd_install_makes_nodes_that_run_under_the_machines_systemd(
    rig: RealThread,
) -> None:
    real = rig.fleet
    given = await ticket(rig)
    for index in range(MACHINES):
        out = await cli(*rig.install_argv(index, given)[2:])
        assert "1 machine(s): 1 requested, 0 refused" in out, out
    for index, machine_id in enumerate(real.ids):
        got = await reported(rig.bmdb_url, machine_id, 1)
        assert got.state is InstallState.INSTALLED, got.cause
        announced = (await rig.sh(index, "od -An -tx1 /run/metropolis/node.key.pub")).stdout
        assert got.node_public_key is not None
        assert bytes.fromhex(announced.replace(" ", "").replace("\n", "")) == got.node_public_key

    addresses = [real.machines.address(i) for i in range(MACHINES)]

    async def all_healthy() -> bool:
        rows = await nodes(rig)
        return all(healthy(rows.get(a)) for a in addresses)

    await until(all_healthy)
    for index in range(MACHINES):
        # The node is the machine's systemd's service, not the agent's child.
        unit = await node_unit(rig, index)
        assert unit["ActiveState"] == "active"
        pid = unit["MainPID"]
        assert (
            f"/system.slice/{bootentry.NODE_UNIT}"
            in (await rig.sh(index, f"cat /proc/{pid}/cgroup")).stdout
        )
        assert (await rig.sh(index, f"ps -o ppid= -p {pid}")).stdout.strip() == "1"
        # Its data partition is the loop disk's fourth, mounted by the unit.
        mounted = (await rig.sh(index, "findmnt -n -o SOURCE /var/lib/metropolis")).stdout.strip()
        assert mounted == f"/dev/{real.root_device(index)}p4"
        # The fixed ports on its own address.
        listening = (await rig.sh(index, "ss -ltnH")).stdout
        assert f"{addresses[index]}:7837" in listening


async def test_two_installed_nodes_become_etcd_voters(rig: RealThread) -> None:
    real = rig.fleet
    rows = await nodes(rig)
    owner = (
        *("metropolis", "owner", "--root", str(real.first.root.path)),
        *("--owner-key", str(real.first.owner_key)),
    )
    for index in (0, 1):
        chosen = rows[real.machines.address(index)]
        await cli(*owner, "set-roles", chosen.node_id, "--consensus-member", "on")

        async def voter(node_id: str = chosen.node_id) -> bool:
            return any(m.name == node_id and not m.is_learner for m in await members(rig))

        await until(voter)  # one learner at a time (etcd 3.4): then the next


async def _consensus_member_back(
    rig: RealThread, index: int, before: NodeRow, member: Member, down_at: float
) -> None:
    """The node of machine ``index`` is back: a heartbeat since ``down_at``
    (trio time; the curator's health alone lags), same id and roles, its
    etcd member the same (not added again: its data came back) and a voter."""
    address = rig.fleet.machines.address(index)

    async def back() -> bool:
        row = (await nodes(rig)).get(address)
        beat = row.since_heartbeat if row is not None else None
        return healthy(row) and beat is not None and beat < trio.current_time() - down_at

    await until(back)
    row = (await nodes(rig))[address]
    assert (row.node_id, row.roles) == (before.node_id, before.roles)
    now = [m for m in await members(rig) if m.name == before.node_id]
    assert [(m.id, m.is_learner) for m in now] == [(member.id, False)]
    # The etcd data on its disk came back: its member id is the one it had.


async def _agent_back(
    rig: RealThread, index: int, started_before: str, checked_before: object
) -> None:
    """The agent is the machine's systemd's again (a new process) and has
    reported the installed generation (stored as checked, still installed)."""
    machine_id = rig.fleet.ids[index]

    async def reported_again() -> bool:
        got = await installation(rig.bmdb_url, machine_id)
        return got is not None and got.checked_at is not None and got.checked_at != checked_before

    await until(reported_again)
    got = await installation(rig.bmdb_url, machine_id)
    assert got is not None and got.state is InstallState.INSTALLED
    assert (await rig.sh(index, f"systemctl is-active {AGENT_UNIT}")).stdout.strip() == "active"
    assert await _agent_started(rig, index) != started_before


async def _agent_started(rig: RealThread, index: int) -> str:
    """When the agent's unit started its process (a pid would repeat: each
    boot of a machine is a new PID namespace)."""
    shown = f"systemctl show -p ExecMainStartTimestampMonotonic --value {AGENT_UNIT}"
    return (await rig.sh(index, f"cat /proc/sys/kernel/random/boot_id; {shown}")).stdout


async def _member_of(rig: RealThread, row: NodeRow) -> Member:
    return next(m for m in await members(rig) if m.name == row.node_id)


async def test_a_reboot_from_inside_brings_node_roles_etcd_and_agent_back(
    rig: RealThread,
) -> None:
    real = rig.fleet
    machine = real.machines.machines[0]
    before = (await nodes(rig))[real.machines.address(0)]
    member = await _member_of(rig, before)
    agent = await _agent_started(rig, 0)
    checked = (await installation(rig.bmdb_url, real.ids[0])).checked_at  # type: ignore[union-attr]
    boots = machine.boots
    down_at = trio.current_time()
    await rig.sh(0, "systemctl reboot", check=False)
    await until(lambda: _later(machine.boots, boots))
    await trio.to_thread.run_sync(rig.wait_ssh, 0)
    await _consensus_member_back(rig, 0, before, member, down_at)
    await _agent_back(rig, 0, agent, checked)


async def _later(now: int, before: int) -> bool:
    return now > before


async def test_a_power_reset_through_the_bmc_brings_node_and_agent_back_and_it_votes(
    rig: RealThread,
) -> None:
    real = rig.fleet
    credentials = Credentials(real.machines.bmc_username, real.machines.bmc_password)
    before = (await nodes(rig))[real.machines.address(0)]
    member = await _member_of(rig, before)
    agent = await _agent_started(rig, 0)
    checked = (await installation(rig.bmdb_url, real.ids[0])).checked_at  # type: ignore[union-attr]
    machine = real.machines.machines[0]
    boots = machine.boots
    async with RedfishClient() as redfish:
        down_at = trio.current_time()
        await redfish.reset(real.machines.system_url(0), credentials, "ForceRestart")
        await until(lambda: _later(machine.boots, boots))
        await trio.to_thread.run_sync(rig.wait_ssh, 0)
        await _consensus_member_back(rig, 0, before, member, down_at)
        await _agent_back(rig, 0, agent, checked)
        # It votes: with machine 1's member off, the first node and this one
        # are two of three voters, and etcd still takes a write.
        other = real.machines.system_url(1)
        await redfish.reset(other, credentials, "ForceOff")
        with trio.fail_after(BOUND):
            while await redfish.power_state(other, credentials) != PowerState.OFF:  # noqa: ASYNC110
                await trio.sleep(0.2)
        with trio.fail_after(30):
            async with Client(real.first.root.ephemeral.consensus / SOCKET_NAME) as etcd:
                await etcd.put(b"/test/quorum", b"two of three")
        await redfish.reset(other, credentials, "On")
    await trio.to_thread.run_sync(rig.wait_ssh, 1)

    async def back() -> bool:
        return healthy((await nodes(rig)).get(real.machines.address(1)))

    await until(back)


async def test_a_disk_emptied_behind_the_shepherds_back_is_reported_and_installed_again(
    rig: RealThread,
) -> None:
    real = rig.fleet
    disk = real.machines.disks[2]
    # From the host, under the running node: zeroes over the table and the
    # boot partition (as an operator's dd would).
    await trio.run_process(
        ["dd", "if=/dev/zero", f"of={disk.device}", "bs=1M", "count=8", "oflag=direct"],
        capture_stderr=True,
    )

    async def lost() -> bool:
        got = await installation(rig.bmdb_url, real.ids[2])
        return got is not None and got.state is InstallState.INSTALL_LOST

    await until(lost)
    got = await installation(rig.bmdb_url, real.ids[2])
    assert got is not None and got.lost_cause is not None
    assert got.lost_cause.startswith(f"generation 1 is gone from /dev/{disk.name}: ")
    old_key = got.node_public_key
    # A new generation needs no --reinstall, and installs over the disk
    # (the earlier node stopped first: its data was still mounted).
    out = await cli(*rig.install_argv(2, await ticket(rig))[2:])
    assert "1 requested" in out, out
    again = await reported(rig.bmdb_url, real.ids[2], 2)
    if again.state is not InstallState.INSTALLED:  # what the machine's systemd saw, to read
        log = (await rig.sh(2, "tail -n 20 /root/agent.log; journalctl -n 60 --no-pager")).stdout
        raise AssertionError(f"{again}\n{log}")
    assert again.node_public_key is not None and again.node_public_key != old_key
    assert again.lost_cause is None

    async def new_node_healthy() -> bool:
        # By key: the old node (gone, its heartbeat timed out) is still listed
        # at the same address, so a table by address may show either.
        async with rig.fleet.first.access.open() as owner:
            rows = await owner.nodes()
        return any(healthy(r) and r.public_key == again.node_public_key for r in rows)

    await until(new_node_healthy)


async def test_decommission_wipes_the_disk_for_real(rig: RealThread) -> None:
    real = rig.fleet
    disk = real.machines.disks[2]
    pem = (await rig.sh(2, f"cat {NODE_KEY}")).stdout.encode()
    key = serialization.load_pem_private_key(pem, password=None)
    assert isinstance(key, Ed25519PrivateKey)
    seed = key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    body = b"".join(pem.splitlines()[1:-1])  # the base64 between the PEM lines
    before = await trio.to_thread.run_sync(disk.device.read_bytes)
    assert body in before  # there before the wipe: the check below can fail
    await cli("bmdb", "--url", rig.bmdb_url, "decommission", str(real.ids[2]), "--reason", "test")

    shown = ""

    async def tombstone() -> bool:
        nonlocal shown
        shown = await cli("bmdb", "--url", rig.bmdb_url, "machine", str(real.ids[2]))
        return "decommissioned (a tombstone)" in shown

    await until(tombstone)
    for step in ("wipefs -a", "blkdiscard", "read back"):
        assert step in shown, shown
    # The whole device, read back off the host: nothing of the node left.
    everything = await trio.to_thread.run_sync(disk.device.read_bytes)
    assert len(everything) == disk.size
    assert b"EFI PART" not in everything  # no GPT, primary or backup
    assert bootrecord.MAGIC not in everything
    assert seed not in everything and body not in everything
    assert everything.count(0) == len(everything)  # discarded: zeroes throughout
    probe = await trio.run_process(["blkid", "-p", str(disk.device)], check=False)
    assert probe.returncode == 2  # no signature at all
    # And on the machine: no unit, no node, no agent.
    left = (await rig.sh(2, "ls /etc/systemd/system | grep metropolis", check=False)).stdout
    assert left == ""
    assert (await rig.sh(2, f"pgrep -f '{bootentry.NODE_LINK} node'", check=False)).returncode == 1
    assert (await rig.sh(2, "pgrep -f /root/agent", check=False)).returncode == 1
    assert (
        json.loads((await rig.sh(2, "lsblk -J -o NAME " + str(disk.device))).stdout)[
            "blockdevices"
        ][0].get("children")
        is None
    )


def test_stopping_leaves_no_machine_disk_or_namespace(rig: RealThread) -> None:
    real = rig.fleet
    disks = real.machines.disks
    names = [m.spec.name for m in real.machines.machines]
    first = real.first.process.pid
    rig.stop()
    assert not [d for d in disks if d.attached()]
    assert not Path(f"/proc/{first}").exists()
    running = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert not [line for line in running.splitlines() if any(n in line for n in names)]
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert real.machines.network.prefix not in spaces
