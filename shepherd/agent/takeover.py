#!/usr/bin/env python3
"""The takeover agent: the program the Shepherd initializer uploads and runs.

It runs on a freshly provided machine that may have nothing but ``python3``, so
this file is deliberately self-contained: standard library only, no imports
from the rest of the ``shepherd`` package, no third-party protobuf runtime.

Protocol (one exchange, then exit)::

    initializer --stdin-->  TakeoverInit {machine_id, bmaas_endpoint, ca_certificate}
                            |
                            v  validate (empty endpoint is refused)
                            v  load or create the Ed25519 key beside this file
    initializer <-stdout--  TakeoverResponse {success {init_message, key, warning*}}
                         or TakeoverResponse {error {message}}

The exit status is 0 whenever a ``TakeoverResponse`` was written, error or not:
the response is the result, and the initializer reads it whatever the status.

With ``--heartbeat-interval SECONDS`` (the initializer always passes it) a
successful takeover does not end the agent: after writing the response it
detaches (double fork, new session, stdio to ``<this file>.log``), so the SSH
session ends, and heartbeats to ``bmaas_endpoint`` until killed (see
"Heartbeats" below). Without it the agent only answers, as it always did.

Key storage: the 32-byte Ed25519 private seed lives in ``<this file>.key``,
mode 0600, created atomically on first run and reused on every later run (the
key is the machine's identity towards the BMaaS endpoint, so it must survive
re-runs of the takeover). A key file that exists but is not 32 bytes is an
error, never silently replaced.

Why Ed25519 in pure Python instead of ``ssh-keygen``: the target promises only
``python3``; ``ssh-keygen`` may be missing, and pulling the raw public key out
of its OpenSSH container format would be more code than deriving it. Public
key derivation (RFC 8032, section 5.1.5) is one scalar multiplication over
edwards25519; it is tested against ``cryptography``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import hmac
import os
import secrets
import signal
import stat
import struct
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import http.client
    import ssl

# The heartbeat's modules (http.client, ssl, urllib.parse, base64, random)
# are imported where the heartbeat starts, not here: the takeover exchange
# is on the initializer's critical path, and they would about double this
# script's start-up time.

# --------------------------------------------------------------------------
# Protobuf wire codec for cloud.agent.api (see shepherd/proto/agent.proto).
#
# Only what the takeover messages use: varints, and length-delimited fields
# (strings, bytes, embedded messages). Encoding follows proto3 rules that every
# implementation shares: fields in field-number order, scalar fields with their
# default value (empty string/bytes) omitted, a set oneof member always written
# (even when empty). Decoding skips unknown fields of any wire type, and the
# last occurrence of a singular field wins, as the spec says.
# --------------------------------------------------------------------------

WIRE_VARINT = 0
WIRE_I64 = 1
WIRE_LEN = 2
WIRE_I32 = 5


class DecodeError(ValueError):
    """The bytes are not a valid encoding of the expected message."""


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _decode_varint(data: bytes, pos: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while True:
        if pos >= len(data):
            raise DecodeError("truncated varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift >= 64:
            raise DecodeError("varint longer than 10 bytes")


def _len_field(number: int, payload: bytes) -> bytes:
    return _encode_varint(number << 3 | WIRE_LEN) + _encode_varint(len(payload)) + payload


def _varint_field(number: int, value: int) -> bytes:
    """A varint field (int32/int64/bool/enum); negatives as 64-bit two's complement."""
    return _encode_varint(number << 3 | WIRE_VARINT) + _encode_varint(value & (2**64 - 1))


def _float_field(number: int, value: float) -> bytes:
    return _encode_varint(number << 3 | WIRE_I32) + struct.pack("<f", value)


def iter_fields(data: bytes) -> list[tuple[int, int, bytes | int]]:
    """Split a message into (field number, wire type, value) triples."""
    fields: list[tuple[int, int, bytes | int]] = []
    pos = 0
    while pos < len(data):
        key, pos = _decode_varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if number == 0:
            raise DecodeError("field number 0")
        value: bytes | int
        if wire_type == WIRE_VARINT:
            value, pos = _decode_varint(data, pos)
        elif wire_type == WIRE_LEN:
            length, pos = _decode_varint(data, pos)
            if pos + length > len(data):
                raise DecodeError(f"field {number}: length {length} past end of message")
            value = data[pos : pos + length]
            pos += length
        elif wire_type == WIRE_I64:
            if pos + 8 > len(data):
                raise DecodeError(f"field {number}: truncated fixed64")
            value = data[pos : pos + 8]
            pos += 8
        elif wire_type == WIRE_I32:
            if pos + 4 > len(data):
                raise DecodeError(f"field {number}: truncated fixed32")
            value = data[pos : pos + 4]
            pos += 4
        else:
            raise DecodeError(f"field {number}: unsupported wire type {wire_type}")
        fields.append((number, wire_type, value))
    return fields


