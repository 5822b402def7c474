"""Work: a lock on (machine, process) held by a session, and its outcome.

Claiming, and why it scales
---------------------------
Many workers source machines for the same process at once. The Go original
took the first candidate of an anti-join with ``LIMIT 1`` and no lock, so
parallel workers all picked the same row and all but one failed on the
unique key of ``work``. Adding ``FOR UPDATE SKIP LOCKED`` to that joined query is not
enough: once the winner commits, its row lock is gone, and a worker whose
snapshot predates the commit still sees the machine as free (the joined
``work`` row is not re-checked) and claims it again.

Our claim runs in one REPEATABLE READ transaction::

    source(q)      SELECT candidates ... FOR UPDATE OF machines SKIP LOCKED
                   (locking sources pick among the oldest few at random)
       │           snapshot S taken here
       ▼
    claim()        INSERT work (or take over a dead session's row),
                     unless an operator holds the machine or it is being
                     decommissioned (then only the decommissioner claims it)
                   UPDATE machines SET work_generation += 1
                   INSERT history 'Started'
                   ... all only if our session is alive
       │
    COMMIT

Invariant: every claim updates the machine row. So a machine claimed by a
transaction that committed after S has a row version newer than S, and
locking it raises a serialization failure in our transaction (retried from
scratch with a fresh snapshot) instead of claiming it twice. A machine
claimed before S shows its work row (or, if that work already finished,
its tags and backoff) in S, and the source query skips it. Machines being
claimed right now are locked and skipped without waiting. Picking at random
among the oldest `SOURCING_WINDOW` candidates makes it rare that two workers
go for the same machine in the first place; the benchmark counts how rare.

Operator actions (`bmdb.actions`) lock and update the machine row the same
way, so a claim sourced before a hold committed fails to lock the machine
and retries, then sees the hold (which the claim statement checks too).

Isolation
---------
The work transactions (claim, finish, fail) run REPEATABLE READ, not
SERIALIZABLE like `Session.transact`, on purpose. SSI takes its predicate
locks on whole index pages, and these transactions all touch the same few
hot pages (the tiny ``work`` table, the tag indexes, ``machines``): with 16
workers, SERIALIZABLE finishes aborted each other in about a quarter of all
attempts, although no two of them touched the same machine. Exclusion is
given by rows instead: a claim holds the machine row lock and bumps its
generation; finish and fail delete their own work row, so a takeover of an
expired lock (an UPDATE of that row) and a late finish cannot both commit
(the loser gets a serialization failure, retries, and finds the row gone:
`SessionExpired`). The ``apply`` function of `Work.finish` only writes the
tags of its own locked machine, which nothing else writes meanwhile.

Layering
--------
Work sits under `bmdb.session` and above `bmdb.transaction`. What it needs
of its session (the id, the transaction layer, and a way to report that the
session is gone) is a `Lease`, which `Session` creates and shares; so this
module never imports `bmdb.session`.
"""

from __future__ import annotations

import logging
import types
import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

from bmdb.backoff import Backoff
from bmdb.errors import (
    BMDBError,
    InvalidArgument,
    NothingToDo,
    SessionExpired,
    WorkClosed,
    WorkConflict,
)
from bmdb.model import Process, Queries, as_uuid
from bmdb.transaction import Isolation, Transactor

logger = logging.getLogger("bmdb.work")

T = TypeVar("T")

#: Seconds allowed for the shielded cancel when a work block is left early.
CANCEL_TIMEOUT = 5.0

_LIVE_SESSION = """
    SELECT 1 FROM sessions WHERE session_id = %(session)s AND session_deadline > now()
"""

#: The claim statement (see the module docstring). Public so that the
#: benchmark can replay exactly this SQL through pgbench.
CLAIM_SQL = f"""
    WITH live AS ({_LIVE_SESSION}),
    held AS (SELECT 1 FROM machine_hold WHERE machine_id = %(machine)s
             UNION ALL
             SELECT 1 FROM machine_decommission WHERE machine_id = %(machine)s
               AND (%(process)s::process <> 'ShepherdDecommission'
                    OR decommissioned_at IS NOT NULL)
             UNION ALL
             SELECT 1 FROM machine_pending_action
             WHERE machine_id = %(machine)s AND until > now()),
    claimed AS (
        INSERT INTO work (machine_id, session_id, process)
        SELECT %(machine)s, %(session)s, %(process)s::process
        WHERE EXISTS (SELECT 1 FROM live) AND NOT EXISTS (SELECT 1 FROM held)
        ON CONFLICT (machine_id, process) DO UPDATE SET session_id = EXCLUDED.session_id
            WHERE NOT EXISTS (SELECT 1 FROM sessions s WHERE s.session_id = work.session_id
                              AND s.session_deadline > now())
        RETURNING machine_id
    ),
    touched AS (
        UPDATE machines SET work_generation = work_generation + 1
        WHERE machine_id IN (SELECT machine_id FROM claimed)
    ),
    logged AS (
        INSERT INTO work_history (machine_id, process, event, session_id)
        SELECT machine_id, %(process)s::process, 'Started', %(session)s FROM claimed
    )
    SELECT EXISTS (SELECT 1 FROM live), EXISTS (SELECT 1 FROM claimed), EXISTS (SELECT 1 FROM held)
"""

