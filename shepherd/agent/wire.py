"""The protobuf wire codec of the agent's messages.

Only what the agent's messages use (``shepherd/proto/agent.proto``,
``hwreport.proto``, ``agent_callback.proto``): varints, fixed32 floats and
length-delimited fields (strings, bytes, embedded messages). Encoding
follows proto3 rules that every implementation shares: fields in
field-number order, scalar fields with their default value omitted, a set
oneof member always written (even when empty). Decoding skips unknown
fields of any wire type, and the last occurrence of a singular field wins,
as the spec says.

Hand-written because the agent may use nothing but the standard library;
the Shepherd's side of each exchange decodes with the generated classes
(``shepherd.proto``) instead, and tests check the two agree byte for byte.
"""

from __future__ import annotations

import dataclasses
import struct

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


# The hardware report's messages (cloud.agent.api.Node and its parts); what
# fills them is `hwreport`.

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


@dataclasses.dataclass(frozen=True)
class InstallationReport:
    """cloud.bmaas.server.api.OSInstallationReport: ``node_public_key`` on
    success, else ``error`` (exactly one of the two is not None)."""

    generation: int
    node_public_key: bytes | None = None
    error: str | None = None

    def encode(self) -> bytes:
        out = _varint_field(1, self.generation) if self.generation else b""
        if self.node_public_key is not None:
            success = _len_field(1, self.node_public_key) if self.node_public_key else b""
            out += _len_field(2, success)
        elif self.error is not None:
            error = _len_field(1, self.error.encode("utf-8")) if self.error else b""
            out += _len_field(3, error)
        return out


#: UpgradeReport.State values.
UPGRADE_STAGED, UPGRADE_COMMITTED, UPGRADE_ROLLED_BACK, UPGRADE_FAILED = 1, 2, 3, 4
UPGRADE_WRITTEN = 5


@dataclasses.dataclass(frozen=True)
class UpgradeReport:
    """cloud.bmaas.server.api.UpgradeReport (beyond the reference)."""

    generation: int
    state: int
    detail: str = ""
    slot: str = ""

    def encode(self) -> bytes:
        out = _varint_field(1, self.generation) if self.generation else b""
        if self.state:
            out += _varint_field(2, self.state)
        if self.detail:
            out += _len_field(3, self.detail.encode("utf-8"))
        if self.slot:
            out += _len_field(4, self.slot.encode("utf-8"))
        return out


def encode_heartbeat_request(
    machine_id: str,
    report: HwNode | None = None,
    warnings: list[str] | None = None,
    installation_report: InstallationReport | None = None,
    upgrade_report: UpgradeReport | None = None,
) -> bytes:
    """cloud.bmaas.server.api.HeartbeatRequest{machine_id, hardware_report?,
    installation_report?, upgrade_report?}, in field-number order."""
    out = _len_field(1, machine_id.encode("utf-8")) if machine_id else b""
    if report is not None:
        hw = _len_field(1, report.encode())
        for warning in warnings or []:
            hw += _len_field(2, warning.encode("utf-8"))
        out += _len_field(2, hw)
    if installation_report is not None:
        out += _len_field(3, installation_report.encode())
    if upgrade_report is not None:
        out += _len_field(101, upgrade_report.encode())
    return out


# The installation request of a HeartbeatResponse. Decoded strictly: a field
# of the wrong wire type, a string that is not UTF-8 or a truncated message
# is a DecodeError (the agent then ignores the whole request), while unknown
# fields are skipped, as protobuf's rules say. An embedded message that
# occurs twice (which protobuf would merge) is refused too: no encoder
# writes one twice, and merging two halves of a request is not a request
# anybody sent.


@dataclasses.dataclass(frozen=True)
class OSImageRef:
    """metropolis.proto.api.OSImageRef."""

    scheme: str = ""
    host: str = ""
    repository: str = ""
    tag: str = ""
    digest: str = ""


@dataclasses.dataclass(frozen=True)
class MetropolisInstallation:
    """cloud.bmaas.server.api.MetropolisInstallationRequest; ``node_parameters``
    raw (the node parses them), None when absent, like ``os_image``."""

    node_parameters: bytes | None = None
    root_device: str = ""
    os_image: OSImageRef | None = None
    node_address: str = ""


@dataclasses.dataclass(frozen=True)
class InstallationRequest:
    """cloud.bmaas.server.api.OSInstallationRequest; ``metropolis`` None when
    the oneof holds no Metropolis installation."""

    generation: int
    metropolis: MetropolisInstallation | None = None


