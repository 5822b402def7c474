"""Supervision trees for long-running Trio tasks.

A *runnable* is an ``async def fn(node: Node) -> None`` that runs until it is
cancelled. The supervisor runs it under a dotted name, gives it a
:class:`Node` (its logger of that name, ``signal_healthy()``,
``signal_done()``, ``restart()``, and ``run()`` / ``run_group()`` /
``scope()`` for children) and restarts it when it fails. The tree that runs
today is the consensus service (``bench/consensus_start.py`` starts it)::

    consensus ─┬─ etcd process        (a task of the runnable, not a child)
               └─ scope, open while the etcd client is ──┬── consensus.promoter
                                                         └── consensus.crl

Rules, which callers rely on:

* A runnable *fails* when it raises, or when it returns without having called
  ``signal_done()``. A failure is logged at ERROR with its traceback and never
  propagates: siblings and parents keep running.
* A failed runnable is restarted after a backoff (0.5 s, then x1.5 per
  consecutive failure, with jitter, capped at 60 s). ``signal_healthy()``
  resets the backoff, so a runnable that worked for a while and then failed
  restarts quickly.
* A runnable that returns after ``signal_done()`` is finished and is not
  restarted.
* ``node.restart(reason)`` (raising :class:`RestartRequested`, from the
  runnable or any task in a nursery under it) restarts it at once: no
  backoff, not a failure (the failure count is unchanged), logged at INFO.
* ``KeyboardInterrupt`` and ``SystemExit`` are never failures: raised
  anywhere under a runnable, alone or inside exception groups, they end the
  whole tree and propagate out of :func:`supervise` / :func:`open_supervisor`
  (unwrapped from the groups Trio's nurseries put them in).
* Children live inside their parent's attempt: when a runnable returns, fails
  or is restarted, its children are cancelled first. There are no hidden
  tasks: every child runs in a nursery owned by its parent's attempt.
* Children started in ``async with node.scope() as sub`` live no longer than
  the block: leaving it (normally, by an error or by cancellation) cancels
  them and waits until they have ended; nested scopes stop inner first. A
  child's name is taken while it runs and free again afterwards.
* The members of a group (``run_group``) share one fate: when any member
  fails, all members are cancelled and the group restarts together.
* Cancellation is Trio's: cancelling the scope around the supervisor cancels
  the whole tree; ``trio.Cancelled`` is never treated as a failure.
* :meth:`Supervisor.snapshot` lists every runnable with its state, restart
  count and last error. A child's entry is removed when the attempt or scope
  that ran it ends, so long-lived trees with churning children do not grow.
"""

from __future__ import annotations

import enum
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import NoReturn

import trio

from common.backoff import ExponentialBackoff
from metropolis.errors import MetropolisError

