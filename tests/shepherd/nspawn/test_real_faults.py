"""Power cuts during an install, and the installs a machine refuses, on real machines.

One run of `shepherd.realfleet` for the module (`real_thread.RealThread`),
two machines: machine 0 (a 256 MiB disk) has its power cut through its
BMC during the image's download, halfway through the write of system A,
and right after that write; each time the next boot's agent reports the
generation failed, with the cause, no node runs (there is no boot entry to
run one), and the next generation installs cleanly over what was left.
Machine 1 (a 128 MiB disk, smaller than the layout) refuses, with the
cause in its install report and its disk read back unchanged: a device
that holds its running system, one that is mounted, one smaller than the
layout, a partition, and a device that is not a block device. The tests
build on each other, in file order (one xdist group).
"""

from __future__ import annotations

import hashlib
import subprocess
import tempfile
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import trio

import bmdb
from bmdb.model import InstallState, OSInstallation, Queries
from shepherd.agent import bootentry, bootrecord, realdisk
from shepherd.agent.unit import AGENT_UNIT
from shepherd.install import request_bytes
from shepherd.providers.base import PowerState
from shepherd.providers.redfish import Credentials, RedfishClient
from tests.fixtures.install_rig import HeldLink
from tests.shepherd.nspawn.fleet_thread import skip_unless_possible
from tests.shepherd.nspawn.real_thread import RealThread

BOUND = 120.0
MIB = 1 << 20


@pytest.fixture(scope="module")
def rig(module_bmdb_url: str, node_image: Path) -> Iterator[RealThread]:
    skip_unless_possible()
    folder = Path(tempfile.mkdtemp(prefix="rf-", dir="/tmp"))  # short: etcd's socket
    thread = RealThread(folder, module_bmdb_url, node_image, 2, disk_size=[256 * MIB, 128 * MIB])
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


async def install(rig: RealThread, index: int, *more: str) -> str:
    """``python -m shepherd install`` of machine ``index`` (its output; exit status kept)."""
    async with rig.fleet.first.access.open() as owner:
        ticket = (await owner.ticket()).hex()
    done = await trio.run_process(
        rig.install_argv(index, ticket, *more), capture_stdout=True, capture_stderr=True,
        check=False,
    )  # fmt: skip
    return done.stdout.decode() + done.stderr.decode()


async def cut_power_and_boot(rig: RealThread, index: int) -> None:
    """ForceOff through the BMC, then On; back once sshd answers."""
    real = rig.fleet
    url = real.machines.system_url(index)
    credentials = Credentials(real.machines.bmc_username, real.machines.bmc_password)
    async with RedfishClient() as redfish:
        await redfish.reset(url, credentials, "ForceOff")
        with trio.fail_after(BOUND):
            while await redfish.power_state(url, credentials) != PowerState.OFF:  # noqa: ASYNC110
                await trio.sleep(0.1)
        await redfish.reset(url, credentials, "On")
    await trio.to_thread.run_sync(rig.wait_ssh, index)


async def no_node(rig: RealThread, index: int) -> None:
    """Nothing runs a node, and nothing would at the next boot."""
    units = await rig.sh(index, "ls /etc/systemd/system | grep metropolis-", check=False)
    assert units.stdout.split() == [AGENT_UNIT]  # the agent's only: no boot entry
    running = await rig.sh(index, f"pgrep -f '{bootentry.NODE_LINK} node'", check=False)
    assert running.returncode == 1, running.stdout
    state = await rig.sh(index, f"systemctl is-active {bootentry.NODE_UNIT}", check=False)
    assert state.stdout.strip() == "inactive"


async def pause_at(rig: RealThread, index: int, step: str) -> None:
    """Make the next install wait at ``step`` (`realdisk.PAUSE_DIR`), until the power goes."""
    await rig.sh(index, f"mkdir -p {realdisk.PAUSE_DIR} && touch {realdisk.PAUSE_DIR}/pause-{step}")


async def paused(rig: RealThread, index: int, step: str) -> None:
    async def there() -> bool:
        found = await rig.sh(index, f"test -e {realdisk.PAUSE_DIR}/paused-{step}", check=False)
        return found.returncode == 0

    await until(there)


def interrupted(got: OSInstallation) -> None:
    assert got.state is InstallState.INSTALL_FAILED
    assert got.cause is not None and got.cause.startswith("interrupted: the agent stopped"), got


