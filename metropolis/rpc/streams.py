"""What a stream's owner receives (:data:`StreamEvent`), and the queue it comes through.

:class:`~metropolis.rpc.transport.Connection`'s reader puts each HTTP/2
stream's events into that stream's :class:`StreamQueue`; the stream's
owner (a server call, a client call) takes them out.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import trio

from metropolis.errors import MetropolisError

__all__ = [
    "END",
    "Closed",
    "Data",
    "End",
    "Headers",
    "Outgoing",
    "RequestCallback",
    "Reset",
    "StreamEvent",
    "StreamGone",
    "StreamQueue",
]


@dataclass(frozen=True)
class Headers:
    """Response headers (client side) or trailers (either side, ``trailers=True``)."""

    headers: dict[str, str]
    trailers: bool = False


@dataclass(frozen=True)
class Data:
    data: bytes


@dataclass(frozen=True)
class End:
    """The peer half-closed the stream: nothing more will arrive."""


END = End()


@dataclass(frozen=True)
class Reset:
    """The peer reset the stream (RST_STREAM) with an HTTP/2 error code."""

    code: int


@dataclass(frozen=True)
class Closed:
    """The connection ended; ``failure`` says why, if it broke."""

    failure: BaseException | None


StreamEvent = Headers | Data | End | Reset | Closed

#: Called by the reader (server side) for every new request stream, with the
#: stream ID and its request headers. It must not block: it starts a task.
RequestCallback = Callable[[int, dict[str, str]], None]


class StreamGone(MetropolisError):
    """The stream was reset or the connection closed while we were writing to it.

    Internal: server and client turn it into their own outcome.
    """


@dataclass
class Outgoing:
    """What remains to be sent of one :meth:`Connection.send`."""

    headers: list[tuple[str, str]] | None
    data: memoryview
    trailers: list[tuple[str, str]] | None
    end_after_data: bool
    done: bool = False


#: Events taken at once from a stream before :meth:`StreamQueue.get` yields anyway.
READY_TAKES = 16


class StreamQueue:
    """One stream's received events, queued for the one task that reads them.

    Lighter than a memory channel (a unary call makes two streams' worth):
    :meth:`get` waits only when nothing is queued. When something is, it is
    a checkpoint without a scheduling round (cancellation is still seen),
    except every :data:`READY_TAKES`-th time, so that a stream whose events
    keep coming still lets other tasks run and its deadline fire.
    """

    __slots__ = ("_events", "_gone", "_on_gone", "_ready_takes", "_waiter")

    def __init__(self) -> None:
        self._events: deque[tuple[StreamEvent, int]] = deque()
        self._waiter: trio.lowlevel.Task | None = None
        self._on_gone: Callable[[], None] | None = None
        self._gone = False
        self._ready_takes = 0

    def put(self, event: StreamEvent, size: int) -> None:
        self._events.append((event, size))
        if isinstance(event, Reset | Closed) and not self._gone:
            self._gone = True
            if self._on_gone is not None:
                self._on_gone()
        if self._waiter is not None:
            trio.lowlevel.reschedule(self._waiter)
            self._waiter = None

    async def get(self) -> tuple[StreamEvent, int]:
        if self._events:
            self._ready_takes += 1
            if self._ready_takes >= READY_TAKES:
                self._ready_takes = 0
                await trio.lowlevel.checkpoint()
            else:
                await trio.lowlevel.checkpoint_if_cancelled()
        else:
            self._ready_takes = 0
            if self._waiter is not None:
                raise trio.BusyResourceError("another task is reading this stream")
            self._waiter = trio.lowlevel.current_task()
            await trio.lowlevel.wait_task_rescheduled(self._abort)
        return self._events.popleft()

    def _abort(self, _: object) -> trio.lowlevel.Abort:
        self._waiter = None
        return trio.lowlevel.Abort.SUCCEEDED

    def watch(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the stream is reset or the connection ends (maybe now)."""
        if self._gone:
            callback()
        else:
            self._on_gone = callback
