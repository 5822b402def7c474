"""Independent calls at once: :func:`gather`.

The control plane's paths wait on etcd round trips; reads that do not
depend on each other are sent together (one round trip's wait instead of
several), as on the bootstrap and ConsensusMember grant paths.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

import trio

__all__ = ["gather"]

_A = TypeVar("_A")
_B = TypeVar("_B")
_C = TypeVar("_C")
_D = TypeVar("_D")


@overload
async def gather(
    a: Callable[[], Awaitable[_A]], b: Callable[[], Awaitable[_B]], /
) -> tuple[_A, _B]: ...


@overload
async def gather(
    a: Callable[[], Awaitable[_A]],
    b: Callable[[], Awaitable[_B]],
    c: Callable[[], Awaitable[_C]],
    /,
) -> tuple[_A, _B, _C]: ...


@overload
async def gather(
    a: Callable[[], Awaitable[_A]],
    b: Callable[[], Awaitable[_B]],
    c: Callable[[], Awaitable[_C]],
    d: Callable[[], Awaitable[_D]],
    /,
) -> tuple[_A, _B, _C, _D]: ...


async def gather(*calls: Callable[[], Awaitable[Any]]) -> tuple[Any, ...]:
    """Run the calls concurrently; return their results in order.

    Errors: the first failure cancels the others and is raised itself, as
    from sequential calls (not wrapped in an exception group). Cancellation
    of the caller cancels every call.
    """
    results: list[object] = [None] * len(calls)

    async def one(i: int, fn: Callable[[], Awaitable[object]]) -> None:
        results[i] = await fn()

    try:
        async with trio.open_nursery() as nursery:
            for i, fn in enumerate(calls):
                nursery.start_soon(one, i, fn)
    except BaseExceptionGroup as group:
        # The first error that is not the cancellation it caused in the others.
        _, errors = group.split(trio.Cancelled)
        if errors is None:
            raise
        first: BaseException = errors
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None
    return tuple(results)
