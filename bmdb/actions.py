"""Operator actions on machines, each one transaction with its audit record.

::

    retry-now        end the machine's active backoffs (of one process, or all)
    hold             offer the machine to no process until it is released
    release          end a hold
    forget-host-key  forget the pinned SSH host key (after a real reinstall):
                     the next takeover pins the key it then sees
    recover-now      have the recoverer take the machine at once, whatever
                     its heartbeat says (it reboots it if the provider can,
                     and the initializer takes it over anew)
    forget-machine   delete a machine its provider no longer lists (the
                     updater recorded it as Missing), history and all
    decommission     ask the Shepherd's decommissioner to remove the machine's
                     cluster node from the cluster, wipe the machine,
                     have its provider release it, and keep it as a
                     tombstone; from now on no other process takes it

Every action runs as one SERIALIZABLE transaction that

1. locks the machine row (``FOR UPDATE``): a claim being sourced skips the
   machine (its sources lock with ``SKIP LOCKED``), a claim already writing
   waits for us and then fails to serialize, and one sourced before we
   commit fails to lock the row we changed (see `bmdb.work`);
2. refuses, writing nothing, if the machine has live work of any process
   (`MachineBusy`; ``release`` excepted, which no work can race): an action
   never changes a machine under a worker's feet;
3. checks what the action needs (a backoff to end, a hold to release, a key
   to forget, ...) and refuses with `ActionRefused` otherwise;
4. makes the change and bumps the machine's work generation;
5. appends the audit record: who (the operator), when (the database's
   clock), what (the action and a line saying what changed), why (the
   operator's reason, required).

`act` with ``wait`` > 0 tries a busy machine again, pausing through
`common.backoff`, until its work is gone or the time is up; without, a busy
machine is refused at once. The first time it finds the machine busy, it
commits a pending-action row (migration 0008) that stops every process
from claiming the machine anew, so the action lands as soon as the work in
progress ends, however busy the workers (it is never starved). The row
goes in the transaction that lands the action, or when the waiter gives
up, fails or is cancelled; a waiter killed outright leaves it, but the row
expires when the wait would have ended, so a dead waiter keeps the machine
from new work no longer than a live one would have. Cancellation rolls back whatever was not
committed. Bad input (an unknown action or machine, an empty reason, an
operator name or reason that is not one printable line) is
`InvalidArgument`, before anything is written.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import math
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from bmdb._pg import Row
from bmdb.connection import Connection
from bmdb.errors import BMDBError, InvalidArgument
from bmdb.model import AuditRecord, Process, Queries, as_uuid
from bmdb.model.enums import Action as Action
from bmdb.transaction import Isolation
from common.backoff import ExponentialBackoff, Retrier

logger = logging.getLogger("bmdb.actions")

#: Longest operator name and reason accepted (characters).
MAX_OPERATOR = 100
MAX_REASON = 1000

#: Seconds allowed to delete the pending row of a waiter that gave up.
_UNPEND_TIMEOUT = 5.0

#: Pauses between tries on a busy machine (``wait``).
WAIT_BACKOFF = ExponentialBackoff(initial=0.1, maximum=2.0, multiplier=1.5)


class ActionRefused(BMDBError):
    """The action does not apply to the machine as it is (nothing to end,
    release or forget; a provider that still lists it). Nothing was written."""


@dataclass(frozen=True)
class LiveWork:
    """Work that keeps an action off a machine."""

    process: Process
    component: str
    session_id: uuid.UUID


class MachineBusy(ActionRefused):
    """The machine has live work; the action waited no longer and wrote nothing."""

    def __init__(self, message: str, work: list[LiveWork]) -> None:
        super().__init__(message)
        self.work = work


def check_text(what: str, value: str, limit: int) -> str:
    """``value`` stripped, or `InvalidArgument` unless it is one printable
    line of 1 to ``limit`` characters."""
    if not isinstance(value, str):
        raise InvalidArgument(f"{what} must be text")
    text = value.strip()
    if not text:
        raise InvalidArgument(f"{what} must not be empty")
    if len(text) > limit:
        raise InvalidArgument(f"{what} is over {limit} characters")
    if not text.isprintable():
        raise InvalidArgument(f"{what} must be one line of printable characters")
    return text


_LOCK = "SELECT machine_id FROM machines WHERE machine_id = %s FOR UPDATE"

_LIVE_WORK = """
    SELECT w.process, s.session_component_name, s.session_id FROM work w
    JOIN sessions s ON s.session_id = w.session_id
    WHERE w.machine_id = %s AND s.session_deadline > now()
    ORDER BY w.process
