"""The machine's disks and the names an installation request gives them.

Real disks (`real_disks`): every whole block device of /sys/block that this
system can open (``/dev/<name>`` is a block node of its number: in a
container /sys lists the host's disks too, but /dev has only its own) and
that is a disk: one with a ``device`` (a controller's disk), or a loop
device with a backing file (a file standing for a disk, as the nspawn test
machines have). RAM disks, zram, device mapper and unbacked loop devices
are not disks to install on. The hardware report lists each by its serial
number; a disk without one (a loop device, some virtual disks) by its
kernel name instead, since a request must be able to name it: that name is
a request's ``root_device`` (`resolve_real`).

Loopback disks: folders that stand for a machine's disks.

On a loopback machine (`shepherd.localfleet`, tests) a disk is a folder
``<agent dir>/disks/<name>/`` beside the agent (``/root/disks/disk0/`` for
the agent at ``/root/agent``). The hardware report lists each one as a
BlockDevice, told apart from real devices by its model `LOOPBACK_MODEL`,
with its name as serial number: that name is what an installation request
gives as its ``root_device``.

Only plain directories with a plain name count: a symbolic link, a file, or
a name with characters outside ``[A-Za-z0-9._-]`` is no disk, so a name
from a request can never reach outside the ``disks`` folder.
"""

from __future__ import annotations

import dataclasses
import os
import re
import stat

from .files import read_text

#: BlockDevice.vendor and .device_model of a loopback disk (its marker).
LOOPBACK_VENDOR = "monotrio"
LOOPBACK_MODEL = "loopback folder"

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def valid_name(name: str) -> bool:
    """Whether ``name`` can name a loopback disk (never ``..``, never a path)."""
    return _NAME.fullmatch(name) is not None and ".." not in name


def loopback_disks(agent_dir: str) -> dict[str, str]:
    """The loopback disks beside an agent in ``agent_dir``: name -> folder path."""
    base = os.path.join(agent_dir, "disks")
    try:
        if not stat.S_ISDIR(os.lstat(base).st_mode):
            return {}
        names = sorted(os.listdir(base))
    except OSError:
        return {}
    disks = {}
    for name in names:
        path = os.path.join(base, name)
        try:
            is_dir = stat.S_ISDIR(os.lstat(path).st_mode)
        except OSError:
            continue
        if is_dir and valid_name(name):
            disks[name] = path
    return disks


@dataclasses.dataclass(frozen=True)
class RealDisk:
    """A whole block device: its kernel name and the name the report gives it."""

    #: ``sda``, ``loop3``: the name in /sys/block and /dev.
    kernel_name: str
    #: Its serial number, or its kernel name when it has none.
    name: str
    serial: str


def _openable(name: str) -> bool:
    """Whether /dev/<name> is the block node of /sys/block/<name>."""
    numbers = read_text(f"/sys/block/{name}/dev")
    try:
        st = os.stat(f"/dev/{name}")
        major, minor = (int(x) for x in (numbers or "").split(":"))
    except (OSError, ValueError):
        return False
    return stat.S_ISBLK(st.st_mode) and st.st_rdev == os.makedev(major, minor)


def real_disks() -> list[RealDisk]:
    """The machine's real disks (see the module), in /sys/block order."""
    try:
        names = sorted(os.listdir("/sys/block"))
    except OSError:
        return []
    disks = []
    for name in names:
        base = f"/sys/block/{name}"
        is_disk = os.path.exists(f"{base}/device") or bool(read_text(f"{base}/loop/backing_file"))
        if not is_disk or not valid_name(name) or not _openable(name):
            continue
        serial = read_text(f"{base}/device/serial") or read_text(f"{base}/serial") or ""
        disks.append(RealDisk(name, serial or name, serial))
    return disks


def resolve_real(name: str, disks: list[RealDisk]) -> str | None:
    """The kernel name of the one real disk a request's ``name`` means, or
    None: a disk the report names so (its serial, or its kernel name when it
    has no serial); ValueError if two disks carry that name."""
    found = [d.kernel_name for d in disks if d.name == name]
    if len(found) > 1:
        raise ValueError(f"root device {name!r} names {len(found)} disks: {', '.join(found)}")
    return found[0] if found else None
