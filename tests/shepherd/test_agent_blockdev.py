"""Installing onto, and wiping, REAL block devices: loop devices on this host.

Each test attaches a sparse file with ``losetup -f --show -P`` and detaches
it in teardown. Root and util-linux are needed; without them the tests skip
with the reason.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from shepherd.agent import (
    blockdev,
    bootentry,
    bootrecord,
    diskwipe,
    gpt,
    installplan,
    realdisk,
    wire,
)
from shepherd.agent.bootentry import Target
from shepherd.agent.gpt import Layout
from shepherd.agent.install import Settings
from shepherd.agent.installer import Installer
from tests.shepherd.agent_install import request, serve_images, stand_in_image
from tests.shepherd.agents import make_tls

SMALL = Layout(boot_mib=1, system_mib=4, data_min_mib=8)  # 19 MiB at least
TOOLS = ("losetup", "sfdisk", "partx", "mkfs.ext4", "wipefs", "blkdiscard", "blkid", "mount")

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or any(shutil.which(t) is None for t in TOOLS),
    reason=f"needs root and {', '.join(TOOLS)}",
)


def _attach(path: Path, mib: int) -> str:
    with open(path, "wb") as f:
        f.truncate(mib * blockdev.MIB)
    return subprocess.run(
        ["losetup", "-f", "--show", "-P", str(path)], capture_output=True, text=True, check=True
    ).stdout.strip()


@pytest.fixture
def loop(tmp_path: Path) -> Iterator[Callable[[int], str]]:
    attached: list[str] = []
    mounts: list[Path] = []

    def make(mib: int) -> str:
        device = _attach(tmp_path / f"disk{len(attached)}.img", mib)
        attached.append(device)
        return device

    make.mounts = mounts  # type: ignore[attr-defined]
    try:
        yield make
    finally:
        for m in mounts:
            subprocess.run(["umount", str(m)], check=False)
        for device in attached:
            subprocess.run(["losetup", "-d", device], check=False)


def _mount(loop: Callable[[int], str], source: str, where: Path) -> None:
    where.mkdir(exist_ok=True)
    subprocess.run(["mount", source, str(where)], check=True, capture_output=True)
    loop.mounts.append(where)  # type: ignore[attr-defined]


def _digest(device: str) -> str:
    with open(device, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _image(tmp_path: Path, size: int = 3 * blockdev.MIB + 12345) -> tuple[Path, str]:
    data = stand_in_image(size=size)
    path = tmp_path / "image.pyz"
    path.write_bytes(data)
    return path, hashlib.sha256(data).hexdigest()


# --- refusals: nothing written


def test_too_small_is_refused(loop: Callable[[int], str]) -> None:
    device = loop(16)
    before = _digest(device)
    with pytest.raises(blockdev.DeviceRefused, match="smaller than the layout"):
        blockdev.check_device(os.path.basename(device), SMALL)
    assert _digest(device) == before


def test_a_mounted_partition_is_refused(loop: Callable[[int], str], tmp_path: Path) -> None:
    device = loop(32)
    subprocess.run(["sfdisk", "-q", device], input=b"label: gpt\nsize=8MiB\n", check=True)
    blockdev.partition_nodes(device)
    subprocess.run(["mkfs.ext4", "-q", f"{device}p1"], check=True)
    _mount(loop, f"{device}p1", tmp_path / "mnt")
    before = _digest(device)
    with pytest.raises(blockdev.DeviceRefused, match=r"is mounted: .*/mnt"):
        blockdev.check_device(device, SMALL)
    assert _digest(device) == before


def test_a_stale_partition_node_is_made_anew(loop: Callable[[int], str]) -> None:
    """Without udev, /dev keeps a partition node with the number of an
    earlier table; the installer replaces it instead of refusing the disk."""
    device = loop(32)
    subprocess.run(
        ["sfdisk", "-q", device], input=b"label: gpt\nsize=4MiB\nsize=4MiB\n", check=True
    )
    first, second = blockdev.partition_nodes(device)
    # The first partition's node now names the second's device number.
    os.unlink(first)
    os.mknod(first, 0o600 | stat.S_IFBLK, os.stat(second).st_rdev)
    assert blockdev.partition_nodes(device) == [first, second]
    name = os.path.basename(first)
    want = Path(f"/sys/class/block/{name}/dev").read_text().strip()
    got = os.stat(first).st_rdev
    assert f"{os.major(got)}:{os.minor(got)}" == want
    # A /dev entry of that name that is no block device is not touched.
    os.unlink(first)
    Path(first).write_text("not a device")
    try:
        with pytest.raises(blockdev.DeviceFailed, match="not a block device"):
            blockdev.partition_nodes(device)
        assert Path(first).read_text() == "not a device"
    finally:
        os.unlink(first)
        blockdev.partition_nodes(device)  # the node again, for the loop fixture's detach


def test_the_device_of_the_running_system_is_refused() -> None:
    name = blockdev.sys_name(os.stat("/").st_dev)
    if os.path.exists(f"/sys/class/block/{name}/partition"):
        name = os.path.basename(os.path.dirname(os.path.realpath(f"/sys/class/block/{name}")))
    if not os.path.exists(f"/dev/{name}"):
        pytest.skip(f"/ is on {name}, which has no /dev node here")
    with pytest.raises(blockdev.DeviceRefused, match="holds the running system"):
        blockdev.check_device(name, SMALL)


@pytest.mark.parametrize("kind", ["regular file", "char device"])
def test_not_a_block_device_is_refused(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "file"
    path.write_bytes(b"x" * 4096)
    target = str(path) if kind == "regular file" else "/dev/null"
    want = "not a device" if kind == "regular file" else "a character device"
    with pytest.raises(blockdev.DeviceRefused, match=f"is not a block device \\({want}\\)"):
        blockdev.check_device(target, SMALL)
    assert path.read_bytes() == b"x" * 4096


# --- the install, read back


def _target(tmp_path: Path) -> Target:
    return Target(
        systemd_root=str(tmp_path / "systemd"),
        helper_dir=str(tmp_path / "lib"),
        mount_point="/var/lib/metropolis",
    )


def test_full_install_reads_back(loop: Callable[[int], str], tmp_path: Path) -> None:
    device = loop(40)
    image, digest = _image(tmp_path)
    target = _target(tmp_path)
    (tmp_path / "systemd").mkdir()
    done = realdisk.install_device(
        blockdev.check_device(os.path.basename(device), SMALL),
        str(image),
        digest,
        b"\x0a\x02params",
        "198.18.0.7",
        layout=SMALL,
        target=target,
    )
    # The table, read back.
    table = json.loads(
        subprocess.run(["sfdisk", "--json", device], capture_output=True, check=True).stdout
    )
    parts = table["partitiontable"]["partitions"]
    assert table["partitiontable"]["label"] == "gpt"
    assert [p["name"] for p in parts] == list(gpt.NAMES)
    assert [p["type"] for p in parts] == [
        gpt.TYPE_BOOT,
        gpt.TYPE_SYSTEM,
        gpt.TYPE_SYSTEM,
        gpt.TYPE_DATA,
    ]
    assert [p["size"] * 512 for p in parts[:3]] == [
        blockdev.MIB,
        4 * blockdev.MIB,
        4 * blockdev.MIB,
    ]
    assert tuple(p["uuid"].lower() for p in parts) == done.partitions.partuuids
    # The image, read back off system A with a fresh descriptor.
    with open(f"{device}p2", "rb") as f:
        assert hashlib.sha256(f.read(image.stat().st_size)).hexdigest() == digest
    # NodeParameters on the boot partition.
    header, parameters = bootrecord.read_boot_record(f"{device}p1")
    assert parameters == b"\x0a\x02params"
    assert header["image_sha256"] == digest and header["data"] == done.partitions.partuuids[3]
    # The data partition mounts by PARTUUID.
    _mount(loop, f"PARTUUID={done.partitions.partuuids[3]}", tmp_path / "root")
    assert (tmp_path / "root" / "lost+found").is_dir()
    # The units, as written.
    units = tmp_path / "systemd"
    node = (units / bootentry.NODE_UNIT).read_text()
    assert "Restart=always" in node and "--address 198.18.0.7" in node
    assert "Requires=var-lib-metropolis.mount" in node
    mount = (units / "var-lib-metropolis.mount").read_text()
    assert f"What={bootentry.RUN}/data" in mount and "Where=/var/lib/metropolis" in mount
    prepare = (units / bootentry.PREPARE_UNIT).read_text()
    assert done.partitions.partuuids[0] in prepare
    link = units / "multi-user.target.wants" / bootentry.NODE_UNIT
    assert os.readlink(link) == str(units / bootentry.NODE_UNIT)
    assert (tmp_path / "lib" / bootentry.HELPER).read_bytes() == (
        Path(blockdev.__file__).with_name(bootentry.HELPER).read_bytes()
    )


_CHILD = """
import sys
from shepherd.agent import bootentry, gpt, realdisk
t = bootentry.Target(systemd_root=sys.argv[4], helper_dir=sys.argv[5])
realdisk.install_device(sys.argv[1], sys.argv[2], sys.argv[3], b"p", "198.18.0.7",
    layout=gpt.Layout(1, 4, 8), target=t)