def _as_len(number: int, wire_type: int, value: bytes | int) -> bytes:
    if wire_type != WIRE_LEN or not isinstance(value, bytes):
        raise DecodeError(f"field {number}: wire type {wire_type}, want length-delimited")
    return value


def _as_str(number: int, wire_type: int, value: bytes | int) -> str:
    try:
        return _as_len(number, wire_type, value).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DecodeError(f"field {number}: string is not UTF-8") from exc


@dataclasses.dataclass(frozen=True)
class TakeoverInit:
    """cloud.agent.api.TakeoverInit."""

    machine_id: str = ""
    bmaas_endpoint: str = ""
    ca_certificate: bytes = b""

    def encode(self) -> bytes:
        out = b""
        if self.machine_id:
            out += _len_field(1, self.machine_id.encode("utf-8"))
        if self.bmaas_endpoint:
            out += _len_field(2, self.bmaas_endpoint.encode("utf-8"))
        if self.ca_certificate:
            out += _len_field(3, self.ca_certificate)
        return out

    @classmethod
    def decode(cls, data: bytes) -> TakeoverInit:
        machine_id, endpoint, ca = "", "", b""
        for number, wire_type, value in iter_fields(data):
            if number == 1:
                machine_id = _as_str(number, wire_type, value)
            elif number == 2:
                endpoint = _as_str(number, wire_type, value)
            elif number == 3:
                ca = _as_len(number, wire_type, value)
        return cls(machine_id, endpoint, ca)


def encode_success(init_message: bytes, key: bytes, warnings: list[str]) -> bytes:
    """TakeoverResponse{success: TakeoverSuccess{init_message, key, warning}}.

    ``init_message`` is an already encoded TakeoverInit, so the agent can echo
    exactly the bytes it was given.
    """
    success = _len_field(1, init_message)
    if key:
        success += _len_field(2, key)
    for warning in warnings:
        # Repeated fields write every element, empty ones included.
        success += _len_field(3, warning.encode("utf-8"))
    return _len_field(1, success)


def encode_error(message: str) -> bytes:
    """TakeoverResponse{error: TakeoverError{message}}."""
    error = _len_field(1, message.encode("utf-8")) if message else b""
    return _len_field(2, error)


# --------------------------------------------------------------------------
# Ed25519 public key derivation, RFC 8032 section 5.1.5.
#
# Points are in extended homogeneous coordinates (X, Y, Z, T) with x = X/Z,
# y = Y/Z, x*y = T/Z, using the unified addition formula (RFC 8032 5.1.4),
# which is also correct for doubling. Not constant time: it runs once per
# key on a machine nobody else is using yet.
# --------------------------------------------------------------------------

_P = 2**255 - 19
_D = -121665 * pow(121666, _P - 2, _P) % _P
_BY = 4 * pow(5, _P - 2, _P) % _P
_BX = 15112221349535400772501151409588531511454012693041857206046113283949847762202
_BASE = (_BX, _BY, 1, _BX * _BY % _P)

_Point = tuple[int, int, int, int]


def _point_add(p: _Point, q: _Point) -> _Point:
    a = (p[1] - p[0]) * (q[1] - q[0]) % _P
    b = (p[1] + p[0]) * (q[1] + q[0]) % _P
    c = 2 * p[3] * q[3] * _D % _P
    d = 2 * p[2] * q[2] % _P
    e, f, g, h = b - a, d - c, d + c, b + a
    return (e * f % _P, g * h % _P, f * g % _P, e * h % _P)


def _scalar_mult(scalar: int, point: _Point) -> _Point:
    result: _Point = (0, 1, 1, 0)  # the neutral element
    while scalar:
        if scalar & 1:
            result = _point_add(result, point)
        point = _point_add(point, point)
        scalar >>= 1
    return result


def ed25519_public_key(seed: bytes) -> bytes:
    """Return the 32-byte Ed25519 public key for a 32-byte private seed."""
    if len(seed) != 32:
        raise ValueError(f"Ed25519 seed must be 32 bytes, got {len(seed)}")
    digest = hashlib.sha512(seed).digest()
    scalar = int.from_bytes(digest[:32], "little")
    scalar &= (1 << 254) - 8  # clear the 3 low bits and bit 255
    scalar |= 1 << 254
    x, y, z, _ = _scalar_mult(scalar, _BASE)
    z_inv = pow(z, _P - 2, _P)
    x, y = x * z_inv % _P, y * z_inv % _P
    return int.to_bytes(y | (x & 1) << 255, 32, "little")


