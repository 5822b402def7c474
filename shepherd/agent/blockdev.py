"""Block devices as the kernel shows them (/sys, /dev), and the checks
before an install writes one.

Refused before anything is written (`check_device`, the cause is the install
report's): not a block device, a device that holds the running system (it
or a partition of it backs ``/``), a device of which any partition is
mounted (/proc/self/mountinfo, by major:minor) or held (device mapper, RAID),
a device smaller than the layout (`gpt.Layout`).

No udev is needed: a partition's /dev node is made from
/sys/class/block/<part>/dev when it is missing, or made again when it names
another device number (`partition_node`). The errors of every step on a
real disk (`DeviceRefused`, `DeviceFailed`) are this module's.
"""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
from typing import TYPE_CHECKING

from .errors import AgentError

if TYPE_CHECKING:
    from .gpt import Layout

MIB = 1024 * 1024


class DeviceRefused(AgentError):
    """A device the installer will not write; the message is the cause."""


class DeviceFailed(AgentError):
    """A step of a real install or wipe failed; the message is the cause."""


def run(argv: list[str], stdin: bytes | None = None) -> str:
    """The output of command ``argv`` (bounded in time); DeviceFailed with
    the end of its error output if it fails."""
    try:
        done = subprocess.run(argv, input=stdin, capture_output=True, check=False, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DeviceFailed(f"{argv[0]}: {exc}") from exc
    if done.returncode != 0:
        err = done.stderr.decode(errors="replace").strip()[-500:]
        raise DeviceFailed(f"{' '.join(argv)} failed (status {done.returncode}): {err}")
    return done.stdout.decode(errors="replace")


def read_sys(path: str) -> str:
    """A /sys attribute's value."""
    with open(path) as f:
        return f.read().strip()


def parse_devno(text: str) -> int:
    """The device number of ``major:minor``."""
    major, minor = text.split(":")
    return os.makedev(int(major), int(minor))


def device_path(root_device: str) -> str:
    """The path a request's root_device names: ``/dev/<name>`` or an absolute path."""
    return root_device if root_device.startswith("/") else f"/dev/{root_device}"


def sys_name(devno: int) -> str:
    """The kernel's name of block device ``devno`` (``loop3``), via /sys/dev/block."""
    link = f"/sys/dev/block/{os.major(devno)}:{os.minor(devno)}"
    try:
        return os.path.basename(os.readlink(link))
    except OSError as exc:
        raise DeviceRefused(
            f"block device {os.major(devno)}:{os.minor(devno)} has no {link}"
        ) from exc


def child_partitions(name: str) -> list[str]:
    """The kernel names of ``name``'s partitions, in partition-number order."""
    base = f"/sys/block/{name}"
    found = []
    for child in os.listdir(base):
        if os.path.exists(f"{base}/{child}/partition"):
            found.append((int(read_sys(f"{base}/{child}/partition")), child))
    return [child for _, child in sorted(found)]


def check_device(root_device: str, layout: Layout, *, own_mount: str | None = None) -> str:
    """The path of the device to install on, or DeviceRefused with the cause.
    ``own_mount``: a mount there is an earlier install's data partition, which
    the install stops first (`bootentry.stop_installed`), so it is not refused here."""
    path = device_path(root_device)
    try:
        st = os.stat(path)
    except OSError as exc:
        raise DeviceRefused(f"root device {path}: {exc.strerror}") from exc
    if not stat.S_ISBLK(st.st_mode):
        kind = "a character device" if stat.S_ISCHR(st.st_mode) else "not a device"
        raise DeviceRefused(f"root device {path} is not a block device ({kind})")
    name = sys_name(st.st_rdev)
    if os.path.exists(f"/sys/class/block/{name}/partition"):
        raise DeviceRefused(f"root device {path} is a partition, not a whole disk")
    parts = child_partitions(name)
    devnos = {st.st_rdev} | {parse_devno(read_sys(f"/sys/class/block/{p}/dev")) for p in parts}
    if os.stat("/").st_dev in devnos:
        raise DeviceRefused(f"root device {path} holds the running system (it backs /)")
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 4 and parse_devno(fields[2]) in devnos and fields[4] != own_mount:
                raise DeviceRefused(f"root device {path} is mounted: {fields[4]}")
    for held in [name, *parts]:
        holders = os.listdir(f"/sys/class/block/{held}/holders")
        if holders:
            raise DeviceRefused(f"root device {path} is in use by {', '.join(sorted(holders))}")
    size = int(read_sys(f"/sys/class/block/{name}/size")) * 512
    if size < layout.min_bytes:
        raise DeviceRefused(
            f"root device {path} has {size} bytes, smaller than the layout's {layout.min_bytes}"
        )
    return path


def partition_nodes(device: str) -> list[str]:
    """Make the kernel see ``device``'s partitions (``partx``) and make each
    missing /dev node from /sys/class/block/<part>/dev: no udev needed.

    A node that is there with another device number is one an earlier
    table left (the kernel numbers partitions anew when it reads a table
    again, and without udev nobody updates /dev): it is replaced. A /dev
    entry of that name that is not a block device is refused."""
    name = sys_name(os.stat(device).st_rdev)
    subprocess.run(["partx", "-u", device], capture_output=True, check=False)
    if not child_partitions(name):
        subprocess.run(["partx", "-a", device], capture_output=True, check=False)
    return [partition_node(part) for part in child_partitions(name)]


def partition_node(part: str) -> str:
    """``/dev/<part>``, made from /sys/class/block/<part>/dev, or made again
    (atomically) when it names another device number: a partition table
    written anew gives a loop device's partitions new (dynamic) numbers, and
    a node made for the old table would reach some other partition. A /dev
    entry of that name that is not a block device is refused."""
    node = f"/dev/{part}"
    devno = parse_devno(read_sys(f"/sys/class/block/{part}/dev"))
    try:
        found = os.lstat(node)
    except FileNotFoundError:
        os.mknod(node, 0o600 | stat.S_IFBLK, devno)
        return node
    if not stat.S_ISBLK(found.st_mode):
        raise DeviceFailed(f"{node} exists but is not a block device")
    if found.st_rdev != devno:
        fresh = f"{node}.new"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(fresh)
        os.mknod(fresh, 0o600 | stat.S_IFBLK, devno)
        os.replace(fresh, node)
    return node


def read_direct(device: str, offset: int, length: int) -> bytes:
    """``length`` bytes at ``offset`` (both multiples of 4096) of ``device``,
    read with O_DIRECT: from the device, never from a page cache that a
    write through another node (a partition, the backing file) left stale."""
    import mmap

    buffer = mmap.mmap(-1, length)  # page-aligned, as O_DIRECT wants
    fd = os.open(device, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    try:
        got = os.preadv(fd, [buffer], offset)
        return bytes(buffer[:got])
    finally:
        os.close(fd)
        buffer.close()
