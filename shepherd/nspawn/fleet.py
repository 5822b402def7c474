"""A fleet of nspawn machines: root, network, disks, machines and their BMC.

``async with open_fleet(folder, count=3, authorized_keys=[key]) as fleet:``
builds (or reuses) the Debian root (`shepherd.nspawn.rootfs`), claims a
network slot with its bridge (`shepherd.nspawn.network`), gives machine i
a namespace, a veth, ``folder/machine-i/disk.img`` on a loop device
(`shepherd.nspawn.disk`) and an overlay root (`shepherd.nspawn.machine`),
serves one Redfish BMC for all of them on the host's loopback
(`shepherd.nspawn.bmc`), and, unless ``boot=False``, powers every machine
on and waits for its sshd. ``fleet.machines[i].spec.link.address`` is where
the Shepherd connects (port 22, user root); ``fleet.host_address`` is the
host's address on the bridge, where a machine reaches the host's servers;
``fleet.system_url(i)`` the machine's Redfish ComputerSystem URL.

Leaving the block, also on error or cancellation, stops everything in
order, shielded: each machine gets an orderly poweroff (forced after
``shutdown_timeout`` s), its overlay is unmounted and its loop device
detached, then the BMC stops and the bridge, veths and namespaces go. The
machines' folders stay (the caller owns ``folder``). Each step's failure
is logged and the others still run; the first is raised at the end.

Needs root, systemd-nspawn, mmdebstrap (first build only), losetup, ip.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import trio

from shepherd.nspawn.bmc import serve_bmc
from shepherd.nspawn.disk import LoopDisk
from shepherd.nspawn.machine import Machine, MachineSpec
from shepherd.nspawn.network import Network, claim_network
from shepherd.nspawn.rootfs import RootImage, ensure_root

__all__ = ["BMC_USERNAME", "DEFAULT_DISK_SIZE", "Fleet", "open_fleet"]

logger = logging.getLogger("shepherd.nspawn.fleet")

DEFAULT_DISK_SIZE = 1 << 30
BMC_USERNAME = "admin"


@dataclass
class Fleet:
    """A running fleet (see the module docstring)."""

    image: RootImage
    network: Network
    machines: list[Machine]
    disks: list[LoopDisk]
    bmc_url: str = ""
    bmc_username: str = BMC_USERNAME
    bmc_password: str = field(default="", repr=False)

    @property
    def host_address(self) -> str:
        return str(self.network.host_address)

    def address(self, index: int) -> str:
        return str(self.machines[index].spec.link.address)

    def system_id(self, index: int) -> str:
        return self.machines[index].spec.hostname

    def system_url(self, index: int) -> str:
        return f"{self.bmc_url}/redfish/v1/Systems/{self.system_id(index)}"


@asynccontextmanager
async def open_fleet(
    folder: Path,
    *,
    count: int,
    authorized_keys: Sequence[str],
    disk_size: int | Sequence[int] = DEFAULT_DISK_SIZE,
    cache: Path | None = None,
    boot: bool = True,
    boot_timeout: float = 120.0,
    shutdown_timeout: float = 30.0,
) -> AsyncIterator[Fleet]:
    """Run ``count`` machines under ``folder`` for the duration of the block.
    ``disk_size``: bytes of every machine's disk, or one size per machine."""
    if count < 1:
        raise ValueError(f"a fleet needs at least one machine, not {count}")
    sizes = [disk_size] * count if isinstance(disk_size, int) else list(disk_size)
    if len(sizes) != count:
        raise ValueError(f"{len(sizes)} disk sizes for {count} machines")
    image = await trio.to_thread.run_sync(ensure_root, cache)
    network = await trio.to_thread.run_sync(claim_network)
    fleet = Fleet(image, network, [], [], bmc_password=secrets.token_urlsafe(16))
    async with trio.open_nursery() as nursery:
        try:
            for index in range(count):
                link = await trio.to_thread.run_sync(network.add, index)
                mfolder = folder / f"machine-{index}"
                mfolder.mkdir(parents=True, exist_ok=True)
                disk = await trio.to_thread.run_sync(
                    LoopDisk.create, mfolder / "disk.img", sizes[index]
                )
                fleet.disks.append(disk)
                spec = MachineSpec(
                    name=f"mt{network.slot}-machine-{index}",
                    hostname=f"machine-{index}",
                    folder=mfolder,
                    image=image,
                    link=link,
                    disk=disk,
                    authorized_keys=tuple(authorized_keys),
                )
                fleet.machines.append(Machine(spec, nursery))
            by_id = {m.spec.hostname: m for m in fleet.machines}
            fleet.bmc_url = await nursery.start(
                serve_bmc, by_id, fleet.bmc_username, fleet.bmc_password
            )
            if boot:
                async with trio.open_nursery() as boots:
                    for machine in fleet.machines:
                        boots.start_soon(_boot, machine, boot_timeout)
            yield fleet
        finally:
            with trio.CancelScope(shield=True):
                await _stop(fleet, shutdown_timeout)
            nursery.cancel_scope.cancel()


async def _boot(machine: Machine, within: float) -> None:
    await machine.power_on()
    await machine.wait_sshd(within)


async def _stop(fleet: Fleet, shutdown_timeout: float) -> None:
    errors: list[BaseException] = []

    async def off(machine: Machine) -> None:
        try:
            await machine.shutdown(shutdown_timeout)
            await trio.to_thread.run_sync(machine.close)
        except Exception as exc:
            logger.exception("stopping machine %s failed", machine.spec.name)
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        for machine in fleet.machines:
            nursery.start_soon(off, machine)
    for disk in fleet.disks:
        try:
            await trio.to_thread.run_sync(disk.detach)
        except Exception as exc:
            logger.exception("detaching %s failed", disk.device)
            errors.append(exc)
    try:
        await trio.to_thread.run_sync(fleet.network.close)
    except Exception as exc:
        logger.exception("removing network slot %d failed", fleet.network.slot)
        errors.append(exc)
    if errors:
        raise errors[0]
