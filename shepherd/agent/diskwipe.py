"""Wiping a block device for real, and showing that it is empty.

`wipe_device`: each partition's signatures, then the table's, then the
whole device (a discard, or a zero-out where a discard does not zero), and
a read-back; each step reported with its outcome. `wipe` (``agent --wipe``)
runs it on the device the install state names.
"""

from __future__ import annotations

import os
import stat
import subprocess

from .blockdev import (
    MIB,
    DeviceFailed,
    child_partitions,
    parse_devno,
    read_direct,
    read_sys,
    run,
    sys_name,
)


def _zeroes_at(device: str, offset: int, length: int) -> bool:
    return read_direct(device, offset, length).count(0) == length


def wipe_device(device: str) -> list[str]:
    """Wipe ``device`` for real; the steps done, each "what: outcome", the
    last one the read-back. DeviceFailed names the step that did not hold.

    Each partition's signatures, then the table's (``wipefs -a``), then the
    whole device: ``blkdiscard``; where the device refuses a discard, or a
    discard leaves its first MiB unzeroed (discard need not zero), a zero-out
    of the whole device (``blkdiscard -z``: the kernel writes zeroes where
    the device has no command for it), so nothing of the node's data stays
    readable. That takes the device's write time; a discard, little."""
    name = sys_name(os.stat(device).st_rdev)
    done = []
    nodes = []
    for part in child_partitions(name):
        node = f"/dev/{part}"
        if not os.path.exists(node):
            devno = parse_devno(read_sys(f"/sys/class/block/{part}/dev"))
            os.mknod(node, 0o600 | stat.S_IFBLK, devno)
        nodes.append(node)
    if nodes:  # one wipefs for them all: it fails as a whole, naming the node
        run(["wipefs", "-a", "-q", *nodes])
        done += [f"wipefs -a {node}: done" for node in nodes]
    run(["wipefs", "-a", "-q", device])
    done.append(f"wipefs -a {device} (the partition table): done")
    size = int(read_sys(f"/sys/class/block/{name}/size")) * 512
    discard = subprocess.run(["blkdiscard", "-f", device], capture_output=True, check=False)
    first = min(MIB, size) // 4096 * 4096
    if discard.returncode == 0 and _zeroes_at(device, 0, first):
        done.append(f"blkdiscard {device}: done")
    else:
        why = (
            discard.stderr.decode(errors="replace").strip()[-200:]
            if discard.returncode != 0
            else "the discarded blocks do not read back as zeroes"
        )
        done.append(f"blkdiscard {device}: not enough ({why})")
        run(["blkdiscard", "-f", "-z", device])
        done.append(f"blkdiscard -z {device} (zeroes over all {size} bytes): done")
    subprocess.run(["partx", "-d", device], capture_output=True, check=False)
    left = run(["wipefs", "--noheadings", device]).strip()
    if left:
        raise DeviceFailed(f"{device} still shows signatures after the wipe: {left}")
    if child_partitions(name):
        raise DeviceFailed(f"the kernel still shows partitions of {device} after the wipe")
    if not (
        _zeroes_at(device, 0, first) and _zeroes_at(device, size // 4096 * 4096 - first, first)
    ):
        raise DeviceFailed(f"{device} does not read back as zeroes after the wipe")
    done.append(f"read back {device}: no signature, no partition, zeroes at both ends")
    return done
