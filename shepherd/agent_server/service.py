"""Heartbeat: authenticate an agent's request and record it in the BMDB.

Checks, in order, each refusing with nothing written::

    body is a HeartbeatRequest         else invalid_argument
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
    BMDB, one statement:
      key == the AgentStarted tag's    else unauthenticated ("unknown")
      time > last accepted time        else unauthenticated ("replayed")
      write heartbeat (+ report)
      read the pending OS installation request
    with an installation report of the
    pending request's generation:      write it (others: ignored, logged)
    answer: the pending request (if any), the new session (if signed)

The OS installation flow (issue 25) rides on heartbeats: while a machine
has a stored installation request of generation g and no stored report of
a generation >= g, every answer to its agent carries that request
(``HeartbeatResponse.installation_request``, the stored bytes embedded as
they are, being a serialized OSInstallationRequest already). The agent
installs and reports the outcome (``HeartbeatRequest.installation_report``)
in a later heartbeat; a report is stored only if it is of the generation
currently requested (an older or newer one is logged at INFO and ignored,
the heartbeat itself accepted), and from then on the answers no longer
carry the request. A report on the current generation after its own was
stored is what the agent finds of that install later (after its restart,
or the disk emptied behind its back): stored beside the report when that
is a success of the same node key (`Queries.record_installation_check`),
ignored otherwise. The request is read by the statement that writes the
heartbeats, so a group costs no more statements than before; a report
costs one more, in the group's transaction. A stored request the agent
could not read or would run under another generation (`request_refusal`:
too large for its answer bound, not decoding, its generation not the
row's) is never carried: the server stores an error report on the row's
generation in its place, with the cause, so the views show the install
failed and why, and a new generation can be asked for. A report's error
cause is a machine's text: made `common.text.printable` before it is
stored or logged; a report is stored as built again from its checked
fields, without fields this server does not know. A report that is
malformed (no result, generation not positive, a node public key that is
neither empty nor 32 bytes) refuses the heartbeat with invalid_argument,
writing nothing. A machine an operator asked to decommission is carried
no request from then on (a report on the pending generation is still
stored, so that the decommissioner learns of the node an install already
under way started).

A signed heartbeat, once written, is answered with a new session
(`shepherd.agent_server.session`), with which the agent then MACs its
heartbeats instead of signing them: a signature check costs more CPU than
all the rest of a heartbeat, a MAC check a hundredth of it. The MAC covers
exactly what the signature covers, and the checks after it are the same.

Why signatures instead of the reference's client certificates: a signature
also works behind a TLS-terminating proxy, and the server's TLS needs no
client-certificate handling. What a signature alone would not stop, a
replay, is stopped by the time check: within the freshness window by the
monotonic per-machine time kept in the BMDB, beyond it by the window.

The same response for "no such machine" and "wrong key", so that nobody
learns which machines exist without holding an agent key.

Group commit: concurrent heartbeats are written together, one transaction
and one statement (`bmdb.Queries.record_agent_heartbeats`) per group,
because a transaction's fixed cost (round trips, commit, the Python that
drives them) is most of a heartbeat's database cost::

    heartbeat()  authenticate, queue ---------------------+   wait for own outcome
    writer       first in queue -> wait `batch_window` -> take up to `max_batch`
                 (one per machine) -> write in a db slot -> wake each member

Each heartbeat is answered only after the transaction that wrote it
committed: nothing is acknowledged that is not durable. If the group's
transaction fails, every member is answered ``unavailable`` (the agents
retry) and nothing of the group is written. While slots are busy the
queue grows, so groups grow with load; at low load a heartbeat waits at
most `batch_window` longer than alone.

The write does not go through the server's BMDB session (`Session.transact`
checks the session first, one more statement, and fails every heartbeat
while the session is being replaced): a heartbeat takes no work lock, and
under overload the session's own poke, which competes with the heartbeats
for database connections, must not take every heartbeat down with it. So
the service bounds its database use instead: at most ``db_slots``
transactions at once (fewer than the pool, which keeps room for the poke),
and a heartbeat still queued after ``queue_timeout`` (no slot freed in
time) is taken out of the queue and answered ``unavailable`` (the agent
backs off) rather than queued forever. One already being written waits
for its transaction. That timeout is enforced by one task that looks at
the oldest queued heartbeats every quarter of ``queue_timeout`` (so it
fires up to that late), not by a deadline on each heartbeat: a deadline
costs Trio's deadline bookkeeping twice per heartbeat, a visible share of
its CPU in the benchmark's profile.

Verified public keys are cached by their bytes (bounded), which saves
decoding the key, not checking: every signed request's signature is verified.

Long poll: a request reaches its agent at once, not at the agent's next
heartbeat. A heartbeat may ask to be held (`protocol.HEADER_HOLD`, the
agent's interval); a session's heartbeat (not a signed one, which gets
its session at once) is, once written, if its answer carries nothing,
held until a request for its machine is written, then answered with it,
or answered empty when its time is up (at most ``max_hold``); the agent
sends its next heartbeat as soon as a held answer comes, so heartbeats
still come once an interval and the liveness the BMDB records is as
before::

    heartbeat (hold h)  registered for its machine ----------+ notification (machine id)
      written as above: carries a request? answer now        | marks it
      else held: notified (during the write, or now) -> read the machine's request, answer it
                 h passed (a sweep every HOLD_TICK)  -> answer empty; the agent's next
                                                        heartbeat, at once, reads it
                 a newer heartbeat of the machine holds -> answer empty

The wake is PostgreSQL's LISTEN/NOTIFY (`bmdb.notify`): the transaction
that writes a request notifies with the machine's id (`bmdb.model.channels`)
and each server process listens on one connection of its own. Guarantees:

- no request is lost when a notification is: the heartbeat is registered
  before its write reads the request (a request committed after that
  read notifies a registered heartbeat), each LISTEN (the first, and after
  a lost connection: a server restarted, a failover) is followed by one
  read of the machines with a request, which counts as their
  notification, and a held answer that times out is followed at once by
  the agent's next heartbeat, which reads it;
- held heartbeats are bounded (``max_held`` per process; beyond it, and
  while the server is not listening, heartbeats are answered at once and
  the agent waits its interval as it did before);
- only a heartbeat the database accepted is held or replaces another: a
  client without the machine's agent key holds nothing; one with it holds
  one connection at a time;
- a server restart or failover closes held connections or answers them:
  the agents send again (their usual retry), which reads what is pending.

Cost when nothing is pending: no statement and no timer per held
heartbeat (a heap entry, swept every `HOLD_TICK`), one connection per
process; a heartbeat that asks no hold pays one header lookup.

Why not simpler: polling faster multiplies the fleet's heartbeat writes;
the Shepherd telling the agent over SSH needs a connection per machine it
asks; a request pushed on the agent's kept-alive connection is what a long
poll is, in HTTP/1.1, without a second protocol.
"""

