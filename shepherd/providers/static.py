"""The static provider: a fleet you already own, listed in a TOML file.

File format, one ``[[machine]]`` table per machine::

    [[machine]]
    id = "rack1-01"            # required, unique: the provider id in the BMDB
    address = "192.0.2.10"     # required: host name or IP address to dial
    port = 22                  # optional, default 22
    location = "fra1"          # optional
    bmc = "https://10.0.0.10/redfish/v1/Systems/1"   # optional: Redfish BMC

A machine with a ``bmc`` can be power-cycled and its power state read; the
BMC's credentials come from a separate file or the environment (see
:func:`shepherd.providers.redfish.load_credentials`), never from this file:
a BMC URL with user info in it is rejected.

Anything else (an unknown key, a wrong type, a duplicate id) is rejected when
the file is loaded, with the file and line in the error, so that a typo such
as ``adress`` fails at start instead of leaving a machine unreachable.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path

from shepherd.providers.base import (
    Availability,
    Capability,
    Machine,
    MachineNotFound,
    ProviderError,
    ProviderUnsupported,
)
from shepherd.providers.redfish import (
    BMCConfigError,
    BMCCredentials,
    RedfishClient,
    parse_system_url,
)

PROVIDER_TYPE = "Static"

#: Largest machine list accepted: thousands of machines fit in far less.
MAX_FILE_SIZE = 4 << 20

_MAX_ID_LENGTH = 255

logger = logging.getLogger("shepherd.providers.static")

_REQUIRED = {"id": str, "address": str}
_OPTIONAL = {"port": int, "location": str, "bmc": str}
_KNOWN = sorted([*_REQUIRED, *_OPTIONAL])


class StaticFileError(ProviderError):
    """The machine list file is unreadable or invalid. The message names file and line."""


class StaticProvider:
    """Machines from a fixed list. Cannot create machines.

    Machines with a BMC can be rebooted and refreshed (power state) over
    Redfish, using ``credentials``; the provider then has the REBOOT and
    REFRESH capabilities. ``bmc_timeout`` bounds each Redfish request and
    ``bmc_verify`` is the TLS verification setting for BMCs (see
    :class:`~shepherd.providers.redfish.RedfishClient`).
    """

    def __init__(
        self,
        machines: list[Machine],
        *,
        credentials: BMCCredentials | None = None,
        bmc_timeout: float = 10.0,
        bmc_verify: bool | str = True,
    ) -> None:
        self._machines: dict[str, Machine] = {}
        for machine in machines:
            if machine.id in self._machines:
                raise ValueError(f"duplicate machine id {machine.id!r}")
            self._machines[machine.id] = machine
        self._credentials = credentials or BMCCredentials()
        self._bmc_timeout = bmc_timeout
        self._bmc_verify = bmc_verify

    @classmethod
    def from_file(
        cls,
        path: Path,
        *,
        credentials: BMCCredentials | None = None,
        bmc_verify: bool | str = True,
    ) -> StaticProvider:
        """Load the machine list from ``path``; :class:`StaticFileError` if invalid."""
        return cls(load_machines(path), credentials=credentials, bmc_verify=bmc_verify)

    @property
    def type(self) -> str:
        return PROVIDER_TYPE

    @property
    def capabilities(self) -> frozenset[Capability]:
        if any(m.bmc for m in self._machines.values()):
            return frozenset({Capability.REBOOT, Capability.REFRESH})
        return frozenset()

    async def creation_slots(self) -> list[str]:
        return []

    async def refresh(self, machine_id: str) -> Machine:
        """The listed machine, with its BMC's power state if it has a BMC.

        Raises :class:`~shepherd.providers.redfish.BMCError` if the BMC fails.
        """
        machine = await self.get_machine(machine_id)
        if machine.bmc is None:
            return machine
        async with self._redfish() as redfish:
            power = await redfish.power_state(
                machine.bmc, self._credentials.for_machine(machine.id)
            )
        return replace(machine, power=power)

    def _redfish(self) -> RedfishClient:
        # A client per operation: BMC calls are rare (a reboot, an updater
        # pass), and nothing then has to be closed when the provider goes.
        return RedfishClient(timeout=self._bmc_timeout, verify=self._bmc_verify)

    async def list_machines(self) -> list[Machine]:
        return list(self._machines.values())

    async def get_machine(self, machine_id: str) -> Machine:
        try:
            return self._machines[machine_id]
        except KeyError:
            raise MachineNotFound(f"static provider has no machine {machine_id!r}") from None

    async def create_machine(self, slot: str) -> Machine:
        raise ProviderUnsupported("the static provider cannot create machines")

    async def reboot(self, machine_id: str) -> None:
        """Power-cycle the machine through its BMC.

        :class:`ProviderUnsupported` if the machine has no ``bmc``,
        :class:`~shepherd.providers.redfish.BMCError` if the BMC fails.
        """
        machine = await self.get_machine(machine_id)
        if machine.bmc is None:
            raise ProviderUnsupported(f"static machine {machine_id!r} has no BMC to reboot it")
        async with self._redfish() as redfish:
            await redfish.power_cycle(machine.bmc, self._credentials.for_machine(machine.id))

    async def release(self, machine_id: str) -> str:
        """Nothing to give back to a list: the BMDB marks the machine removed
        (a tombstone the provisioner never adds again)."""
        return (
            f"static machine {machine_id!r} marked removed in the BMDB "
            "(take it out of the machines file to stop listing it)"
        )


def load_machines(path: Path) -> list[Machine]:
    """Parse and validate a static machine list file.

    Raises :class:`StaticFileError` with ``<path>:<line>: <problem>``.
    """
    try:
        with path.open("rb") as f:
            data = f.read(MAX_FILE_SIZE + 1)
    except OSError as exc:
        raise StaticFileError(f"{path}: cannot read machine list: {exc.strerror}") from exc
    if len(data) > MAX_FILE_SIZE:
        raise StaticFileError(
            f"{path}: machine list is larger than {MAX_FILE_SIZE // (1 << 20)} MiB; refusing it"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise StaticFileError(f"{path}: machine list is not UTF-8: {exc}") from exc
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        # tomllib's message already ends with "(at line N, column M)".
        raise StaticFileError(f"{path}: {exc}") from exc
    except RecursionError:
        # tomllib parses nested arrays and inline tables recursively.
        raise StaticFileError(f"{path}: arrays or tables nested too deeply") from None
    lines = _KeyLines(text)
    for key in document:
        if key != "machine":
            raise StaticFileError(
                f"{path}:{lines.top_level(key)}: unknown top-level key {key!r}, want [[machine]]"
            )
    tables = document.get("machine", [])
    if not isinstance(tables, list):
        raise StaticFileError(f"{path}:{lines.top_level('machine')}: 'machine' must be [[machine]]")
    machines: list[Machine] = []
    seen: dict[str, int] = {}
    for index, table in enumerate(tables):
        where = f"{path}:{lines.header(index)}"
        if not isinstance(table, dict):
            raise StaticFileError(f"{where}: machine entry must be a table")
        for key, value in table.items():
            want = _REQUIRED.get(key) or _OPTIONAL.get(key)
            at = f"{path}:{lines.key(index, key)}"
            if want is None:
                raise StaticFileError(
                    f"{at}: unknown field {key!r} in machine #{index + 1} "
                    f"(known fields: {', '.join(_KNOWN)})"
                )
            # bool is an int subclass in Python; TOML's true is not a port.
            if not isinstance(value, want) or isinstance(value, bool):
                raise StaticFileError(
                    f"{at}: field {key!r} must be a {want.__name__}, got {value!r}"
                )
        for key in _REQUIRED:
            if not table.get(key):
                raise StaticFileError(f"{where}: machine #{index + 1} lacks required {key!r}")
        port = table.get("port", 22)
        if not 1 <= port <= 65535:
            raise StaticFileError(f"{path}:{lines.key(index, 'port')}: port {port} out of range")
        machine_id = table["id"]
        if len(machine_id) > _MAX_ID_LENGTH or not machine_id.isprintable():
            raise StaticFileError(
                f"{path}:{lines.key(index, 'id')}: machine id {machine_id[:_MAX_ID_LENGTH]!r} "
                f"must be printable text of at most {_MAX_ID_LENGTH} characters"
            )
        if not _is_host(table["address"]):
            raise StaticFileError(
                f"{path}:{lines.key(index, 'address')}: address {table['address'][:300]!r} "
                "is neither a host name nor an IP address"
            )
        if machine_id in seen:
            raise StaticFileError(
                f"{path}:{lines.key(index, 'id')}: duplicate machine id {machine_id!r} "
                f"(first at line {seen[machine_id]})"
            )
        seen[machine_id] = lines.key(index, "id")
        bmc = table.get("bmc")
        if bmc is not None:
            try:
                bmc = parse_system_url(bmc)
            except BMCConfigError as exc:
                raise StaticFileError(f"{path}:{lines.key(index, 'bmc')}: {exc}") from None
        machines.append(
            Machine(
                id=machine_id,
                address=table["address"],
                port=port,
                location=table.get("location"),
                bmc=bmc,
                # Listed by the operator for the Shepherd to take over.
                availability=Availability.KNOWN_UNUSED,
            )
        )
    if not machines:
        logger.warning("%s lists no machines; the static provider will provide none", path)
    return machines


def _is_host(address: str) -> bool:
    """A host name (RFC 1123 labels) or an IPv4/IPv6 literal: what we may dial."""
    try:
        ipaddress.ip_address(address)
    except ValueError:
        pass
    else:
        return True
    name = address.removesuffix(".")
    return 0 < len(name) <= 253 and all(_LABEL.fullmatch(label) for label in name.split("."))


_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?", re.ASCII)

_HEADER = re.compile(r"^\s*\[\[\s*machine\s*\]\]")
_TABLE = re.compile(r"^\s*\[")
_KEY = re.compile(r"""^\s*(?:"([^"]*)"|'([^']*)'|([A-Za-z0-9_-]+))\s*=""")


