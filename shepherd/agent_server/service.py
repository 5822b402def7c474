"""Heartbeat: the service that authenticates an agent's request and records
it in the BMDB, in groups (`HeartbeatService`).

A heartbeat's way through it::

    authenticate (no database)         `shepherd.agent_server.authenticate`:
                                       body, freshness, signature or session MAC
    BMDB, one statement per group:
      key == the AgentStarted tag's    else unauthenticated ("unknown")
      time > last accepted time        else unauthenticated ("replayed")
      write heartbeat (+ report)
      read the pending requests
    with an installation report of the
    pending request's generation:      write it (others: ignored, logged);
                                       `shepherd.agent_server.reports`
    held, if it asked and carries
    nothing                            `shepherd.agent_server.hold`
    answer: the pending requests (if any), the new session (if signed);
                                       `shepherd.agent_server.answers`

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
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import trio

from bmdb import Connection, Isolation, Queries
from bmdb.errors import BMDBError, InvalidArgument
from bmdb.model import AgentHeartbeat, HeartbeatOutcome, channels
from bmdb.model.agents import HeartbeatResult
from shepherd.agent_server.answers import (
    EMPTY_RESPONSE,
    session_response,
    with_installation_request,
    with_upgrade_request,
)
from shepherd.agent_server.authenticate import DEFAULT_FRESHNESS, Heartbeat, authenticate
from shepherd.agent_server.connect import ConnectError
from shepherd.agent_server.hold import HOLD_HEADER, Holds
from shepherd.agent_server.reports import (
    carried,
    record_installation_report,
    record_upgrade_report,
)
from shepherd.agent_server.session import SessionKeys, new_secret

logger = logging.getLogger("shepherd.agent_server.service")


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
        seconds (0: none; see `shepherd.agent_server.hold`); ``max_held``:
        most heartbeats held at once. ValueError if either is negative."""
        self._conn = conn
        #: Issues and checks sessions; by default under a secret of this service's own.
        self.sessions = sessions if sessions is not None else SessionKeys(new_secret())
        self.freshness = freshness
        self._slots = trio.Semaphore(db_slots)
        self._holds = Holds(conn, self._slots, max_hold=max_hold, max_held=max_held)
        #: The long poll's counters.
        self.hold_stats = self._holds.stats
        self.queue_timeout = queue_timeout
        self.batch_window = batch_window
        self.max_batch = max_batch
        self._clock = clock
        # Insertion-ordered; a dict so that a timed-out member leaves in O(1).
        self._queue: dict[_Pending, None] = {}
        self._arrived = trio.Event()

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
        if HOLD_HEADER in headers:
            hold = self._holds.asked(headers, beat.signed)
            if hold > 0:
                watch = self._holds.watch(beat.machine_id, hold)
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
                result = await self._holds.hold(watch)
            response = (
                session_response(self.sessions, beat, self._clock())
                if beat.signed
                else EMPTY_RESPONSE
            )
            response = with_installation_request(response, result.installation_request)
            return with_upgrade_request(response, result.upgrade_request)
        finally:
            if watch is not None:
                self._holds.unwatch(watch)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The writer: form groups from the queue and write them, until cancelled.

        Cancelled, groups being written are cancelled too (their transactions
        roll back; their members are answered ``unavailable``, if anyone
        still listens).
        """
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._expire)
            holds = self._holds
            if holds.max_hold > 0:
                nursery.start_soon(holds.release)
                listener = self._conn.listener(
                    [channels.AGENT_REQUEST], holds.notified, on_listening=holds.catch_up
                )
                holds.listening = lambda: listener.listening
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
                    and await record_installation_report(q, machine_id, report, result, notes)
                ):
                    # Reported: no longer pending (an upgrade request stays).
                    results[index] = dataclasses.replace(
                        result, installation_request=None, installation_generation=None
                    )
            for index, machine_id, upgrade in upgrading:
                if upgrade is not None and results[index].outcome is HeartbeatOutcome.ACCEPTED:
                    await record_upgrade_report(q, machine_id, upgrade, results[index], notes)
            for index, result in enumerate(results):
                if result.installation_request is not None:  # rare: no call for the rest
                    results[index] = await carried(q, group[index].beat.machine_id, result, notes)
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
