"""Heartbeat: authenticate an agent's request and record it in the BMDB.

Checks, in order, each refusing with nothing written::

    body is a HeartbeatRequest         else invalid_argument
    machine_id is a UUID               else invalid_argument
    key/time/signature headers parse   else unauthenticated
    time within +-freshness of ours    else unauthenticated ("stale")
    Ed25519 signature over the request else unauthenticated
    BMDB, one statement:
      key == the AgentStarted tag's    else unauthenticated ("unknown")
      time > last accepted time        else unauthenticated ("replayed")
      write heartbeat (+ report)

Why signatures instead of the reference's client certificates: hypercorn
does not hand the peer certificate to the app, and a signature also works
behind a TLS-terminating proxy. What a signature alone would not stop, a
replay, is stopped by the time check: within the freshness window by the
monotonic per-machine time kept in the BMDB, beyond it by the window.

The same response for "no such machine" and "wrong key", so that nobody
learns which machines exist without holding an agent key.

The write does not go through the server's BMDB session (`Session.transact`
checks the session first, one more statement, and fails every heartbeat
while the session is being replaced): a heartbeat takes no work lock, and
under overload the session's own poke, which competes with the heartbeats
for database connections, must not take every heartbeat down with it. So
the service bounds its database use instead: at most ``db_slots``
transactions at once (fewer than the pool, which keeps room for the poke),
and a request that waits longer than ``queue_timeout`` for a slot is
answered ``unavailable`` (the agent backs off) rather than queued forever.
"""

from __future__ import annotations

import base64
import binascii
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import trio
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from bmdb import Connection, Isolation, Queries
from bmdb.errors import BMDBError, InvalidArgument
from bmdb.model import HeartbeatOutcome
from shepherd.agent.takeover import (
    HEADER_KEY,
    HEADER_SIGNATURE,
    HEADER_TIME,
    HEARTBEAT_PATH,
    WIRE_LEN,
    DecodeError,
    iter_fields,
    signed_message,
)
from shepherd.agent_server.connect import ConnectError
from shepherd.proto.agent_callback import HeartbeatResponse

logger = logging.getLogger("shepherd.agent_server.service")

#: Default bound on |agent clock - server clock| for a request to count as fresh.
DEFAULT_FRESHNESS = 300.0

_EMPTY_RESPONSE = bytes(HeartbeatResponse())


@dataclass(frozen=True)
class Heartbeat:
    """An authenticated-looking request, before the BMDB had its say."""

    machine_id: uuid.UUID
    key: bytes
    time_ns: int
    #: The raw AgentHardwareReport bytes, as sent, if any.
    hardware_report: bytes | None


def parse_request(body: bytes) -> tuple[str, bytes | None]:
    """(machine_id, raw hardware report) of a HeartbeatRequest; invalid_argument if malformed.

    Parsed with the agent's strict codec: betterproto2 would turn garbage
    into an empty message instead of failing.
    """
    machine_id, report = "", None
    try:
        fields = iter_fields(body)
        for number, wire_type, value in fields:
            if number not in (1, 2):
                continue
            if wire_type != WIRE_LEN or not isinstance(value, bytes):
                raise ConnectError(
                    "invalid_argument",
                    f"malformed HeartbeatRequest: field {number}: want length-delimited",
                )
            if number == 1:
                machine_id = value.decode("utf-8")
            else:
                iter_fields(value)  # well-formed at least at its top level
                report = value
    except (DecodeError, UnicodeDecodeError) as exc:
        raise ConnectError("invalid_argument", f"malformed HeartbeatRequest: {exc}") from exc
    return machine_id, report


def _header_bytes(headers: Mapping[str, str], name: str, length: int) -> bytes:
    try:
        value = base64.b64decode(headers.get(name.lower(), ""), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ConnectError("unauthenticated", f"{name} is not base64") from exc
    if len(value) != length:
        raise ConnectError("unauthenticated", f"{name} missing or not {length} bytes")
    return value


def authenticate(
    headers: Mapping[str, str], body: bytes, *, now_ns: int, freshness: float
) -> Heartbeat:
    """Every check that needs no database; raise `ConnectError` on the first failing one."""
    text_id, report = parse_request(body)
    try:
        machine_id = uuid.UUID(text_id)
    except ValueError:
        raise ConnectError("invalid_argument", "machine_id invalid") from None
    key = _header_bytes(headers, HEADER_KEY, 32)
    signature = _header_bytes(headers, HEADER_SIGNATURE, 64)
    time_text = headers.get(HEADER_TIME.lower(), "")
    if not time_text.isdigit() or len(time_text) > 19:
        raise ConnectError("unauthenticated", f"{HEADER_TIME} missing or malformed")
    time_ns = int(time_text)
    if abs(time_ns - now_ns) > freshness * 1e9:
        raise ConnectError(
            "unauthenticated", f"stale request: time outside the {freshness:g}s freshness window"
        )
    message = signed_message("POST", HEARTBEAT_PATH, text_id, time_ns, body)
    try:
        Ed25519PublicKey.from_public_bytes(key).verify(signature, message)
    except (InvalidSignature, ValueError):
        raise ConnectError("unauthenticated", "bad signature") from None
    return Heartbeat(machine_id, key, time_ns, report)


class HeartbeatService:
    """The Heartbeat method, writing through ``conn``."""

    def __init__(
        self,
        conn: Connection,
        *,
        freshness: float = DEFAULT_FRESHNESS,
        db_slots: int = 12,
        queue_timeout: float = 5.0,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        self._conn = conn
        self.freshness = freshness
        self._slots = trio.CapacityLimiter(db_slots)
        self.queue_timeout = queue_timeout
        self._clock = clock

    async def heartbeat(self, headers: Mapping[str, str], body: bytes) -> bytes:
        """Handle one request (a `shepherd.agent_server.connect.Handler`)."""
        beat = authenticate(headers, body, now_ns=self._clock(), freshness=self.freshness)

        async def record(q: Queries) -> HeartbeatOutcome:
            return await q.record_agent_heartbeat(
                beat.machine_id, beat.key, beat.time_ns, beat.hardware_report
            )

        acquired = False
        with trio.move_on_after(self.queue_timeout):
            await self._slots.acquire()
            acquired = True  # no checkpoint between: a slot taken is a slot known
        if not acquired:
            raise ConnectError("unavailable", "overloaded, try again later")
        try:
            outcome = await self._conn.transact(record, isolation=Isolation.READ_COMMITTED)
        except InvalidArgument as exc:
            raise ConnectError("invalid_argument", str(exc)) from exc
        except BMDBError as exc:
            logger.warning("heartbeat of %s not recorded: %s", beat.machine_id, exc)
            raise ConnectError("unavailable", "could not record heartbeat") from exc
        finally:
            self._slots.release()
        if outcome is HeartbeatOutcome.UNKNOWN_AGENT:
            logger.info("refused heartbeat: unknown machine %s or key", beat.machine_id)
            raise ConnectError("unauthenticated", "machine id or public key unknown")
        if outcome is HeartbeatOutcome.REPLAYED:
            logger.warning("refused replayed heartbeat for %s", beat.machine_id)
            raise ConnectError("unauthenticated", "replayed request")
        logger.debug(
            "heartbeat from %s%s",
            beat.machine_id,
            " with hardware report" if beat.hardware_report is not None else "",
        )
        return _EMPTY_RESPONSE