def _as_int64(number: int, wire_type: int, value: bytes | int) -> int:
    if wire_type != WIRE_VARINT or not isinstance(value, int):
        raise DecodeError(f"field {number}: wire type {wire_type}, want varint")
    value &= 2**64 - 1  # a varint longer than 64 bits keeps its low 64, as protobuf's do
    return value - 2**64 if value >= 2**63 else value


def _decode_image(data: bytes) -> OSImageRef:
    texts = ["", "", "", "", ""]
    for number, wire_type, value in iter_fields(data):
        if 1 <= number <= 5:
            texts[number - 1] = _as_str(number, wire_type, value)
    return OSImageRef(*texts)


def _decode_metropolis(data: bytes) -> MetropolisInstallation:
    params: bytes | None = None
    root_device, address = "", ""
    image: OSImageRef | None = None
    for number, wire_type, value in iter_fields(data):
        if number == 2:
            params = _as_len(number, wire_type, value)
        elif number == 3:
            root_device = _as_str(number, wire_type, value)
        elif number == 4:
            if image is not None:
                raise DecodeError("os_image twice")
            image = _decode_image(_as_len(number, wire_type, value))
        elif number == 100:
            address = _as_str(number, wire_type, value)
    return MetropolisInstallation(params, root_device, image, address)


def decode_installation_request(data: bytes) -> InstallationRequest | None:
    """The installation request of a HeartbeatResponse (field 1), if any;
    DecodeError if the response or the request is malformed."""
    request = None
    for number, wire_type, value in iter_fields(data):
        if number != 1:
            continue
        if request is not None:
            raise DecodeError("installation_request twice")
        generation = 0
        metropolis: MetropolisInstallation | None = None
        for inner, inner_type, inner_value in iter_fields(_as_len(number, wire_type, value)):
            if inner == 1:
                generation = _as_int64(inner, inner_type, inner_value)
            elif inner == 2:
                if metropolis is not None:
                    raise DecodeError("metropolis twice")
                metropolis = _decode_metropolis(_as_len(inner, inner_type, inner_value))
        request = InstallationRequest(generation, metropolis)
    return request


@dataclasses.dataclass(frozen=True)
class UpgradeRequest:
    """cloud.bmaas.server.api.UpgradeRequest (beyond the reference); ``os_image``
    None when absent."""

    generation: int
    os_image: OSImageRef | None = None
    health_timeout_seconds: int = 0
    root_device: str = ""
    #: Try the written slot now (else only write it).
    activate: bool = False


def _as_bool(number: int, wire_type: int, value: bytes | int) -> bool:
    return _as_int64(number, wire_type, value) != 0


def decode_upgrade_request(data: bytes) -> UpgradeRequest | None:
    """The upgrade request of a HeartbeatResponse (field 101), if any;
    DecodeError if the response or the request is malformed (strictly, as
    `decode_installation_request`: wrong wire types, a string that is not
    UTF-8, a request or image given twice)."""
    request = None
    for number, wire_type, value in iter_fields(data):
        if number != 101:
            continue
        if request is not None:
            raise DecodeError("upgrade_request twice")
        generation, timeout, device, activate = 0, 0, "", False
        image: OSImageRef | None = None
        for inner, inner_type, inner_value in iter_fields(_as_len(number, wire_type, value)):
            if inner == 1:
                generation = _as_int64(inner, inner_type, inner_value)
            elif inner == 2:
                if image is not None:
                    raise DecodeError("os_image twice")
                image = _decode_image(_as_len(inner, inner_type, inner_value))
            elif inner == 3:
                timeout = _as_int64(inner, inner_type, inner_value)
            elif inner == 4:
                device = _as_str(inner, inner_type, inner_value)
            elif inner == 5:
                activate = _as_bool(inner, inner_type, inner_value)
        request = UpgradeRequest(generation, image, timeout, device, activate)
    return request


@dataclasses.dataclass(frozen=True)
class AgentSession:
    """cloud.bmaas.server.api.AgentSession: what a server answers a signed heartbeat with."""

    token: bytes
    key: bytes
    lifetime_seconds: int


def encode_heartbeat_session(session: AgentSession) -> bytes:
    """cloud.bmaas.server.api.HeartbeatResponse{session}: what the agent
    callback server answers a signed heartbeat with (no installation request;
    `decode_heartbeat_session` reads it back)."""
    inner = b""
    if session.token:
        inner += _len_field(1, session.token)
    if session.key:
        inner += _len_field(2, session.key)
    if session.lifetime_seconds:
        inner += _varint_field(3, session.lifetime_seconds)
    return _len_field(100, inner)


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
