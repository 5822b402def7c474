"""The heartbeat long poll: a request reaches its agent at once, not at the
agent's next heartbeat (`Holds`, one per `HeartbeatService`).

A heartbeat may ask to be held (`protocol.HEADER_HOLD`, the agent's
interval); a session's heartbeat (not a signed one, which gets its session
at once) is, once written, if its answer carries nothing, held until a
request for its machine is written, then answered with it, or answered
empty when its time is up (at most ``max_hold``); the agent sends its next
heartbeat as soon as a held answer comes, so heartbeats still come once an
interval and the liveness the BMDB records is as before::

    heartbeat (hold h)  registered for its machine ----------+ notification (machine id)
      written: carries a request? answer now                 | marks it
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
  notification (`Holds.catch_up`), and a held answer that times out is
  followed at once by the agent's next heartbeat, which reads it;
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

import heapq
import itertools
import logging
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import trio

from bmdb import Connection, Isolation, Queries
from bmdb.errors import BMDBError
from bmdb.model import HeartbeatOutcome, channels
from bmdb.model.agents import HeartbeatResult
from common.numbers import parse_decimal
from shepherd.agent.protocol import HEADER_HOLD
from shepherd.agent_server.connect import ConnectError
from shepherd.agent_server.reports import carried

logger = logging.getLogger("shepherd.agent_server.hold")

#: How often held heartbeats whose time is up are answered, seconds: one
#: is answered up to this much later than it asked (the agent's exchange
#: bound allows for it).
HOLD_TICK = 0.5

#: The header asking for a hold, as the HTTP layer hands headers over (lower case).
HOLD_HEADER = HEADER_HOLD.lower()

#: The outcome of a held heartbeat answered with nothing to carry.
ACCEPTED = HeartbeatResult(HeartbeatOutcome.ACCEPTED)


@dataclass(eq=False, slots=True)
class Watch:
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


class Holds:
    """The heartbeats of one service that may be held, and their wakes.

    A heartbeat that asks a hold (`asked`) is registered (`watch`) before
    it is written, held after (`hold`) and unregistered once answered
    (`unwatch`). `notified` and `catch_up` are the LISTEN side's callbacks;
    `release` must run (with the listener) for held heartbeats to time out.
    Reads go through ``conn`` under ``slots``, the service's bound on its
    transactions at once.
    """

    def __init__(
        self, conn: Connection, slots: trio.Semaphore, *, max_hold: float, max_held: int
    ) -> None:
        """``max_hold``: longest hold of an answer with nothing to carry,
        seconds (0: none); ``max_held``: most heartbeats held at once.
        ValueError if either is negative."""
        if max_hold < 0 or max_held < 0:
            raise ValueError("max_hold and max_held must not be negative")
        self._conn = conn
        self._slots = slots
        self.max_hold = max_hold
        self.max_held = max_held
        #: The heartbeats that may be held, by machine (usually one each).
        self._watches: dict[uuid.UUID, list[Watch]] = {}
        #: How many are held now.
        self._held = 0
        #: (deadline, order, watch) of held heartbeats; answered ones stay
        #: until their deadline passes (cheaper than taking them out).
        self._deadlines: list[tuple[float, int, Watch]] = []
        self._order = itertools.count()
        #: Whether requests are heard (the service's listener): holds only then.
        self.listening: Callable[[], bool] = lambda: False
        self.stats = HoldStats()

    def asked(self, headers: Mapping[str, str], signed: bool) -> float:
        """Seconds this heartbeat may be held: what it asks (`HEADER_HOLD`,
        present in ``headers``), at most `max_hold`; 0 when it asks none, is
        signed, or may not be held now (not listening, or `max_held` held
        already). `ConnectError` if the header is malformed."""
        text = headers[HOLD_HEADER]
        try:
            asked = parse_decimal(text, max_digits=9, what=HEADER_HOLD) / 1000
        except ValueError as exc:
            raise ConnectError("invalid_argument", str(exc)) from None
        if asked <= 0 or self.max_hold <= 0 or signed:
            return 0.0
        if self._held >= self.max_held or not self.listening():
            self.stats.not_held += 1
            return 0.0
        return min(asked, self.max_hold)

    def watch(self, machine_id: uuid.UUID, hold: float) -> Watch:
        """Register a heartbeat that may be held, before it is written (so
        that a notification meanwhile marks it). Not yet authenticated by
        the database: it takes no other heartbeat's place until it holds."""
        watch = Watch(machine_id, hold, trio.lowlevel.current_task())
        self._watches.setdefault(machine_id, []).append(watch)
        return watch

    def unwatch(self, watch: Watch) -> None:
        """Unregister ``watch`` (answered, or its heartbeat failed)."""
        watches = self._watches[watch.machine_id]
        watches.remove(watch)
        if not watches:
            del self._watches[watch.machine_id]

    def _wake(self, watch: Watch) -> None:
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
                self.stats.notified += 1
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

    async def hold(self, watch: Watch) -> HeartbeatResult:
        """Hold a written (so authenticated) heartbeat that carries nothing
        until a request for its machine is written (then read it: the
        answer), its time is up, or a newer heartbeat of its machine holds
        (then nothing: `ACCEPTED`). Cancelled, it ends at once."""
        if not watch.notified:
            if self._held >= self.max_held:
                self.stats.not_held += 1
                return ACCEPTED
            for other in self._watches[watch.machine_id]:
                if other.held:  # an older one (the agent gave up on it): this one replaces it
                    other.superseded = True
                    self.stats.superseded += 1
                    self._wake(other)
            self.stats.held += 1
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
        return ACCEPTED

    async def _read_pending(self, machine_id: uuid.UUID) -> HeartbeatResult:
        """The machine's request to carry, read anew (as its group's write
        reads it, refusals stored the same way). A database that fails it
        answers nothing: the agent's next heartbeat reads it again."""
        notes: list[str] = []

        async def body(q: Queries) -> HeartbeatResult:
            notes.clear()  # a retried transaction starts over
            return await carried(q, machine_id, await q.agent_pending(machine_id), notes)

        try:
            async with self._slots:
                result = await self._conn.transact(body, isolation=Isolation.READ_COMMITTED)
        except BMDBError as exc:
            logger.warning(
                "machine %s: request not read for its held heartbeat: %s", machine_id, exc
            )
            return ACCEPTED
        for note in notes:
            logger.info("%s", note)
        return result

    async def release(self) -> None:
        """Answer held heartbeats whose time is up, every `HOLD_TICK`, until cancelled."""
        deadlines = self._deadlines
        while True:
            await trio.sleep(HOLD_TICK)
            now = trio.current_time()
            while deadlines and deadlines[0][0] <= now:
                watch = heapq.heappop(deadlines)[2]
                if watch.held:
                    self.stats.timed_out += 1
                    self._wake(watch)
