"""The agent's hardware report, as the BMDB stores it, decoded for an operator.

The stored bytes are a ``cloud.bmaas.server.api.AgentHardwareReport``: a
``cloud.agent.api.Node`` (field 1) and the agent's warnings (field 2), as the
agent sent them and the agent callback server checked them
(``shepherd/proto/agent_callback.proto`` and ``hwreport.proto``; the field
numbers are the reference's). ``bmdb machine`` and the console's machine
page show it, and neither may import the Shepherd, which holds the
generated classes (``tests/test_package_layers.py``): this module reads the
message by number (`common.protowire.wire_fields`) against the declaration
below, with `common.protobuf.parse_checked`'s judgement (known fields of
their declared wire type, strings UTF-8, a singular field at most once,
unknown fields skipped). ``tests/common/test_hwreport.py`` holds it to the
generated classes and to ``parse_checked``.

`decode` raises ``ValueError`` saying why bytes are no report (cut short,
written by something else, hostile): the views show ``unreadable: <why>``.

A report's texts are the agent's, so the machine's to choose: each is made
printable and bounded (`common.text.printable`, `MAX_TEXT` characters), and
each list keeps its first `MAX_LISTED` entries and counts the others, so that
no report makes a page or a terminal unbounded.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from common.protowire import FIXED32, LEN, VARINT, varint, wire_fields
from common.text import printable

__all__ = ["CPU", "MAX_LISTED", "MAX_TEXT", "NIC", "Disk", "HardwareReport", "decode", "size"]

#: Characters of one text of a report kept (escapes included).
MAX_TEXT = 200
#: Entries of one list (CPUs, disks, NICs, warnings) kept.
MAX_LISTED = 256

_PROTOCOLS = {0: "", 1: "SCSI", 2: "ATA", 3: "NVMe", 4: "MMC"}
_EFI = {0: "invalid", 1: "unknown", 2: "unsupported", 3: "supported", 4: "enabled"}


def size(n: int) -> str:
    """A size in bytes as binary units, as ``lsblk`` and ``free -h`` count:
    ``447.1 GiB``, ``512 B``."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 1024 or unit == "PiB":
            break
    return f"{value:.1f} {unit}"


def _speed(bytes_per_second: int) -> str:
    bits = bytes_per_second * 8
    for unit, scale in (("Tbit/s", 10**12), ("Gbit/s", 10**9), ("Mbit/s", 10**6)):
        if bits >= scale:
            return f"{bits / scale:g} {unit}"
    return f"{bits} bit/s"


@dataclass(frozen=True)
class CPU:
    """One socket."""

    vendor: str
    model: str
    cores: int
    threads: int


@dataclass(frozen=True)
class Disk:
    """A block device; ``name`` is what an installation's ``--root-device``
    takes (its serial number, or the kernel name of a disk without one)."""

    name: str
    capacity_bytes: int
    vendor: str
    model: str
    rotational: bool
    #: ``SCSI``, ``ATA``, ``NVMe``, ``MMC``; empty if unknown.
    protocol: str

    @property
    def size(self) -> str:
        return size(self.capacity_bytes)

    @property
    def description(self) -> str:
        """``ATA SAMSUNG MZ7LH480, SSD`` (what is known of it)."""
        what = " ".join(t for t in (self.vendor, self.model) if t) or "unknown model"
        kind = " ".join(t for t in (self.protocol, "HDD" if self.rotational else "") if t)
        return f"{what}, {kind}" if kind else what


@dataclass(frozen=True)
class NIC:
    """A network interface."""

    #: ``aa:bb:cc:dd:ee:ff``, or ``-`` if none was reported.
    mac: str
    driver: str
    link_up: bool
    speed_bytes: int

    @property
    def description(self) -> str:
        """``driver ixgbe, link up, 10 Gbit/s``."""
        parts = [f"driver {self.driver}" if self.driver else "no driver reported"]
        parts.append("link up" if self.link_up else "link down")
        if self.speed_bytes > 0:
            parts.append(_speed(self.speed_bytes))
        return ", ".join(parts)