__all__ = [
    "BackoffPolicy",
    "Node",
    "RestartRequested",
    "Runnable",
    "RunnableInfo",
    "Scope",
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
        if not 0 <= self.jitter < 1:
            raise ValueError(f"jitter must be in [0, 1), got {self.jitter}")
        # Building the policy validates the rest (ValueError).
        self.backoff.ceiling(1)

    @property
    def backoff(self) -> ExponentialBackoff:
        """The same waits as a `common.backoff` policy."""
        return ExponentialBackoff(
            initial=self.initial,
            maximum=self.maximum,
            multiplier=self.multiplier,
            jitter=(1 - self.jitter, 1 + self.jitter),
        )

    def delay(self, failures: int, rng: random.Random) -> float:
        """The wait after ``failures`` consecutive failures (``failures >= 1``)."""
        return self.backoff.delay(failures, rng)


class RestartRequested(MetropolisError):
    """Raised by :meth:`Node.restart`: restart this runnable now.

    Not a failure: the runnable is restarted at once, without backoff, and
    its failure count is unchanged. It may be raised by the runnable itself
    or by any task in a nursery under it (an exception group holding only
    ``RestartRequested`` and ``trio.Cancelled`` counts as a request).
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class RunnableInfo:
    """One runnable in :meth:`Supervisor.snapshot`."""

    name: str
    state: State
    #: Restarts of this slot so far: after failures, and on request.
    restarts: int
    #: The last failure, one line (``"Boom: kaboom"``); None if it never failed.
    last_error: str | None
    #: Wall-clock time (``time.time()``) of ``last_error``.
    last_error_at: float | None


class _Outcome(enum.Enum):
    """How one attempt of a runnable ended (short of cancellation or exit)."""

    DONE = "done"
    FAILED = "failed"
    RESTART = "restart"


@dataclass(eq=False)
class _Slot:
    """Book-keeping for one supervised name, kept across its restarts."""

    name: str
    state: State = State.STARTING
    failures: int = 0  # consecutive failures since the last signal_healthy()
    restarts: int = 0
    last_error: str | None = None
    last_error_at: float | None = None


def _validate(runnables: Mapping[str, Runnable]) -> None:
    if not runnables:
        raise ValueError("run_group needs at least one runnable")
    for child in runnables:
        if not child or "." in child:
            raise ValueError(f"invalid runnable name {child!r}: must be non-empty, no dots")


class Node:
    """A runnable's handle on the supervision tree, one per attempt.

    It is only valid while the attempt runs: ``run()`` or ``scope()`` after
    the runnable returned raises ``RuntimeError``.
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
        # Short names of the children that run now (from run() and open
        # scopes): a name is taken until the attempt or scope that runs it ends.
        self._children: set[str] = set()
        self._alive = True
        self._done = False
        self.logger = logging.getLogger(slot.name)

    @property
    def name(self) -> str:
        """The dotted name of this runnable, e.g. ``root.consensus``."""
        return self._slot.name

    def tree_snapshot(self) -> list[RunnableInfo]:
        """:meth:`Supervisor.snapshot` of the whole tree this runnable is in.

        For a runnable that shows the tree to someone (a node's debug
        service); it stays valid after the attempt ended.
        """
        return self._supervisor.snapshot()

    def tree_restart_totals(self) -> dict[tuple[str, str], int]:
        """:meth:`Supervisor.restart_totals` of the whole tree this runnable is in."""
        return self._supervisor.restart_totals()

    def signal_healthy(self) -> None:
        """Report that the runnable works; resets the restart backoff."""
        if self._alive and not self._done:
            self._slot.failures = 0
            self._supervisor._set_state(self._slot, State.HEALTHY)

    def signal_done(self) -> None:
        """Report that the runnable will finish on purpose: returning is not a failure."""
        self._done = True

    def restart(self, reason: str) -> NoReturn:
        """Ask to be restarted at once; raises :class:`RestartRequested`.

        For a runnable whose configuration changed: its children are
        cancelled as on any restart, then it starts again in the same
        scheduler tick, without backoff and without counting a failure.
        ``reason`` is logged at INFO. It restarts the runnable whose task
        raises it: called with a parent's node from inside a child runnable,
        it restarts the child, not the parent.
        """
        raise RestartRequested(reason)

    def run(self, name: str, fn: Runnable) -> None:
        """Start ``fn`` as a supervised child named ``<this name>.<name>``.

        Returns at once, like ``nursery.start_soon``. The child is cancelled when
        this runnable returns, fails or restarts. Raises ``ValueError`` for an
        invalid name or one taken by a running child.
        """
        self.run_group({name: fn})

    def run_group(self, runnables: Mapping[str, Runnable]) -> None:
        """Start several children that fail and restart together.

        When any of them fails, all of them are cancelled, and after the backoff
        all of them start again.
        """
        members = self._reserve(runnables)
        self._nursery.start_soon(self._supervisor._supervise, members)

    @asynccontextmanager
    async def scope(self) -> AsyncIterator[Scope]:
        """A block whose children (``sub.run()``, ``sub.run_group()``) end with it.

        Children are named ``<this name>.<name>`` like those of ``run()``.
        Leaving the block, however it is left, cancels them and waits until
        they have ended (shielded from cancellation, like a nursery's exit);
        then their names are free again and their snapshot entries removed.
        Until then they are also shielded from cancellation of this runnable:
        they stop when the block is left, so nested scopes always stop inner
        before outer and a child never outlives what the block borrowed.
        Exceptions from the block propagate unchanged (never wrapped in a group).
        """
        if not self._alive:
            raise RuntimeError(f"{self.name}: scope() after the runnable ended")
        stopped = trio.Event()

        async def hold(task_status: trio.TaskStatus[trio.Nursery]) -> None:
            # The children's nursery lives in a task of the attempt's own
            # nursery rather than in the caller's task, so that the block's
            # exceptions are not wrapped in a group. Shielded: only leaving
            # the block (below) ends it.
            try:
                with trio.CancelScope(shield=True):
                    async with trio.open_nursery() as nursery:
                        task_status.started(nursery)
                        await trio.sleep_forever()
            finally:
                stopped.set()

        nursery: trio.Nursery = await self._nursery.start(hold)
        scope = Scope(self, nursery)
        try:
            yield scope
        finally:
            scope._open = False
            nursery.cancel_scope.cancel()
            with trio.CancelScope(shield=True):
                await stopped.wait()
            self._children.difference_update(scope._names)
            self._supervisor._prune(f"{self.name}.{child}" for child in scope._names)

    def _reserve(self, runnables: Mapping[str, Runnable]) -> dict[str, Runnable]:
        """Check and take the children's names; their dotted names and runnables."""
        if not self._alive:
            raise RuntimeError(f"{self.name}: run() after the runnable ended")
        _validate(runnables)
        for child in runnables:
            if child in self._children:
                raise ValueError(f"{self.name}: a child named {child!r} already runs")
        self._children.update(runnables)
        return {f"{self.name}.{child}": fn for child, fn in runnables.items()}


class Scope:
    """Children that live no longer than an ``async with node.scope()`` block.

    ``run()`` / ``run_group()`` behave as :meth:`Node.run` /
    :meth:`Node.run_group`; after the block was left they raise ``RuntimeError``.
    """

    def __init__(self, node: Node, nursery: trio.Nursery) -> None:
        self._node = node
        self._nursery = nursery
        self._names: set[str] = set()
        self._open = True

    def run(self, name: str, fn: Runnable) -> None:
        """Start ``fn`` as a child named ``<node name>.<name>`` for the block's duration."""
        self.run_group({name: fn})

    def run_group(self, runnables: Mapping[str, Runnable]) -> None:
        """Start several children that fail and restart together, for the block's duration."""
        if not self._open:
            raise RuntimeError(f"{self._node.name}: run() on a scope that was left")
        members = self._node._reserve(runnables)
        self._names.update(runnables)
        self._nursery.start_soon(self._node._supervisor._supervise, members)


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
        #: Restarts by (dotted name, "failure" or "request"), never forgotten.
        self._restart_totals: dict[tuple[str, str], int] = {}

    # -- observing ---------------------------------------------------------

    def state(self, name: str) -> State | None:
        """The state of the runnable ``name``, or ``None`` if it has no entry.

        A child has no entry before it first ran and after the attempt or
        scope that ran it ended (see :meth:`snapshot`).
        """
        slot = self._slots.get(name)
        return slot.state if slot else None

    def restarts(self, name: str) -> int:
        """How many times ``name`` was restarted (after failures or on request)."""
        slot = self._slots.get(name)
        return slot.restarts if slot else 0

    def restart_totals(self) -> dict[tuple[str, str], int]:
        """Every restart since the tree started, by (dotted name, why).

        Why is ``"failure"`` or ``"request"`` (:meth:`Node.restart`).
        Unlike :meth:`restarts` and :meth:`snapshot`, these counts outlive
        the slots: a child that stopped (its parent restarted) keeps its
        count, and one that runs again adds to it, as a counter must.
        """
        return dict(self._restart_totals)

    def snapshot(self) -> list[RunnableInfo]:
        """Every runnable that has an entry now, sorted by dotted name.

        Entries of children are removed when the attempt of their parent, or
        the scope, that ran them ends; the root's entry stays.
        """
        return [
            RunnableInfo(
                name=slot.name,
                state=slot.state,
                restarts=slot.restarts,
                last_error=slot.last_error,
                last_error_at=slot.last_error_at,
            )
            for slot in sorted(self._slots.values(), key=lambda s: s.name)
        ]

    async def wait_state(self, name: str, *states: State) -> None:
        """Wait until the runnable ``name`` is in one of ``states``."""
        while self.state(name) not in states:
            await self._changed.wait()

    async def wait_healthy(self, name: str) -> None:
        """Wait until the runnable ``name`` has signalled healthy (in its current attempt)."""
        await self.wait_state(name, State.HEALTHY)

    def _set_state(self, slot: _Slot, state: State) -> None:
        slot.state = state
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _prune(self, names: Iterable[str]) -> None:
        """Forget the slots of children that no longer run (they have all ended)."""
        for name in names:
            self._slots.pop(name, None)
        self._notify()

    # -- running -----------------------------------------------------------

    async def _supervise(self, members: Mapping[str, Runnable]) -> None:
        """Run a group until all members are done, restarting it on failure or request.

        Never raises except ``trio.Cancelled`` (and KeyboardInterrupt/SystemExit).
        """
        slots = {name: self._register(name) for name in members}
        try:
            while True:
                outcome, who = await self._attempt(members, slots)
                if outcome is _Outcome.DONE:
                    return
                if outcome is _Outcome.FAILED:
                    # The group backs off as long as its worst member says.
                    failures = max(slot.failures for slot in slots.values())
                    delay = self._policy.delay(failures, self._rng)
                    for slot in slots.values():
                        self._set_state(slot, State.BACKOFF)
                    logging.getLogger(who).warning("restarting in %.2f s", delay)
                    await trio.sleep(delay)
                else:
                    # On request: no sleep, but a schedule point, so that a
                    # runnable that asks again and again cannot starve the
                    # other tasks, and cancellation is noticed.
                    await trio.lowlevel.checkpoint()
                why = "failure" if outcome is _Outcome.FAILED else "request"
                for slot in slots.values():
                    slot.restarts += 1
                    key = (slot.name, why)
                    self._restart_totals[key] = self._restart_totals.get(key, 0) + 1
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
            slot.failures = 0
        self._set_state(slot, State.STARTING)
        return slot

    async def _attempt(
        self, members: Mapping[str, Runnable], slots: Mapping[str, _Slot]
    ) -> tuple[_Outcome, str]:
        """Run every member once; how the group's attempt ended, and because of whom.

        The first member that fails or asks for a restart cancels the others;
        a failure outweighs a restart request.
        """
        outcome, who = _Outcome.DONE, ""

        async def member(name: str, fn: Runnable, group: trio.CancelScope) -> None:
            nonlocal outcome, who
            result = await self._run_once(slots[name], fn)
            if result is _Outcome.DONE or outcome is _Outcome.FAILED:
                return
            outcome, who = result, name
            group.cancel()

        async with trio.open_nursery() as nursery:
            for name, fn in members.items():
                nursery.start_soon(member, name, fn, nursery.cancel_scope)
        return outcome, who

    async def _run_once(self, slot: _Slot, fn: Runnable) -> _Outcome:
        """One attempt of one runnable with its children; how it ended.

        Raises ``trio.Cancelled`` when cancelled, and re-raises an exception
        that holds KeyboardInterrupt or SystemExit anywhere.
        """
        log = logging.getLogger(slot.name)
        error: BaseException | None = None
        node: Node | None = None
        try:
            async with trio.open_nursery() as children:
                node = Node(self, slot, children)
                try:
                    await fn(node)
                except BaseException as exc:  # sorted below; Cancelled goes back up
                    error = _without_cancelled(exc)
                    if error is None or _exit_in(error) is not None:
                        raise
                finally:
                    node._alive = False
                    children.cancel_scope.cancel()
        finally:
            # Every child has ended: its entry goes (descendants pruned theirs).
            if node is not None:
                self._prune(f"{slot.name}.{child}" for child in node._children)

        assert node is not None
        if error is not None:
            requests, rest = _split(error, RestartRequested)
            if rest is None and requests:
                reason = getattr(requests[0], "reason", "")
                log.info("restarting on request: %s", reason)
                return _Outcome.RESTART
            self._fail(slot, error)
            log.error("runnable failed: %r", error, exc_info=error)
            return _Outcome.FAILED
        if not node._done:
            self._fail(slot, RuntimeError("returned without signalling done"))
            log.error("runnable returned without signalling done")
            return _Outcome.FAILED
        self._set_state(slot, State.DONE)
        return _Outcome.DONE

    def _fail(self, slot: _Slot, error: BaseException) -> None:
        slot.failures += 1
        text = str(error)
        slot.last_error = f"{type(error).__name__}: {text}" if text else type(error).__name__
        slot.last_error_at = time.time()


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


def _split(
    exc: BaseException, kind: type[BaseException]
) -> tuple[list[BaseException], BaseException | None]:
    """The leaves of ``exc`` that are ``kind``, and what is left (None if nothing)."""
    if isinstance(exc, BaseExceptionGroup):
        match, rest = exc.split(kind)
        return _leaves(match) if match is not None else [], rest
    if isinstance(exc, kind):
        return [exc], None
    return [], exc


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in _leaves(sub)]
    return [exc]


