"""Event values: a variable that tasks can watch for newer contents.

A :class:`Value` holds the newest of a series of values. Each
:class:`Watcher` keeps its own position in that series::

    value.set(a)   value.set(b)   value.set(c)
         │              │              │
    watcher.get() ─► a  │              │        first get: the current value
    watcher.get() ──────┴─ (skipped) ──┴─► c    later gets: only newer values

Guarantees, which callers rely on:

* The first ``get()`` of a watcher returns the current value, waiting while
  the value was never set. Each later ``get()`` returns a value set after the
  one it returned before, waiting until there is one.
* Only the newest value matters: values set between two ``get()`` calls are
  skipped. A watcher never sees an older value after a newer one.
* ``get(predicate)`` skips values for which ``predicate`` is false.
* ``get()`` is cancellation-safe: when cancelled it has consumed nothing, so
  the next ``get()`` returns what the cancelled one would have.
* A watcher is one reader: a second ``get()`` while one is waiting on the
  same watcher raises ``trio.BusyResourceError`` (two readers would silently
  split the values between them). Each reader makes its own watcher.
* :meth:`Value.readonly` gives a view that can only be watched: a service
  publishes its status through it so that consumers cannot ``set()`` it.
* ``set()`` never blocks and costs O(watchers waiting) to wake them.
* ``update(change)`` sets ``change(current)`` with no checkpoint between the
  read and the set: a value with several writers, each owning some of its
  fields, is changed by each through ``update``, and none loses what
  another set. The writer reads nothing (no watcher, no wait).
* After ``Value.close()``, a watcher still gets the newest value if it has not
  seen it, then ``get()`` raises :class:`Closed`. After ``Watcher.close()``,
  that watcher's ``get()`` raises :class:`Closed`.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Generic, TypeGuard, TypeVar, overload

import trio

from metropolis.errors import MetropolisError

__all__ = ["Closed", "ReadOnlyValue", "Value", "Watcher"]

T = TypeVar("T")
S = TypeVar("S")


class Closed(MetropolisError):
    """The value or the watcher was closed; no further values will come."""


class Value(Generic[T]):
    """The newest of a series of values of type ``T``; see the module docstring."""

    def __init__(self) -> None:
        self._value: T | None = None
        # Number of set() calls so far; version 0 means "never set".
        self._version = 0
        self._closed = False
        # Set and replaced on every change; waiters wait on the one current
        # when they started waiting, so no wake-up is ever missed.
        self._changed = trio.Event()

    def set(self, value: T) -> None:
        """Make ``value`` the newest value and wake every waiting watcher.

        Raises :class:`Closed` after ``close()``.
        """
        if self._closed:
            raise Closed("set() on a closed Value")
        self._value = value
        self._version += 1
        self._wake()

    def update(self, change: Callable[[T], T]) -> T:
        """Set ``change(current)`` and return it; the same object back sets nothing.

        ``change`` must not block (it runs between the read and the set).
        Raises :class:`Closed` after ``close()``, `RuntimeError` if the value
        was never set (the caller's bug: nothing to change yet).
        """
        if self._closed:
            raise Closed("update() on a closed Value")
        if self._version == 0:
            raise RuntimeError("update() of a Value that was never set")
        current: T = self._value  # type: ignore[assignment]
        new = change(current)
        if new is not current:
            self.set(new)
        return new

    def close(self) -> None:
        """End the series: watchers get the newest value, then :class:`Closed`."""
        self._closed = True
        self._wake()

    def watch(self) -> Watcher[T]:
        """A new watcher positioned before the current value."""
        return Watcher(self)

    def readonly(self) -> ReadOnlyValue[T]:
        """A view of this value that can be watched but not set or closed."""
        return ReadOnlyValue(self)

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()


class ReadOnlyValue(Generic[T]):
    """A watch-only view of a :class:`Value`: it has ``watch()``, and no ``set()``."""

    __slots__ = ("_value",)

    def __init__(self, value: Value[T]) -> None:
        self._value = value

    def watch(self) -> Watcher[T]:
        """A new watcher of the underlying value, positioned before its current value."""
        return self._value.watch()


class Watcher(Generic[T]):
    """One reader's position in a :class:`Value`'s series. Use as a context manager."""

    def __init__(self, value: Value[T]) -> None:
        self._source = value
        self._seen = 0  # version of the last value this watcher returned
        self._closed = False
        self._getting = False  # a get() is in progress

    @overload
    async def get(self) -> T: ...
    @overload
    async def get(self, predicate: Callable[[T], TypeGuard[S]]) -> S: ...
    @overload
    async def get(self, predicate: Callable[[T], bool]) -> T: ...

    async def get(self, predicate: Callable[[T], bool] | None = None) -> object:
        """The next value (see the module docstring) for which ``predicate`` holds.

        Raises :class:`Closed` when the watcher or its value was closed and no
        qualifying value is left, and ``trio.BusyResourceError`` when another
        task is in ``get()`` on this watcher. Cancellation-safe.
        """
        if self._getting:
            raise trio.BusyResourceError("another task is already in get() on this Watcher")
        self._getting = True
        try:
            return await self._get(predicate)
        finally:
            self._getting = False

    async def _get(self, predicate: Callable[[T], bool] | None) -> object:
        await trio.lowlevel.checkpoint()
        source = self._source
        while True:
            if self._closed:
                raise Closed("get() on a closed Watcher")
            if source._version > self._seen:
                # Read and mark seen with no checkpoint in between: a
                # cancellation can never lose a value.
                self._seen = source._version
                value: T = source._value  # type: ignore[assignment]  # set at version >= 1
                if predicate is None or predicate(value):
                    return value
                continue
            if source._closed:
                raise Closed("the Value was closed")
            await source._changed.wait()

    def close(self) -> None:
        """Stop watching; a ``get()`` waiting in another task raises :class:`Closed`."""
        self._closed = True
        # Wake everyone: the spurious wake-ups of other watchers are harmless
        # (they re-check and wait again) and closing is rare.
        self._source._wake()

    def __enter__(self) -> Watcher[T]:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
