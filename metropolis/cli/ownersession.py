"""The owner's kept-open session, the serving side.

``python -m metropolis owner-session OPTIONS`` (started by an owner call
with ``--keep-open SECONDS``, see :mod:`metropolis.cli.ownerlink`) listens
on the UNIX socket of its options and runs the owner calls handed to it,
each as the same command in a process of its own would run it:

- the whole command line is parsed by the CLI's own parser, relative
  paths against the caller's folder; a line the parser refuses, or whose
  options are not this session's, is *declined* (the caller then runs it
  itself and prints the usage error);
- the owner's files (key, cluster file or node root) are read again for
  every call: a call sees the files as they are now. One connection to
  the curators is kept per distinct access they give (CA, curators, key),
  so an edited cluster file gets a connection of its own;
- what the call writes to stdout and stderr, then its exit code, go back
  to the caller as they happen; an error is the caller's one line, as
  the CLI prints it.

Each connection is one call: one request, then frames (the wire is
:mod:`metropolis.cli.ownerlink`'s). Calls run side by side on the kept
connections. A caller that goes away (Ctrl-C) cancels its call.

The session ends after ``--keep-open`` seconds without a call (never
during one), or as soon as another session has taken its socket path (a
newer session for the same options); it then removes its socket if the
path is still its own. Log lines go to ``<socket>.log`` beside the
socket, not to any caller.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio
from cryptography.hazmat.primitives import serialization

from metropolis.cli import owner as owner_cli
from metropolis.cli import ownerlink
from metropolis.errors import MetropolisError
from metropolis.owner import Owner, OwnerAccess

__all__ = ["ErrorAnswer", "Parse", "main", "serve"]

log = logging.getLogger("metropolis.cli.ownersession")

#: The CLI's parser: argv (after ``metropolis``) to arguments; SystemExit
#: on a usage error.
Parse = Callable[[list[str]], argparse.Namespace]
#: An error of a call as the CLI reports it: its line (newline included)
#: and the exit code.
ErrorAnswer = Callable[[MetropolisError], tuple[str, int]]

#: A request is one line of at most this many bytes, read within this many seconds.
_REQUEST_LIMIT = 1 << 20
_REQUEST_TIMEOUT = 5.0
#: Distinct accesses (CA, curators, key) a session keeps a connection for;
#: a call needing another is declined.
_MAX_ACCESSES = 8
#: How often the session checks that its socket path is still its own.
_WATCH_INTERVAL = 1.0
#: The path arguments, made absolute against the caller's folder.
_PATH_ARGS = ("cluster", "root", "owner_key", "out")


def _identity(access: OwnerAccess) -> tuple[Any, ...]:
    """What makes two accesses the same connection: curators, CA, key, certificate."""
    raw = serialization.Encoding.Raw, serialization.PublicFormat.Raw
    der = serialization.Encoding.DER
    return (
        tuple(access.endpoints),
        access.ca_certificate.public_bytes(der),
        access.owner_key.public_key().public_bytes(*raw),
        access.certificate.public_bytes(der) if access.certificate else None,
    )


@dataclass
class _Session:
    key: str
    parse: Parse
    answer_error: ErrorAnswer
    keep_open: float
    nursery: trio.Nursery
    owners: dict[tuple[Any, ...], Owner] = field(default_factory=dict)
    opening: dict[tuple[Any, ...], trio.Lock] = field(default_factory=dict)
    calls: int = 0
    idle_since: float = field(default_factory=trio.current_time)

    async def owner_for(self, access: OwnerAccess, err: owner_cli.Say) -> Owner | None:
        """The kept owner client for ``access``, opened on first use (with
        the escrow, if due); None when the session keeps too many."""
        identity = _identity(access)
        lock = self.opening.setdefault(identity, trio.Lock())
        async with lock:
            if identity not in self.owners:
                if len(self.owners) >= _MAX_ACCESSES:
                    return None
                async with owner_cli.saying_waits("any", err):
                    await access.tls_context()
                self.owners[identity] = await self.nursery.start(_hold, access)
        return self.owners[identity]

    async def answer(self, stream: trio.SocketStream) -> None:
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
                        await self._run(request, stream, frames)
            except Exception:
                # A bug in one call ends that call, not the session: its
                # caller, left without an exit code, says the outcome is
                # unknown, as for a process that crashed mid-call.
                log.exception("a call failed")

    async def _run(
        self,
        request: tuple[list[str], str],
        stream: trio.SocketStream,
        frames: trio.MemorySendChannel[bytes],
    ) -> None:
        args = self._parse(*request)
        if args is None:
            frames.send_nowait(ownerlink.encode_frame(b"D", b"not this session's call"))
            return
        frames.send_nowait(ownerlink.encode_frame(b"S"))

        def out(text: str) -> None:
            frames.send_nowait(ownerlink.encode_frame(b"O", text.encode()))

        def err(text: str) -> None:
            frames.send_nowait(ownerlink.encode_frame(b"E", text.encode()))

        self.calls += 1
        try:
            async with trio.open_nursery() as call:
                # The caller's end closing (Ctrl-C) cancels the call.
                call.start_soon(_cancel_on_close, stream, call.cancel_scope)
                code = await self._call(args, out, err)
                frames.send_nowait(ownerlink.encode_frame(b"X", b"%d" % code))
                call.cancel_scope.cancel()
        finally:
            self.calls -= 1
            self.idle_since = trio.current_time()

    def _parse(self, argv: list[str], cwd: str) -> argparse.Namespace | None:
        if not cwd.startswith("/"):
            return None
        found = ownerlink.scan(argv)
        # Another session's options: the caller's key differs from ours.
        # (Paths in the key were made absolute in the caller's folder.)
        if found is None or found.key_in(cwd) != self.key:
            return None
        try:
            args = self.parse(argv)
        except SystemExit:
            return None  # a usage error: the caller prints it
        for name in _PATH_ARGS:
            value = getattr(args, name, None)
            if isinstance(value, Path) and not value.is_absolute():
                setattr(args, name, Path(cwd) / value)
        return args

    async def _call(self, args: argparse.Namespace, out: owner_cli.Say, err: owner_cli.Say) -> int:
        try:
            access = owner_cli.owner_access(args)
            owner = await self.owner_for(access, err)
            if owner is None:
                err(
                    "metropolis: error: the owner session keeps too many clusters; "
                    "run the call without --keep-open\n"
                )
                return 1
            await owner_cli.call(args, owner, out, err)
        except MetropolisError as error:
            return self._report([error], err)
        except BaseExceptionGroup as group:
            # From a nursery inside the call (saying_waits): the CLI reports
            # each of our errors in it as one line, and so does the session.
            ours, rest = group.split(MetropolisError)
            if ours is None or rest is not None:
                raise
            return self._report(_leaves(ours), err)
        return 0

    def _report(self, errors: list[MetropolisError], err: owner_cli.Say) -> int:
        code = 0
        for error in errors:
            line, code = self.answer_error(error)
            err(line)
        return code


def _leaves(group: BaseExceptionGroup[MetropolisError]) -> list[MetropolisError]:
    leaves: list[MetropolisError] = []
    for error in group.exceptions:
        if isinstance(error, BaseExceptionGroup):
            leaves += _leaves(error)
        else:
            leaves.append(error)
    return leaves


async def _hold(
    access: OwnerAccess, *, task_status: trio.TaskStatus[Owner] = trio.TASK_STATUS_IGNORED
) -> None:
    async with access.open() as owner:
        task_status.started(owner)
        await trio.sleep_forever()


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
            if length > ownerlink.REQUEST_LIMIT:
                return None
    if len(data) != 4 + length:
        return None  # more than the request: not our caller
    return ownerlink.decode_request(bytes(data[4:]))


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
    try:
        while await stream.receive_some(4096):
            pass  # nothing more is expected of the caller
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    scope.cancel()


async def serve(
    prefix: list[str], parse: Parse, answer_error: ErrorAnswer, keep_open: float
) -> None:
    """Serve the owner calls for the options ``prefix`` until ``keep_open``
    seconds pass without one, or a newer session takes the socket path.

    Returns at once when the socket's folder is not the user's alone.
    """
    found = ownerlink.scan(["owner", *prefix, "nodes"])
    path = None if found is None else ownerlink.session_path(found, create=True)
    if found is None or path is None:
        log.error("no private folder for the session's socket; not serving")
        return
    listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # Bound under a name of its own, then renamed over the session path: a
    # caller never meets a socket that does not listen yet, and of two
    # sessions started for the same options the later one wins the path.
    temporary = f"{path}.{os.getpid()}.new"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(temporary)
    await listener.bind(os.fsencode(temporary))
    listener.listen(64)
    os.rename(temporary, path)
    ours = os.stat(path).st_ino
    log.info("serving %s (pid %d) for %g s after the last call", path, os.getpid(), keep_open)
    try:
        async with trio.open_nursery() as nursery:
            session = _Session(found.key, parse, answer_error, keep_open, nursery)
            nursery.start_soon(_accept, listener, session, nursery)
            await _until_idle_or_replaced(session, path, ours)
            nursery.cancel_scope.cancel()
    finally:
        listener.close()
        if _inode(path) == ours:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    log.info("ended")


async def _accept(
    listener: trio.socket.SocketType, session: _Session, nursery: trio.Nursery
) -> None:
    while True:
        sock, _ = await listener.accept()
        session.idle_since = trio.current_time()
        nursery.start_soon(session.answer, trio.SocketStream(sock))


async def _until_idle_or_replaced(session: _Session, path: str, ours: int) -> None:
    while True:
        await trio.sleep(_WATCH_INTERVAL)
        if _inode(path) != ours:
            log.info("another session took %s", path)
            return
        if session.calls == 0 and trio.current_time() - session.idle_since >= session.keep_open:
            return


def _inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def main(prefix: list[str], parse: Parse, answer_error: ErrorAnswer) -> int:
    """``python -m metropolis owner-session OPTIONS``: serve until idle."""
    args = parse(["owner", *prefix, "nodes"])
    if args.keep_open is None:
        return 2
    found = ownerlink.scan(["owner", *prefix, "nodes"])
    path = None if found is None else ownerlink.session_path(found, create=True)
    if path is not None:
        logging.basicConfig(
            filename=path.removesuffix(".sock") + ".log",
            filemode="w",
            level=logging.INFO,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
    trio.run(serve, prefix, parse, answer_error, args.keep_open)
    return 0