from __future__ import annotations

import binascii
import dataclasses
import heapq
import hmac
import itertools
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
from bmdb.model import MAX_INSTALLATION_TEXT, AgentHeartbeat, HeartbeatOutcome, channels
from bmdb.model.agents import HeartbeatResult
from common.numbers import parse_decimal
from common.protobuf import checked_fields, parse_checked
from common.text import printable
from metropolis.proto.configuration import OsImageRef
from shepherd.agent import wire
from shepherd.agent.heartbeat import MAX_ANSWER
from shepherd.agent.protocol import (
    HEADER_HOLD,
    HEADER_KEY,
    HEADER_MAC,
    HEADER_SESSION,
    HEADER_SIGNATURE,
    HEADER_TIME,
    HEARTBEAT_PATH,
    signed_message,
)
from shepherd.agent_server.connect import ConnectError
from shepherd.agent_server.session import TOKEN_BYTES, SessionKeys, new_secret, session_mac
from shepherd.proto.agent_callback import (
    HeartbeatRequest,
    HeartbeatResponse,
    OsInstallationReport,
    OsInstallationReportError,
    OsInstallationReportSuccess,
    OsInstallationRequest,
    UpgradeReportState,
)
from shepherd.proto.agent_callback import UpgradeReport as UpgradeReportMessage

logger = logging.getLogger("shepherd.agent_server.service")

#: Default bound on |agent clock - server clock| for a request to count as fresh.
DEFAULT_FRESHNESS = 300.0

#: How often held heartbeats whose time is up are answered, seconds: one
#: is answered up to this much later than it asked (the agent's exchange
#: bound allows for it).
HOLD_TICK = 0.5

