"""A heartbeat request's checks that need no database: body, freshness,
signature or session MAC (`authenticate`).

Checks, in order, each refusing with `ConnectError` and nothing written::

    body is a HeartbeatRequest         else invalid_argument
    reports in it are well formed      else invalid_argument (`shepherd.agent_server.reports`)
    machine_id is a UUID               else invalid_argument
    time header parses                 else unauthenticated
    time within +-freshness of ours    else unauthenticated ("stale")
    with a session token:
      token and MAC headers parse      else unauthenticated
      token made here, not expired     else unauthenticated (its own message each)
      token's machine is the body's    else unauthenticated
      HMAC-SHA256 (session key) over
      the request                      else unauthenticated ("bad session MAC")
      key := the token's agent key
    else:
      key/signature headers parse      else unauthenticated
      Ed25519 signature over the
      request                          else unauthenticated ("bad signature")

What passes is a `Heartbeat`: the BMDB then checks its key against the
machine's AgentStarted tag and its time against the last accepted one
(`shepherd.agent_server.service`), and answers "unknown" for a machine that
does not exist and for a wrong key alike, so that nobody learns which
machines exist without holding an agent key.

A signed heartbeat, once written, is answered with a new session
(`shepherd.agent_server.session`), with which the agent then MACs its
heartbeats instead of signing them: a signature check costs more CPU than
all the rest of a heartbeat, a MAC check a hundredth of it. The MAC covers
exactly what the signature covers (`shepherd.agent.protocol.signed_message`),
and the checks after it are the same.

Why signatures instead of the reference's client certificates: a signature
also works behind a TLS-terminating proxy, and the server's TLS needs no
client-certificate handling. What a signature alone would not stop, a
replay, is stopped by the time check: within the freshness window by the
monotonic per-machine time kept in the BMDB, beyond it by the window.

Verified public keys are cached by their bytes (bounded), which saves
decoding the key, not checking: every signed request's signature is verified.
"""

from __future__ import annotations

import binascii
import hmac
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from common.numbers import parse_decimal
from common.protobuf import checked_fields, parse_checked
from shepherd.agent.protocol import (
    HEADER_KEY,
    HEADER_MAC,
    HEADER_SESSION,
    HEADER_SIGNATURE,
    HEADER_TIME,
    HEARTBEAT_PATH,
    signed_message,
)
from shepherd.agent_server.connect import ConnectError
from shepherd.agent_server.reports import (
    InstallationReport,
    UpgradeReport,
    installation_report,
    upgrade_report,
)
from shepherd.agent_server.session import TOKEN_BYTES, SessionKeys, session_mac
from shepherd.proto.agent_callback import HeartbeatRequest, OsInstallationReport
from shepherd.proto.agent_callback import UpgradeReport as UpgradeReportMessage

#: Default bound on |agent clock - server clock| for a request to count as fresh.
DEFAULT_FRESHNESS = 300.0

#: Decoded public keys kept (a fleet's worth; beyond, the cache starts over).
KEY_CACHE_SIZE = 65536
_keys: dict[bytes, Ed25519PublicKey] = {}


def _public_key(raw: bytes) -> Ed25519PublicKey:
    """The key object for 32 raw bytes, from the cache if seen before; ValueError if invalid."""
    key = _keys.get(raw)
    if key is None:
        key = Ed25519PublicKey.from_public_bytes(raw)
        if len(_keys) >= KEY_CACHE_SIZE:
            _keys.clear()
        _keys[raw] = key
    return key


@dataclass(frozen=True)
class Heartbeat:
    """An authenticated-looking request, before the BMDB had its say."""

    machine_id: uuid.UUID
    key: bytes
    time_ns: int
    #: The AgentHardwareReport's bytes as the agent sent them (checked), if any.
    hardware_report: bytes | None
    #: Authenticated by a signature (answered with a new session once
    #: written), not by a session's MAC.
    signed: bool = True
    installation_report: InstallationReport | None = None
    upgrade_report: UpgradeReport | None = None


@dataclass(frozen=True, slots=True)
class _Request:
    """A checked HeartbeatRequest's fields, as sent."""

    machine_id: str
    #: The AgentHardwareReport's bytes as received, if one was sent.
    hardware_report: bytes | None
    #: The OSInstallationReport's bytes as received, if one was sent.
    installation_report: bytes | None
    #: The UpgradeReport's bytes as received, if one was sent.
    upgrade_report: bytes | None = None


