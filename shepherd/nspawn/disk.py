"""A machine's disk: a sparse file on a loop device, a real block device.

`LoopDisk.create` makes ``size`` bytes of sparse file and attaches it with
``losetup -f --show -P`` (``-P``: the kernel scans partition tables on it).
The machine gets the device node with ``--bind=/dev/loopN``; the file and
the device outlive the machine's boots, so a reboot keeps what was written.

What a partition made inside a machine needs before it can be used
(tried on this project's CI host: Debian 12, systemd-nspawn 252, cgroup v1
with no systemd on the host, so nspawn sets no device policy and every
device node made inside can be opened):

* ``sfdisk /dev/loopN`` inside writes the table, but the kernel's re-read
  it asks for does not show the new partition: neither the host nor the
  machine sees ``loopNp1`` afterwards.
* ``partx -u /dev/loopN`` then makes the kernel add the partitions (run
  inside the machine, or on the host); ``/sys/class/block/loopNp1``
  appears in both. (Once, in the first trial, ``partx -u`` inside answered
  0 and added nothing; ``partx -u`` on the host did. The installer should
  check ``/sys/class/block`` afterwards rather than trust the exit status.)
* The host's ``/dev`` (devtmpfs) gets ``/dev/loopNp1`` by itself; the
  machine's ``/dev`` is nspawn's own tmpfs, with no udev, so nothing makes
  the node there: ``mknod /dev/loopNp1 b MAJOR MINOR`` with the numbers
  from ``/sys/class/block/loopNp1/dev`` (major 259, blkext). Then
  ``mkfs.ext4`` and ``mount`` work as on any disk.
* The other way works by itself: ``wipefs -a /dev/loopN`` inside removes
  the table and the kernel drops ``loopNp*`` at once (the nodes made with
  mknod stay in the machine's ``/dev`` until removed or the next boot).

(tests/shepherd/nspawn/test_fleet.py runs the sfdisk, partx, mknod, mkfs
and mount steps inside a machine, and checks that sfdisk alone shows no
partition.)

Blocking (runs losetup): for a thread. Errors: `DiskError`.
"""

from __future__ import annotations

import logging
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from shepherd.errors import ShepherdError

__all__ = ["DiskError", "LoopDisk"]

logger = logging.getLogger("shepherd.nspawn.disk")


class DiskError(ShepherdError):
    """Creating, attaching or detaching a loop disk failed."""


@dataclass
class LoopDisk:
    """An attached loop device and its backing file."""

    file: Path
    device: Path
    size: int

    @classmethod
    def create(cls, file: Path, size: int) -> LoopDisk:
        """A new sparse ``file`` of ``size`` bytes (an existing one is reused,
        grown to ``size`` if smaller), attached to a free loop device."""
        if size <= 0 or size % 512:
            raise ValueError(f"disk size {size} is not a positive multiple of 512")
        with file.open("ab") as f:
            if os.fstat(f.fileno()).st_size < size:
                f.truncate(size)
        result = subprocess.run(
            ["losetup", "-f", "--show", "-P", str(file)],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0 or not result.stdout.startswith("/dev/loop"):
            raise DiskError(f"losetup -f --show -P {file}: {result.stderr.strip()}")
        device = Path(result.stdout.strip())
        logger.info("disk %s on %s", file, device)
        return cls(file, device, size)

    @property
    def name(self) -> str:
        """``loopN``, as in ``/sys/class/block``."""
        return self.device.name

    def partitions(self) -> list[str]:
        """The partitions the kernel knows of (``loopNp1``...), in order."""
        block = Path("/sys/class/block")
        return sorted(
            (p.name for p in block.glob(f"{self.name}p*")),
            key=lambda n: int(n.removeprefix(f"{self.name}p")),
        )

    def detach(self) -> None:
        """Detach the loop device (the file stays). Raises `DiskError`."""
        result = subprocess.run(
            ["losetup", "-d", str(self.device)], capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            raise DiskError(f"losetup -d {self.device}: {result.stderr.strip()}")

    def attached(self) -> bool:
        """True while the loop device is still backed by our file."""
        backing = Path("/sys/class/block") / self.name / "loop" / "backing_file"
        try:
            return Path(backing.read_text().strip()) == self.file.resolve()
        except OSError:
            return False
