"""The partition table of an installed disk: a GPT of four partitions.

Boot, system A, system B and data, of fixed type GUIDs and the sizes of
`Layout` (Monogon's by default; data takes the rest), written by sfdisk and
read back with ``sfdisk --json`` (`partition`).
"""

from __future__ import annotations

import dataclasses
import json

from .blockdev import MIB, DeviceFailed, partition_nodes, run

# Fixed partition type GUIDs: the EFI system partition's, and the project's own.
TYPE_BOOT = "C12A7328-F81F-11D2-BA4B-00A0C93EC93B"
TYPE_SYSTEM = "7E5F4C1A-2B6D-4E1F-9A3C-6D0B5E8F1A21"
TYPE_DATA = "3A9C7B52-1E4D-4F60-8B2A-5C7D9E0F1B34"
NAMES = ("boot", "system-a", "system-b", "data")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Partition sizes in MiB (Monogon's by default); data takes the rest."""

    boot_mib: int = 384
    system_mib: int = 4096
    data_min_mib: int = 128

    @property
    def min_bytes(self) -> int:
        # 1 MiB before the first partition and 1 MiB for the backup GPT.
        return (2 + self.boot_mib + 2 * self.system_mib + self.data_min_mib) * MIB


@dataclasses.dataclass(frozen=True)
class Partitions:
    """The four partitions of an installed disk: device nodes and PARTUUIDs."""

    nodes: tuple[str, str, str, str]
    partuuids: tuple[str, str, str, str]


def read_table(device: str) -> dict[str, object]:
    """``sfdisk --json``'s partition table of ``device``."""
    table = json.loads(run(["sfdisk", "--json", device]))["partitiontable"]
    assert isinstance(table, dict)
    return table


def partition(device: str, layout: Layout) -> Partitions:
    """Write the GPT, read it back, make the partition nodes."""
    script = (
        "label: gpt\n"
        f"size={layout.boot_mib}MiB, type={TYPE_BOOT}, name={NAMES[0]}\n"
        f"size={layout.system_mib}MiB, type={TYPE_SYSTEM}, name={NAMES[1]}\n"
        f"size={layout.system_mib}MiB, type={TYPE_SYSTEM}, name={NAMES[2]}\n"
        f"type={TYPE_DATA}, name={NAMES[3]}\n"
    )
    run(["sfdisk", "--quiet", "--wipe", "always", device], script.encode())
    parts = read_table(device).get("partitions")
    want = (TYPE_BOOT, TYPE_SYSTEM, TYPE_SYSTEM, TYPE_DATA)
    if not isinstance(parts, list) or [p.get("type") for p in parts] != list(want):
        raise DeviceFailed(f"the partition table read back from {device} is not the one written")
    nodes = partition_nodes(device)
    if len(nodes) != 4:
        raise DeviceFailed(f"{device}: the kernel shows {len(nodes)} partitions, want 4")
    uuids = [str(p["uuid"]).lower() for p in parts]
    return Partitions(
        (nodes[0], nodes[1], nodes[2], nodes[3]), (uuids[0], uuids[1], uuids[2], uuids[3])
    )