_EMPTY_RESPONSE = bytes(HeartbeatResponse())

#: Bound on a stored installation request the server carries: the agent
#: reads answers of at most `MAX_ANSWER` bytes (and ignores the rest), and
#: an answer holds the session beside the request.
MAX_CARRIED_REQUEST = MAX_ANSWER - 4096

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
class InstallationReport:
    """An agent's OSInstallationReport, checked and made safe to store."""

    generation: int
    #: The report as stored: built again from its checked fields alone (the
    #: cause as in `cause`), so that fields this server does not know, which
    #: an agent could make as large as its request, are not stored.
    raw: bytes
    success: bool
    #: Why it failed (`common.text.printable`); None for a success.
    cause: str | None
    #: The new node's Ed25519 public key (32 bytes), if a success sent one.
    node_public_key: bytes | None


@dataclass(frozen=True)
class UpgradeReport:
    """An agent's UpgradeReport, checked and made safe to store."""

    generation: int
    #: The state's name in lower case: "staged", "committed", "rolled-back", "failed".
    state: str
    detail: str
    slot: str


_UPGRADE_STATES = {
    UpgradeReportState.STAGED: "staged",
    UpgradeReportState.COMMITTED: "committed",
    UpgradeReportState.ROLLED_BACK: "rolled-back",
    UpgradeReportState.FAILED: "failed",
    UpgradeReportState.WRITTEN: "written",
}


def upgrade_report(report: UpgradeReportMessage) -> UpgradeReport:
    """The checked form of a parsed upgrade report; `ConnectError`
    invalid_argument if malformed (a generation that is not positive, no
    known state, a slot that is not a or b)."""
    if not 0 < report.generation < 2**63:
        raise ConnectError("invalid_argument", "upgrade report: generation not positive")
    state = _UPGRADE_STATES.get(report.state)
    if state is None:
        raise ConnectError("invalid_argument", "upgrade report: no known state")
    if report.slot not in ("", "a", "b"):
        raise ConnectError("invalid_argument", "upgrade report: slot is neither a nor b")
    return UpgradeReport(
        report.generation, state, printable(report.detail)[:MAX_INSTALLATION_TEXT], report.slot
    )


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


def installation_report(report: OsInstallationReport) -> InstallationReport:
    """The checked form of a parsed report; `ConnectError` invalid_argument if malformed."""
    generation = report.generation
    if not 0 < generation < 2**63:
        raise ConnectError("invalid_argument", "installation report: generation not positive")
    if report.success is not None:
        key = report.success.node_public_key
        if len(key) not in (0, 32):
            raise ConnectError(
                "invalid_argument", "installation report: node public key not 32 bytes"
            )
        safe = OsInstallationReport(
            generation=generation, success=OsInstallationReportSuccess(node_public_key=key)
        )
        return InstallationReport(generation, bytes(safe), True, None, key or None)
    if report.error is not None:
        cause = printable(report.error.error)
        safe = OsInstallationReport(
            generation=generation, error=OsInstallationReportError(error=cause)
        )
        return InstallationReport(generation, bytes(safe), False, cause, None)
    raise ConnectError("invalid_argument", "installation report without a result")


def _len_field_1(payload: bytes) -> bytes:
    """Field 1, length-delimited, holding ``payload`` (protobuf's encoding)."""
    head = bytearray(b"\x0a")
    length = len(payload)
    while length > 0x7F:
        head.append(length & 0x7F | 0x80)
        length >>= 7
    head.append(length)
    return bytes(head) + payload


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
_HOLD = HEADER_HOLD.lower()


def session_response(sessions: SessionKeys, beat: Heartbeat, now_ns: int) -> bytes:
    """The HeartbeatResponse to an accepted signed heartbeat: a new session."""
    token, key = sessions.issue(beat.machine_id, beat.key, now_ns)
    return wire.encode_heartbeat_session(wire.AgentSession(token, key, int(sessions.lifetime)))


def with_installation_request(response: bytes, request: bytes | None) -> bytes:
    """A HeartbeatResponse's bytes with ``installation_request`` (field 1) set to
    the serialized OSInstallationRequest ``request``, if given.

    The stored bytes are embedded as they are (an embedded message is a
    length-delimited field holding the message's bytes), before the rest:
    ``response`` holds only higher fields, so field order stays canonical.
    """
    return response if request is None else _len_field_1(request) + response


