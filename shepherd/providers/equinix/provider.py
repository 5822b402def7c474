"""The Equinix Metal provider: project devices under a hostname prefix.

Machines are the project's devices whose hostname starts with the configured
prefix (other devices in the project are not ours and are never touched).
A machine's address is its public IPv4 address, else its public IPv6 one;
its location is the facility (else metro) code; its status follows the
device's ``state`` the way the seed's updater maps it.

New machines are deployed on the project's free, provisionable hardware
reservations (:meth:`EquinixProvider.creation_slots`), with the Shepherd's
SSH key, which :meth:`EquinixProvider.ensure_ssh_key` keeps registered in the
project under its label. A reservation whose deployment failed is set aside
for an hour (in memory: a restart forgets it, as in the seed).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from bmdb import ProviderStatus
from shepherd.providers.base import (
    Availability,
    Capability,
    Machine,
    MachineNotFound,
    ProviderError,
)
from shepherd.providers.equinix.client import (
    EquinixAPIError,
    EquinixClient,
    EquinixMalformedResponse,
)

logger = logging.getLogger("shepherd.providers.equinix")

PROVIDER_TYPE = "Equinix"

#: How long a reservation that failed to deploy is left alone.
SET_ASIDE_SECONDS = 3600.0

#: The seed's mapping of device states to provider statuses (its updater).
_STATES = {
    "active": ProviderStatus.RUNNING,
    "deleted": ProviderStatus.MISSING,
    "failed": ProviderStatus.PROVISIONING_FAILED_PERMANENT,
    "inactive": ProviderStatus.STOPPED,
    "powering_on": ProviderStatus.STOPPED,
    "powering_off": ProviderStatus.STOPPED,
    "queued": ProviderStatus.PROVISIONING,
    "provisioning": ProviderStatus.PROVISIONING,
    "reinstalling": ProviderStatus.PROVISIONING,
    "post_provisioning": ProviderStatus.PROVISIONING,
}


class EquinixConfigError(ProviderError):
    """An Equinix option is missing or unusable. The message names the option."""


@dataclass(frozen=True)
class EquinixConfig:
    """The seed's shared config (``SharedConfig``), plus the OS to deploy."""

    project_id: str
    ssh_key_label: str
    device_prefix: str
    os: str = "ubuntu_20_04"

    def check(self) -> None:
        """Raise :class:`EquinixConfigError` naming the first bad option.

        The seed's defaults for label and prefix contain ``FIXME`` so that an
        operator cannot run with them by accident; refuse them here.
        """
        if not self.project_id:
            raise EquinixConfigError("--equinix-project-id must be set")
        try:
            uuid.UUID(self.project_id)
        except ValueError:
            raise EquinixConfigError(
                f"--equinix-project-id {self.project_id!r} is not a project UUID"
            ) from None
        for option, value in (
            ("--equinix-ssh-key-label", self.ssh_key_label),
            ("--equinix-device-prefix", self.device_prefix),
        ):
            if not value:
                raise EquinixConfigError(f"{option} must be set")
            if "FIXME" in value:
                raise EquinixConfigError(f"{option} {value!r} still contains FIXME: set it")
        if not self.os:
            raise EquinixConfigError("--provisioner-os must be set")


