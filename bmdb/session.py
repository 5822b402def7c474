"""Sessions: a component's liveness in the BMDB, and the scope of its work.

A session is a row with a deadline. Its owner keeps pushing the deadline out
(a *poke*) every ``interval / 2``; a session is valid while its deadline is in
the future. Work locks belong to a session, so a component that dies (or is
cut off from the database) loses its locks at most ``interval`` later, and
other workers take its machines over.

::

    async with conn.session("shepherd-initializer", "host:pid") as sess:
        │  INSERT sessions row, collect expired sessions
        │  nursery ── heartbeat task: every interval/2
        │                UPDATE ... SET deadline = now() + interval
        │                WHERE session_id = $1 AND deadline > now()
        │                no row, or no answer before the deadline
        │                  ─▶ raise SessionExpired ─▶ cancels the body
        │  body: sess.transact(fn), sess.work(process, source), ...
        ▼  exit: DELETE the session row (its remaining work rows go with it)

Collecting expired sessions (deleting them, which releases their work and
records "Canceled" in the history) is done by every session owner: on start
and then at most every `GC_PERIOD` seconds, so it happens while any
component runs and costs one cheap statement per period.

Invariant relied on by sourcing: a work row whose session's deadline has
passed is dead. Its owner cannot poke the session back to life (the poke
requires ``deadline > now()``), so the row can be ignored and replaced
before the collector gets to it.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

import trio

from bmdb.errors import BMDBError, DatabaseUnavailable, InvalidArgument, SessionExpired
from bmdb.model import Process, Queries
from bmdb.transaction import Isolation, Transactor
from bmdb.work import Lease, Work, claim
from common.backoff import ExponentialBackoff, Retrier
from common.cli import leaf_errors

logger = logging.getLogger("bmdb.session")

T = TypeVar("T")

#: Default seconds between a session's deadline and its last poke.
DEFAULT_INTERVAL = 5.0

#: Seconds between two collections of expired sessions by one owner.
GC_PERIOD = 30.0

_POKE = """
    UPDATE sessions SET session_deadline = now() + make_interval(secs => session_interval_seconds)
    WHERE session_id = %s AND session_deadline > now()
    RETURNING 1
"""

# Delete sessions matching the condition; their work goes with them, and the
# history records it as canceled.
_DELETE_SESSIONS = """
    WITH dead AS (DELETE FROM sessions WHERE {condition} RETURNING session_id),
    gone AS (DELETE FROM work WHERE session_id IN (SELECT session_id FROM dead)
             RETURNING machine_id, process, session_id)
    INSERT INTO work_history (machine_id, process, event, session_id, cause)
    SELECT machine_id, process, 'Canceled', session_id, %(cause)s FROM gone
