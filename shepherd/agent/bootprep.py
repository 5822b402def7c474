"""What the installed machine runs at each boot before the node: ``python3 bootprep.py``.

Standalone (the standard library only): the installer copies this file to
the machine (`bootentry.HELPER`), with `abslots` and `unpack` beside it
(`bootentry.HELPER_MODULES`), and ``metropolis-prepare.service`` runs it
with the boot partition's PARTUUID and the folder unpacked images live in
(`unpack.CACHE`). Without udev (a rescue system, a systemd-nspawn machine)
no partition node appears in /dev by itself, so it:

    makes every partition node           /dev/<part> from /sys/class/block/<part>/dev
                                         (a stale one made anew)
    finds the boot partition             by PARTUUID, with ``blkid`` (util-linux)
    reads the boot record                `bootrecord.write_boot_record`'s layout
    chooses the slot                     `abslots`: the active one, or a new
                                         one tried once (its state written
                                         before it runs)
    unpacks that slot's image            into the cache (`unpack`), unless it
                                         is there whole (the agent unpacked it
                                         at install, or at an upgrade's write
                                         while the old node served); else read
                                         off the slot's partition, its SHA-256
                                         checked first (a tried slot that does
                                         not match or unpack is given up at
                                         once: the active one boots); linked as
                                         /run/metropolis/node, what the node
                                         unit runs; the other images' folders
                                         removed
    writes /run/metropolis/boot.json     the slot, image and whether a try, which
                                         the node reports in its status
    links /run/metropolis/data           to the data partition's node: the mount
                                         unit names that path, outside /dev, so
                                         systemd waits for no udev device unit

Exit status 1 with a line on stderr if anything does not match: the node
unit then does not start (it Requires this one).

``python3 bootprep.py --check BOOT_PARTUUID`` is the boot check
(`abslots.CHECK_UNIT`): on a boot that tries a new slot, it keeps the slot
once the node announces itself healthy, or reboots (and the next boot goes
back) when it does not in time; on any other boot it exits at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import struct
import subprocess
import sys

try:
    from . import abslots, unpack  # imported as shepherd.agent.bootprep
except ImportError:  # run as a script, beside abslots.py and unpack.py
    import abslots  # type: ignore[no-redef,import-not-found]
    import unpack  # type: ignore[no-redef,import-not-found]

RUN = "/run/metropolis"
MAGIC = b"MONOTRIO-BOOT1\n"


def make_nodes(sys_block: str = "/sys/class/block", dev: str = "/dev") -> None:
    """A block node in ``dev`` for every partition the kernel lists.

    A node that is there with another device number is one an earlier
    table or loop device left (a machine's /dev outlives the loop device
    bound into it, and the kernel hands the freed numbers to the next): it
    is replaced, as `blockdev.partition_nodes` does. A non-block entry of
    that name is refused. A device that goes while it is listed (the host's
    other loop devices, which an nspawn machine's /sys shows too) is
    skipped: it needs no node."""
    for name in sorted(os.listdir(sys_block)):
        base = f"{sys_block}/{name}"
        path = f"{dev}/{name}"
        if not os.path.exists(f"{base}/partition"):
            continue
        try:
            with open(f"{base}/dev") as f:
                major, minor = (int(x) for x in f.read().split(":"))
        except OSError:  # gone since the listing (ENOENT, or ENODEV from sysfs)
            continue
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


def copy_checked(source: str, image: abslots.SlotImage, path: str) -> None:
    """The image's bytes on ``source`` copied to ``path``, its SHA-256
    checked; `abslots.SlotError` (nothing left at ``path``) if the partition
    is shorter or the digest does not match."""
    digest = hashlib.sha256()
    try:
        with open(source, "rb") as src, open(path, "wb") as dst:
            left = image.size
            while left:
                chunk = src.read(min(left, 1 << 20))
                if not chunk:
                    raise abslots.SlotError(f"{source} is shorter than the image")
                digest.update(chunk)
                dst.write(chunk)
                left -= len(chunk)
        if digest.hexdigest() != image.sha256:
            raise abslots.SlotError(f"the image on {source} does not match its SHA-256")
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise


def unpacked(source: str, image: abslots.SlotImage, cache: str) -> str:
    """The folder of ``image`` unpacked under ``cache``: the one there if it
    is `unpack.complete`, else the image read off ``source`` (checked, to a
    temporary file in /run that is removed after) and unpacked.
    `abslots.SlotError` if it cannot be: a tried slot is then given up."""
    try:
        folder = unpack.tree(image.sha256, cache)
        if unpack.complete(folder):
            return folder
        os.makedirs(RUN, mode=0o700, exist_ok=True)
        pyz = f"{RUN}/image.pyz.tmp"
        copy_checked(source, image, pyz)
        try:
            return unpack.ensure(pyz, image.sha256, cache)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(pyz)
    except (unpack.UnpackError, OSError) as exc:
        raise abslots.SlotError(f"cannot unpack the image of {source}: {exc}") from None


def main(boot_partuuid: str, cache: str = unpack.CACHE) -> int:
    make_nodes()
    boot_device = by_partuuid(boot_partuuid)
    header, parameters = read_record(boot_device)
    os.makedirs(RUN, mode=0o700, exist_ok=True)

    def extract(slot: str, image: abslots.SlotImage) -> None:
        unpacked(by_partuuid(str(header[f"system_{slot}"])), image, cache)

    def installed() -> abslots.SlotState:
        size, want = int(str(header["image_bytes"])), str(header["image_sha256"])
        return abslots.initial(abslots.SlotImage(want, size))

    try:
        chosen = abslots.boot(abslots.DeviceStore(boot_device), installed, extract, RUN)
    except abslots.SlotError as exc:
        raise SystemExit(f"bootprep: {exc}") from None
    # Only the chosen image's folder is kept: a tried one that failed, and
    # the one before an upgrade, are memory (a tmpfs) nothing runs from.
    unpack.prune(cache, keep=chosen.image.sha256)
    symlink(unpack.tree(chosen.image.sha256, cache), f"{RUN}/node")
    with open(f"{RUN}/node-parameters.pb", "wb") as f:
        f.write(parameters)
    link = f"{RUN}/data"
    if os.path.lexists(link):
        os.unlink(link)
    os.symlink(by_partuuid(str(header["data"])), link)
    return 0


def check_main(boot_partuuid: str) -> int:
    """The boot check (see the module): 0 when done, whatever it found."""
    make_nodes()

    def reboot() -> None:
        subprocess.run(["systemctl", "reboot"], check=False)

    def log(message: str) -> None:
        sys.stderr.write(f"bootprep: {message}\n")
        sys.stderr.flush()

    store = abslots.DeviceStore(by_partuuid(boot_partuuid))
    log(abslots.check(store, RUN, reboot, log=log))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--check"]:
        sys.exit(check_main(sys.argv[2]))
    sys.exit(main(*sys.argv[1:3]))