class EquinixProvider:
    """Equinix Metal devices as Shepherd machines."""

    def __init__(
        self,
        client: EquinixClient,
        config: EquinixConfig,
        ssh_public_key: str,
        *,
        set_aside: float = SET_ASIDE_SECONDS,
        ssh_port: int = 22,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        config.check()
        self._ssh_port = ssh_port
        self._client = client
        self._config = config
        self._public_key = ssh_public_key.strip()
        self._set_aside = set_aside
        self._clock = clock
        self._bad_reservations: dict[str, float] = {}
        self._key_id: str | None = None

    @property
    def type(self) -> str:
        return PROVIDER_TYPE

    @property
    def capabilities(self) -> frozenset[Capability]:
        return frozenset({Capability.CREATE, Capability.REBOOT, Capability.REFRESH})

    @property
    def config(self) -> EquinixConfig:
        return self._config

    async def ensure_ssh_key(self) -> str:
        """Make the project's key under our label hold our public key; return its id.

        Creates it if missing, updates it if it holds another key. Raises
        :class:`EquinixError` (e.g. a 404 for a project that does not exist).
        """
        label = self._config.ssh_key_label
        for key in await self._client.list_ssh_keys(self._config.project_id):
            if key.get("label") == label:
                key_id = str(key["id"])
                if (key.get("key") or "").strip() != self._public_key:
                    logger.info("SSH key %r (%s): updating to our key", label, key_id)
                    await self._client.update_ssh_key(key_id, self._public_key)
                self._key_id = key_id
                return key_id
        created = await self._client.create_ssh_key(
            self._config.project_id, label, self._public_key
        )
        logger.info("SSH key %r: created as %s", label, created.get("id"))
        self._key_id = str(created["id"])
        return self._key_id

    async def list_machines(self) -> list[Machine]:
        devices = await self._client.list_devices(self._config.project_id)
        return [
            self._machine(d) for d in devices if str(d.get("hostname", "")).startswith(self._prefix)
        ]

    @property
    def _prefix(self) -> str:
        return self._config.device_prefix

    async def get_machine(self, machine_id: str) -> Machine:
        try:
            device = await self._client.get_device(machine_id)
        except EquinixAPIError as exc:
            if exc.status == 404:
                raise MachineNotFound(f"Equinix has no device {machine_id!r}") from exc
            raise
        machine = self._machine(device)
        if not str(device.get("hostname", "")).startswith(self._prefix):
            raise MachineNotFound(
                f"Equinix device {machine_id!r} is not ours (hostname lacks {self._prefix!r})"
            )
        return machine

    async def refresh(self, machine_id: str) -> Machine:
        return await self.get_machine(machine_id)

    async def creation_slots(self) -> list[str]:
        """Free provisionable reservations, minus those set aside after a failure."""
        now = self._clock()
        self._bad_reservations = {r: t for r, t in self._bad_reservations.items() if t > now}
        slots = []
        for reservation in await self._client.list_reservations(self._config.project_id):
            rid = reservation.get("id")
            if not isinstance(rid, str) or not reservation.get("provisionable"):
                continue
            if reservation.get("device") or rid in self._bad_reservations:
                continue
            slots.append(rid)
        return slots

    def set_aside(self, reservation_id: str) -> None:
        """Leave ``reservation_id`` out of :meth:`creation_slots` for a while."""
        until = self._clock() + self._set_aside
        self._bad_reservations[reservation_id] = until
        logger.warning("reservation %s: set aside for %.0fs", reservation_id, self._set_aside)

    async def create_machine(self, slot: str) -> Machine:
        """Deploy a device on reservation ``slot``; idempotent across retries.

        On failure the reservation is set aside (see :meth:`set_aside`) and
        the error raised.
        """
        try:
            key_id = self._key_id or await self.ensure_ssh_key()
            reservation = await self._client.get_reservation(slot)
            plan = (reservation.get("plan") or {}).get("slug")
            request = {
                "hostname": self._prefix + slot[:18],
                "operating_system": self._config.os,
                "plan": plan,
                "hardware_reservation_id": slot,
                "project_ssh_keys": [key_id],
                "tags": [],
            }
            device = await self._client.create_device(self._config.project_id, request)
            machine = self._machine(device)
        except ProviderError:
            self.set_aside(slot)
            raise
        logger.info("reservation %s: device %s created", slot, machine.id)
        return machine

    async def reboot(self, machine_id: str) -> None:
        await self.get_machine(machine_id)  # never reboot a device that is not ours
        await self._client.reboot_device(machine_id)

    async def release(self, machine_id: str) -> str:
        """Delete the device (its hardware reservation is free again); a device
        already gone counts as released."""
        try:
            device = await self._client.get_device(machine_id)
        except EquinixAPIError as exc:
            if exc.status == 404:
                return f"Equinix device {machine_id} already deleted"
            raise
        if not str(device.get("hostname", "")).startswith(self._prefix):
            # Never delete a device that is not ours.
            raise MachineNotFound(
                f"Equinix device {machine_id!r} is not ours (hostname lacks {self._prefix!r})"
            )
        await self._client.delete_device(machine_id)
        return f"Equinix device {machine_id} deleted"

    def _machine(self, device: dict[str, Any]) -> Machine:
        device_id = device.get("id")
        if not isinstance(device_id, str) or not device_id:
            raise EquinixMalformedResponse(f"device without an id: {str(device)[:120]}")
        state = device.get("state")
        status = _STATES.get(state) if isinstance(state, str) else None
        if status is None:
            logger.warning("device %s: unexpected state %r", device_id, state)
            status = ProviderStatus.UNKNOWN
        return Machine(
            id=device_id,
            address=_address(device),
            port=self._ssh_port,
            location=_code(device.get("facility")) or _code(device.get("metro")),
            availability=Availability.KNOWN_USED,
            failed=state == "failed",
            status=status,
        )


def _address(device: dict[str, Any]) -> str | None:
    """The public IPv4 address, else the public IPv6 one, else None."""
    addresses = device.get("ip_addresses") or []
    if not isinstance(addresses, list):
        return None
    for family in (4, 6):
        for a in addresses:
            if (
                isinstance(a, dict)
                and a.get("public")
                and a.get("address_family") == family
                and isinstance(a.get("address"), str)
            ):
                address: str = a["address"]
                return address
    return None


def _code(value: Any) -> str | None:
    if isinstance(value, dict) and isinstance(value.get("code"), str):
        code: str = value["code"]
        return code
    return None