def _parse(body: bytes) -> _Request:
    """The fields of a HeartbeatRequest, checked (`common.protobuf.checked_fields`);
    invalid_argument if malformed.

    No message is built: the hot path needs the machine id, and the
    embedded reports go on as their bytes (an installation report is parsed
    further by `installation_report`).
    """
    try:
        fields = checked_fields(HeartbeatRequest, body)
    except ValueError as exc:
        raise ConnectError("invalid_argument", f"malformed HeartbeatRequest: {exc}") from exc
    machine_id = fields.get("machine_id", b"")
    hardware = fields.get("hardware_report")
    install = fields.get("installation_report")
    upgrade = fields.get("upgrade_report")
    # The walk checked the wire types: a string field's value is UTF-8
    # bytes, a message field's bytes.
    assert isinstance(machine_id, bytes)
    assert hardware is None or isinstance(hardware, bytes)
    assert install is None or isinstance(install, bytes)
    assert upgrade is None or isinstance(upgrade, bytes)
    return _Request(machine_id.decode("utf-8"), hardware, install, upgrade)


def parse_request(body: bytes) -> tuple[str, bytes | None]:
    """(machine_id, hardware report) of a HeartbeatRequest; invalid_argument if malformed.

    Parsed strictly (`common.protobuf`): betterproto2 alone would turn
    garbage into an empty message instead of failing. The report is the
    bytes the agent sent, once checked as an AgentHardwareReport (unknown
    fields kept, as they came).
    """
    request = _parse(body)
    return request.machine_id, request.hardware_report


def _header_bytes(headers: Mapping[str, str], name: str, length: int) -> bytes:
    try:
        # base64.b64decode(validate=True) checks the alphabet with a regular
        # expression first: four times the cost of this, which checks it in C.
        value = binascii.a2b_base64(headers.get(name.lower(), ""), strict_mode=True)
    except (binascii.Error, ValueError) as exc:
        raise ConnectError("unauthenticated", f"{name} is not base64") from exc
    if len(value) != length:
        raise ConnectError("unauthenticated", f"{name} missing or not {length} bytes")
    return value


def authenticate(
    headers: Mapping[str, str],
    body: bytes,
    *,
    now_ns: int,
    freshness: float,
    sessions: SessionKeys,
) -> Heartbeat:
    """Every check that needs no database; raise `ConnectError` on the first failing one.

    A request with a session token (`HEADER_SESSION`) is authenticated by
    its MAC under ``sessions``, any other by its signature.
    """
    request = _parse(body)
    text_id = request.machine_id
    report = request.hardware_report
    install = (
        installation_report(OsInstallationReport.parse(request.installation_report))
        if request.installation_report is not None
        else None
    )
    upgrade = (
        upgrade_report(parse_checked(UpgradeReportMessage, request.upgrade_report))
        if request.upgrade_report is not None
        else None
    )
    try:
        machine_id = uuid.UUID(text_id)
    except ValueError:
        raise ConnectError("invalid_argument", "machine_id invalid") from None
    try:
        time_ns = parse_decimal(headers.get(_TIME, ""), max_digits=19, what=HEADER_TIME)
    except ValueError:
        raise ConnectError("unauthenticated", f"{HEADER_TIME} missing or malformed") from None
    if abs(time_ns - now_ns) > freshness * 1e9:
        raise ConnectError(
            "unauthenticated", f"stale request: time outside the {freshness:g}s freshness window"
        )
    message = signed_message("POST", HEARTBEAT_PATH, text_id, time_ns, body)
    if _SESSION in headers:
        token = _header_bytes(headers, HEADER_SESSION, TOKEN_BYTES)
        mac = _header_bytes(headers, HEADER_MAC, 32)
        session = sessions.open(token, now_ns)
        if session.machine_id != machine_id:
            raise ConnectError("unauthenticated", "session token is for another machine")
        if not hmac.compare_digest(session_mac(session.mac, message), mac):
            raise ConnectError("unauthenticated", "bad session MAC")
        return Heartbeat(
            machine_id,
            session.public_key,
            time_ns,
            report,
            False,
            installation_report=install,
            upgrade_report=upgrade,
        )
    key = _header_bytes(headers, HEADER_KEY, 32)
    signature = _header_bytes(headers, HEADER_SIGNATURE, 64)
    try:
        _public_key(key).verify(signature, message)
    except (InvalidSignature, ValueError):
        raise ConnectError("unauthenticated", "bad signature") from None
    return Heartbeat(
        machine_id, key, time_ns, report, installation_report=install, upgrade_report=upgrade
    )


_TIME = HEADER_TIME.lower()
_SESSION = HEADER_SESSION.lower()
