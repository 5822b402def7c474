"""Issue 26: the agent server's retry loops wait through `common.backoff`, not fixed sleeps."""

from __future__ import annotations

import contextlib
import errno
import random
import sys
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest
import trio

from bmdb import Connection
from bmdb.errors import BMDBError
from common.backoff import ExponentialBackoff, Retrier
from shepherd.agent_server import http1, server, workers


class _DeadBMDB:
    """A connection whose sessions never open."""

    def __init__(self) -> None:
        self.attempts = 0

    @contextlib.asynccontextmanager
    async def session(self, *args: Any, **kwargs: Any) -> AsyncIterator[None]:
        self.attempts += 1
        raise BMDBError("database gone")
        yield  # pragma: no cover


async def test_lost_session_is_reopened_after_growing_jittered_waits() -> None:
    dead = _DeadBMDB()
    holder = server._SessionHolder(cast(Connection, dead), "", 1.0, random.Random(7))
    waits: list[float] = []
    real_next = holder._retrier.next_delay

    def next_delay() -> float:
        waits.append(real_next())
        return 0.0  # the test does not wait them out

    holder._retrier.next_delay = next_delay  # type: ignore[method-assign]
    with trio.move_on_after(0.5):
        await holder.run()
    assert len(waits) >= 4
    assert dead.attempts in (len(waits), len(waits) + 1)  # one wait after each failure
    ceilings = [server.SESSION_BACKOFF.ceiling(n + 1) for n in range(len(waits))]
    low, high = server.SESSION_BACKOFF.jitter
    assert all(c * low <= w <= c * high for w, c in zip(waits, ceilings, strict=True))
    assert waits[3] > waits[0]  # grows (jitter (0.5, 1): ceiling doubles)


async def test_a_crashing_worker_is_restarted_through_the_retrier() -> None:
    retrier = Retrier(ExponentialBackoff(0.001, 0.01), random.Random(1))
    with trio.move_on_after(2):
        await workers._keep_running(0, [sys.executable, "-c", "raise SystemExit(3)"], None, retrier)
    assert retrier.failures >= 2  # each restart counted: waits grow until one ran STABLE_RUN


class _ExhaustedListener:
    """A listener whose first ``failures`` accepts run out of descriptors."""

    def __init__(self, failures: int, stream: trio.SocketStream) -> None:
        self.failures = failures
        self.stream = stream
        self.calls = 0

    async def accept(self) -> trio.SocketStream:
        await trio.lowlevel.checkpoint()
        self.calls += 1
        if self.calls <= self.failures:
            raise OSError(errno.EMFILE, "Too many open files")
        if self.calls == self.failures + 1:
            return self.stream
        await trio.sleep_forever()
        raise AssertionError("unreachable")


async def test_accept_out_of_descriptors_pauses_through_the_retrier_and_goes_on() -> None:
    """The agent and image servers' shared accept loop: EMFILE waits grow, then serves."""
    a, b = trio.socket.socketpair()
    stream = trio.SocketStream(a)
    listener = _ExhaustedListener(4, stream)
    retrier = Retrier(http1.ACCEPT_BACKOFF, random.Random(3))
    waits: list[float] = []
    real_next = retrier.next_delay

    def next_delay() -> float:
        waits.append(real_next())
        return 0.0

    retrier.next_delay = next_delay  # type: ignore[method-assign]
    connections = trio.Semaphore(2)
    served: list[trio.SocketStream] = []

    async def handler(got: trio.SocketStream, slots: trio.Semaphore) -> None:
        served.append(got)
        slots.release()

    with trio.move_on_after(2):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                http1.accept_loop,
                cast(trio.SocketListener, listener),
                connections,
                handler,
                nursery,
                retrier,
            )
            while not served:  # noqa: ASYNC110
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    assert served == [stream] and len(waits) == 4
    ceilings = [http1.ACCEPT_BACKOFF.ceiling(n + 1) for n in range(4)]
    low, high = http1.ACCEPT_BACKOFF.jitter
    assert all(c * low <= w <= c * high for w, c in zip(waits, ceilings, strict=True))
    assert retrier.failures == 0  # the accepted connection started the count over
    assert connections.value == 2  # every slot taken for a failed accept was given back
    a.close()
    b.close()


async def test_accept_fails_on_other_errors() -> None:
    class _Broken:
        async def accept(self) -> trio.SocketStream:
            raise OSError(errno.EBADF, "Bad file descriptor")

    connections = trio.Semaphore(1)
    retrier = Retrier(http1.ACCEPT_BACKOFF, random.Random(3))

    async def handler(got: trio.SocketStream, slots: trio.Semaphore) -> None:
        raise AssertionError("nothing was accepted")

    async with trio.open_nursery() as nursery:
        with pytest.raises(OSError, match="Bad file descriptor"):
            await http1.accept_loop(
                cast(trio.SocketListener, _Broken()), connections, handler, nursery, retrier
            )
    assert connections.value == 1 and retrier.failures == 0