def with_upgrade_request(response: bytes, request: bytes | None) -> bytes:
    """A HeartbeatResponse's bytes with ``upgrade_request`` (field 101) set to
    the serialized UpgradeRequest ``request``, if given: after the rest, the
    highest field."""
    if request is None:
        return response
    head = bytearray(b"\xaa\x06")  # field 101, length-delimited
    length = len(request)
    while length > 0x7F:
        head.append(length & 0x7F | 0x80)
        length >>= 7
    head.append(length)
    return response + bytes(head) + request


@dataclass(eq=False, slots=True)
class _Pending:
    """A queued heartbeat and, once its group's transaction ended, its outcome.

    Its task sleeps in `trio.lowlevel.wait_task_rescheduled` until whoever
    takes it out of the queue (its group's writer, `_expire`) sets the
    outcome and reschedules it, once: a `trio.Event` per heartbeat (and its
    parking lot) was a visible share of the service's CPU.
    """

    beat: Heartbeat
    #: When it was queued (Trio time).
    queued_at: float
    task: trio.lowlevel.Task
    outcome: HeartbeatResult | ConnectError | None = None

    def wake(self, outcome: HeartbeatResult | ConnectError) -> None:
        self.outcome = outcome
        trio.lowlevel.reschedule(self.task)


_OVERLOADED = ConnectError("unavailable", "overloaded, try again later")


@dataclass(eq=False, slots=True)
class _Watch:
    """A heartbeat that may be held, from before its write until answered.

    Registered per machine before the heartbeat is queued, so that a
    notification for the machine that comes while it is written is not
    lost (`notified`); held, its task sleeps in
    `trio.lowlevel.wait_task_rescheduled` until a notification, its time,
    a newer heartbeat of the same machine, or cancellation.
    """

    machine_id: uuid.UUID
    #: Seconds it may be held.
    hold: float
    task: trio.lowlevel.Task
    #: A request for its machine was written since it was registered.
    notified: bool = False
    #: A newer heartbeat of the machine took its place.
    superseded: bool = False
    #: Sleeping until woken (only then may it be rescheduled).
    held: bool = False


@dataclass
class HoldStats:
    """Counters of held heartbeats (one service)."""

    #: Heartbeats held (that waited for a request).
    held: int = 0
    #: Held ones answered because a request for their machine was written.
    notified: int = 0
    #: Held ones answered empty because their time was up.
    timed_out: int = 0
    #: Held ones answered empty because a newer heartbeat of the machine came.
    superseded: int = 0
    #: Heartbeats that asked to be held and were answered at once: the
    #: bound on held heartbeats was reached, or the server was not listening.
    not_held: int = 0