async def test_power_cut_during_the_download(rig: RealThread) -> None:
    real = rig.fleet
    host = real.machines.host_address
    link = HeldLink(int(real.images.rsplit(":", 1)[1]), hold_after=2 * MIB, host_address=host)
    async with trio.open_nursery() as nursery:
        await nursery.start(link.serve)
        async with real.first.access.open() as owner:
            ticket = (await owner.ticket()).hex()
        argv = rig.install_argv(0, ticket)
        argv[argv.index("--image-server") + 1] = f"http://{link.host}"
        done = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
        assert done.returncode == 0, done.stderr

        async def held() -> bool:
            return link.holding > 0

        await until(held)  # 2 MiB of the image are on the machine, the rest held
        await cut_power_and_boot(rig, 0)
        link.release()
        nursery.cancel_scope.cancel()
    got = await reported(rig.bmdb_url, real.ids[0], 1)
    interrupted(got)
    await no_node(rig, 0)
    left = await rig.sh(0, "ls -a /root | grep -c part$", check=False)
    assert left.stdout.strip() == "0"  # the download's temporary file went with it


async def test_power_cut_halfway_through_the_image_write(rig: RealThread, node_image: Path) -> None:
    real = rig.fleet
    await pause_at(rig, 0, "image-half")
    assert "1 requested" in await install(rig, 0)
    await paused(rig, 0, "image-half")
    await cut_power_and_boot(rig, 0)
    got = await reported(rig.bmdb_url, real.ids[0], 2)
    interrupted(got)
    await no_node(rig, 0)
    # System A holds half an image (and nothing runs it): read from the host.
    image = await trio.Path(node_image).read_bytes()
    disk = real.machines.disks[0]
    assert disk.partitions() == [f"{disk.name}p{i}" for i in (1, 2, 3, 4)]
    written = (await trio.Path(f"/dev/{disk.name}p2").read_bytes())[: len(image)]
    half = len(image) // 2
    assert written[:half] == image[:half] and written != image


async def test_power_cut_right_after_the_image_write(rig: RealThread, node_image: Path) -> None:
    real = rig.fleet
    await pause_at(rig, 0, "boot-record")
    assert "1 requested" in await install(rig, 0)
    await paused(rig, 0, "boot-record")
    await cut_power_and_boot(rig, 0)
    got = await reported(rig.bmdb_url, real.ids[0], 3)
    interrupted(got)
    await no_node(rig, 0)
    # The whole image is on system A, checked; but no boot record, no unit.
    image = await trio.Path(node_image).read_bytes()
    disk = real.machines.disks[0]
    assert (await trio.Path(f"/dev/{disk.name}p2").read_bytes())[: len(image)] == image
    assert bootrecord.MAGIC not in await trio.Path(f"/dev/{disk.name}p1").read_bytes()


async def test_the_next_generation_installs_cleanly_over_what_the_cuts_left(
    rig: RealThread,
) -> None:
    real = rig.fleet
    assert "1 requested" in await install(rig, 0)
    got = await reported(rig.bmdb_url, real.ids[0], 4)
    assert got.state is InstallState.INSTALLED, got.cause

    async def healthy() -> bool:
        async with real.first.access.open() as owner:
            rows = {r.address: r for r in await owner.nodes()}
        row = rows.get(real.machines.address(0))
        return row is not None and row.state == "UP" and row.health == "HEALTHY"

    await until(healthy)


# --- refusals, on machine 1: each with its cause, its disk read back unchanged


async def disk_digest(rig: RealThread, index: int) -> str:
    data = await trio.to_thread.run_sync(rig.fleet.machines.disks[index].device.read_bytes)
    return hashlib.sha256(data).hexdigest()


async def refused(rig: RealThread, generation: int) -> str:
    got = await reported(rig.bmdb_url, rig.fleet.ids[1], generation)
    assert got.state is InstallState.INSTALL_FAILED and got.cause is not None
    return got.cause


#: A first partition on machine 1's disk, formatted, mounted at /mnt/sysroot
#: and made the root of a unit (the agent's, below): python3 runs there from
#: the machine's /usr, bound in.
_SYSROOT = """
set -e
disk=/dev/{name}
echo 'label: gpt
size=64M' | sfdisk -q $disk
partx -u $disk
test -e ${{disk}}p1 || mknod ${{disk}}p1 b $(tr : ' ' < /sys/class/block/{name}p1/dev)
mkfs.ext4 -q ${{disk}}p1
mkdir -p /mnt/sysroot
mount ${{disk}}p1 /mnt/sysroot
cd /mnt/sysroot
mkdir -p usr etc root dev proc sys run tmp
ln -s usr/bin bin; ln -s usr/lib lib; ln -s usr/lib64 lib64; ln -s usr/sbin sbin
"""