@dataclass(frozen=True)
class HardwareReport:
    """What an agent reported of its machine (see the module)."""

    manufacturer: str
    product: str
    serial_number: str
    #: EFI firmware: ``enabled``, ``supported``, ``unsupported``, ``unknown``, ...
    efi: str
    memory_installed_bytes: int
    #: Share of the installed memory the kernel can use (0..1, as reported).
    memory_usable_ratio: float
    cpus: tuple[CPU, ...]
    disks: tuple[Disk, ...]
    nics: tuple[NIC, ...]
    #: The agent's warnings on what it could not read.
    warnings: tuple[str, ...]
    #: Entries of each list past `MAX_LISTED`, left out.
    more_cpus: int = 0
    more_disks: int = 0
    more_nics: int = 0
    more_warnings: int = 0

    @property
    def machine(self) -> str:
        """``Supermicro SYS-1029P, serial S123, EFI enabled``."""
        name = " ".join(t for t in (self.manufacturer, self.product) if t) or "unknown machine"
        serial = f", serial {self.serial_number}" if self.serial_number else ""
        return f"{name}{serial}, EFI {self.efi}"

    @property
    def cpu_summary(self) -> str:
        """``2 sockets, 40 cores, 80 threads: 2 x Intel(R) Xeon(R) Gold 6230``."""
        if not self.cpus:
            return "none reported"
        sockets = len(self.cpus) + self.more_cpus
        cores = sum(c.cores for c in self.cpus)
        threads = sum(c.threads for c in self.cpus)
        models: dict[str, int] = {}
        for cpu in self.cpus:
            model = cpu.model or cpu.vendor or "unknown model"
            models[model] = models.get(model, 0) + 1
        named = ", ".join(f"{n} x {m}" if n > 1 else m for m, n in models.items())
        counted = "" if self.more_cpus == 0 else f" (of the first {len(self.cpus)})"
        plural = "socket" if sockets == 1 else "sockets"
        return f"{sockets} {plural}, {cores} cores, {threads} threads{counted}: {named}"

    @property
    def memory(self) -> str:
        """``192.0 GiB installed, 98% usable``."""
        if self.memory_installed_bytes <= 0:
            return "none reported"
        ratio = self.memory_usable_ratio
        usable = f", {ratio:.0%} usable" if math.isfinite(ratio) and 0 < ratio <= 1 else ""
        return f"{size(self.memory_installed_bytes)} installed{usable}"

    def lines(self) -> list[tuple[str, str]]:
        """The report as (label, text) lines, for a terminal."""
        out = [
            ("hardware", self.machine),
            ("cpus", self.cpu_summary),
            ("memory", self.memory),
        ]
        out += [("disk", f"{d.name or '-'}: {d.size}, {d.description}") for d in self.disks]
        if self.more_disks:
            out.append(("disk", f"... and {self.more_disks} more"))
        if not self.disks:
            out.append(("disks", "none reported"))
        out += [("nic", f"{n.mac}: {n.description}") for n in self.nics]
        if self.more_nics:
            out.append(("nic", f"... and {self.more_nics} more"))
        if not self.nics:
            out.append(("nics", "none reported"))
        out += [("report warning", w) for w in self.warnings]
        if self.more_warnings:
            out.append(("report warning", f"... and {self.more_warnings} more"))
        return out

    def to_json(self) -> dict[str, object]:
        ratio = self.memory_usable_ratio
        return {
            "manufacturer": self.manufacturer,
            "product": self.product,
            "serial_number": self.serial_number,
            "efi": self.efi,
            "memory_installed_bytes": self.memory_installed_bytes,
            # JSON has no NaN or infinity: a ratio that is none is null.
            "memory_usable_ratio": ratio if math.isfinite(ratio) else None,
            "cpus": [
                {"vendor": c.vendor, "model": c.model, "cores": c.cores, "threads": c.threads}
                for c in self.cpus
            ],
            "disks": [
                {
                    "name": d.name,
                    "capacity_bytes": d.capacity_bytes,
                    "vendor": d.vendor,
                    "model": d.model,
                    "rotational": d.rotational,
                    "protocol": d.protocol,
                }
                for d in self.disks
            ],
            "nics": [
                {
                    "mac": n.mac,
                    "driver": n.driver,
                    "link_up": n.link_up,
                    "speed_bytes": n.speed_bytes,
                }
                for n in self.nics
            ],
            "warnings": list(self.warnings),
            "left_out": {
                "cpus": self.more_cpus,
                "disks": self.more_disks,
                "nics": self.more_nics,
                "warnings": self.more_warnings,
            },
        }