#: The order of the edwards25519 base point.
_L = 2**252 + 27742317777372353535851937790883648493


def _encode_point(p: _Point) -> bytes:
    x, y, z, _ = p
    z_inv = pow(z, _P - 2, _P)
    x, y = x * z_inv % _P, y * z_inv % _P
    return int.to_bytes(y | (x & 1) << 255, 32, "little")


def ed25519_sign(seed: bytes, message: bytes) -> bytes:
    """The 64-byte Ed25519 signature of ``message`` (RFC 8032 section 5.1.6).

    Deterministic, like every Ed25519 signer: the same key and message give
    the same signature, which the test vectors and ``cryptography`` check.
    """
    if len(seed) != 32:
        raise ValueError(f"Ed25519 seed must be 32 bytes, got {len(seed)}")
    digest = hashlib.sha512(seed).digest()
    scalar = int.from_bytes(digest[:32], "little")
    scalar &= (1 << 254) - 8
    scalar |= 1 << 254
    public = _encode_point(_scalar_mult(scalar, _BASE))
    r = int.from_bytes(hashlib.sha512(digest[32:] + message).digest(), "little") % _L
    big_r = _encode_point(_scalar_mult(r, _BASE))
    k = int.from_bytes(hashlib.sha512(big_r + public + message).digest(), "little") % _L
    return big_r + int.to_bytes((r + k * scalar) % _L, 32, "little")


# --------------------------------------------------------------------------
# The hardware report (cloud.agent.api.Node, see shepherd/proto/hwreport.proto),
# read from /proc and /sys. Every probe is best effort: what cannot be read
# is left out and said in a warning, never fatal, because a report with gaps
# is still worth more to the operator than none.
# --------------------------------------------------------------------------

EFI_SUPPORT_UNKNOWN = 1
EFI_SUPPORT_ENABLED = 4
PROTOCOL_UNKNOWN, PROTOCOL_SCSI, PROTOCOL_NVME, PROTOCOL_MMC = 0, 1, 3, 4


@dataclasses.dataclass
class HwCPU:
    """cloud.agent.api.CPU; ``family``/``model_number``/``stepping`` only on x86_64."""

    vendor: str = ""
    model: str = ""
    cores: int = 0
    hardware_threads: int = 0
    x86_64: tuple[int, int, int] | None = None  # (family, model, stepping)

    def encode(self) -> bytes:
        out = b""
        if self.x86_64 is not None:
            x86 = b""
            for number, value in enumerate(self.x86_64, start=1):
                if value:
                    x86 += _varint_field(number, value)
            out += _len_field(1, x86)  # a set oneof member is written even if empty
        if self.cores:
            out += _varint_field(8, self.cores)
        if self.hardware_threads:
            out += _varint_field(9, self.hardware_threads)
        if self.vendor:
            out += _len_field(10, self.vendor.encode("utf-8"))
        if self.model:
            out += _len_field(11, self.model.encode("utf-8"))
        return out


@dataclasses.dataclass
class HwBlockDevice:
    """cloud.agent.api.BlockDevice (the fields /sys tells without SMART)."""

    vendor: str = ""
    device_model: str = ""
    serial_number: str = ""
    wwn: bytes = b""
    rotational: bool = False
    capacity_bytes: int = 0
    logical_block_size_bytes: int = 0
    physical_block_size_bytes: int = 0
    protocol: int = PROTOCOL_UNKNOWN

    def encode(self) -> bytes:
        out = b""
        for number, text in ((1, self.vendor), (2, self.device_model), (3, self.serial_number)):
            if text:
                out += _len_field(number, text.encode("utf-8"))
        if self.wwn:
            out += _len_field(4, self.wwn)
        for number, value in (
            (5, int(self.rotational)),
            (6, self.capacity_bytes),
            (7, self.logical_block_size_bytes),
            (8, self.physical_block_size_bytes),
            (9, self.protocol),
        ):
            if value:
                out += _varint_field(number, value)
        return out


@dataclasses.dataclass
class HwNetworkInterface:
    """cloud.agent.api.NetworkInterface."""

    mac: bytes = b""
    driver: str = ""
    link_up: bool = False
    current_speed_bytes: int = 0

    def encode(self) -> bytes:
        out = b""
        if self.mac:
            out += _len_field(1, self.mac)
        if self.driver:
            out += _len_field(2, self.driver.encode("utf-8"))
        if self.link_up:
            out += _varint_field(4, 1)
        if self.current_speed_bytes:
            out += _varint_field(5, self.current_speed_bytes)
        return out


