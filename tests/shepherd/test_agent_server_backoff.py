"""Issue 26: the agent server's retry loops wait through `common.backoff`, not fixed sleeps."""

from __future__ import annotations

import errno
import random
import sys
from typing import cast

import pytest
import trio

from bmdb import Connection
from common.backoff import ExponentialBackoff, Retrier
from shepherd.agent_server import http1, server, workers
from tests.shepherd.retries import DeadBMDB, assert_backed_off, recorded_waits


async def test_lost_session_is_reopened_after_growing_jittered_waits() -> None:
    dead = DeadBMDB()
    holder = server._SessionHolder(cast(Connection, dead), "", 1.0, random.Random(7))
    waits = recorded_waits(holder._retrier)
    with trio.move_on_after(0.5):
        await holder.run()
    assert dead.attempts in (len(waits), len(waits) + 1)  # one wait after each failure
    # Jitter (0.5, 1): the ceiling doubles, so the waits grow.
    assert_backed_off(waits, server.SESSION_BACKOFF)


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
    waits = recorded_waits(retrier)
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
    assert_backed_off(waits, http1.ACCEPT_BACKOFF)
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
