"""Supervision trees for long-running Trio tasks.

A *runnable* is an ``async def fn(node: Node) -> None`` that runs until it is
cancelled. The supervisor runs it under a dotted name (``root.role.launcher``),
gives it a :class:`Node` (its logger of that name, ``signal_healthy()``,
``signal_done()``, and ``run()`` / ``run_group()`` for children) and restarts
it when it fails::

    root ──┬── consensus ──── etcd
           └── role ──┬── map-roles    ┐
                      ├── reduce       ├ a group: one dies, all restart
                      └── launcher     ┘

Rules, which callers rely on:

* A runnable *fails* when it raises, or when it returns without having called
  ``signal_done()``. A failure is logged with its traceback and never
  propagates: siblings and parents keep running.
* A failed runnable is restarted after a backoff (0.5 s, then x1.5 per
  consecutive failure, with jitter, capped at 60 s). ``signal_healthy()``
  resets the backoff, so a runnable that worked for a while and then failed
  restarts quickly.
* A runnable that returns after ``signal_done()`` is finished and is not
  restarted.
* Children live inside their parent's attempt: when a runnable returns, fails
  or is restarted, its children are cancelled first. There are no hidden
  tasks: every child runs in a nursery owned by its parent's attempt.
* The members of a group (``run_group``) share one fate: when any member
  fails, all members are cancelled and the group restarts together.
* Cancellation is Trio's: cancelling the scope around the supervisor cancels
  the whole tree; ``trio.Cancelled`` is never treated as a failure.
"""

from __future__ import annotations

import enum
import logging
import math
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio

__all__ = [
    "BackoffPolicy",
    "Node",
    "Runnable",
    "State",
    "Supervisor",
    "open_supervisor",
    "supervise",
]

Runnable = Callable[["Node"], Awaitable[None]]


class State(enum.Enum):
    """Where a supervised runnable is in its life."""

    STARTING = "starting"
    """Running, not yet signalled healthy (in this attempt)."""
    HEALTHY = "healthy"
    """Running and signalled healthy."""
    BACKOFF = "backoff"
    """Failed; waiting for the backoff to pass before it restarts."""
    DONE = "done"
    """Returned after ``signal_done()``; will not restart."""
    STOPPED = "stopped"
    """Cancelled together with its parent or the whole tree."""


@dataclass(frozen=True)
class BackoffPolicy:
    """How long to wait before restarting a failed runnable.

    The n-th consecutive failure waits ``initial * multiplier**(n-1)`` seconds,
    capped at ``maximum``, then scaled by a random factor in
    ``[1 - jitter, 1 + jitter]`` (jitter spreads restarts of runnables that
    failed together). ``jitter=0`` gives exact delays, for tests.
    """

    initial: float = 0.5
    multiplier: float = 1.5
    maximum: float = 60.0
    jitter: float = 0.25

    def __post_init__(self) -> None:
        if not (self.initial > 0 and self.multiplier >= 1 and self.maximum >= self.initial):
            raise ValueError(f"invalid backoff policy: {self}")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"jitter must be in [0, 1), got {self.jitter}")

    def delay(self, failures: int, rng: random.Random) -> float:
        """The wait after ``failures`` consecutive failures (``failures >= 1``)."""
        exponent = min(failures - 1, 1000)  # far past the cap; avoids float overflow
        base = min(self.maximum, self.initial * math.pow(self.multiplier, exponent))
        if self.jitter:
            base *= rng.uniform(1 - self.jitter, 1 + self.jitter)
        return base


@dataclass(eq=False)
class _Slot:
    """Book-keeping for one supervised name, kept across its restarts."""

    name: str
    state: State = State.STARTING
    failures: int = 0  # consecutive failures since the last signal_healthy()
    restarts: int = 0


class Node:
    """A runnable's handle on the supervision tree, one per attempt.

    It is only valid while the attempt runs: ``run()`` after the runnable
    returned raises ``RuntimeError``.
    """

    def __init__(
        self,
        supervisor: Supervisor,
        slot: _Slot,
        nursery: trio.Nursery,
    ) -> None:
        self._supervisor = supervisor
        self._slot = slot
        self._nursery = nursery
        self._children: set[str] = set()
        self._alive = True
        self._done = False
        self.logger = logging.getLogger(slot.name)

    @property
    def name(self) -> str:
        """The dotted name of this runnable, e.g. ``root.consensus``."""
        return self._slot.name

    def signal_healthy(self) -> None:
        """Report that the runnable works; resets the restart backoff."""
        if self._alive and not self._done:
            self._slot.failures = 0
            self._supervisor._set_state(self._slot, State.HEALTHY)

    def signal_done(self) -> None:
        """Report that the runnable will finish on purpose: returning is not a failure."""
        self._done = True

    def run(self, name: str, fn: Runnable) -> None:
        """Start ``fn`` as a supervised child named ``<this name>.<name>``.

        Returns at once, like ``nursery.start_soon``. The child is cancelled when
        this runnable returns, fails or restarts. Raises ``ValueError`` for an
        invalid or duplicate name.
        """
        self.run_group({name: fn})

    def run_group(self, runnables: Mapping[str, Runnable]) -> None:
        """Start several children that fail and restart together.

        When any of them fails, all of them are cancelled, and after the backoff
        all of them start again.
        """
        if not self._alive:
            raise RuntimeError(f"{self.name}: run() after the runnable ended")
        if not runnables:
            raise ValueError("run_group needs at least one runnable")
        for child in runnables:
            if not child or "." in child:
                raise ValueError(f"invalid runnable name {child!r}: must be non-empty, no dots")
            if child in self._children:
                raise ValueError(f"{self.name}: a child named {child!r} already runs")
        self._children.update(runnables)
        members = {f"{self.name}.{child}": fn for child, fn in runnables.items()}
        self._nursery.start_soon(self._supervisor._supervise, members)