#: Release the work row; record the outcome. The event is 'Finished',
#: 'Failed' or 'Canceled'. Finishing also clears the backoff. Public for the
#: benchmark, like `CLAIM_SQL`.
RELEASE_SQL = f"""
    WITH live AS ({_LIVE_SESSION}),
    released AS (
        DELETE FROM work
        WHERE machine_id = %(machine)s AND process = %(process)s::process
          AND session_id = %(session)s AND EXISTS (SELECT 1 FROM live)
        RETURNING machine_id
    ),
    unbacked AS (
        DELETE FROM work_backoff
        WHERE %(event)s::work_history_event = 'Finished'
          AND machine_id IN (SELECT machine_id FROM released) AND process = %(process)s::process
    ),
    logged AS (
        INSERT INTO work_history (machine_id, process, event, session_id, cause)
        SELECT machine_id, %(process)s::process, %(event)s::work_history_event, %(session)s,
               %(cause)s
        FROM released
    )
    SELECT EXISTS (SELECT 1 FROM live), EXISTS (SELECT 1 FROM released)
"""

_PREVIOUS_BACKOFF = """
    SELECT last_interval_seconds FROM work_backoff WHERE machine_id = %s AND process = %s
"""

_SET_BACKOFF = """
    INSERT INTO work_backoff (machine_id, process, until, cause, last_interval_seconds)
    VALUES (%(machine)s, %(process)s::process, now() + make_interval(secs => %(seconds)s::bigint),
            %(cause)s, %(seconds)s::bigint)
    ON CONFLICT (machine_id, process) DO UPDATE
    SET until = EXCLUDED.until, cause = EXCLUDED.cause,
        last_interval_seconds = EXCLUDED.last_interval_seconds
"""


class Lease:
    """A session as the work under it sees it: its id, the transaction layer
    it runs on, and whether it is known to be gone.

    `bmdb.session.Session` creates one and keeps it alive; every `Work` it
    claims holds the same lease. Whoever first learns that the session is
    gone calls `expire`, which wakes `wait_expired` (the session's heartbeat
    then cancels everything under the session).
    """

    def __init__(self, tx: Transactor, session_id: uuid.UUID, component: str) -> None:
        self.tx = tx
        self.id = session_id
        self.component = component
        self.why = ""
        self._expired = trio.Event()

    @property
    def expired(self) -> bool:
        """True once the session is known to have expired."""
        return self._expired.is_set()

    def expire(self, why: str) -> SessionExpired:
        """Record that the session is gone (the first reason wins) and return
        the `SessionExpired` to raise."""
        if not self._expired.is_set():
            self.why = why
            self._expired.set()
        return SessionExpired(f"session {self.id} ({self.component}) expired: {why}")

    async def wait_expired(self) -> None:
        """Return once `expire` was called."""
        await self._expired.wait()

    def require_live(self) -> None:
        """Raise `SessionExpired` if the session is known to be gone."""
        if self.expired:
            raise SessionExpired(f"session {self.id} ({self.component}) has expired")

    async def transact(self, fn: Callable[[Queries], Awaitable[T]]) -> T:
        """Run ``fn(queries)`` in a SERIALIZABLE transaction that first checks
        the session is still valid; see `bmdb.session.Session.transact`."""
        self.require_live()

        async def body(q: Queries) -> T:
            if not await q.execute(_LIVE_SESSION, {"session": self.id}):
                raise self.expire("deadline passed")
            return await fn(q)

        return await self.tx.run(Isolation.SERIALIZABLE, body)


async def claim(
    lease: Lease,
    process: Process | str,
    source: Callable[[Queries], Awaitable[list[uuid.UUID]]],
) -> Work:
    """Source one machine with ``source`` and lock it for ``process`` under
    ``lease``; see `bmdb.session.Session.work` for the contract."""
    lease.require_live()
    parsed = Process.parse(process)
    stats = lease.tx.stats

    async def body(q: Queries) -> uuid.UUID:
        ids = await source(q)
        if not ids:
            raise NothingToDo(f"no machine to work on for {parsed}")
        if len(ids) != 1:
            raise InvalidArgument(f"a work source must return one machine, got {len(ids)}")
        machine_id = as_uuid(ids[0])
        rows = await q.execute(
            CLAIM_SQL, {"machine": machine_id, "session": lease.id, "process": parsed}
        )
        live, claimed, held = rows[0]
        if not live:
            raise lease.expire("deadline passed")
        if held:
            stats.conflicts += 1
            raise WorkConflict(
                f"machine {machine_id} is held by an operator or decommissioned (or being so)"
            )
        if not claimed:
            stats.conflicts += 1
            raise WorkConflict(f"machine {machine_id} already has live {parsed} work")
        return machine_id

    try:
        machine_id = await lease.tx.run(Isolation.REPEATABLE_READ, body, locking=True)
    except NothingToDo:
        stats.nothing_to_do += 1
        raise
    stats.claims += 1
    stats.work_started[lease.component, str(parsed)] += 1
    return Work(lease, machine_id, parsed)


