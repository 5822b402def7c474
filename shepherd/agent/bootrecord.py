"""The boot record: what a real install writes raw on the boot partition,
and what the agent and the boot read back.

MAGIC, a length-prefixed JSON header (the generation, the image's size and
digest, the four PARTUUIDs), the length-prefixed NodeParameters: python3
reads it at boot with no extra package (`bootprep` has its own reader); the
agent reads its header back at each heartbeat (`read_installed`) to tell
that the install is still there.
"""

from __future__ import annotations

import json
import os
import struct

from .blockdev import DeviceFailed, child_partitions, read_direct, read_sys, sys_name

MAGIC = b"MONOTRIO-BOOT1\n"


def write_boot_record(node: str, header: dict[str, object], parameters: bytes) -> None:
    """MAGIC, a length-prefixed JSON header, the length-prefixed NodeParameters."""
    blob = json.dumps(header, sort_keys=True).encode()
    data = (
        MAGIC
        + struct.pack(">Q", len(blob))
        + blob
        + struct.pack(">Q", len(parameters))
        + parameters
    )
    with open(node, "r+b") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def read_boot_record(node: str) -> tuple[dict[str, object], bytes]:
    """What `write_boot_record` wrote on ``node``, or DeviceFailed."""
    with open(node, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise DeviceFailed(f"{node} holds no boot record")
        (n,) = struct.unpack(">Q", f.read(8))
        header = json.loads(f.read(n))
        (m,) = struct.unpack(">Q", f.read(8))
        return header, f.read(m)


def read_installed(device: str) -> dict[str, object]:
    """The header of the boot record on ``device``'s first partition, read
    off the device (`blockdev.read_direct`); DeviceFailed saying what is missing
    (a disk emptied, wiped or written over since the install)."""
    name = sys_name(os.stat(device).st_rdev)
    parts = child_partitions(name)
    if not parts:
        raise DeviceFailed(f"{device} has no partition")
    start = int(read_sys(f"/sys/class/block/{parts[0]}/start")) * 512
    data = read_direct(device, start, 64 * 1024)
    if not data.startswith(MAGIC):
        raise DeviceFailed(f"{device} holds no boot record")
    (n,) = struct.unpack(">Q", data[len(MAGIC) : len(MAGIC) + 8])
    blob = data[len(MAGIC) + 8 : len(MAGIC) + 8 + n]
    try:
        header = json.loads(blob)
    except ValueError as exc:
        raise DeviceFailed(f"the boot record on {device} does not decode: {exc}") from exc
    if len(blob) != n or not isinstance(header, dict):
        raise DeviceFailed(f"the boot record on {device} does not decode")
    return header