@dataclasses.dataclass
class HwNode:
    """cloud.agent.api.Node."""

    manufacturer: str = ""
    product: str = ""
    serial_number: str = ""
    memory_installed_bytes: int = 0
    memory_usable_ratio: float = 0.0
    cpu: list[HwCPU] = dataclasses.field(default_factory=list)
    block_device: list[HwBlockDevice] = dataclasses.field(default_factory=list)
    network_interface: list[HwNetworkInterface] = dataclasses.field(default_factory=list)
    efi_support: int = 0

    def encode(self) -> bytes:
        out = b""
        for number, text in ((1, self.manufacturer), (2, self.product), (3, self.serial_number)):
            if text:
                out += _len_field(number, text.encode("utf-8"))
        if self.memory_installed_bytes:
            out += _varint_field(8, self.memory_installed_bytes)
        if self.memory_usable_ratio:
            out += _float_field(9, self.memory_usable_ratio)
        for number, items in (
            (10, self.cpu),
            (11, self.block_device),
            (12, self.network_interface),
        ):
            for item in items:
                out += _len_field(number, item.encode())
        if self.efi_support:
            out += _varint_field(13, self.efi_support)
        return out


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def _read_int(path: str) -> int | None:
    text = _read(path)
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _cpus(warnings: list[str]) -> list[HwCPU]:
    """One entry per socket ("physical id"), from /proc/cpuinfo."""
    text = _read("/proc/cpuinfo")
    if text is None:
        warnings.append("cannot read /proc/cpuinfo")
        return []
    sockets: dict[str, HwCPU] = {}
    for block in text.split("\n\n"):
        info: dict[str, str] = {}
        for line in block.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                info[key.strip()] = value.strip()
        if "processor" not in info:
            continue
        cpu = sockets.setdefault(info.get("physical id", "0"), HwCPU())
        cpu.hardware_threads += 1
        cpu.vendor = cpu.vendor or info.get("vendor_id", "")
        cpu.model = cpu.model or info.get("model name", "")
        if info.get("cpu cores", "").isdigit():
            cpu.cores = int(info["cpu cores"])
        numbers = [info.get(k, "") for k in ("cpu family", "model", "stepping")]
        if cpu.x86_64 is None and all(n.isdigit() for n in numbers):
            cpu.x86_64 = (int(numbers[0]), int(numbers[1]), int(numbers[2]))
    for cpu in sockets.values():
        cpu.cores = cpu.cores or cpu.hardware_threads
    return list(sockets.values())


def _memory(node: HwNode, warnings: list[str]) -> None:
    """Installed memory from the online memory blocks in sysfs; MemTotal as usable."""
    total_kib = None
    for line in (_read("/proc/meminfo") or "").splitlines():
        if line.startswith("MemTotal:"):
            total_kib = int(line.split()[1])
    base = "/sys/devices/system/memory"
    block = _read(f"{base}/block_size_bytes")
    installed = 0
    if block is not None:
        try:
            names = os.listdir(base)
        except OSError:
            names = []
        online = sum(
            1 for n in names if n.startswith("memory") and _read(f"{base}/{n}/online") == "1"
        )
        installed = online * int(block, 16)
    if not installed and total_kib:
        warnings.append("no memory blocks in sysfs; installed memory is MemTotal")
        installed = total_kib * 1024
    node.memory_installed_bytes = installed
    if installed and total_kib:
        node.memory_usable_ratio = min(1.0, total_kib * 1024 / installed)


def _block_devices() -> list[HwBlockDevice]:
    """Disks with a backing device (loop, ram, zram, dm-... have none)."""
    devices = []
    try:
        names = sorted(os.listdir("/sys/block"))
    except OSError:
        return []
    for name in names:
        base = f"/sys/block/{name}"
        if not os.path.exists(f"{base}/device"):
            continue
        protocol = PROTOCOL_UNKNOWN
        if name.startswith("nvme"):
            protocol = PROTOCOL_NVME
        elif name.startswith("mmcblk"):
            protocol = PROTOCOL_MMC
        elif name.startswith("sd"):
            protocol = PROTOCOL_SCSI
        wwid = _read(f"{base}/wwid") or _read(f"{base}/device/wwid") or ""
        devices.append(
            HwBlockDevice(
                vendor=_read(f"{base}/device/vendor") or "",
                device_model=_read(f"{base}/device/model") or "",
                serial_number=_read(f"{base}/device/serial") or _read(f"{base}/serial") or "",
                wwn=wwid.encode("utf-8"),
                rotational=_read(f"{base}/queue/rotational") == "1",
                capacity_bytes=(_read_int(f"{base}/size") or 0) * 512,
                logical_block_size_bytes=_read_int(f"{base}/queue/logical_block_size") or 0,
                physical_block_size_bytes=_read_int(f"{base}/queue/physical_block_size") or 0,
                protocol=protocol,
            )
        )
    return devices