class Supervisor:
    """Runs a tree of runnables; see the module docstring for the rules.

    Create one with :func:`open_supervisor` (or run a tree to completion with
    :func:`supervise`). It exposes the state of every runnable by dotted name,
    which tests and diagnostics use.
    """

    def __init__(self, policy: BackoffPolicy, rng: random.Random) -> None:
        self._policy = policy
        self._rng = rng
        self._slots: dict[str, _Slot] = {}
        self._changed = trio.Event()

    # -- observing ---------------------------------------------------------

    def state(self, name: str) -> State | None:
        """The state of the runnable ``name``, or ``None`` if it never ran."""
        slot = self._slots.get(name)
        return slot.state if slot else None

    def restarts(self, name: str) -> int:
        """How many times ``name`` was restarted after a failure."""
        slot = self._slots.get(name)
        return slot.restarts if slot else 0

    async def wait_state(self, name: str, *states: State) -> None:
        """Wait until the runnable ``name`` is in one of ``states``."""
        while self.state(name) not in states:
            await self._changed.wait()

    async def wait_healthy(self, name: str) -> None:
        """Wait until the runnable ``name`` has signalled healthy (in its current attempt)."""
        await self.wait_state(name, State.HEALTHY)

    def _set_state(self, slot: _Slot, state: State) -> None:
        slot.state = state
        self._changed.set()
        self._changed = trio.Event()

    # -- running -----------------------------------------------------------

    async def _supervise(self, members: Mapping[str, Runnable]) -> None:
        """Run a group until all members are done, restarting it on failure.

        Never raises except ``trio.Cancelled`` (and KeyboardInterrupt/SystemExit).
        """
        slots = {name: self._register(name) for name in members}
        try:
            while True:
                failed = await self._attempt(members, slots)
                if not failed:
                    return
                # The group backs off as long as its worst member says.
                failures = max(slot.failures for slot in slots.values())
                delay = self._policy.delay(failures, self._rng)
                for slot in slots.values():
                    self._set_state(slot, State.BACKOFF)
                logging.getLogger(failed).warning("restarting in %.2f s", delay)
                await trio.sleep(delay)
                for slot in slots.values():
                    slot.restarts += 1
                    self._set_state(slot, State.STARTING)
        finally:
            for slot in slots.values():
                if slot.state is not State.DONE:
                    self._set_state(slot, State.STOPPED)

    def _register(self, name: str) -> _Slot:
        slot = self._slots.get(name)
        if slot is None:
            slot = self._slots[name] = _Slot(name)
        else:
            # A parent restarted and runs this child again: a fresh history.
            slot.failures = 0
        self._set_state(slot, State.STARTING)
        return slot

    async def _attempt(self, members: Mapping[str, Runnable], slots: Mapping[str, _Slot]) -> str:
        """Run every member once. Returns the name of the first to fail, or ''."""
        failed = ""

        async def member(name: str, fn: Runnable, group: trio.CancelScope) -> None:
            nonlocal failed
            if not await self._run_once(slots[name], fn) and not failed:
                failed = name
                group.cancel()

        async with trio.open_nursery() as nursery:
            for name, fn in members.items():
                nursery.start_soon(member, name, fn, nursery.cancel_scope)
        return failed

    async def _run_once(self, slot: _Slot, fn: Runnable) -> bool:
        """One attempt of one runnable with its children. True if it finished well."""
        log = logging.getLogger(slot.name)
        error: BaseException | None = None
        async with trio.open_nursery() as children:
            node = Node(self, slot, children)
            try:
                await fn(node)
            except BaseException as exc:  # sorted below; Cancelled goes back up
                error = _without_cancelled(exc)
                if error is None:
                    raise
                if isinstance(error, KeyboardInterrupt | SystemExit):
                    raise
            finally:
                node._alive = False
                children.cancel_scope.cancel()

        if error is not None:
            slot.failures += 1
            log.error("runnable failed: %r", error, exc_info=error)
            return False
        if not node._done:
            slot.failures += 1
            log.error("runnable returned without signalling done")
            return False
        self._set_state(slot, State.DONE)
        return True


def _without_cancelled(exc: BaseException) -> BaseException | None:
    """``exc`` without its ``trio.Cancelled`` parts; None if it was only that.

    A runnable's nursery may raise a group mixing a real error with the
    Cancelled that the error itself triggered; the error must still count as a
    failure, and a bare Cancelled must propagate.
    """
    if isinstance(exc, trio.Cancelled):
        return None
    if isinstance(exc, BaseExceptionGroup):
        _, rest = exc.split(trio.Cancelled)
        return rest
    return exc


@asynccontextmanager
async def open_supervisor(
    root: Runnable,
    *,
    name: str = "root",
    policy: BackoffPolicy | None = None,
    rng: random.Random | None = None,
) -> AsyncIterator[Supervisor]:
    """Run ``root`` under ``name`` for the duration of the ``async with`` block.

    Leaving the block cancels the whole tree and waits until it has stopped.
    """
    supervisor = Supervisor(policy or BackoffPolicy(), rng or random.Random())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(supervisor._supervise, {name: root})
        try:
            yield supervisor
        finally:
            nursery.cancel_scope.cancel()


async def supervise(
    root: Runnable,
    *,
    name: str = "root",
    policy: BackoffPolicy | None = None,
) -> None:
    """Run ``root`` as a supervision tree until it signals done (or forever).

    The form for entry points: ``trio.run(supervise, main)``.
    """
    supervisor = Supervisor(policy or BackoffPolicy(), random.Random())
    await supervisor._supervise({name: root})
