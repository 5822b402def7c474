"""The control loop runner: N workers sourcing machines from the BMDB, one at a time.

A *processor* says what the loop does (which process, how to source a machine,
what to do with it); :func:`run_control_loop` runs it::

    run_control_loop(conn, processor, parallelism=N, limiter=L)
      │
      ├─ worker 1 ─┐  session = conn.session(processor.component)
      ├─ worker 2  │  loop:
      │    ...     │    L.acquire()                      (shared: bounds BMDB queries)
      └─ worker N ─┘    work = session.work(process, source)   NothingToDo: next
                          task = processor.source(q)            WorkConflict: next
                        async with work:
                          processor.handle(work, task)    finishes the work itself
                            raises ProcessingFailed  ─▶ work.fail(cause, backoff)
                            raises another error     ─▶ work.fail("internal error: ..")
                        any BMDBError (session expired, database gone, ...):
                          new session after SESSION_BACKOFF (0.5 s, doubling to 10 s)

Each worker has its own session, so a worker whose session expires (a long
stall, a lost database connection) restarts alone and its locks die with its
session. Cancelling the runner cancels every worker; the work in flight is
then canceled in the BMDB (history "Canceled") and the sessions are deleted,
so nothing stays locked.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import socket
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Concatenate, Generic, ParamSpec, Protocol, TypeVar

import trio

from bmdb import Backoff, Connection, Process, Queries, Session, Work
from bmdb.errors import BMDBError, DatabaseUnavailable, NothingToDo, SessionExpired, WorkConflict
from common.backoff import ExponentialBackoff, Retrier
from common.text import printable
from shepherd.errors import ShepherdError
from shepherd.rate_limit import RateLimiter

logger = logging.getLogger("shepherd.control_loop")

T = TypeVar("T")
P = ParamSpec("P")
T_contra = TypeVar("T_contra", contravariant=True)

#: Seconds a worker's BMDB session survives without a heartbeat.
DEFAULT_SESSION_INTERVAL = 5.0

#: Waits before a worker opens a new session after losing one; a session
#: that stayed open for an iteration starts the count over. Jittered, so
#: that the workers of a loop that lost the database together do not come
#: back together.
SESSION_BACKOFF = ExponentialBackoff(0.5, 10.0, jitter=(0.5, 1.0))


class ProcessingFailed(ShepherdError):
    """Raised by a processor: fail this machine's work with ``str(exc)`` as the cause.

    ``backoff`` overrides the processor's default backoff for this failure.
    """

    def __init__(self, cause: str, backoff: Backoff | None = None) -> None:
        super().__init__(cause)
        self.backoff = backoff


@dataclass
class LoopStats:
    """Counters of control loops (exported by `shepherd.metrics`). One may be
    shared by several loops: everything is keyed by component."""

    #: Iterations by (component, outcome): "worked" (a machine was claimed),
    #: "nothing" (no machine to work on), "conflict" (lost a claim race),
    #: "session_lost" (a BMDB error ended the worker's session).
    iterations: Counter[tuple[str, str]] = field(default_factory=Counter)
    #: Rate limiter acquisitions that had to wait, and the seconds waited,
    #: by component.
    limiter_waits: Counter[str] = field(default_factory=Counter)
    limiter_wait_seconds: dict[str, float] = field(default_factory=dict)


class Processor(Protocol[T]):
    """What a control loop does. ``T`` is the task a source produces."""

    #: Component name of the workers' BMDB sessions (and of their logs).
    component: str
    #: The BMDB process the loop works under.
    process: Process
    #: Backoff for failed machines.
    backoff: Backoff

    async def source(self, q: Queries) -> T | None:
        """Find one machine to work on, inside the claiming transaction.

        Return None if there is nothing to do. May run more than once per
        claim (transactions are retried), so it must have no side effects
        outside ``q``.
        """
        ...

    def machine_id(self, task: T) -> uuid.UUID:
        """The BMDB machine a task is about."""
        ...

    async def handle(self, work: Work, task: T) -> None:
        """Act on the machine and ``work.finish()`` on success.

        Raise :class:`ProcessingFailed` to fail the work with a cause. Any
        other exception also fails the work (as an internal error) and is
        logged with its traceback; the loop carries on either way.
        """
        ...


class _Worker(Generic[T]):
    def __init__(
        self,
        conn: Connection,
        processor: Processor[T],
        limiter: RateLimiter,
        runtime_info: str,
        index: int,
        session_interval: float,
        stats: LoopStats,
        rng: random.Random,
    ) -> None:
        self._conn = conn
        self._processor = processor
        self._limiter = limiter
        self._runtime_info = f"{runtime_info} worker {index}"
        self._session_interval = session_interval
        self._stats = stats
        self._log = logging.getLogger(f"shepherd.{processor.component}.{index}")
        self._retrier = Retrier(SESSION_BACKOFF, rng)

    async def run(self) -> None:
        while True:
            try:
                async with self._conn.session(
                    self._processor.component, self._runtime_info, interval=self._session_interval
                ) as s:
                    while True:
                        waited = await self._limiter.acquire()
                        if waited:
                            component = self._processor.component
                            seconds = self._stats.limiter_wait_seconds
                            self._stats.limiter_waits[component] += 1
                            seconds[component] = seconds.get(component, 0.0) + waited
                        await self._iteration(s)
                        self._retrier.reset()
            except SessionExpired as exc:
                self._log.warning("session lost, starting a new one: %s", exc)
            except DatabaseUnavailable as exc:
                self._log.warning("BMDB unavailable, retrying: %s", exc)
            except BMDBError as exc:
                # E.g. a claim that kept failing to serialize. Whatever state
                # the session was in, a fresh one is a clean start.
                self._log.error("BMDB error, starting a new session: %s", exc)
            self._count("session_lost")
            await self._retrier.sleep()

    async def _iteration(self, session: Session) -> None:
        processor = self._processor
        sourced: T | None = None

        async def source(q: Queries) -> list[uuid.UUID]:
            # Overwritten on every attempt: the last attempt is the one that
            # committed.
            nonlocal sourced
            sourced = await processor.source(q)
            if sourced is None:
                raise NothingToDo(f"no machine for {processor.process}")
            return [processor.machine_id(sourced)]

        try:
            work = await session.work(processor.process, source)
        except NothingToDo:
            self._count("nothing")
            return
        except WorkConflict:
            self._count("conflict")
            return
        self._count("worked")
        assert sourced is not None
        task: T = sourced
        async with work:
            try:
                await processor.handle(work, task)
            except ProcessingFailed as exc:
                await self._fail(work, str(exc), exc.backoff or processor.backoff)
            except (SessionExpired, DatabaseUnavailable):
                raise
            except BMDBError as exc:
                # The work's own transaction failed (retries exhausted, bad
                # data); leaving the block cancels it.
                self._log.error("machine %s: BMDB error: %s", work.machine_id, exc)
            except Exception as exc:
                self._log.exception("machine %s: processor crashed", work.machine_id)
                await self._fail(work, f"internal error: {exc!r}", processor.backoff)
            else:
                if not work.closed:
                    self._log.error("machine %s: processor left its work open", work.machine_id)

    def _count(self, outcome: str) -> None:
        self._stats.iterations[self._processor.component, outcome] += 1

    async def _fail(self, work: Work, cause: str, backoff: Backoff) -> None:
        # Causes quote machines (an agent's error, a server's disconnect
        # reason): bounded and escaped before they reach the history and log.
        cause = printable(cause)
        self._log.warning("machine %s: failed: %s", work.machine_id, cause)
        await work.fail(cause, backoff)


def default_runtime_info() -> str:
    """``host:pid``, to tell sessions of different processes apart."""
    return f"{socket.gethostname()}:{os.getpid()}"


async def run_control_loop(
    conn: Connection,
    processor: Processor[T],
    *,
    parallelism: int,
    limiter: RateLimiter,
    runtime_info: str | None = None,
    session_interval: float = DEFAULT_SESSION_INTERVAL,
    stats: LoopStats | None = None,
    rng: random.Random | None = None,
) -> None:
    """Run ``parallelism`` workers of ``processor`` until cancelled.

    ``session_interval`` is how long a stalled worker keeps its locks (see
    ``bmdb.Connection.session``). Never returns. Failures of single machines
    are recorded and logged, lost sessions are replaced; only cancellation
    (or a bug in this module) ends it. ``stats``, if given, is counted into
    (see `LoopStats`). ``rng`` jitters the waits before a lost session is
    replaced (`SESSION_BACKOFF`). The BMDB needs no asyncio loop; run
    it inside ``trio_asyncio.open_loop()`` only if the processor uses asyncio
    libraries (the `Initializer`'s SSH client does).
    """
    if parallelism < 1:
        raise ValueError(f"parallelism must be at least 1, got {parallelism}")
    info = runtime_info or default_runtime_info()
    counters = stats if stats is not None else LoopStats()
    rng = rng if rng is not None else random.Random()
    workers = [
        _Worker(
            conn,
            processor,
            limiter,
            info,
            i,
            session_interval,
            counters,
            random.Random(rng.getrandbits(64)),
        )
        for i in range(parallelism)
    ]
    logger.info("%s: starting %d worker(s)", processor.component, parallelism)
    async with trio.open_nursery() as nursery:
        for worker in workers:
            nursery.start_soon(worker.run)


def _in_nursery(
    fn: Callable[P, Awaitable[None]],
) -> Callable[Concatenate[trio.Nursery, P], None]:
    def start(nursery: trio.Nursery, /, *args: P.args, **kwargs: P.kwargs) -> None:
        nursery.start_soon(functools.partial(fn, *args, **kwargs))

    return start


#: ``start_control_loop(nursery, conn, processor, parallelism=N, limiter=L,
#: ...)``: start `run_control_loop` (same arguments) as a task of ``nursery``;
#: cancel the nursery's scope to stop it.
start_control_loop = _in_nursery(run_control_loop)