class Work:
    """A claimed (machine, process), as returned by `Session.work`.

    Exactly one of `finish`, `fail` or `cancel` closes it; `finish` and
    `fail` on closed work raise `WorkClosed`, `cancel` is a no-op then. Used
    as an async context manager, the work is canceled on leaving the block
    unless it was closed (also when leaving through an exception or
    cancellation: the cancel then runs shielded, bounded by
    `CANCEL_TIMEOUT`).
    """

    def __init__(self, lease: Lease, machine_id: uuid.UUID, process: Process) -> None:
        self._lease = lease
        self.machine_id = machine_id
        self.process = process
        self._closed = False

    @property
    def session_id(self) -> uuid.UUID:
        """The id of the session holding this work."""
        return self._lease.id

    async def transact(self, fn: Callable[[Queries], Awaitable[T]]) -> T:
        """Run ``fn(queries)`` in a transaction of the session holding this
        work, apart from the work's outcome (exactly as `Session.transact`)."""
        return await self._lease.transact(fn)

    @property
    def closed(self) -> bool:
        """True once finished, failed or canceled."""
        return self._closed

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<Work {self.process} on {self.machine_id} ({state})>"

    async def __aenter__(self) -> Work:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        if not self._closed:
            with trio.CancelScope(shield=True) as scope:
                scope.relative_deadline = CANCEL_TIMEOUT
                await self.cancel()

    async def finish(self, apply: Callable[[Queries], Awaitable[None]] | None = None) -> None:
        """Release the work as done: delete the work row, clear the backoff,
        record "Finished" and run ``apply(queries)`` (to set the tags the work
        produced), all in one REPEATABLE READ transaction (see the module
        docstring), retried on serialization failures (so ``apply`` may run
        more than once).

        Raises `WorkClosed` if already closed, `SessionExpired` if the
        session (and with it the lock) is gone, and whatever ``apply`` raises
        (the work then stays open: fail or cancel it).
        """
        self._require_open()

        async def body(q: Queries) -> None:
            await self._release(q, "Finished", None)
            if apply is not None:
                await apply(q)

        await self._close_with(Isolation.REPEATABLE_READ, body)
        self._count("Finished")

    async def fail(self, cause: str, backoff: Backoff | None = None) -> None:
        """Release the work as failed: record "Failed" with ``cause`` and, if
        ``backoff`` is given, hide the machine from this process for the next
        backoff interval (growing on repeated failures, see `Backoff`).

        Raises `WorkClosed` if already closed, `SessionExpired` if the session
        is gone, `InvalidArgument` for an empty cause.
        """
        self._require_open()
        if not cause:
            raise InvalidArgument("a failure needs a cause")

        async def body(q: Queries) -> None:
            await self._release(q, "Failed", cause)
            if backoff is not None:
                rows = await q.execute(_PREVIOUS_BACKOFF, (self.machine_id, self.process))
                seconds = backoff.next(rows[0][0] if rows else None)
                await q.execute(
                    _SET_BACKOFF,
                    {
                        "machine": self.machine_id,
                        "process": self.process,
                        "seconds": seconds,
                        "cause": cause,
                    },
                )

        await self._close_with(Isolation.REPEATABLE_READ, body)
        self._count("Failed")

    async def cancel(self) -> None:
        """Release the work without an outcome: record "Canceled". Idempotent.

        Never raises for an expired session or an unreachable database (the
        lock then dies with the session; the collector records it); it logs
        instead. Cancellation of the caller still propagates.
        """
        if self._closed:
            return

        async def body(q: Queries) -> None:
            await self._release(q, "Canceled", None)

        try:
            await self._close_with(Isolation.READ_COMMITTED, body)
        except BMDBError as e:
            logger.warning("canceling %r: %s", self, e)
            self._closed = True
        else:
            self._count("Canceled")

    def _count(self, result: str) -> None:
        key = (self._lease.component, str(self.process), result)
        self._lease.tx.stats.work_finished[key] += 1

    def _require_open(self) -> None:
        if self._closed:
            raise WorkClosed(f"{self!r} was already finished, failed or canceled")

    async def _close_with(
        self, isolation: Isolation, body: Callable[[Queries], Awaitable[None]]
    ) -> None:
        try:
            await self._lease.tx.run(isolation, body)
        except SessionExpired:
            self._closed = True
            raise
        self._closed = True

    async def _release(self, q: Queries, event: str, cause: str | None) -> None:
        rows = await q.execute(
            RELEASE_SQL,
            {
                "machine": self.machine_id,
                "process": self.process,
                "session": self._lease.id,
                "event": event,
                "cause": cause,
            },
        )
        live, released = rows[0]
        if not live:
            raise self._lease.expire("deadline passed")
        if not released:
            raise SessionExpired(f"{self!r}: the work row is gone (taken over or deleted)")