def _network_interfaces() -> list[HwNetworkInterface]:
    """Interfaces with a backing device (physical NICs), with their MACs."""
    nics = []
    try:
        names = sorted(os.listdir("/sys/class/net"))
    except OSError:
        return []
    for name in names:
        base = f"/sys/class/net/{name}"
        if not os.path.exists(f"{base}/device"):
            continue
        try:
            mac = bytes.fromhex((_read(f"{base}/address") or "").replace(":", ""))
        except ValueError:
            mac = b""
        try:
            driver = os.path.basename(os.readlink(f"{base}/device/driver"))
        except OSError:
            driver = ""
        speed = _read_int(f"{base}/speed")  # Mbit/s; -1 or unreadable when down
        nics.append(
            HwNetworkInterface(
                mac=mac,
                driver=driver,
                link_up=_read(f"{base}/carrier") == "1",
                current_speed_bytes=speed * 125_000 if speed and speed > 0 else 0,
            )
        )
    return nics


def collect_hardware_report() -> tuple[HwNode, list[str]]:
    """Describe this machine; return the report and the warnings met."""
    warnings: list[str] = []
    dmi = "/sys/class/dmi/id"
    node = HwNode(
        manufacturer=_read(f"{dmi}/sys_vendor") or "",
        product=_read(f"{dmi}/product_name") or "",
        serial_number=_read(f"{dmi}/product_serial") or "",
    )
    if not os.path.isdir(dmi):
        warnings.append("no DMI data in /sys/class/dmi/id")
    node.efi_support = (
        EFI_SUPPORT_ENABLED if os.path.isdir("/sys/firmware/efi") else EFI_SUPPORT_UNKNOWN
    )
    node.cpu = _cpus(warnings)
    _memory(node, warnings)
    node.block_device = _block_devices()
    node.network_interface = _network_interfaces()
    return node, warnings


def encode_heartbeat_request(
    machine_id: str, report: HwNode | None = None, warnings: list[str] | None = None
) -> bytes:
    """cloud.bmaas.server.api.HeartbeatRequest{machine_id, hardware_report?}."""
    out = _len_field(1, machine_id.encode("utf-8")) if machine_id else b""
    if report is not None:
        hw = _len_field(1, report.encode())
        for warning in warnings or []:
            hw += _len_field(2, warning.encode("utf-8"))
        out += _len_field(2, hw)
    return out


# --------------------------------------------------------------------------
# Heartbeats.
#
# Transport: Connect's unary protocol over HTTP/1.1 (POST, application/proto,
# the bare message as body; errors as JSON {code, message}), because
# http.client speaks it and HTTP/2 (gRPC) is not in the standard library.
#
# Authentication: the TLS layer only authenticates the server. The agent signs
# a request with its Ed25519 key (see signed_message); the server checks the
# signature against the key in the machine's AgentStarted tag, that the time
# is fresh, and that it is newer than the last accepted one (so a captured
# request cannot be replayed). An accepted signed request is answered with a
# session (HeartbeatResponse.session: an opaque token and an HMAC-SHA256 key),
# and the agent authenticates its next requests with a MAC under that key over
# the same bytes instead of a signature, far cheaper for the server, until the
# session ends (its lifetime, or a refusal: the agent then signs again).
# --------------------------------------------------------------------------

HEARTBEAT_PATH = "/cloud.bmaas.server.api.AgentCallback/Heartbeat"
SIGNATURE_CONTEXT = b"monotrio-agent-callback-v1"
HEADER_KEY = "Monotrio-Agent-Key"
HEADER_TIME = "Monotrio-Agent-Time"
HEADER_SIGNATURE = "Monotrio-Agent-Signature"
#: A session's token (base64), instead of HEADER_KEY and HEADER_SIGNATURE.
HEADER_SESSION = "Monotrio-Agent-Session"
#: HMAC-SHA256 (base64) of signed_message under the session key.
HEADER_MAC = "Monotrio-Agent-Mac"
#: Bound on one heartbeat exchange (connect, TLS, request, response), seconds.
REQUEST_TIMEOUT = 15.0


def signed_message(method: str, path: str, machine_id: str, time_ns: int, body: bytes) -> bytes:
    """The bytes an agent signs for one request: everything that makes it unique."""
    return b"\n".join(
        [
            SIGNATURE_CONTEXT,
            method.encode("ascii"),
            path.encode("utf-8"),
            machine_id.encode("utf-8"),
            str(time_ns).encode("ascii"),
            hashlib.sha256(body).hexdigest().encode("ascii"),
        ]
    )


