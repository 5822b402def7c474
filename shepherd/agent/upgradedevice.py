"""Upgrading a real disk: the new image written to its inactive slot, then
the slot activated (pointed at for the next boot, once).

The A/B machine itself (what is written when, what a crash leaves, what the
next boot does) is `abslots`'s; `upgrade.Upgrader` runs these steps as
requests ask::

    write       `write_device`: the inactive slot written raw, read back; the
                helpers and the boot check refreshed (`refresh_boot_entry`);
                nothing points at the slot (no boot runs it: a Shepherd asks
                every machine of a run for this at once)
    activate    `activate_device`: the slot read back again, and the slot
                state points at it for the next boot only
    outcome     after the reboot, `device_outcome` reads the try's outcome
                off the slot state (committed, rolled back, still staged)

Each step has crash points (`abslots.crash_point`) where a test kills the agent.
"""

from __future__ import annotations

import dataclasses
import json
import os

from . import abslots, blockdev, bootentry, bootrecord, gpt, realdisk
from .abslots import SlotError, SlotImage
from .errors import UpgradeFailed
from .wire import UPGRADE_COMMITTED, UPGRADE_FAILED, UPGRADE_ROLLED_BACK, UPGRADE_STAGED

#: The drop-in that tells the node unit where the boot info is (for a unit
#: written before the install set it).
DROP_IN = "metropolis-node.service.d/50-boot-info.conf"


@dataclasses.dataclass(frozen=True)
class DeviceDisk:
    """An installed block device: its partition nodes and the boot record."""

    device: str
    nodes: list[str]
    header: dict[str, object]
    record_end: int

    @property
    def store(self) -> abslots.DeviceStore:
        return abslots.DeviceStore(self.nodes[0], self.record_end)

    def installed(self) -> abslots.SlotState:
        """The state of a disk with none yet: slot a, as the install wrote it."""
        return abslots.initial(
            SlotImage(str(self.header["image_sha256"]), int(str(self.header["image_bytes"])))
        )

    def state(self) -> abslots.SlotState:
        return self.store.read() or self.installed()


def partition_nodes(device: str) -> list[str]:
    """The /dev nodes of ``device``'s partitions as the kernel knows them now
    (`blockdev.partition_node`): no udev needed, and no re-read of the table.
    (A re-read, ``partx -u``, of a disk whose data partition is mounted may
    give the other partitions new minor numbers; the install's
    `blockdev.partition_nodes` runs on a disk nothing uses.)"""
    name = blockdev.sys_name(os.stat(device).st_rdev)
    return [blockdev.partition_node(part) for part in blockdev.child_partitions(name)]


def open_device(device: str) -> DeviceDisk:
    """The installed disk ``device``; UpgradeFailed unless it is one an install wrote."""
    try:
        nodes = partition_nodes(device)
        header, params = bootrecord.read_boot_record(nodes[0]) if nodes else ({}, b"")
    except (OSError, ValueError, blockdev.DeviceFailed) as exc:
        raise UpgradeFailed(f"{device} holds no installed node: {exc}") from exc
    if len(nodes) != 4:
        raise UpgradeFailed(f"{device} has {len(nodes)} partitions, not an installed disk's 4")
    try:
        table = gpt.read_table(device).get("partitions")
    except (blockdev.DeviceFailed, ValueError, KeyError) as exc:
        raise UpgradeFailed(f"cannot read the partition table of {device}: {exc}") from exc
    names = ("boot", "system_a", "system_b", "data")
    uuids = [str(p.get("uuid", "")).lower() for p in table] if isinstance(table, list) else []
    if uuids != [str(header.get(n, "")) for n in names]:
        raise UpgradeFailed(f"the boot record of {device} does not name its partitions")
    record = len(bootrecord.MAGIC) + 16 + len(json.dumps(header, sort_keys=True).encode())
    return DeviceDisk(device, nodes, header, record + len(params))


def write_device(
    disk: DeviceDisk, image: str, digest: str, target: bootentry.Target
) -> tuple[str, int]:
    """Write ``image`` (hex SHA-256 ``digest``) to the inactive slot of ``disk``,
    read it back, and refresh the helpers and the boot check: (the slot, the
    image's size). Nothing points at the slot yet: no boot runs it, so this
    may happen on every machine of a run at once. UpgradeFailed if a try is
    under way, the write fails or reads back wrong."""
    state = disk.state()
    if state.next is not None:
        raise UpgradeFailed(f"a try of slot {state.next} is staged or under way on {disk.device}")
    slot = abslots.other(state.active)
    node = disk.nodes[1] if slot == "a" else disk.nodes[2]
    try:
        abslots.crash_point("upgrade-image")
        size = realdisk.write_image(image, node, digest)
        abslots.crash_point("upgrade-helpers")
        refresh_boot_entry(target, str(disk.header["boot"]))
    except (OSError, blockdev.DeviceFailed, SlotError) as exc:
        raise UpgradeFailed(f"writing slot {slot} of {disk.device}: {exc}") from exc
    return slot, size


