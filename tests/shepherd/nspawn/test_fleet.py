"""Real systemd-nspawn machines: boot, SSH, network, disk, reboot, Redfish, cleanup.

One fleet of two machines for the module (booting is the slow part); the
tests run in file order and the last one stops the fleet and checks that
nothing is left.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from shepherd.nspawn.machine import REBOOT_STATUS
from shepherd.providers.base import PowerState
from shepherd.providers.redfish import BMCError, Credentials, RedfishClient
from tests.shepherd.nspawn.fleet_thread import FleetThread, skip_unless_possible
from tests.shepherd.nspawn.netids import link_id, namespaces


@pytest.fixture(scope="module")
def machines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetThread]:
    skip_unless_possible()
    rig = FleetThread(tmp_path_factory.mktemp("nspawn"), count=2)
    rig.start()
    try:
        yield rig
    finally:
        rig.stop()


def _wait_sshd(rig: FleetThread, index: int, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if rig.ssh(index, "true", check=False).returncode == 0:
                return
        except subprocess.TimeoutExpired:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"machine {index}: no SSH within {timeout} s")
        time.sleep(0.3)


def test_a_machine_runs_systemd_and_accepts_the_key(machines: FleetThread) -> None:
    assert machines.ssh(0, "cat /proc/1/comm").stdout.strip() == "systemd"
    state = machines.ssh(0, "systemctl is-system-running --wait", check=False).stdout.strip()
    assert state in ("running", "degraded"), state
    assert machines.ssh(0, "hostname").stdout.strip() == "machine-0"
    # A key the machine was not given is refused.
    other = FleetThread(machines.folder / "other", count=0)
    other.folder.mkdir()
    other.key_file.write_bytes(other.key.openssh_private)
    other.key_file.chmod(0o600)
    refused = other.ssh_to(machines.fleet.address(0) if machines.fleet else "", "true", check=False)
    assert refused.returncode == 255


def test_each_machine_has_its_own_nic_and_namespace(machines: FleetThread) -> None:
    assert machines.fleet is not None
    for index in range(2):
        link = machines.fleet.machines[index].spec.link
        assert machines.ssh(index, "cat /sys/class/net/eth0/address").stdout.strip() == link.mac
        links = json.loads(machines.ssh(index, "ip -j link show").stdout)
        assert sorted(i["ifname"] for i in links) == ["eth0", "lo"]
    namespaces = {machines.ssh(i, "readlink /proc/1/ns/net").stdout.strip() for i in range(2)}
    assert len(namespaces) == 2
    assert os.readlink("/proc/self/ns/net") not in namespaces


def test_machines_reach_each_other_and_the_host_only_over_the_bridge(
    machines: FleetThread,
) -> None:
    fleet = machines.fleet
    assert fleet is not None
    # The host's servers listen on its bridge address: a machine reaches them.
    with socket.create_server((fleet.host_address, 0)) as server:
        port = server.getsockname()[1]
        reached = machines.ssh(
            0, f"timeout 5 bash -c 'echo hi > /dev/tcp/{fleet.host_address}/{port}'"
        )
        assert reached.returncode == 0
        conn, _ = server.accept()
        assert conn.recv(16) == b"hi\n"
        conn.close()
    probe = f"timeout 5 bash -c 'head -c 4 < /dev/tcp/{fleet.address(1)}/22'"
    assert machines.ssh(0, probe).stdout == "SSH-"
    # ...which went over the bridge: it learnt both machines' MACs on its ports.
    fdb = subprocess.run(
        ["bridge", "fdb", "show", "br", fleet.network.bridge], capture_output=True, text=True
    ).stdout
    for machine in fleet.machines:
        assert machine.spec.link.mac in fdb
    # No route beyond the bridge's /24.
    routes = json.loads(machines.ssh(0, "ip -j route show").stdout)
    assert [r["dst"] for r in routes] == [str(fleet.network.subnet)]
    beyond = machines.ssh(0, "ip route get 192.0.2.1", check=False)
    assert beyond.returncode != 0 and "unreachable" in beyond.stderr


#: Inside the machine: partition the disk, make the kernel and /dev know the
#: partition (partx; mknod, there is no udev), then use it.
_PARTITION = """
set -e
disk=/dev/{name}
echo 'label: gpt
size=64M, type=linux' | sfdisk -q $disk
# sfdisk's own re-read does not show the new partition (see shepherd.nspawn.disk)...
! test -e /sys/class/block/{name}p1
# ...partx does.
partx -u $disk
test -e /sys/class/block/{name}p1
mknod /dev/{name}p1 b $(tr : ' ' < /sys/class/block/{name}p1/dev)
mkfs.ext4 -q /dev/{name}p1
mkdir -p /mnt/data
mount /dev/{name}p1 /mnt/data
echo kept-across-reboot > /mnt/data/marker
umount /mnt/data
"""

_MOUNT_AGAIN = """
set -e
test -e /dev/{name}p1 || mknod /dev/{name}p1 b $(tr : ' ' < /sys/class/block/{name}p1/dev)
mkdir -p /mnt/data
mount /dev/{name}p1 /mnt/data
cat /mnt/data/marker
umount /mnt/data
"""


def test_the_loop_disk_is_a_block_device_to_partition_and_mount(machines: FleetThread) -> None:
    assert machines.fleet is not None
    disk = machines.fleet.disks[0]
    assert machines.ssh(
        0, f"test -b {disk.device} && blockdev --getsize64 {disk.device}"
    ).stdout.strip() == str(disk.size)
    made = machines.ssh(0, _PARTITION.format(name=disk.name), check=False)
    assert made.returncode == 0, made.stderr
    assert disk.partitions() == [f"{disk.name}p1"]


def test_a_reboot_from_inside_comes_back_with_the_disk(machines: FleetThread) -> None:
    fleet = machines.fleet
    assert fleet is not None
    machine, disk = fleet.machines[0], fleet.disks[0]
    boots = machine.boots
    machines.ssh(0, "echo in-the-root > /root/kept; systemctl reboot", check=False)
    deadline = time.monotonic() + 60
    while machine.boots == boots:
        assert time.monotonic() < deadline, "no second boot"
        time.sleep(0.2)
    assert machine.last_status == REBOOT_STATUS
    _wait_sshd(machines, 0)
    assert machines.ssh(0, "cat /root/kept").stdout.strip() == "in-the-root"
    again = machines.ssh(0, _MOUNT_AGAIN.format(name=disk.name), check=False)
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == "kept-across-reboot"


async def _wait_power(
    client: RedfishClient, url: str, credentials: Credentials, want: PowerState
) -> None:
    with trio.fail_after(60):
        while await client.power_state(url, credentials) != want:  # noqa: ASYNC110
            await trio.sleep(0.2)


async def test_redfish_powers_the_machine_off_on_and_resets_it(machines: FleetThread) -> None:
    fleet = machines.fleet
    assert fleet is not None
    url, machine = fleet.system_url(1), fleet.machines[1]
    good = Credentials(fleet.bmc_username, fleet.bmc_password)
    async with RedfishClient() as client:
        with pytest.raises(BMCError, match="401"):
            await client.power_state(url, Credentials(fleet.bmc_username, "wrong"))
        with pytest.raises(BMCError, match="not offered"):
            await client.reset(url, good, "Nmi")
        assert await client.power_state(url, good) == PowerState.ON

        await client.reset(url, good, "ForceOff")
        await _wait_power(client, url, good, PowerState.OFF)
        assert machine.container_pid() is None
        await client.reset(url, good, "On")
        await _wait_power(client, url, good, PowerState.ON)
        await trio.to_thread.run_sync(_wait_sshd, machines, 1)

        boots = machine.boots
        assert await client.power_cycle(url, good) == "ForceRestart"
        with trio.fail_after(60):
            while machine.boots == boots:  # noqa: ASYNC110  (another thread's Trio run)
                await trio.sleep(0.2)
        await trio.to_thread.run_sync(_wait_sshd, machines, 1)

        await client.reset(url, good, "GracefulShutdown")
        await _wait_power(client, url, good, PowerState.OFF)
        assert machine.last_status == 0  # systemd powered off in order
        # A system that is off: power_cycle powers it on.
        assert await client.power_cycle(url, good) == "On"
        await _wait_power(client, url, good, PowerState.ON)
        await trio.to_thread.run_sync(_wait_sshd, machines, 1)


def test_stopping_the_fleet_leaves_nothing(machines: FleetThread) -> None:
    fleet = machines.fleet
    assert fleet is not None
    names = [m.spec.name for m in fleet.machines]
    roots = [m.root for m in fleet.machines]
    inits = [m.container_pid() for m in fleet.machines]
    assert None not in inits
    # By identity: another run may claim the slot, and its names, once it is free.
    links = [fleet.network.bridge, *(m.spec.link.host_veth for m in fleet.machines)]
    network = {(n, link_id(n)) for n in links} | set(namespaces(fleet.network.prefix).items())
    machines.stop()
    # The machines' PID 1s (and so their PID namespaces) are gone.
    assert not [pid for pid in inits if Path(f"/proc/{pid}").exists()]
    running = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert not [line for line in running.splitlines() if any(n in line for n in names)]
    assert not [d for d in fleet.disks if d.attached()]
    assert not [r for r in roots if os.path.ismount(r)]
    now = {(n, link_id(n)) for n in links} | set(namespaces(fleet.network.prefix).items())
    assert not network & now