_ON_THE_DISK = f"""
mkdir -p /etc/systemd/system/{AGENT_UNIT}.d
printf '[Service]\\nRootDirectory=/mnt/sysroot\\nBindReadOnlyPaths=/usr /etc\\nBindPaths=/root /dev /run /tmp\\nMountAPIVFS=yes\\n' > /etc/systemd/system/{AGENT_UNIT}.d/root.conf
systemctl daemon-reload
systemctl restart {AGENT_UNIT}
"""  # noqa: E501

_OFF_THE_DISK = f"""
rm -r /etc/systemd/system/{AGENT_UNIT}.d
systemctl daemon-reload
systemctl restart {AGENT_UNIT}
"""


async def test_a_disk_that_holds_the_running_system_is_refused(rig: RealThread) -> None:
    name = rig.fleet.root_device(1)
    await rig.sh(1, _SYSROOT.format(name=name))
    # The agent now runs from a root on that disk (systemd's RootDirectory=).
    await rig.sh(1, _ON_THE_DISK)
    pid = f"$(systemctl show -p MainPID --value {AGENT_UNIT})"
    roots = await rig.sh(1, f"stat -L -c %d /proc/{pid}/root /mnt/sysroot")
    assert len(set(roots.stdout.split())) == 1, roots.stdout
    before = await disk_digest(rig, 1)
    assert "1 requested" in await install(rig, 1)
    cause = await refused(rig, 1)
    assert cause == f"root device /dev/{name} holds the running system (it backs /)"
    assert await disk_digest(rig, 1) == before
    await rig.sh(1, _OFF_THE_DISK)


async def test_a_mounted_disk_is_refused(rig: RealThread) -> None:
    name = rig.fleet.root_device(1)
    before = await disk_digest(rig, 1)
    assert "1 requested" in await install(rig, 1)  # its last generation failed: no --reinstall
    assert await refused(rig, 2) == f"root device /dev/{name} is mounted: /mnt/sysroot"
    assert await disk_digest(rig, 1) == before


async def test_a_partition_is_refused(rig: RealThread) -> None:
    name = rig.fleet.root_device(1)
    await rig.sh(1, "umount /mnt/sysroot")
    before = await disk_digest(rig, 1)
    await _raw_request(rig, 3, f"{name}p1")
    assert await refused(rig, 3) == f"root device /dev/{name}p1 is a partition, not a whole disk"
    assert await disk_digest(rig, 1) == before


async def test_a_disk_smaller_than_the_layout_is_refused(rig: RealThread) -> None:
    name = rig.fleet.root_device(1)
    before = await disk_digest(rig, 1)
    assert "1 requested" in await install(rig, 1)
    cause = await refused(rig, 4)
    want = rig.fleet.layout.min_bytes
    assert cause == (
        f"root device /dev/{name} has {128 * MIB} bytes, smaller than the layout's {want}"
    )
    assert await disk_digest(rig, 1) == before


async def test_what_is_not_a_block_device_is_refused(rig: RealThread) -> None:
    # The Shepherd refuses to ask: its hardware report lists no such disk.
    said = await install(rig, 1, "--root-device", "null")
    assert "root device 'null' is not in its hardware report" in said, said
    # Asked all the same (a request written straight into the BMDB), the
    # agent refuses it.
    before = await disk_digest(rig, 1)
    await _raw_request(rig, 5, "null")
    assert (
        await refused(rig, 5) == "root device /dev/null is not a block device (a character device)"
    )
    assert await disk_digest(rig, 1) == before


async def _raw_request(rig: RealThread, generation: int, root_device: str) -> None:
    """Write an installation request past `shepherd.install`'s checks."""
    real = rig.fleet
    plan = await real.plan(root_device=root_device)
    address = real.machines.address(1)
    async with bmdb.open_connection(rig.bmdb_url) as conn:

        async def body(q: Queries) -> bool:
            return await q.set_os_installation_request(
                real.ids[1], generation, request_bytes(plan, generation, address),
                root_device=root_device, image_digest=plan.image.digest, node_address=address,
            )  # fmt: skip

        assert await conn.transact(body)


def test_the_module_leaves_nothing(rig: RealThread) -> None:
    disks = rig.fleet.machines.disks
    prefix = rig.fleet.machines.network.prefix
    rig.stop()
    assert not [d for d in disks if d.attached()]
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert prefix not in spaces