def session_mac(key: bytes, message: bytes) -> bytes:
    """The MAC of a session request: HMAC-SHA256 under the session key of
    signed_message's bytes."""
    return hmac.digest(key, message, "sha256")


@dataclasses.dataclass(frozen=True)
class AgentSession:
    """cloud.bmaas.server.api.AgentSession: what a server answers a signed heartbeat with."""

    token: bytes
    key: bytes
    lifetime_seconds: int


def decode_heartbeat_session(data: bytes) -> AgentSession | None:
    """The session in a HeartbeatResponse (field 100), if any; DecodeError if malformed."""
    session = None
    for number, wire_type, value in iter_fields(data):
        if number != 100:
            continue
        token, key, lifetime = b"", b"", 0
        for inner, inner_type, inner_value in iter_fields(_as_len(number, wire_type, value)):
            if inner == 1:
                token = _as_len(inner, inner_type, inner_value)
            elif inner == 2:
                key = _as_len(inner, inner_type, inner_value)
            elif inner == 3:
                if inner_type != WIRE_VARINT or not isinstance(inner_value, int):
                    raise DecodeError("field 3: want varint")
                lifetime = inner_value
        session = AgentSession(token, key, lifetime)
    return session


def _log(message: str) -> None:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    sys.stderr.write(f"{stamp} agent: {message}\n")
    sys.stderr.flush()


class Heartbeater:
    """Sends heartbeats to the endpoint of ``init``, signed with ``seed``."""

    def __init__(
        self,
        init: TakeoverInit,
        seed: bytes,
        *,
        interval: float,
        backoff_cap: float,
        report: tuple[HwNode, list[str]] | None = None,
    ) -> None:
        self.init = init
        self.seed = seed
        self.public_key = ed25519_public_key(seed)
        self.interval = interval
        self.backoff_cap = max(backoff_cap, interval)
        self.report = report  # sent until one heartbeat carrying it is accepted
        self._last_time_ns = 0
        #: The session requests are MACed with, if any, and when (time.monotonic())
        #: to stop using it and sign again, ahead of its end at the server.
        self.session: AgentSession | None = None
        self.session_until = 0.0
        import ssl
        import urllib.parse

        endpoint = init.bmaas_endpoint
        url = urllib.parse.urlsplit(endpoint if "://" in endpoint else f"https://{endpoint}")
        if url.scheme not in ("http", "https") or not url.hostname:
            raise AgentError(f"cannot use endpoint {endpoint!r}: want [https://]host[:port]")
        self.scheme, self.host = url.scheme, url.hostname
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self._conn: http.client.HTTPConnection | None = None
        self.context: ssl.SSLContext | None = None
        if self.scheme == "https":
            try:
                self.context = ssl.create_default_context(cadata=init.ca_certificate or None)
            except (ssl.SSLError, ValueError) as exc:
                raise AgentError(f"cannot use ca_certificate: {exc}") from exc

    def request(self) -> tuple[bytes, dict[str, str]]:
        """The next request: body and headers, MACed with the session if one
        is held and still in use, else signed."""
        import base64

        report, warnings = self.report if self.report is not None else (None, None)
        body = encode_heartbeat_request(self.init.machine_id, report, warnings)
        # Strictly increasing, also when the clock steps back: the server
        # refuses a time not newer than the last it accepted.
        now = max(time.time_ns(), self._last_time_ns + 1)
        self._last_time_ns = now
        message = signed_message("POST", HEARTBEAT_PATH, self.init.machine_id, now, body)
        headers = {
            "Content-Type": "application/proto",
            "Connect-Protocol-Version": "1",
            "Connect-Timeout-Ms": str(int(REQUEST_TIMEOUT * 1000)),
            HEADER_TIME: str(now),
        }
        if self.session is not None and time.monotonic() >= self.session_until:
            self.session = None
        if self.session is not None:
            headers[HEADER_SESSION] = base64.b64encode(self.session.token).decode("ascii")
            mac = session_mac(self.session.key, message)
            headers[HEADER_MAC] = base64.b64encode(mac).decode("ascii")
        else:
            signature = ed25519_sign(self.seed, message)
            headers[HEADER_KEY] = base64.b64encode(self.public_key).decode("ascii")
            headers[HEADER_SIGNATURE] = base64.b64encode(signature).decode("ascii")
        return body, headers

    def accepted(self, answer: bytes) -> None:
        """Take the session an accepted heartbeat's answer carries, if any.

        Used until 90% of its lifetime has passed (by this machine's
        monotonic clock, which the server's need not match closely), so that
        it is renewed by a signed heartbeat before the server refuses it.
        """
        try:
            session = decode_heartbeat_session(answer)
        except DecodeError as exc:
            _log(f"ignoring a malformed session: {exc}")
            return
        if session is None or not session.token or not session.key:
            return
        if 0 < session.lifetime_seconds < 2**62:
            self.session = session
            self.session_until = time.monotonic() + 0.9 * session.lifetime_seconds

    def _connect(self) -> http.client.HTTPConnection:
        import http.client

        if self.context is not None:
            return http.client.HTTPSConnection(
                self.host, self.port, timeout=REQUEST_TIMEOUT, context=self.context
            )
        return http.client.HTTPConnection(self.host, self.port, timeout=REQUEST_TIMEOUT)

    def beat(self) -> None:
        """Send one heartbeat; raise OSError, HTTPException or AgentError on failure.

        The connection is kept for the next heartbeat (the server keeps idle
        connections longer than the interval), which spares both sides a
        TCP and TLS handshake per heartbeat. A kept connection the server
        closed meanwhile is replaced once, with a new request. A session
        the server refuses (expired, or made before the server restarted)
        is dropped and the heartbeat sent again at once, signed.
        """
        import http.client

        reconnected = resigned = False
        while True:
            reused = self._conn is not None
            if self._conn is None:
                self._conn = self._connect()
            conn = self._conn
            body, headers = self.request()
            try:
                conn.request("POST", HEARTBEAT_PATH, body=body, headers=headers)
                response = conn.getresponse()
                answer = response.read(64 * 1024)
            except (OSError, http.client.HTTPException):
                conn.close()
                self._conn = None
                if reused and not reconnected:
                    reconnected = True
                    continue
                raise
            if response.will_close:
                conn.close()
                self._conn = None
            if response.status == 401 and HEADER_SESSION in headers and not resigned:
                text = answer[:300].decode("utf-8", errors="replace")
                _log(f"session refused, signing again: {text}")
                self.session = None
                resigned = True
                continue
            break
        if response.status != 200:
            text = answer[:300].decode("utf-8", errors="replace")
            raise AgentError(f"heartbeat refused: HTTP {response.status}: {text}")
        self.accepted(answer)
        if self.report is not None:
            _log("hardware report accepted")
            self.report = None

    def run(self) -> None:
        """Heartbeat forever: every ``interval`` while accepted, else with
        exponential backoff (1 s doubling, jittered, up to ``backoff_cap``)."""
        import http.client
        import random

        delay = 0.0
        failing = False
        while True:
            try:
                self.beat()
            except (OSError, http.client.HTTPException, AgentError) as exc:
                delay = min(self.backoff_cap, max(1.0, delay * 2)) if failing else 1.0
                if not failing:
                    _log(f"heartbeat failed, backing off: {exc}")
                failing = True
                time.sleep(delay * random.uniform(0.8, 1.0))
                continue
            if failing:
                _log("heartbeats accepted again")
            failing = False
            delay = 0.0
            time.sleep(self.interval)


