"""What rides on heartbeats: installation and upgrade reports, and the
installation requests the server carries (issue 25).

While a machine has a stored installation request of generation g and no
stored report of a generation >= g, every answer to its agent carries that
request (``HeartbeatResponse.installation_request``, the stored bytes
embedded as they are, being a serialized OSInstallationRequest already;
`shepherd.agent_server.answers`). The agent installs and reports the
outcome (``HeartbeatRequest.installation_report``) in a later heartbeat; a
report is stored only if it is of the generation currently requested (an
older or newer one is logged at INFO and ignored, the heartbeat itself accepted),
and from then on the answers no longer carry the request. A report on the
current generation after its own was stored is what the agent finds of
that install later (after its restart, or the disk emptied behind its
back): stored beside the report when that is a success of the same node key
(`Queries.record_installation_check`), ignored otherwise. The request is
read by the statement that writes the heartbeats, so a group costs no more
statements than before; a report costs one more, in the group's
transaction (`shepherd.agent_server.service`).

A stored request the agent could not read or would run under another
generation (`request_refusal`: too large for its answer bound, not
decoding, its generation not the row's) is never carried: the server
stores an error report on the row's generation in its place
(`carried`, `refuse_request`), with the cause, so the views show the install failed
and why, and a new generation can be asked for.

A report's error cause is a machine's text: made `common.text.printable`
before it is stored or logged; a report is stored as built again from its
checked fields, without fields this server does not know. A report that is
malformed (no result, generation not positive, a node public key that is
neither empty nor 32 bytes) raises `ConnectError` invalid_argument, which
refuses the heartbeat, writing nothing. A machine an operator asked to
decommission is carried no request from then on (a report on the pending
generation is still stored, so that the decommissioner learns of the node
an install already under way started).

An upgrade report is stored when it is on the machine's requested upgrade
generation, noted and ignored otherwise.

The ``record_*``, `carried` and `refuse_request` coroutines run inside the caller's
transaction and append what they did to ``notes``, which the caller logs
once the transaction committed (a retried transaction starts its notes
over).
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass

from bmdb import Queries
from bmdb.model import MAX_INSTALLATION_TEXT
from bmdb.model.agents import HeartbeatResult
from common.protobuf import parse_checked
from common.text import printable
from metropolis.proto.configuration import OsImageRef
from shepherd.agent.heartbeat import MAX_ANSWER
from shepherd.agent_server.connect import ConnectError
from shepherd.proto.agent_callback import (
    OsInstallationReport,
    OsInstallationReportError,
    OsInstallationReportSuccess,
    OsInstallationRequest,
    UpgradeReportState,
)
from shepherd.proto.agent_callback import UpgradeReport as UpgradeReportMessage

#: Bound on a stored installation request the server carries: the agent
#: reads answers of at most `MAX_ANSWER` bytes (and ignores the rest), and
#: an answer holds the session beside the request.
MAX_CARRIED_REQUEST = MAX_ANSWER - 4096


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


async def carried(
    q: Queries, machine_id: uuid.UUID, result: HeartbeatResult, notes: list[str]
) -> HeartbeatResult:
    """``result`` as the answer to ``machine_id``'s agent may carry it: without
    its installation request if `request_refusal` refuses that one (which is
    then stored as failed, `refuse_request`, and so no longer pending); an
    upgrade request stays."""
    raw, generation = result.installation_request, result.installation_generation
    if raw is None or generation is None:
        return result
    why = request_refusal(raw, generation)
    if why is None:
        return result
    await refuse_request(q, machine_id, generation, why, notes)
    return dataclasses.replace(result, installation_request=None, installation_generation=None)


async def refuse_request(
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


async def record_installation_report(
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


async def record_upgrade_report(
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
