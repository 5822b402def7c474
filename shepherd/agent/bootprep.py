"""What the installed machine runs at each boot before the node: ``python3 bootprep.py``.

Standalone (the standard library only): the installer copies this file to
the machine (`blockdev.HELPER`), and ``metropolis-prepare.service`` runs it
with the boot partition's PARTUUID. Without udev (a rescue system, a
systemd-nspawn machine) no partition node appears in /dev by itself, so it:

    makes every missing partition node   /dev/<part> from /sys/class/block/<part>/dev
    finds the boot partition             by PARTUUID, with ``blkid`` (util-linux)
    reads the boot record                `blockdev.write_boot_record`'s layout
    chooses the slot                     `abslots` (copied beside this file):
                                         the active one, or a new one tried once
                                         (its state written before it runs)
    extracts the node image              from that slot, its SHA-256 checked (a
                                         tried slot that does not match is given
                                         up at once: the active one boots)
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

import hashlib
import json
import os
import struct
import subprocess
import sys

try:
    from . import abslots  # imported as shepherd.agent.bootprep
except ImportError:  # run as a script, beside abslots.py
    import abslots  # type: ignore[no-redef,import-not-found]

RUN = "/run/metropolis"
MAGIC = b"MONOTRIO-BOOT1\n"


def make_nodes() -> None:
    for name in sorted(os.listdir("/sys/class/block")):
        base = f"/sys/class/block/{name}"
        path = f"/dev/{name}"
        if not os.path.exists(f"{base}/partition") or os.path.exists(path):
            continue
        with open(f"{base}/dev") as f:
            major, minor = (int(x) for x in f.read().split(":"))
        os.mknod(path, 0o600 | 0o060000, os.makedev(major, minor))


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


def main(boot_partuuid: str) -> int:
    make_nodes()
    boot_device = by_partuuid(boot_partuuid)
    header, parameters = read_record(boot_device)
    os.makedirs(RUN, mode=0o700, exist_ok=True)

    def extract(slot: str, image: abslots.SlotImage) -> None:
        digest = hashlib.sha256()
        source = by_partuuid(str(header[f"system_{slot}"]))
        with open(source, "rb") as src, open(f"{RUN}/image.pyz.tmp", "wb") as dst:
            left = image.size
            while left:
                chunk = src.read(min(left, 1 << 20))
                if not chunk:
                    raise abslots.SlotError(f"system {slot.upper()} is shorter than the image")
                digest.update(chunk)
                dst.write(chunk)
                left -= len(chunk)
        if digest.hexdigest() != image.sha256:
            raise abslots.SlotError(
                f"the image on system {slot.upper()} does not match its SHA-256"
            )
        os.replace(f"{RUN}/image.pyz.tmp", f"{RUN}/image.pyz")

    def installed() -> abslots.SlotState:
        size, want = int(str(header["image_bytes"])), str(header["image_sha256"])
        return abslots.initial(abslots.SlotImage(want, size))

    try:
        abslots.boot(abslots.DeviceStore(boot_device), installed, extract, RUN)
    except abslots.SlotError as exc:
        raise SystemExit(f"bootprep: {exc}") from None
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
    sys.exit(main(sys.argv[1]))