"""


class Session:
    """A live BMDB session. Obtain one with ``Connection.session()``.

    Every method raises `SessionExpired` once the session is known to be
    gone; the ``async with`` block that owns the session is then cancelled
    and raises `SessionExpired` too.
    """

    def __init__(self, lease: Lease, interval: float) -> None:
        # The lease is shared with every Work claimed under this session;
        # whoever first learns that the session is gone expires it, and the
        # heartbeat task then raises at once, cancelling everything under
        # the session.
        self._lease = lease
        self._tx = lease.tx
        self.id = lease.id
        self.component = lease.component
        self.interval = interval

    @property
    def expired(self) -> bool:
        """True once the session is known to have expired."""
        return self._lease.expired

    async def transact(self, fn: Callable[[Queries], Awaitable[T]]) -> T:
        """Run ``fn(queries)`` in a SERIALIZABLE transaction and return its result.

        Every attempt first checks that the session is still valid (raising
        `SessionExpired` if not). Serialization failures and deadlocks are
        retried with jittered backoff, so ``fn`` may run more than once and
        must only have effects through ``queries``. Whatever ``fn`` raises
        rolls the transaction back and propagates.
        """
        return await self._lease.transact(fn)

    async def work(
        self, process: Process | str, source: Callable[[Queries], Awaitable[list[uuid.UUID]]]
    ) -> Work:
        """Source one machine with ``source`` and lock it for ``process``.

        ``source`` runs in the claiming transaction with a `Queries` whose
        sourcing queries lock what they return; it returns the id of the
        machine to work on (a one-element list), or raises `NothingToDo` (an
        empty list means the same). The work row and the history entry
        "Started" are written in the same transaction.

        Raises `NothingToDo`, `WorkConflict` (the machine has live work for
        ``process`` in another session), `SessionExpired`, or
        `InvalidArgument` (unknown process, more than one machine). The
        returned `Work` must be finished, failed or canceled; use it as an
        ``async with`` block to cancel it on any other way out.
        """
        return await claim(self._lease, process, source)

    async def _poke(self) -> bool:
        async def body(q: Queries) -> bool:
            return bool(await q.execute(_POKE, (self.id,)))

        return await self._tx.run(Isolation.READ_COMMITTED, body)

    async def _keep_alive(self) -> None:
        """Poke the session every interval/2 until cancelled; raise
        `SessionExpired` when the session is gone or cannot be poked before
        its deadline (the database being unreachable counts), or as soon as
        another task found it expired."""
        # Trio-clock estimate of the deadline, taken before each poke is sent,
        # so it never runs later than the server's.
        deadline = trio.current_time() + self.interval
        last_gc = trio.current_time()
        # An unreachable database is retried at a steady pace until the deadline.
        pause = min(0.5, self.interval / 4)
        retrier = Retrier(ExponentialBackoff(initial=pause, maximum=pause, multiplier=1.0))
        while True:
            with trio.move_on_after(self.interval / 2):
                await self._lease.wait_expired()
            if self._lease.expired:
                raise self._lease.expire(self._lease.why)
            sent = trio.current_time()
            poked: bool | None = None
            with trio.move_on_at(deadline):
                while poked is None:
                    try:
                        poked = await self._poke()
                    except DatabaseUnavailable as e:
                        logger.warning("session %s: cannot poke: %s", self.id, e)
                        await retrier.sleep()
            if poked is None:
                raise self._lease.expire("could not reach the database before the deadline")
            if not poked:
                raise self._lease.expire("deadline passed")
            deadline = sent + self.interval
            if trio.current_time() - last_gc >= GC_PERIOD:
                last_gc = trio.current_time()
                await collect_expired(self._tx)

    async def _close(self) -> None:
        """Delete the session row, releasing leftover work (shielded, bounded,
        errors logged: the row expires by itself if this fails)."""
        with trio.CancelScope(shield=True) as scope:
            scope.relative_deadline = max(self.interval, 1.0)
            try:
                await _delete_sessions(self._tx, "session_id = %(id)s", self.id, "session closed")
            except Exception as e:
                logger.warning("session %s: could not delete on close: %s", self.id, e)
        self._lease.expire("session closed")


async def collect_expired(tx: Transactor) -> None:
    """Delete every session past its deadline, releasing its work. Errors
    are logged, not raised: collection is best effort and runs again later."""
    try:
        await _delete_sessions(tx, "session_deadline <= now()", None, "session expired")
    except Exception as e:
        logger.warning("collecting expired sessions failed: %s", e)


async def _delete_sessions(
    tx: Transactor, condition: str, session_id: uuid.UUID | None, cause: str
) -> None:
    sql = _DELETE_SESSIONS.format(condition=condition)

    async def body(q: Queries) -> None:
        await q.execute(sql, {"id": session_id, "cause": cause})

    await tx.run(Isolation.READ_COMMITTED, body)


@asynccontextmanager
async def open_session(
    tx: Transactor, component: str, runtime_info: str, *, interval: float
) -> AsyncIterator[Session]:
    """Create a session row and keep it alive for the duration of the block.

    If the session expires, the block is cancelled and raises
    `SessionExpired`. On exit the row is deleted, which releases any work
    still held. Raises `InvalidArgument` for an empty component name or a
    non-positive interval, `DatabaseUnavailable` if the row cannot be written.
    """
    if not component:
        raise InvalidArgument("a session needs a component name")
    if not interval > 0:
        raise InvalidArgument(f"session interval must be positive, got {interval!r}")

    async def create(q: Queries) -> uuid.UUID:
        rows = await q.execute(
            """INSERT INTO sessions (session_component_name, session_runtime_info,
                   session_interval_seconds, session_deadline)
               VALUES (%s, %s, %s, now() + make_interval(secs => %s))
               RETURNING session_id""",
            (component, runtime_info, interval, interval),
        )
        session_id: uuid.UUID = rows[0][0]
        return session_id

    await collect_expired(tx)
    session_id = await tx.run(Isolation.READ_COMMITTED, create)
    session = Session(Lease(tx, session_id, component), interval)
    tx.stats.sessions_started[component] += 1
    logger.info("session %s started for %s (%s)", session.id, component, runtime_info)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(session._keep_alive)
            yield session
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # The block raises one exception, never a group (`_one_error`);
        # its cause is the others, if any, not the group.
        error = _one_error(group)
        raise error from error.__cause__
    finally:
        await session._close()


def _one_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The one exception a session block raises for what its nursery raised.

    The heartbeat and the body can fail at once: the session expires while
    the body's COMMIT finds the database gone, say. Callers are promised
    the documented `BMDBError`s, so a group of them becomes the one that
    explains the rest: `SessionExpired` first (everything under the session
    was cancelled because of it), else the first; the others are chained
    as its ``__cause__`` (one, or a group of them) and noted on it. An
    exception of the body's own that is not a BMDB error (a bug, or the
    caller's own error) wins over BMDB errors, as it would without the
    session; two of those stay a group, as the body's own nursery would
    have raised them. `trio.Cancelled` among the leaves is dropped while
    anything else is there.
    """
    leaves = leaf_errors(group)
    errors = [e for e in leaves if not isinstance(e, trio.Cancelled)]
    if not errors:
        return leaves[0]
    foreign = [e for e in errors if not isinstance(e, BMDBError)]
    if len(foreign) > 1:
        return group
    if foreign:
        chosen = foreign[0]
    else:
        expired = [e for e in errors if isinstance(e, SessionExpired)]
        chosen = (expired or errors)[0]
    others = [e for e in errors if e is not chosen]
    for other in others:
        chosen.add_note(f"also: {type(other).__name__}: {other}")
    if others and chosen.__cause__ is None:
        chosen.__cause__ = (
            others[0] if len(others) == 1 else BaseExceptionGroup("the other errors", others)
        )
    return chosen
