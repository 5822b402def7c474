"""The boot helper's partition nodes (`shepherd.agent.bootprep.make_nodes`), without udev;
and the agent's own unmount of the data partition.

On a machine booted again (an nspawn machine whose disk is another loop
device now), /dev may still hold a partition node with the numbers of a
device gone: the helper must make it anew, not read the wrong disk.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from shepherd.agent import blockdev, bootentry, bootprep


def _sys(root: Path, name: str, devno: tuple[int, int], *, partition: bool) -> None:
    entry = root / name
    entry.mkdir(parents=True)
    (entry / "dev").write_text(f"{devno[0]}:{devno[1]}\n")
    if partition:
        (entry / "partition").write_text("1\n")


def _rdev(path: Path) -> tuple[int, int]:
    st = os.lstat(path)
    assert stat.S_ISBLK(st.st_mode)
    return os.major(st.st_rdev), os.minor(st.st_rdev)


@pytest.fixture
def roots(tmp_path: Path) -> tuple[Path, Path]:
    if os.geteuid() != 0:
        pytest.skip("mknod needs root")
    sys_block, dev = tmp_path / "sys", tmp_path / "dev"
    dev.mkdir()
    _sys(sys_block, "loop9", (7, 9), partition=False)
    _sys(sys_block, "loop9p1", (259, 4), partition=True)
    _sys(sys_block, "loop9p2", (259, 5), partition=True)
    return sys_block, dev


def test_missing_partition_nodes_are_made(roots: tuple[Path, Path]) -> None:
    sys_block, dev = roots
    bootprep.make_nodes(str(sys_block), str(dev))
    assert sorted(p.name for p in dev.iterdir()) == ["loop9p1", "loop9p2"]
    assert _rdev(dev / "loop9p1") == (259, 4)
    assert _rdev(dev / "loop9p2") == (259, 5)


def test_a_stale_partition_node_is_made_anew(roots: tuple[Path, Path]) -> None:
    sys_block, dev = roots
    os.mknod(dev / "loop9p1", 0o600 | stat.S_IFBLK, os.makedev(259, 0))  # a device gone
    bootprep.make_nodes(str(sys_block), str(dev))
    assert _rdev(dev / "loop9p1") == (259, 4)
    assert not (dev / "loop9p1.new").exists()


def test_a_device_gone_while_listed_is_skipped(roots: tuple[Path, Path]) -> None:
    """Its sysfs entry listed, its ``dev`` gone before it is read: no node, no error."""
    sys_block, dev = roots
    (sys_block / "loop9p2" / "dev").unlink()
    bootprep.make_nodes(str(sys_block), str(dev))
    assert sorted(p.name for p in dev.iterdir()) == ["loop9p1"]


def test_a_non_block_entry_is_refused(roots: tuple[Path, Path]) -> None:
    sys_block, dev = roots
    (dev / "loop9p2").write_text("not a device")
    with pytest.raises(SystemExit, match="not a block device"):
        bootprep.make_nodes(str(sys_block), str(dev))
    assert (dev / "loop9p2").read_text() == "not a device"


def test_the_agents_unmount_unmounts_by_the_system_call(tmp_path: Path) -> None:
    """What the agent falls back on when systemd cannot run umount for the
    data partition (`bootentry.stop_installed`)."""
    if os.geteuid() != 0:
        pytest.skip("mount needs root")
    point = tmp_path / "mnt"
    point.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(point)], check=True)
    try:
        assert os.path.ismount(point)
        bootentry.unmount(str(point))
        assert not os.path.ismount(point)
        with pytest.raises(blockdev.DeviceFailed, match="cannot unmount"):
            bootentry.unmount(str(point))
    finally:
        subprocess.run(["umount", str(point)], capture_output=True, check=False)