def activate_device(
    disk: DeviceDisk, slot: str, digest: str, size: int, health_timeout: float
) -> None:
    """Point the next boot of ``disk`` at ``slot``, once (`abslots.stage`),
    after reading the slot back: it must still hold ``size`` bytes of SHA-256
    ``digest``. UpgradeFailed (nothing pointed at) otherwise, or if a try is
    under way, or the slot is the active one now."""
    state = disk.state()
    if state.next is not None:
        raise UpgradeFailed(f"a try of slot {state.next} is staged or under way on {disk.device}")
    if slot != abslots.other(state.active):
        raise UpgradeFailed(f"slot {slot} of {disk.device} is the active slot now")
    node = disk.nodes[1] if slot == "a" else disk.nodes[2]
    try:
        back = realdisk.sha256_of(node, size)
        if back != digest:
            raise UpgradeFailed(f"slot {slot} of {disk.device} holds SHA-256 {back}, not {digest}")
        abslots.crash_point("upgrade-state")
        disk.store.write(abslots.stage(state, SlotImage(digest, size), health_timeout))
        abslots.crash_point("upgrade-staged")
    except (OSError, blockdev.DeviceFailed, SlotError) as exc:
        raise UpgradeFailed(f"staging slot {slot} of {disk.device}: {exc}") from exc


def stage_device(
    disk: DeviceDisk,
    image: str,
    digest: str,
    health_timeout: float,
    target: bootentry.Target,
) -> str:
    """`write_device`, then `activate_device`: the slot, tried at the next boot.
    Steps and crash points as `abslots` draws them."""
    slot, size = write_device(disk, image, digest, target)
    activate_device(disk, slot, digest, size, health_timeout)
    return slot


def refresh_boot_entry(target: bootentry.Target, boot_partuuid: str) -> None:
    """The helpers and the boot check as this agent has them, and the node
    unit's boot info (a drop-in): what a try needs at boot, whatever agent
    installed the disk. Each file atomic; the check's symlink last."""
    from importlib import resources

    os.makedirs(target.helper_dir, exist_ok=True)
    for name in (*bootentry.HELPER_MODULES, bootentry.HELPER):
        data = resources.files(__package__).joinpath(name).read_bytes()
        abslots.write_file(os.path.join(target.helper_dir, name), data, 0o755)
    helper = os.path.join(target.helper_dir, bootentry.HELPER)
    check = abslots.check_unit(target.python, helper, boot_partuuid)
    abslots.write_file(os.path.join(target.systemd_root, abslots.CHECK_UNIT), check.encode())
    drop_in = os.path.join(target.systemd_root, DROP_IN)
    os.makedirs(os.path.dirname(drop_in), exist_ok=True)
    abslots.write_file(
        drop_in,
        (
            "[Service]\n"
            f"Environment=METROPOLIS_BOOT_INFO={bootentry.RUN}/{abslots.BOOT_INFO} "
            f"METROPOLIS_ANNOUNCE_HEALTHY={bootentry.RUN}/{abslots.HEALTHY}\n"
        ).encode(),
    )
    bootentry.enable(target, abslots.CHECK_UNIT)


def device_outcome(state: abslots.SlotState, digest: str) -> tuple[int, str]:
    """What a real disk's slot state says of the try of ``digest``: (state, detail)."""
    back = state.rolled_back
    if back is not None and back.sha256 == digest:
        return UPGRADE_ROLLED_BACK, f"went back to slot {state.active}: {back.cause}"
    held = state.slots.get(state.active)
    if state.next is None and held is not None and held.sha256 == digest:
        return UPGRADE_COMMITTED, f"slot {state.active} runs {digest[:12]} and is permanent"
    if state.next is not None:
        tried = "booted for its try" if state.trying == state.next else "tried at the next boot"
        return UPGRADE_STAGED, f"slot {state.next} is {tried}"
    return UPGRADE_FAILED, f"the slot state names no slot of {digest[:12]}"