"""


@pytest.mark.parametrize("step", ["partition", "image", "boot-record", "data", "boot-entry"])
def test_a_cut_before_the_boot_entry_leaves_no_unit(
    loop: Callable[[int], str], tmp_path: Path, step: str
) -> None:
    device = loop(40)
    image, digest = _image(tmp_path)
    units = tmp_path / "systemd"
    units.mkdir()
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            _CHILD,
            device,
            str(image),
            digest,
            str(units),
            str(tmp_path / "lib"),
        ],
        env={**os.environ, realdisk.CRASH_ENV: step},
        capture_output=True,
        check=False,
    )
    assert result.returncode == -9, result.stderr
    assert list(units.iterdir()) == []


def test_wipe_reads_back_nothing_left(loop: Callable[[int], str], tmp_path: Path) -> None:
    device = loop(40)
    image, digest = _image(tmp_path)
    secret = b"NODE-PRIVATE-KEY-" + os.urandom(16).hex().encode()
    (tmp_path / "systemd").mkdir()
    done = realdisk.install_device(
        device, str(image), digest, secret, "198.18.0.7", layout=SMALL, target=_target(tmp_path)
    )
    steps = diskwipe.wipe_device(device)
    assert steps[-1].startswith(f"read back {device}: no signature, no partition, zeroes")
    assert f"wipefs -a {device}p4: done" in steps
    assert f"blkdiscard {device}: done" in steps  # a loop device discards (punches holes)
    with open(device, "rb") as f:
        everything = f.read()
    assert b"EFI PART" not in everything  # neither GPT header
    assert secret not in everything
    assert bootrecord.MAGIC not in everything
    assert b"\x53\xef" not in everything[1024 + 56 : 1024 + 58]
    assert subprocess.run(["blkid", "-p", device], capture_output=True).returncode == 2
    for uuid in done.partitions.partuuids:
        assert (
            subprocess.run(["blkid", "-t", f"PARTUUID={uuid}"], capture_output=True).returncode != 0
        )


# --- through the agent's Installer


def test_installer_refuses_a_mounted_loop_device_and_installs_onto_a_free_one(
    loop: Callable[[int], str], tmp_path: Path
) -> None:
    tls = make_tls(tmp_path / "tls")
    agent = tmp_path / "root" / "agent"
    agent.parent.mkdir()
    busy, free = loop(32), loop(40)
    subprocess.run(["mkfs.ext4", "-q", busy], check=True)
    _mount(loop, busy, tmp_path / "mnt")
    (tmp_path / "systemd").mkdir()
    settings = Settings(
        read_timeout=5.0,
        download_deadline=30.0,
        layout=SMALL,
        target=_target(tmp_path),
        after_install="none",
    )
    with serve_images((tls.certfile, tls.keyfile)) as server:
        data = stand_in_image(size=2 * blockdev.MIB)
        digest = server.add(data)
        host = f"127.0.0.1:{server.port}"
        installer = Installer(
            str(agent), endpoint_scheme="https", ca_certificate=tls.ca_der, settings=settings
        )
        req = request(1, host=host, digest=f"sha256:{digest}", root_device=os.path.basename(busy))
        installer.on_answer(req)
        installer.join(120)
        installer.on_answer(req)
        report = installer.pending_report()
        assert (
            report is not None
            and report.error == f"root device {busy} is mounted: {tmp_path / 'mnt'}"
        )
        assert server.ranges == []  # refused before the download
        req = request(2, host=host, digest=f"sha256:{digest}", root_device=os.path.basename(free))
        installer.on_answer(req)
        installer.join(120)
        installer.on_answer(req)
        report = installer.pending_report()
    assert report is not None and report.error is not None
    assert report.error.startswith(f"installed onto {free}; the node was not started")
    assert (tmp_path / "systemd" / "multi-user.target.wants" / bootentry.NODE_UNIT).is_symlink()
    assert realdisk.sha256_of(f"{free}p2", len(data)) == digest
    state = json.loads((tmp_path / "root" / "agent.install.json").read_text())
    assert state["generation"] == 2 and state["status"] == "done"
    assert not [p for p in os.listdir(agent.parent) if p.endswith(".part")]
    assert installplan.BLOCK_DEVICE_REFUSAL  # kept for agents without a layout


def test_agent_wipe_wipes_the_installed_device(loop: Callable[[int], str], tmp_path: Path) -> None:
    from shepherd.agent.wipe import wipe

    device = loop(40)
    image, digest = _image(tmp_path)
    target = _target(tmp_path)
    (tmp_path / "systemd").mkdir()
    realdisk.install_device(
        device, str(image), digest, b"secret-params", "198.18.0.7", layout=SMALL, target=target
    )
    agent = tmp_path / "agent"
    (tmp_path / "agent.install.json").write_text(
        json.dumps({"generation": 1, "status": "done", "device": device})
    )
    report = wipe(str(agent), target)
    assert report["errors"] == []
    link = tmp_path / "systemd" / "multi-user.target.wants" / bootentry.NODE_UNIT
    assert f"removed {link}: done" in report["steps"]
    assert any(str(w).startswith(f"read back {device}: no signature") for w in report["steps"])
    assert [p.name for p in (tmp_path / "systemd").iterdir()] == ["multi-user.target.wants"]
    with open(device, "rb") as f:
        everything = f.read()
    assert b"secret-params" not in everything and b"EFI PART" not in everything
    assert not (tmp_path / "agent.install.json").exists()


def test_the_installer_reports_what_it_finds_of_its_install(
    loop: Callable[[int], str], tmp_path: Path
) -> None:
    """Unasked, after a start and whenever it changes: the installed
    generation still on the device (its key again), or gone, with the cause."""
    device = loop(40)
    image, digest = _image(tmp_path)
    target = _target(tmp_path)
    (tmp_path / "systemd").mkdir()
    realdisk.install_device(
        device, str(image), digest, b"p", "198.18.0.7", layout=SMALL, target=target, generation=3
    )
    key = bytes(range(32))
    state = {"generation": 3, "status": "done", "device": device, "node_public_key": key.hex()}
    (tmp_path / "agent.install.json").write_text(json.dumps(state))
    installer = Installer(
        str(tmp_path / "agent"),
        endpoint_scheme="http",
        ca_certificate=b"",
        settings=Settings(layout=SMALL, target=target),
    )
    installer.on_answer(None)  # the server asks for no installation
    there = installer.pending_report()
    assert there == wire.InstallationReport(3, node_public_key=key)
    assert there is not None
    installer.sent(there)
    assert installer.pending_report() is None  # said once
    # Emptied behind its back: zeroes over the boot partition's start.
    with open(device, "r+b") as f:
        f.seek(blockdev.MIB)
        f.write(bytes(blockdev.MIB))
        f.flush()
        os.fsync(f.fileno())
    gone = installer.pending_report()
    assert gone == wire.InstallationReport(
        3, error=f"generation 3 is gone from {device}: {device} holds no boot record"
    )
    assert gone is not None
    installer.sent(gone)
    assert installer.pending_report() is None
    # Another generation's install there is not this one.
    realdisk.install_device(
        device, str(image), digest, b"p", "198.18.0.7", layout=SMALL, target=target, generation=4
    )
    other = installer.pending_report()
    assert other is not None and other.error is not None
    assert other.error.endswith("its boot record is of generation 4")