# --- the declaration, by field number ------------------------------------------

_STR, _BYTES, _INT64, _INT32, _BOOL, _ENUM, _FLOAT, _MSG = range(8)
_WIRE = {
    _STR: LEN,
    _BYTES: LEN,
    _MSG: LEN,
    _INT64: VARINT,
    _INT32: VARINT,
    _BOOL: VARINT,
    _ENUM: VARINT,
    _FLOAT: FIXED32,
}


@dataclass(frozen=True)
class _Field:
    name: str
    kind: int
    repeated: bool = False
    #: For a message field: its fields by number.
    message: dict[int, _Field] | None = None


_X86_64 = {1: _Field("family", _INT32), 2: _Field("model", _INT32), 3: _Field("stepping", _INT32)}
_CPU = {
    1: _Field("x86_64", _MSG, message=_X86_64),
    9: _Field("hardware_threads", _INT32),
    8: _Field("cores", _INT32),
    10: _Field("vendor", _STR),
    11: _Field("model", _STR),
}
_BLOCK_DEVICE = {
    1: _Field("vendor", _STR),
    2: _Field("device_model", _STR),
    3: _Field("serial_number", _STR),
    4: _Field("wwn", _BYTES),
    5: _Field("rotational", _BOOL),
    6: _Field("capacity_bytes", _INT64),
    7: _Field("logical_block_size_bytes", _INT32),
    8: _Field("physical_block_size_bytes", _INT32),
    9: _Field("protocol", _ENUM),
    10: _Field("critical_warning", _BOOL),
    11: _Field("media_errors", _INT64),
    12: _Field("available_spare_ratio", _FLOAT),
    13: _Field("usage_ratio", _FLOAT),
}
_NIC = {
    1: _Field("mac", _BYTES),
    2: _Field("driver", _STR),
    3: _Field("supported_speed_bytes", _INT64, repeated=True),
    4: _Field("link_up", _BOOL),
    5: _Field("current_speed_bytes", _INT64),
}
_NODE = {
    1: _Field("manufacturer", _STR),
    2: _Field("product", _STR),
    3: _Field("serial_number", _STR),
    13: _Field("efi_support", _ENUM),
    8: _Field("memory_installed_bytes", _INT64),
    9: _Field("memory_usable_ratio", _FLOAT),
    10: _Field("cpu", _MSG, repeated=True, message=_CPU),
    11: _Field("block_device", _MSG, repeated=True, message=_BLOCK_DEVICE),
    12: _Field("network_interface", _MSG, repeated=True, message=_NIC),
}
_REPORT = {
    1: _Field("report", _MSG, message=_NODE),
    2: _Field("warning", _STR, repeated=True),
}

_Value = str | bytes | int | float | bool | dict[str, object]


def _signed(value: int, bits: int) -> int:
    """A varint's number as protobuf's intN reads it (two's complement, cut to ``bits``)."""
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >> (bits - 1) else value


def _scalar(field: _Field, raw: int | bytes, where: str) -> _Value:
    kind = field.kind
    if kind == _STR:
        assert isinstance(raw, bytes)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{where}: not UTF-8") from None
    if kind == _BYTES:
        assert isinstance(raw, bytes)
        return raw
    if kind == _FLOAT:
        assert isinstance(raw, bytes)
        return float(struct.unpack("<f", raw)[0])
    if kind == _MSG:
        assert isinstance(raw, bytes) and field.message is not None
        return _message(raw, field.message, where)
    assert isinstance(raw, int)
    if kind == _BOOL:
        return raw != 0
    if kind == _INT64:
        return _signed(raw, 64)
    return _signed(raw, 32)  # int32 and enums