def _exit_in(exc: BaseException) -> BaseException | None:
    """The first KeyboardInterrupt or SystemExit in ``exc`` (a group or not), if any."""
    for leaf in _leaves(exc):
        if isinstance(leaf, KeyboardInterrupt | SystemExit):
            return leaf
    return None


@asynccontextmanager
async def _exits_unwrapped() -> AsyncIterator[None]:
    """Re-raise a group holding KeyboardInterrupt/SystemExit as that bare exception.

    So that ``trio.run(supervise, main)`` ends like a plain program would: a
    ``SystemExit(3)`` deep in the tree exits the process with status 3.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        leaf = _exit_in(group)
        if leaf is None:
            raise
        raise leaf from None


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
    A KeyboardInterrupt or SystemExit in the tree cancels the block and
    propagates from it, unwrapped.
    """
    supervisor = Supervisor(policy or BackoffPolicy(), rng or random.Random())
    async with _exits_unwrapped(), trio.open_nursery() as nursery:
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

    The form for entry points: ``trio.run(supervise, main)``. A
    KeyboardInterrupt or SystemExit anywhere in the tree ends it at once and
    is raised from here, unwrapped from exception groups.
    """
    supervisor = Supervisor(policy or BackoffPolicy(), random.Random())
    async with _exits_unwrapped():
        await supervisor._supervise({name: root})