class HeartbeatService:
    """The Heartbeat method, writing through ``conn`` in groups.

    `run` must be running (it is the writer) for `heartbeat` to answer.
    """

    def __init__(
        self,
        conn: Connection,
        *,
        freshness: float = DEFAULT_FRESHNESS,
        db_slots: int = 12,
        queue_timeout: float = 5.0,
        batch_window: float = 0.005,
        max_batch: int = 512,
        clock: Callable[[], int] = time.time_ns,
        sessions: SessionKeys | None = None,
        max_hold: float = 0.0,
        max_held: int = 8000,
    ) -> None:
        """``max_hold``: longest hold of an answer with nothing to carry,
        seconds (0: none; see the module's "Long poll"); ``max_held``: most
        heartbeats held at once."""
        if max_hold < 0 or max_held < 0:
            raise ValueError("max_hold and max_held must not be negative")
        self._conn = conn
        #: Issues and checks sessions; by default under a secret of this service's own.
        self.sessions = sessions if sessions is not None else SessionKeys(new_secret())
        self.freshness = freshness
        self._slots = trio.Semaphore(db_slots)
        self.queue_timeout = queue_timeout
        self.batch_window = batch_window
        self.max_batch = max_batch
        self._clock = clock
        # Insertion-ordered; a dict so that a timed-out member leaves in O(1).
        self._queue: dict[_Pending, None] = {}
        self._arrived = trio.Event()
        self.max_hold = max_hold
        self.max_held = max_held
        #: The heartbeats that may be held, by machine (usually one each).
        self._watches: dict[uuid.UUID, list[_Watch]] = {}
        #: How many are held now.
        self._held = 0
        #: (deadline, order, watch) of held heartbeats; answered ones stay
        #: until their deadline passes (cheaper than taking them out).
        self._deadlines: list[tuple[float, int, _Watch]] = []
        self._order = itertools.count()
        #: Whether requests are heard (`run`'s listener): holds only then.
        self._listening: Callable[[], bool] = lambda: False
        self.hold_stats = HoldStats()

    async def heartbeat(self, headers: Mapping[str, str], body: bytes) -> bytes:
        """Handle one request (a `shepherd.agent_server.connect.Handler`).

        Returns after the transaction that wrote the heartbeat committed.
        Cancelled while queued, the heartbeat leaves the queue; cancelled
        while its group is being written, the write still completes.
        """
        beat = authenticate(
            headers, body, now_ns=self._clock(), freshness=self.freshness, sessions=self.sessions
        )
        # Inline rather than a helper's frame: the common heartbeat asks no hold.
        # A signed one is answered at once: it gets the session its agent
        # MACs the next ones with (one after the agent starts, one an hour).
        watch = None
        if _HOLD in headers:
            hold = self._hold_asked(headers, beat.signed)
            if hold > 0:
                watch = self._watch(beat.machine_id, hold)
        try:
            pending = _Pending(beat, trio.current_time(), trio.lowlevel.current_task())
            queue = self._queue
            queue[pending] = None
            self._arrived.set()

            def abort(_: object) -> trio.lowlevel.Abort:
                if pending in queue:  # cancelled while queued: never written
                    del queue[pending]
                    return trio.lowlevel.Abort.SUCCEEDED
                return trio.lowlevel.Abort.FAILED  # being written: its writer wakes it

            # Woken by its group's writer, or by `_expire` (queued too long).
            await trio.lowlevel.wait_task_rescheduled(abort)
            result = pending.outcome
            if isinstance(result, ConnectError):  # shared by the group: raise a copy
                raise ConnectError(result.code, result.message)
            assert result is not None  # woken with an outcome, always
            outcome = result.outcome
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
            if (
                watch is not None
                and result.installation_request is None
                and result.upgrade_request is None
            ):
                result = await self._hold(watch)
            response = (
                session_response(self.sessions, beat, self._clock())
                if beat.signed
                else _EMPTY_RESPONSE
            )
            response = with_installation_request(response, result.installation_request)
            return with_upgrade_request(response, result.upgrade_request)
        finally:
            if watch is not None:
                self._unwatch(watch)

    def _hold_asked(self, headers: Mapping[str, str], signed: bool) -> float:
        """Seconds this heartbeat may be held: what it asks (`HEADER_HOLD`),
        at most `max_hold`; 0 when it asks none, is signed, or may not be
        held now (not listening, or `max_held` held already). `ConnectError`
        if the header is malformed."""
        text = headers[_HOLD]
        try:
            asked = parse_decimal(text, max_digits=9, what=HEADER_HOLD) / 1000
        except ValueError as exc:
            raise ConnectError("invalid_argument", str(exc)) from None
        if asked <= 0 or self.max_hold <= 0 or signed:
            return 0.0
        if self._held >= self.max_held or not self._listening():
            self.hold_stats.not_held += 1
            return 0.0
        return min(asked, self.max_hold)

    def _watch(self, machine_id: uuid.UUID, hold: float) -> _Watch:
        """Register a heartbeat that may be held, before it is written (so
        that a notification meanwhile marks it). Not yet authenticated by
        the database: it takes no other heartbeat's place until it holds."""
        watch = _Watch(machine_id, hold, trio.lowlevel.current_task())
        self._watches.setdefault(machine_id, []).append(watch)
        return watch

    def _unwatch(self, watch: _Watch) -> None:
        watches = self._watches[watch.machine_id]
        watches.remove(watch)
        if not watches:
            del self._watches[watch.machine_id]

    def _wake(self, watch: _Watch) -> None:
        watch.held = False
        self._held -= 1
        trio.lowlevel.reschedule(watch.task)

    def notified(self, channel: str, payload: str) -> None:
        """A notification (`bmdb.notify.Listener`'s ``on_notify``): a request
        was written for machine ``payload``; its held heartbeat, if any,
        reads it and answers. Payloads that are not machine ids are ignored."""
        try:
            machine_id = uuid.UUID(payload)
        except ValueError:
            logger.warning("ignoring a notification on %s of %r", channel, payload[:100])
            return
        for watch in self._watches.get(machine_id, ()):
            watch.notified = True
            if watch.held:
                self.hold_stats.notified += 1
                self._wake(watch)

    async def catch_up(self) -> None:
        """What the listener runs once it listens (again): every machine with
        a request to carry counts as notified, since its notification may
        have come while nobody listened. One statement."""
        if not self._watches:
            return
        async with self._slots:
            pending = await self._conn.transact(
                lambda q: q.machines_with_agent_requests(), isolation=Isolation.READ_COMMITTED
            )
        for machine_id in pending:
            self.notified(channels.AGENT_REQUEST, str(machine_id))

    async def _hold(self, watch: _Watch) -> HeartbeatResult:
        """Hold a written (so authenticated) heartbeat that carries nothing
        until a request for its machine is written (then read it: the
        answer), its time is up, or a newer heartbeat of its machine holds
        (then nothing). Cancelled, it ends at once."""
        if not watch.notified:
            if self._held >= self.max_held:
                self.hold_stats.not_held += 1
                return _ACCEPTED
            for other in self._watches[watch.machine_id]:
                if other.held:  # an older one (the agent gave up on it): this one replaces it
                    other.superseded = True
                    self.hold_stats.superseded += 1
                    self._wake(other)
            self.hold_stats.held += 1
            deadline = trio.current_time() + watch.hold
            heapq.heappush(self._deadlines, (deadline, next(self._order), watch))
            watch.held = True
            self._held += 1

            def abort(_: object) -> trio.lowlevel.Abort:
                watch.held = False  # nobody reschedules it now
                self._held -= 1
                return trio.lowlevel.Abort.SUCCEEDED

            await trio.lowlevel.wait_task_rescheduled(abort)
        if watch.notified and not watch.superseded:
            return await self._read_pending(watch.machine_id)
        return _ACCEPTED

    async def _read_pending(self, machine_id: uuid.UUID) -> HeartbeatResult:
        """The machine's request to carry, read anew (as its group's write
        reads it, refusals stored the same way). A database that fails it
        answers nothing: the agent's next heartbeat reads it again."""
        notes: list[str] = []

        async def body(q: Queries) -> HeartbeatResult:
            notes.clear()  # a retried transaction starts over
            result = await q.agent_pending(machine_id)
            raw, generation = result.installation_request, result.installation_generation
            if raw is not None and generation is not None:
                why = request_refusal(raw, generation)
                if why is not None:
                    await _refuse_request(q, machine_id, generation, why, notes)
                    # Refused: not carried (an upgrade stays).
                    return dataclasses.replace(
                        result, installation_request=None, installation_generation=None
                    )
            return result

        try:
            async with self._slots:
                result = await self._conn.transact(body, isolation=Isolation.READ_COMMITTED)
        except BMDBError as exc:
            logger.warning(
                "machine %s: request not read for its held heartbeat: %s", machine_id, exc
            )
            return _ACCEPTED
        for note in notes:
            logger.info("%s", note)
        return result

    async def _release_holds(self) -> None:
        """Answer held heartbeats whose time is up, every `HOLD_TICK`, until cancelled."""
        deadlines = self._deadlines
        while True:
            await trio.sleep(HOLD_TICK)
            now = trio.current_time()
            while deadlines and deadlines[0][0] <= now:
                watch = heapq.heappop(deadlines)[2]
                if watch.held:
                    self.hold_stats.timed_out += 1
                    self._wake(watch)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The writer: form groups from the queue and write them, until cancelled.

        Cancelled, groups being written are cancelled too (their transactions
        roll back; their members are answered ``unavailable``, if anyone
        still listens).
        """
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._expire)
            if self.max_hold > 0:
                nursery.start_soon(self._release_holds)
                listener = self._conn.listener(
                    [channels.AGENT_REQUEST], self.notified, on_listening=self.catch_up
                )
                self._listening = lambda: listener.listening
                await nursery.start(listener.run)
            task_status.started()
            while True:
                while not self._queue:
                    self._arrived = trio.Event()
                    await self._arrived.wait()
                if self.batch_window > 0 and len(self._queue) < self.max_batch:
                    await trio.sleep(self.batch_window)
                await self._slots.acquire()
                group = self._take()
                if group:
                    nursery.start_soon(self._write, group)
                else:  # all of them timed out while waiting for the slot
                    self._slots.release()

    async def _expire(self) -> None:
        """Answer ``unavailable`` to each heartbeat queued longer than
        `queue_timeout`, looking every quarter of it, until cancelled."""
        while True:
            await trio.sleep(self.queue_timeout / 4)
            oldest_allowed = trio.current_time() - self.queue_timeout
            expired = []
            for pending in self._queue:  # oldest first
                if pending.queued_at >= oldest_allowed:
                    break
                expired.append(pending)
            for pending in expired:
                del self._queue[pending]
                pending.wake(_OVERLOADED)

    def _take(self) -> list[_Pending]:
        """Up to `max_batch` queued members, at most one per machine, out of the queue."""
        group: list[_Pending] = []
        machines: set[uuid.UUID] = set()
        for pending in self._queue:
            if pending.beat.machine_id not in machines:
                machines.add(pending.beat.machine_id)
                group.append(pending)
                if len(group) >= self.max_batch:
                    break
        for pending in group:
            del self._queue[pending]
        # Sorted: concurrent groups then lock their machines in the same order.
        group.sort(key=lambda p: p.beat.machine_id.int)  # ints: compared in C
        return group

    async def _write(self, group: list[_Pending]) -> None:
        """Write ``group`` in one transaction (holding a slot) and wake its members."""
        beats = [
            AgentHeartbeat(b.machine_id, b.key, b.time_ns, b.hardware_report)
            for b in (p.beat for p in group)
        ]

        # Members with an installation report (rare: one per install).
        reporting = [
            (index, p.beat.machine_id, p.beat.installation_report)
            for index, p in enumerate(group)
            if p.beat.installation_report is not None
        ]
        # Members with an upgrade report (rare: a few per upgrade).
        upgrading = [
            (index, p.beat.machine_id, p.beat.upgrade_report)
            for index, p in enumerate(group)
            if p.beat.upgrade_report is not None
        ]
        notes: list[str] = []

        async def record(q: Queries) -> list[HeartbeatResult]:
            notes.clear()  # a retried transaction starts over
            results = await q.record_agent_heartbeats_pending(beats)
            for index, machine_id, report in reporting:
                result = results[index]
                if (
                    report is not None
                    and result.outcome is HeartbeatOutcome.ACCEPTED
                    and await _record_report(q, machine_id, report, result, notes)
                ):
                    # Reported: no longer pending (an upgrade request stays).
                    results[index] = dataclasses.replace(
                        result, installation_request=None, installation_generation=None
                    )
            for index, machine_id, upgrade in upgrading:
                if upgrade is not None and results[index].outcome is HeartbeatOutcome.ACCEPTED:
                    await _record_upgrade_report(q, machine_id, upgrade, results[index], notes)
            for index, result in enumerate(results):
                raw, generation = result.installation_request, result.installation_generation
                if raw is None or generation is None:
                    continue
                why = request_refusal(raw, generation)
                if why is not None:
                    await _refuse_request(q, group[index].beat.machine_id, generation, why, notes)
                    # Refused: not carried, no longer pending (an upgrade stays).
                    results[index] = dataclasses.replace(
                        results[index], installation_request=None, installation_generation=None
                    )
            return results

        # What members learn if the write is cancelled (server stopping).
        outcomes: list[HeartbeatResult | ConnectError]
        outcomes = [ConnectError("unavailable", "server stopping")] * len(group)
        try:
            outcomes = list(await self._conn.transact(record, isolation=Isolation.READ_COMMITTED))
            for note in notes:
                logger.info("%s", note)
        except InvalidArgument as exc:
            logger.warning("heartbeat group of %d refused: %s", len(group), exc)
            outcomes = [ConnectError("invalid_argument", str(exc))] * len(group)
        except BMDBError as exc:
            logger.warning("heartbeat group of %d not recorded: %s", len(group), exc)
            outcomes = [ConnectError("unavailable", "could not record heartbeat")] * len(group)
        except Exception:
            logger.exception("heartbeat group of %d crashed", len(group))
            outcomes = [ConnectError("internal", "internal error")] * len(group)
        finally:
            self._slots.release()
            for pending, outcome in zip(group, outcomes, strict=True):
                pending.wake(outcome)


_ACCEPTED = HeartbeatResult(HeartbeatOutcome.ACCEPTED)


def request_refusal(raw: bytes, generation: int) -> str | None:
    """Why the stored installation request ``raw`` of ``generation`` (the
    row's) must not be carried to the agent, or None.

    Refused: a request over `MAX_CARRIED_REQUEST` bytes (the agent would
    ignore the answer), one that does not decode as an OSInstallationRequest
    (wrong wire types, cut short; checked as from a peer,
    `common.protobuf.parse_checked`) or whose ``os_image`` does not decode
    as an OSImageRef (the agent would ignore it as malformed), and one
    whose own generation is not the row's (the agent would install and
    report another generation than the one asked for, and then take every
    later request up to it as already run). The agent checks the rest
    itself and reports its refusals: the root device, the digest, the
    image's address, the size of the node parameters.
    """
    if len(raw) > MAX_CARRIED_REQUEST:
        return f"request of {len(raw)} bytes, over the bound of {MAX_CARRIED_REQUEST}"
    try:
        request = parse_checked(OsInstallationRequest, raw)
        image = request.metropolis.os_image if request.metropolis is not None else None
        if image is not None:
            parse_checked(OsImageRef, image)
    except ValueError as exc:
        return f"request does not decode: {exc}"
    if request.generation != generation:
        return f"request names generation {request.generation}, the BMDB requests {generation}"
    return None


async def _refuse_request(
    q: Queries, machine_id: uuid.UUID, generation: int, why: str, notes: list[str]
) -> None:
    """Store the error report on ``generation`` that the server makes for a
    request it does not carry, so that the views show it failed and why."""
    cause = printable(f"refused by the agent callback server, not sent to the agent: {why}")
    report = OsInstallationReport(
        generation=generation, error=OsInstallationReportError(error=cause)
    )
    await q.record_os_installation_report(machine_id, generation, bytes(report), False, cause, None)
    notes.append(f"machine {machine_id}: installation {generation} failed: {cause}")


async def _record_report(
    q: Queries,
    machine_id: uuid.UUID,
    report: InstallationReport,
    result: HeartbeatResult,
    notes: list[str],
) -> bool:
    """Store ``report`` if it is of the pending request's generation (True);
    else, as what the agent finds of the generation it installed, if that is
    the machine's current one and installed (`Queries.record_installation_check`:
    still there, or gone); else add why it is ignored to ``notes`` (False)."""
    if report.generation != result.installation_generation:
        checkable = (report.node_public_key is not None) != (report.cause is not None)
        if checkable and await q.record_installation_check(
            machine_id, report.generation, report.node_public_key, report.cause
        ):
            what = "still there" if report.success else f"gone: {report.cause}"
            notes.append(f"machine {machine_id}: installation {report.generation} {what}")
            return False
        pending = (
            f"generation {result.installation_generation} is requested"
            if result.installation_generation is not None
            else "no installation request is pending"
        )
        notes.append(
            f"machine {machine_id}: ignored installation report of generation"
            f" {report.generation}: {pending}"
        )
        return False
    await q.record_os_installation_report(
        machine_id,
        report.generation,
        report.raw,
        report.success,
        report.cause,
        report.node_public_key,
    )
    if report.success:
        notes.append(f"machine {machine_id}: installation {report.generation} succeeded")
    else:
        notes.append(
            f"machine {machine_id}: installation {report.generation} failed: {report.cause}"
        )
    return True


async def _record_upgrade_report(
    q: Queries,
    machine_id: uuid.UUID,
    report: UpgradeReport,
    result: HeartbeatResult,
    notes: list[str],
) -> None:
    """Store ``report`` if it is on the machine's requested upgrade; else note
    why it is ignored."""
    if report.generation != result.upgrade_generation:
        notes.append(
            f"machine {machine_id}: ignored upgrade report of generation {report.generation}"
            f" (requested: {result.upgrade_generation or 'none'})"
        )
        return
    if await q.record_upgrade_report(
        machine_id, report.generation, report.state, report.detail, report.slot
    ):
        notes.append(
            f"machine {machine_id}: upgrade {report.generation} {report.state}: {report.detail}"
        )