"""

_BUMP = "UPDATE machines SET work_generation = work_generation + 1 WHERE machine_id = %s"

_AUDIT = """
    INSERT INTO audit_log (operator, action, machine_id, reason, detail)
    VALUES (%s, %s, %s, %s, %s)
    RETURNING id, at, operator, action, machine_id, reason, detail
"""

_HELD = "SELECT held_by, held_at, reason FROM machine_hold WHERE machine_id = %s"


@dataclass(frozen=True)
class _Request:
    machine_id: uuid.UUID
    operator: str
    reason: str
    process: Process | None


async def _retry_now(q: Queries, r: _Request) -> str:
    rows = await q.execute(
        """SELECT process, until, cause FROM work_backoff
           WHERE machine_id = %(m)s AND until > now()
             AND (%(p)s::process IS NULL OR process = %(p)s::process)
           ORDER BY process""",
        {"m": r.machine_id, "p": r.process},
    )
    if not rows:
        which = f" of {r.process}" if r.process else ""
        raise ActionRefused(f"machine {r.machine_id} has no active backoff{which}")
    # The interval stays: a machine that fails again backs off longer.
    await q.execute(
        """UPDATE work_backoff SET until = now()
           WHERE machine_id = %s AND process = ANY(%s::process[])""",
        (r.machine_id, [row[0] for row in rows]),
    )
    ended = "; ".join(
        f"{process} (was until {until.isoformat(timespec='seconds')}, cause: {cause})"
        for process, until, cause in rows
    )
    held = await q.execute(_HELD, (r.machine_id,))
    note = f"; still held by {held[0][0]}" if held else ""
    return f"ended backoff of {ended}{note}"


async def _hold(q: Queries, r: _Request) -> str:
    held = await q.execute(_HELD, (r.machine_id,))
    if held:
        by, at, why = held[0]
        raise ActionRefused(
            f"machine {r.machine_id} is already held by {by} since "
            f"{at.isoformat(timespec='seconds')}: {why}"
        )
    await q.execute(
        "INSERT INTO machine_hold (machine_id, held_by, reason) VALUES (%s, %s, %s)",
        (r.machine_id, r.operator, r.reason),
    )
    return "held: no process takes the machine until it is released"


async def _release(q: Queries, r: _Request) -> str:
    rows = await q.execute(
        "DELETE FROM machine_hold WHERE machine_id = %s RETURNING held_by, held_at, reason",
        (r.machine_id,),
    )
    if not rows:
        raise ActionRefused(f"machine {r.machine_id} is not held")
    by, at, why = rows[0]
    return f"released the hold of {by} since {at.isoformat(timespec='seconds')} ({why})"


def fingerprint(key: bytes) -> str:
    """An SSH host key's OpenSSH-style fingerprint: ``SHA256:`` and base64."""
    return "SHA256:" + base64.b64encode(hashlib.sha256(key).digest()).decode().rstrip("=")


async def _forget_host_key(q: Queries, r: _Request) -> str:
    rows = await q.execute(
        "DELETE FROM machine_ssh_host_key WHERE machine_id = %s RETURNING public_key, first_seen",
        (r.machine_id,),
    )
    if not rows:
        raise ActionRefused(f"machine {r.machine_id} has no pinned SSH host key")
    key, first_seen = rows[0]
    return (
        f"forgot SSH host key {fingerprint(bytes(key))} (first seen "
        f"{first_seen.isoformat(timespec='seconds')}); the next takeover pins the key it sees"
    )


