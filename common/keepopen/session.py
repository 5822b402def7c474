"""The serving side of a kept-open session (`common.keepopen`).

:func:`serve` listens on a session's socket and hands each request to the
tool's ``accept``: given the caller's arguments and folder, it returns the
call to run, or ``None`` to decline (a command line the tool's parser
refuses, or another session's options: the caller then runs the call
itself). A call writes through ``out`` and ``err`` as it goes, and
returns its exit code; the caller prints each as it arrives.

Calls run side by side. A caller that goes away (Ctrl-C) cancels its
call. A call that raises (a bug) ends that call, not the session: its
caller, left without an exit code, says the outcome is unknown. The
session ends after ``keep_open`` seconds without a call (never during
one), or as soon as another session has taken its socket path (a newer
session for the same key); it then removes its socket if the path is
still its own. Log lines go to the file :func:`log_beside` names.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from common.cli import LOG_FORMAT
from common.keepopen import link

__all__ = ["Accept", "Call", "Say", "log_beside", "serve"]

log = logging.getLogger("common.keepopen.session")

#: Where a call's text goes: the caller's stdout or stderr.
Say = Callable[[str], None]
#: A call to run: writes through ``out`` and ``err``, returns the exit code.
Call = Callable[[Say, Say], Awaitable[int]]
#: The tool's reading of a request: (argv, cwd) to its call, or None to decline.
Accept = Callable[[list[str], str], "Call | None"]

#: A request is read within this many seconds.
_REQUEST_TIMEOUT = 5.0
#: How often the session checks that its socket path is still its own.
_WATCH_INTERVAL = 1.0


@dataclass
class _State:
    accept: Accept
    calls: int = 0
    idle_since: float = field(default_factory=trio.current_time)


async def serve(path: str, keep_open: float, accept: Accept) -> None:
    """Serve the calls ``accept`` takes, on the socket ``path`` (from
    `link.session_path`), until ``keep_open`` seconds pass without one or
    a newer session takes the path.

    Cancellation: cancels every call in progress and removes the socket.
    """
    listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # Bound under a name of its own, then renamed over the session path: a
    # caller never meets a socket that does not listen yet, and of two
    # sessions started for the same key the later one wins the path.
    temporary = f"{path}.{os.getpid()}.new"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(temporary)
    await listener.bind(os.fsencode(temporary))
    listener.listen(64)
    os.rename(temporary, path)
    ours = os.stat(path).st_ino
    log.info("serving %s (pid %d) for %g s after the last call", path, os.getpid(), keep_open)
    state = _State(accept)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_accept_loop, listener, state, nursery)
            await _until_idle_or_replaced(state, keep_open, path, ours)
            nursery.cancel_scope.cancel()
    finally:
        listener.close()
        if _inode(path) == ours:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    log.info("ended")


def log_beside(path: str) -> None:
    """Send this process's log lines to ``<socket>.log`` (the session has
    no terminal)."""
    logging.basicConfig(
        filename=path.removesuffix(".sock") + ".log",
        filemode="w",
        level=logging.INFO,
        format=LOG_FORMAT,
    )


async def _accept_loop(
    listener: trio.socket.SocketType, state: _State, nursery: trio.Nursery
) -> None:
    while True:
        sock, _ = await listener.accept()
        state.idle_since = trio.current_time()
        nursery.start_soon(_answer, trio.SocketStream(sock), state)


async def _answer(stream: trio.SocketStream, state: _State) -> None:
    """One caller: its request, its call, its frames."""
    async with stream:
        if not _same_user(stream):
            return
        request = None
        with trio.move_on_after(_REQUEST_TIMEOUT):
            request = await _read_request(stream)
        if request is None:
            return
        frames, outgoing = trio.open_memory_channel[bytes](math.inf)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_send_frames, stream, outgoing)
                with frames:
                    await _run(request, stream, frames, state)
        except Exception:
            log.exception("a call failed")


async def _run(
    request: tuple[list[str], str],
    stream: trio.SocketStream,
    frames: trio.MemorySendChannel[bytes],
    state: _State,
) -> None:
    argv, cwd = request
    call = state.accept(argv, cwd) if cwd.startswith("/") else None
    if call is None:
        frames.send_nowait(link.encode_frame(b"D", b"not this session's call"))
        return
    frames.send_nowait(link.encode_frame(b"S"))

    def out(text: str) -> None:
        frames.send_nowait(link.encode_frame(b"O", text.encode()))

    def err(text: str) -> None:
        frames.send_nowait(link.encode_frame(b"E", text.encode()))

    state.calls += 1
    try:
        async with trio.open_nursery() as running:
            # The caller's end closing (Ctrl-C) cancels the call.
            running.start_soon(_cancel_on_close, stream, running.cancel_scope)
            code = await call(out, err)
            frames.send_nowait(link.encode_frame(b"X", b"%d" % code))
            running.cancel_scope.cancel()
    finally:
        state.calls -= 1
        state.idle_since = trio.current_time()


def _same_user(stream: trio.SocketStream) -> bool:
    """Whether the caller runs as our user (SO_PEERCRED)."""
    try:
        creds = stream.socket.getsockopt(
            socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")
        )
    except OSError:
        return False
    _pid, uid, _gid = struct.unpack("3i", creds)
    return bool(uid == os.geteuid())


async def _read_request(stream: trio.SocketStream) -> tuple[list[str], str] | None:
    """The caller's arguments and folder; None for a malformed or oversized request."""
    data = bytearray()
    length: int | None = None
    while length is None or len(data) < 4 + length:
        chunk = await stream.receive_some(65536)
        if not chunk:
            return None
        data += chunk
        if length is None and len(data) >= 4:
            length = int.from_bytes(data[:4], "big")
            if length > link.REQUEST_LIMIT:
                return None
    if len(data) != 4 + length:
        return None  # more than the request: not our caller
    return link.decode_request(bytes(data[4:]))


async def _send_frames(
    stream: trio.SocketStream, outgoing: trio.MemoryReceiveChannel[bytes]
) -> None:
    async with outgoing:
        async for frame in outgoing:
            try:
                await stream.send_all(frame)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return


async def _cancel_on_close(stream: trio.SocketStream, scope: trio.CancelScope) -> None:
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        while await stream.receive_some(4096):
            pass  # nothing more is expected of the caller
    scope.cancel()


async def _until_idle_or_replaced(state: _State, keep_open: float, path: str, ours: int) -> None:
    while True:
        await trio.sleep(_WATCH_INTERVAL)
        if _inode(path) != ours:
            log.info("another session took %s", path)
            return
        if state.calls == 0 and trio.current_time() - state.idle_since >= keep_open:
            return


def _inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None