def _message(data: bytes, declared: dict[int, _Field], where: str) -> dict[str, object]:
    """The declared fields of one message: a singular one's value (absent if
    not set), a repeated one's list (absent if empty); unknown fields skipped."""
    out: dict[str, object] = {}
    lists: dict[str, list[object]] = {}
    for number, wire_type, raw in wire_fields(data):
        field = declared.get(number)
        if field is None:
            continue  # a newer agent's field: protobuf's readers skip it
        here = f"{where}.{field.name}"
        if field.repeated:
            values = lists.setdefault(field.name, [])
            if wire_type == LEN and _WIRE[field.kind] == VARINT:  # packed
                assert isinstance(raw, bytes)
                values += [_scalar(field, item, here) for item in _varints(raw, here)]
                continue
        if wire_type != _WIRE[field.kind]:
            raise ValueError(f"{here}: wire type {wire_type}, not the declared one")
        value = _scalar(field, raw, here)
        if field.repeated:
            lists[field.name].append(value)
        elif field.name in out:
            raise ValueError(f"{here}: set twice")
        else:
            out[field.name] = value
    return out | lists


def _varints(payload: bytes, where: str) -> list[int]:
    """The numbers of a packed run of varints."""
    out = []
    pos = 0
    while pos < len(payload):
        try:
            value, pos = varint(payload, pos)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        out.append(value)
    return out


def _text(value: object) -> str:
    return printable(value if isinstance(value, str) else "", MAX_TEXT)


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _mac(value: object) -> str:
    if not isinstance(value, bytes) or not value:
        return "-"
    if len(value) > 32:
        return f"{value[:32].hex(':')}... ({len(value)} bytes)"
    return value.hex(":")


def _as_list(value: object) -> list[object]:
    return value if isinstance(value, list) else []


def _listed(value: object) -> tuple[list[dict[str, object]], int]:
    """The first `MAX_LISTED` embedded messages of a repeated field, and how many more."""
    items = [item for item in _as_list(value) if isinstance(item, dict)]
    return items[:MAX_LISTED], max(0, len(items) - MAX_LISTED)


def decode(data: bytes) -> HardwareReport:
    """The report stored as ``data`` (an AgentHardwareReport's bytes).

    `ValueError` saying why, if they are not one (see the module). Pure.
    """
    top = _message(data, _REPORT, "AgentHardwareReport")
    node = top.get("report")
    if not isinstance(node, dict):
        raise ValueError("AgentHardwareReport without a report")
    cpus, more_cpus = _listed(node.get("cpu"))
    disks, more_disks = _listed(node.get("block_device"))
    nics, more_nics = _listed(node.get("network_interface"))
    warnings = [w for w in _as_list(top.get("warning")) if isinstance(w, str)]
    efi = _int(node.get("efi_support"))
    ratio = node.get("memory_usable_ratio", 0.0)
    return HardwareReport(
        manufacturer=_text(node.get("manufacturer")),
        product=_text(node.get("product")),
        serial_number=_text(node.get("serial_number")),
        efi=_EFI.get(efi, f"of unknown kind {efi}"),
        memory_installed_bytes=_int(node.get("memory_installed_bytes")),
        memory_usable_ratio=ratio if isinstance(ratio, float) else 0.0,
        cpus=tuple(
            CPU(
                vendor=_text(c.get("vendor")),
                model=_text(c.get("model")),
                cores=_int(c.get("cores")),
                threads=_int(c.get("hardware_threads")),
            )
            for c in cpus
        ),
        disks=tuple(
            Disk(
                name=_text(d.get("serial_number")),
                capacity_bytes=_int(d.get("capacity_bytes")),
                vendor=_text(d.get("vendor")),
                model=_text(d.get("device_model")),
                rotational=d.get("rotational") is True,
                protocol=_PROTOCOLS.get(_int(d.get("protocol")), "unknown protocol"),
            )
            for d in disks
        ),
        nics=tuple(
            NIC(
                mac=_mac(n.get("mac")),
                driver=_text(n.get("driver")),
                link_up=n.get("link_up") is True,
                speed_bytes=_int(n.get("current_speed_bytes")),
            )
            for n in nics
        ),
        warnings=tuple(printable(w, MAX_TEXT * 2) for w in warnings[:MAX_LISTED]),
        more_cpus=more_cpus,
        more_disks=more_disks,
        more_nics=more_nics,
        more_warnings=max(0, len(warnings) - MAX_LISTED),
    )