@dataclass
class _KeyLines:
    """Finds the line of a key in a TOML text, for error messages.

    tomllib returns plain dicts without positions, so this scans the text the
    simple way: ``[[machine]]`` headers and ``key =`` lines below them. For
    unusual layouts (inline tables) it falls back to the nearest header, or 1.
    """

    text: str

    def __post_init__(self) -> None:
        self._headers: list[int] = []
        self._keys: list[dict[str, int]] = []
        self._top: dict[str, int] = {}
        section: dict[str, int] | None = self._top
        for number, line in enumerate(self.text.splitlines(), start=1):
            if _HEADER.match(line):
                self._headers.append(number)
                self._keys.append({})
                section = self._keys[-1]
            elif _TABLE.match(line):
                section = None
                self._top.setdefault(line.strip().strip("[]").strip(), number)
            elif section is not None and (m := _KEY.match(line)):
                name = next(g for g in m.groups() if g is not None)
                section.setdefault(name, number)

    def header(self, index: int) -> int:
        return self._headers[index] if index < len(self._headers) else 1

    def key(self, index: int, name: str) -> int:
        if index < len(self._keys) and name in self._keys[index]:
            return self._keys[index][name]
        return self.header(index)

    def top_level(self, name: str) -> int:
        return self._top.get(name, 1)