def _replace_running_agent(pid_file: str) -> None:
    """Stop an agent still running from an earlier takeover, and record our pid.

    A takeover without a reboot (a provider that cannot reboot) finds the old
    agent possibly alive; two would heartbeat for one machine. Only a process
    whose command line names this very script is signalled.
    """
    old = _read_int(pid_file)
    if old and old != os.getpid():
        cmdline = (_read(f"/proc/{old}/cmdline") or "").split("\0")
        if any(os.path.abspath(arg) == os.path.abspath(sys.argv[0]) for arg in cmdline if arg):
            with contextlib.suppress(OSError):
                os.kill(old, signal.SIGTERM)
    tmp = f"{pid_file}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{os.getpid()}\n")
    os.replace(tmp, pid_file)


def detach(log_file: str) -> bool:
    """Double-fork into a new session with stdio away from the SSH channel.

    Returns False in the original process (which then exits, ending the SSH
    session) and True in the detached daemon.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    child = os.fork()
    if child:
        os.waitpid(child, 0)
        return False
    os.setsid()
    if os.fork():
        os._exit(0)
    null = os.open(os.devnull, os.O_RDWR)
    log = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    os.chdir("/")
    return True


# --------------------------------------------------------------------------
# The key file and the program.
# --------------------------------------------------------------------------


class AgentError(Exception):
    """A failure the agent reports to the initializer as TakeoverError."""


def load_or_create_seed(path: str, warnings: list[str]) -> bytes:
    """Return the private seed stored at ``path``, creating it if absent.

    The file must be a regular file owned by us: opened without following a
    symlink (one planted at the path is refused, never read or chmodded
    through), checked and tightened through its descriptor. Creation writes
    an unpredictably named temporary file (exclusive create, 0600) and links
    it into place, which fails if the key appeared meanwhile (then that one
    is used): a crash never leaves a truncated key, and two agents starting
    at once agree on one key. Every failure is an :class:`AgentError`.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return _create_seed(path, warnings)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise AgentError(f"key file {path} is a symbolic link; refusing it") from exc
        raise AgentError(f"cannot read key file {path}: {exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise AgentError(f"key file {path} is not a regular file")
        if st.st_uid != os.geteuid():
            raise AgentError(f"key file {path} is owned by uid {st.st_uid}, not by us")
        seed = os.read(fd, 33)
        if len(seed) != 32:
            raise AgentError(f"key file {path} holds {st.st_size} bytes, want 32; not replacing it")
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            os.fchmod(fd, 0o600)
            warnings.append(f"key file {path} had mode {mode:04o}, tightened to 0600")
        return seed
    except OSError as exc:
        raise AgentError(f"cannot read key file {path}: {exc.strerror}") from exc
    finally:
        os.close(fd)


def _create_seed(path: str, warnings: list[str]) -> bytes:
    seed = os.urandom(32)
    tmp = f"{path}.{secrets.token_hex(8)}.tmp"
    try:
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
    except OSError as exc:
        raise AgentError(f"cannot create key file {path}: {exc.strerror}") from exc
    try:
        try:
            os.write(fd, seed)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.link(tmp, path, follow_symlinks=False)
    except FileExistsError:
        return load_or_create_seed(path, warnings)  # another run created it: use that
    except OSError as exc:
        raise AgentError(f"cannot create key file {path}: {exc.strerror}") from exc
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return seed


def key_path() -> str:
    """The key file lives beside the agent: ``<agent path>.key``."""
    return os.path.abspath(sys.argv[0]) + ".key"


def take_over(init_bytes: bytes, key_file: str) -> bytes:
    """Run one takeover exchange and return the encoded TakeoverResponse."""
    try:
        init = TakeoverInit.decode(init_bytes)
    except DecodeError as exc:
        return encode_error(f"malformed TakeoverInit on stdin: {exc}")
    if not init.bmaas_endpoint:
        return encode_error("TakeoverInit has an empty bmaas_endpoint")
    warnings: list[str] = []
    try:
        seed = load_or_create_seed(key_file, warnings)
    except AgentError as exc:
        return encode_error(str(exc))
    return encode_success(init_bytes, ed25519_public_key(seed), warnings)


def _parse_args(argv: list[str]) -> tuple[float | None, float]:
    """``[--heartbeat-interval SECONDS] [--heartbeat-backoff-cap SECONDS]``."""
    interval: float | None = None
    cap = 60.0
    args = list(argv)
    while args:
        flag = args.pop(0)
        if flag not in ("--heartbeat-interval", "--heartbeat-backoff-cap") or not args:
            raise AgentError(
                f"usage: agent [--heartbeat-interval S] [--heartbeat-backoff-cap S], got {flag!r}"
            )
        value = float(args.pop(0))
        if not value > 0:
            raise AgentError(f"{flag} must be positive")
        if flag == "--heartbeat-interval":
            interval = value
        else:
            cap = value
    return interval, cap


def main() -> int:
    try:
        interval, cap = _parse_args(sys.argv[1:])
    except (AgentError, ValueError) as exc:
        sys.stderr.write(f"agent: {exc}\n")
        return 2
    init_bytes = sys.stdin.buffer.read()
    response = take_over(init_bytes, key_path())
    heartbeater = None
    if interval is not None and iter_fields(response)[0][0] == 1:  # success
        try:
            warnings: list[str] = []
            heartbeater = Heartbeater(
                TakeoverInit.decode(init_bytes),
                load_or_create_seed(key_path(), warnings),
                interval=interval,
                backoff_cap=cap,
            )
        except AgentError as exc:
            response = encode_error(str(exc))
    sys.stdout.buffer.write(response)
    sys.stdout.buffer.flush()
    if heartbeater is None or not detach(os.path.abspath(sys.argv[0]) + ".log"):
        return 0
    try:
        _replace_running_agent(os.path.abspath(sys.argv[0]) + ".pid")
        _log(f"heartbeating to {heartbeater.init.bmaas_endpoint} every {interval:g}s")
        heartbeater.report = collect_hardware_report()
        heartbeater.run()
    except BaseException as exc:  # the daemon's last word goes to its log
        _log(f"stopped: {exc!r}")
        os._exit(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
