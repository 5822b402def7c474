"""Installing the node onto a real block device.

What the installer needs of the machine (root, no udev needed):

    commands   sfdisk, partx, blkid, wipefs, blkdiscard (util-linux; Debian
               fdisk + util-linux), mkfs.ext4 (e2fsprogs), python3, systemctl
               (only when the request starts the unit), systemd as PID 1
    paths      /proc/self/mountinfo, /sys/class/block/<dev>/{dev,size,partition},
               /sys/block/<dev>/holders, /dev (nodes made by mknod when missing),
               the systemd root (default /etc/systemd/system) and the helper
               folder (default /usr/local/lib/metropolis), /run/metropolis at boot

The device is checked first (`blockdev.check_device`). One install
(`install_device`), each step a crash point (`crash_point`,
``METROPOLIS_TEST_CRASH_AT`` as in metropolis/crashpoint.py, which the
agent bundle cannot import) and a pause point (`PAUSE_DIR`, where a test
cuts the machine's power), and one more halfway through the image write.
A disk that an earlier install left running is stopped first
(`bootentry.stop_installed`: its node unit stopped, its data unmounted, its
boot entry removed):

    partition   a GPT written by sfdisk: boot, system A, system B, data, of
                fixed type GUIDs and the sizes of `gpt.Layout`; PARTUUIDs read
                back with ``sfdisk --json``; nodes made
                (`blockdev.partition_nodes`)
    image       written raw to system A (a fixed-size slot, as Monogon's: an
                A/B upgrade is one write of the other slot, no filesystem to
                repair), then read back from the device and its SHA-256 checked
    boot record on the boot partition, raw and length-prefixed (`bootrecord`:
                MAGIC, JSON header with the generation, the image's size and
                digest and the PARTUUIDs, the NodeParameters)
    data        mkfs.ext4 of the data partition, the node's root
    boot entry  LAST (`bootentry.write_boot_entry`): the helper and the
                units, then the enable symlinks, the node's last of all

A/B upgrades (slot B written, tried once, kept or given up) are
`abslots`'s and `shepherd.agent.upgrade`'s; the install only writes the
pieces every boot runs. The wipe is `diskwipe`'s.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
from collections.abc import Callable

from . import abslots
from .blockdev import MIB, DeviceFailed, read_sys, run
from .bootentry import Target, write_boot_entry
from .bootrecord import write_boot_record
from .gpt import Layout, Partitions, partition

CRASH_ENV = "METROPOLIS_TEST_CRASH_AT"

#: Tests stop an install at a step (to cut the machine's power there) with
#: a file ``pause-<step>`` here: on the machine's /run, a tmpfs, so a reboot
#: forgets it. The installer then makes ``paused-<step>`` and waits until
#: ``pause-<step>`` is gone. No machine in service has this folder.
PAUSE_DIR = "/run/metropolis-test"


def crash_point(step: str) -> None:
    """SIGKILL this process here if ``METROPOLIS_TEST_CRASH_AT`` names ``step``;
    wait here while ``PAUSE_DIR/pause-<step>`` exists (`PAUSE_DIR`)."""
    if os.environ.get(CRASH_ENV) == step:
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    pause = os.path.join(PAUSE_DIR, f"pause-{step}")
    if os.path.exists(pause):
        import time

        with open(os.path.join(PAUSE_DIR, f"paused-{step}"), "w"):
            pass
        while os.path.exists(pause):
            time.sleep(0.05)


def sha256_of(node: str, size: int) -> str:
    """The SHA-256 of the first ``size`` bytes of ``node``, read with O_DIRECT
    off the device (not from the page cache the write filled)."""
    digest = hashlib.sha256()
    subprocess.run(["blockdev", "--flushbufs", node], capture_output=True, check=False)
    with open(node, "rb", buffering=0) as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        left = size
        while left:
            chunk = f.read(min(left, MIB))
            if not chunk:
                raise DeviceFailed(f"{node} ends before {size} bytes")
            digest.update(chunk)
            left -= len(chunk)
    return digest.hexdigest()


def write_image(image: str, node: str, digest: str) -> int:
    """Copy file ``image`` raw onto ``node``, fsync, and check the digest read back."""
    size = os.path.getsize(image)
    if size > int(read_sys(f"/sys/class/block/{os.path.basename(node)}/size")) * 512:
        raise DeviceFailed(f"the image of {size} bytes does not fit {node}")
    with open(image, "rb") as src, open(node, "r+b") as dst:
        written = 0
        while chunk := src.read(MIB):
            dst.write(chunk)
            if written < size // 2 <= written + len(chunk):
                dst.flush()
                os.fsync(dst.fileno())
                crash_point("image-half")  # a test cuts the power here: half an image
            written += len(chunk)
        dst.flush()
        os.fsync(dst.fileno())
    back = sha256_of(node, size)
    if back != digest:
        raise DeviceFailed(f"the image read back from {node} has SHA-256 {back}, want {digest}")
    return size


@dataclasses.dataclass(frozen=True)
class Installed:
    """What `install_device` wrote: the partitions, the image's size, the boot entry's files."""

    partitions: Partitions
    image_bytes: int
    units: list[str]


def install_device(
    device: str,
    image: str,
    digest: str,
    node_parameters: bytes,
    node_address: str,
    *,
    layout: Layout,
    target: Target,
    generation: int = 0,
    step: Callable[[str], None] = lambda _: None,
) -> Installed:
    """Install onto ``device`` (checked by `blockdev.check_device`): see the
    module's steps. ``generation`` goes into the boot record
    (`bootrecord.read_installed` checks it).
    Raises DeviceFailed with the cause; a failure leaves no boot entry."""
    crash_point("partition")
    parts = partition(device, layout)
    step("partition")
    crash_point("image")
    size = write_image(image, parts.nodes[1], digest)
    step(f"image {size} bytes, SHA-256 read back")
    crash_point("boot-record")
    header: dict[str, object] = {
        "generation": generation,
        "image_bytes": size,
        "image_sha256": digest,
        **dict(zip(("boot", "system_a", "system_b", "data"), parts.partuuids, strict=True)),
    }
    write_boot_record(parts.nodes[0], header, node_parameters)
    abslots.DeviceStore(parts.nodes[0]).clear()  # no slot state of an earlier install
    step("boot record")
    crash_point("data")
    run(["mkfs.ext4", "-q", "-F", "-L", "metropolis-data", "-U", "random", parts.nodes[3]])
    step("data")
    crash_point("boot-entry")
    written = write_boot_entry(target, parts.partuuids[0], node_address)
    step("boot entry")
    return Installed(parts, size, written)
