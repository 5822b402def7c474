"""The static provider: a fleet you already own, listed in a TOML file.

File format, one ``[[machine]]`` table per machine::

    [[machine]]
    id = "rack1-01"            # required, unique: the provider id in the BMDB
    address = "192.0.2.10"     # required: host name or IP address to dial
    port = 22                  # optional, default 22
    location = "fra1"          # optional

Anything else (an unknown key, a wrong type, a duplicate id) is rejected when
the file is loaded, with the file and line in the error, so that a typo such
as ``adress`` fails at start instead of leaving a machine unreachable.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from shepherd.providers.base import (
    Availability,
    Capability,
    Machine,
    MachineNotFound,
    ProviderError,
    ProviderUnsupported,
)

PROVIDER_TYPE = "Static"

_REQUIRED = {"id": str, "address": str}
_OPTIONAL = {"port": int, "location": str}
_KNOWN = sorted([*_REQUIRED, *_OPTIONAL])


class StaticFileError(ProviderError):
    """The machine list file is unreadable or invalid. The message names file and line."""


class StaticProvider:
    """Machines from a fixed list. Cannot create machines."""

    def __init__(self, machines: list[Machine]) -> None:
        self._machines: dict[str, Machine] = {}
        for machine in machines:
            if machine.id in self._machines:
                raise ValueError(f"duplicate machine id {machine.id!r}")
            self._machines[machine.id] = machine

    @classmethod
    def from_file(cls, path: Path) -> StaticProvider:
        """Load the machine list from ``path``; :class:`StaticFileError` if invalid."""
        return cls(load_machines(path))

    @property
    def type(self) -> str:
        return PROVIDER_TYPE

    @property
    def capabilities(self) -> frozenset[Capability]:
        return frozenset()

    async def list_machines(self) -> list[Machine]:
        return list(self._machines.values())

    async def get_machine(self, machine_id: str) -> Machine:
        try:
            return self._machines[machine_id]
        except KeyError:
            raise MachineNotFound(f"static provider has no machine {machine_id!r}") from None

    async def create_machine(self) -> Machine:
        raise ProviderUnsupported("the static provider cannot create machines")

    async def reboot(self, machine_id: str) -> None:
        raise ProviderUnsupported("the static provider cannot reboot machines")


def load_machines(path: Path) -> list[Machine]:
    """Parse and validate a static machine list file.

    Raises :class:`StaticFileError` with ``<path>:<line>: <problem>``.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise StaticFileError(f"{path}: cannot read machine list: {exc}") from exc
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        # tomllib's message already ends with "(at line N, column M)".
        raise StaticFileError(f"{path}: {exc}") from exc
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
        if machine_id in seen:
            raise StaticFileError(
                f"{path}:{lines.key(index, 'id')}: duplicate machine id {machine_id!r} "
                f"(first at line {seen[machine_id]})"
            )
        seen[machine_id] = lines.key(index, "id")
        machines.append(
            Machine(
                id=machine_id,
                address=table["address"],
                port=port,
                location=table.get("location"),
                # Listed by the operator for the Shepherd to take over.
                availability=Availability.KNOWN_UNUSED,
            )
        )
    return machines


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
