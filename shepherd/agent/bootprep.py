"""What the installed machine runs at each boot before the node: ``python3 bootprep.py``.

Standalone (the standard library only): the installer copies this file to
the machine (`blockdev.HELPER`), and ``metropolis-prepare.service`` runs it
with the boot partition's PARTUUID. Without udev (a rescue system, a
systemd-nspawn machine) no partition node appears in /dev by itself, so it:

    makes every missing partition node   /dev/<part> from /sys/class/block/<part>/dev
    finds the boot partition             by PARTUUID, with ``blkid`` (util-linux)
    reads the boot record                `blockdev.write_boot_record`'s layout
    unpacks the node image (`unpack`)    into /run (argument 2: `unpack.CACHE`),
                                         from system A, its SHA-256 checked
                                         first; unless it is there whole (the
                                         agent unpacked it at install, for the
                                         first boot); linked as
                                         /run/metropolis/node, what the node
                                         unit runs (the other images' removed)
    links /run/metropolis/data           to the data partition's node: the mount
                                         unit names that path, outside /dev, so
                                         systemd waits for no udev device unit

Exit status 1 with a line on stderr if anything does not match: the node
unit then does not start (it Requires this one).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
import subprocess
import sys

try:
    from . import unpack  # imported as shepherd.agent.bootprep
except ImportError:  # run as a script, beside unpack.py
    import unpack  # type: ignore[no-redef,import-not-found]

RUN = "/run/metropolis"
MAGIC = b"MONOTRIO-BOOT1\n"


def make_nodes(sys_block: str = "/sys/class/block", dev: str = "/dev") -> None:
    """A block node in ``dev`` for every partition the kernel lists.

    A node that is there with another device number is one an earlier
    table or loop device left (a machine's /dev outlives the loop device
    bound into it, and the kernel hands the freed numbers to the next): it
    is replaced, as `blockdev.partition_nodes` does. A non-block entry of
    that name is refused."""
    for name in sorted(os.listdir(sys_block)):
        base = f"{sys_block}/{name}"
        path = f"{dev}/{name}"
        if not os.path.exists(f"{base}/partition"):
            continue
        with open(f"{base}/dev") as f:
            major, minor = (int(x) for x in f.read().split(":"))
        devno = os.makedev(major, minor)
        try:
            found = os.lstat(path)
        except FileNotFoundError:
            os.mknod(path, 0o600 | stat.S_IFBLK, devno)
            continue
        if not stat.S_ISBLK(found.st_mode):
            raise SystemExit(f"bootprep: {path} exists but is not a block device")
        if found.st_rdev != devno:
            fresh = f"{path}.new"
            if os.path.lexists(fresh):
                os.unlink(fresh)
            os.mknod(fresh, 0o600 | stat.S_IFBLK, devno)
            os.replace(fresh, path)


def by_partuuid(partuuid: str) -> str:
    out = subprocess.run(
        ["blkid", "-o", "device", "-t", f"PARTUUID={partuuid}"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.split()
    if len(out) != 1:
        raise SystemExit(f"bootprep: PARTUUID {partuuid}: {len(out)} devices")
    return out[0]


def read_record(device: str) -> tuple[dict[str, object], bytes]:
    with open(device, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise SystemExit(f"bootprep: {device} holds no boot record")
        (n,) = struct.unpack(">Q", f.read(8))
        header = json.loads(f.read(n))
        (m,) = struct.unpack(">Q", f.read(8))
        return header, f.read(m)


def symlink(target: str, path: str) -> None:
    """``path`` made a symlink to ``target``, replacing what was there at once."""
    tmp = f"{path}.tmp"
    if os.path.lexists(tmp):
        os.unlink(tmp)
    os.symlink(target, tmp)
    os.replace(tmp, path)


def extract(device: str, size: int, want: str) -> None:
    """The image on ``device`` to /run/metropolis/image.pyz, its SHA-256 checked."""
    digest = hashlib.sha256()
    with open(device, "rb") as src, open(f"{RUN}/image.pyz.tmp", "wb") as dst:
        left = size
        while left:
            chunk = src.read(min(left, 1 << 20))
            if not chunk:
                raise SystemExit("bootprep: system A is shorter than the image")
            digest.update(chunk)
            dst.write(chunk)
            left -= len(chunk)
    if digest.hexdigest() != want:
        raise SystemExit("bootprep: the image on system A does not match its SHA-256")
    os.replace(f"{RUN}/image.pyz.tmp", f"{RUN}/image.pyz")


def main(boot_partuuid: str, cache: str = unpack.CACHE) -> int:
    make_nodes()
    header, parameters = read_record(by_partuuid(boot_partuuid))
    os.makedirs(RUN, mode=0o700, exist_ok=True)
    size, want = int(str(header["image_bytes"])), str(header["image_sha256"])
    try:
        folder = unpack.tree(want, cache)
        # Whole already: the agent unpacked it at install, from the image
        # it verified, moments ago (the first boot); else read it off the
        # slot, check it, unpack it.
        if not unpack.complete(folder):
            extract(by_partuuid(str(header["system_a"])), size, want)
            unpack.ensure(f"{RUN}/image.pyz", want, cache)
        unpack.prune(cache, keep=want)
    except (unpack.UnpackError, OSError) as exc:
        raise SystemExit(f"bootprep: cannot unpack the image: {exc}") from None
    symlink(folder, f"{RUN}/node")
    with open(f"{RUN}/node-parameters.pb", "wb") as f:
        f.write(parameters)
    link = f"{RUN}/data"
    if os.path.lexists(link):
        os.unlink(link)
    os.symlink(by_partuuid(str(header["data"])), link)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