async def _recover_now(q: Queries, r: _Request) -> str:
    if not await q.execute(
        "SELECT 1 FROM machine_agent_started WHERE machine_id = %s", (r.machine_id,)
    ):
        raise ActionRefused(
            f"machine {r.machine_id} has no started agent to recover: the initializer takes "
            "it over (retry-now ends an agent-start backoff)"
        )
    held = await q.execute(_HELD, (r.machine_id,))
    if held:
        raise ActionRefused(f"machine {r.machine_id} is held by {held[0][0]}: release it first")
    inserted = await q.execute(
        """INSERT INTO machine_recovery_request (machine_id, requested_by) VALUES (%s, %s)
           ON CONFLICT (machine_id) DO NOTHING RETURNING 1""",
        (r.machine_id, r.operator),
    )
    if not inserted:
        raise ActionRefused(f"machine {r.machine_id}: a recovery is already requested")
    ended = await q.execute(
        """UPDATE work_backoff SET until = now()
           WHERE machine_id = %s AND process = %s AND until > now() RETURNING 1""",
        (r.machine_id, Process.SHEPHERD_RECOVERY),
    )
    also = f"; ended its {Process.SHEPHERD_RECOVERY} backoff" if ended else ""
    return f"recovery requested: the recoverer takes the machine at its next pass{also}"


async def _forget_machine(q: Queries, r: _Request) -> str:
    provided = await q.execute(
        """SELECT provider, provider_id, provider_address, provider_status
           FROM machine_provided WHERE machine_id = %s""",
        (r.machine_id,),
    )
    if provided and provided[0][3] != "Missing":
        provider, pid, _, status = provided[0]
        raise ActionRefused(
            f"machine {r.machine_id} ({provider}:{pid}) has provider status {status}: forget "
            "only machines the provider no longer lists (the updater marks them Missing)"
        )
    (events,) = await q.execute(
        "SELECT count(*) FROM work_history WHERE machine_id = %s", (r.machine_id,)
    )
    await q.execute("DELETE FROM machines WHERE machine_id = %s", (r.machine_id,))
    was = (
        f"{provided[0][0]}:{provided[0][1]} at {provided[0][2] or '-'}, status Missing"
        if provided
        else "not provided"
    )
    return f"deleted the machine ({was}) with its tags and {events[0]} history entries"


async def _decommission(q: Queries, r: _Request) -> str:
    rows = await q.execute(
        """SELECT requested_by, requested_at, decommissioned_at FROM machine_decommission
           WHERE machine_id = %s""",
        (r.machine_id,),
    )
    if rows:
        by, at, done = rows[0]
        state = f"decommissioned at {done.isoformat(timespec='seconds')}" if done else "requested"
        raise ActionRefused(
            f"machine {r.machine_id}: decommission {state} (asked by {by} at "
            f"{at.isoformat(timespec='seconds')})"
        )
    await q.execute(
        """INSERT INTO machine_decommission (machine_id, requested_by, reason)
           VALUES (%s, %s, %s)""",
        (r.machine_id, r.operator, r.reason),
    )
    return (
        "decommission requested: no other process takes the machine from now on; the "
        "decommissioner removes its cluster node (if it is one) from the cluster, has its agent "
        "wipe it, the provider release it, and keeps it as a tombstone"
    )


_HANDLERS: dict[Action, Callable[[Queries, _Request], Awaitable[str]]] = {
    Action.RETRY_NOW: _retry_now,
    Action.HOLD: _hold,
    Action.RELEASE: _release,
    Action.FORGET_HOST_KEY: _forget_host_key,
    Action.RECOVER_NOW: _recover_now,
    Action.FORGET_MACHINE: _forget_machine,
    Action.DECOMMISSION: _decommission,
}


_PEND = """
    WITH expired AS (
        DELETE FROM machine_pending_action WHERE machine_id = %(m)s AND until <= now()
    )
    INSERT INTO machine_pending_action (pending_id, machine_id, action, requested_by, until)
    VALUES (%(id)s, %(m)s, %(action)s, %(by)s, now() + make_interval(secs => %(left)s))
"""

_UNPEND = "DELETE FROM machine_pending_action WHERE pending_id = %s"


async def _pend(
    conn: Connection, mid: uuid.UUID, action: Action, operator: str, left: float
) -> uuid.UUID:
    """Commit a pending-action row for ``mid`` that expires when the wait
    does (``left`` seconds from now): from then on no process claims the
    machine anew, so its work in progress is the last (see migration
    0008). Returns the row's id."""
    pending = uuid.uuid4()

    async def insert(q: Queries) -> None:
        await q.execute(
            _PEND,
            {"id": pending, "m": mid, "action": str(action), "by": operator, "left": left},
        )

    await conn.transact(insert)
    logger.info("%s on %s waits for its work to end; no new claims meanwhile", action, mid)
    return pending


async def _unpend(conn: Connection, pending: uuid.UUID) -> None:
    """Delete the pending row of a waiter that gave up (or failed, or was
    cancelled), shielded. A failure to is logged, not raised: the row
    expires by itself when the wait would have ended."""

    async def delete(q: Queries) -> None:
        await q.execute(_UNPEND, (pending,))

    with trio.CancelScope(shield=True), trio.move_on_after(_UNPEND_TIMEOUT):
        try:
            await conn.transact(delete)
        except BMDBError as e:
            logger.warning("could not delete pending action %s (it expires): %s", pending, e)


def _audit_record(r: Row) -> AuditRecord:
    return AuditRecord(*r)


async def act(
    conn: Connection,
    action: Action | str,
    machine_id: uuid.UUID | str,
    *,
    operator: str,
    reason: str,
    process: Process | str | None = None,
    wait: float = 0.0,
    on_wait: Callable[[MachineBusy], None] | None = None,
) -> AuditRecord:
    """Do ``action`` on the machine and return its audit record (whose
    ``detail`` says what changed); see the module docstring.

    ``process`` narrows ``retry-now`` to one process's backoff (refused for
    the other actions). A machine with live work is retried for up to
    ``wait`` seconds (``on_wait`` is told the first time), then refused with
    `MachineBusy`. Raises `ActionRefused` when the action does not apply,
    `InvalidArgument` for bad input or an unknown machine, and the
    database's errors; whatever it raises, nothing was written.
    """
    try:
        chosen = Action(action)
    except ValueError:
        known = ", ".join(a.value for a in Action)
        raise InvalidArgument(f"unknown action {action!r} (known: {known})") from None
    mid = as_uuid(machine_id)
    request = _Request(
        machine_id=mid,
        operator=check_text("operator name", operator, MAX_OPERATOR),
        reason=check_text("reason", reason, MAX_REASON),
        process=None if process is None else Process.parse(str(process)),
    )
    if request.process is not None and chosen is not Action.RETRY_NOW:
        raise InvalidArgument(f"only {Action.RETRY_NOW} takes a process")
    if not (math.isfinite(wait) and wait >= 0):
        raise InvalidArgument(f"wait must be a non-negative number of seconds, got {wait!r}")
    handler = _HANDLERS[chosen]

    async def body(q: Queries) -> AuditRecord:
        if not await q.execute(_LOCK, (mid,)):
            raise InvalidArgument(f"no machine {mid}")
        if chosen is not Action.RELEASE:
            busy = [LiveWork(Process(p), c, s) for p, c, s in await q.execute(_LIVE_WORK, (mid,))]
            if busy:
                work = ", ".join(f"{w.process} by {w.component} (session {w.session_id})"
                                 for w in busy)  # fmt: skip
                raise MachineBusy(f"machine {mid} is under work: {work}; nothing changed", busy)
        detail = await handler(q, request)
        if chosen is not Action.FORGET_MACHINE:
            await q.execute(_BUMP, (mid,))
        rows = await q.execute(_AUDIT, (request.operator, str(chosen), mid, request.reason, detail))
        return _audit_record(rows[0])

    deadline = trio.current_time() + wait
    retrier = Retrier(WAIT_BACKOFF)
    pending: uuid.UUID | None = None

    async def landing(q: Queries) -> AuditRecord:
        record = await body(q)
        # The action and the end of its pending row commit together.
        await q.execute(_UNPEND, (pending,))
        return record

    try:
        while True:
            try:
                record = await conn.transact(
                    body if pending is None else landing, isolation=Isolation.SERIALIZABLE
                )
            except MachineBusy as busy:
                left = deadline - trio.current_time()
                if left <= 0:
                    if wait:
                        raise MachineBusy(
                            f"{busy} (still under work after waiting {wait:g}s)", busy.work
                        ) from None
                    raise MachineBusy(f"{busy} (--wait SECONDS waits for it)", busy.work) from None
                if pending is None:
                    pending = await _pend(conn, mid, chosen, request.operator, left)
                if retrier.failures == 0 and on_wait is not None:
                    on_wait(busy)
                await retrier.sleep(at_most=left)
                continue
            pending = None  # deleted with the action
            break
    finally:
        if pending is not None:
            await _unpend(conn, pending)
    logger.info(
        "audit #%d: %s %s on %s: %s (%s)",
        record.id,
        record.operator,
        record.action,
        mid,
        record.detail,
        record.reason,
    )
    return record
