"""The image server: node images by their SHA-256, for agents that install them.

::

    GET|HEAD /images/sha256/<64 lowercase hex>   ->  <image dir>/<hex>.pyz

Only a path that is exactly that form names a file (anything else is 404:
the name is the digest, so no path can reach outside the image directory),
and a file is served only if its SHA-256 is its name: checked once, the
first time it is asked for, and remembered per (name, device, inode, size,
modification time), so that a replaced or rewritten file is checked again.
A file whose content does not match is answered 404, as if absent, and
logged: an agent would refuse it anyway (it verifies the digest before it
writes anything), and ``shepherd install`` must not take it as present.

Answers: ``ETag`` the digest (quoted), ``Content-Length``, ``Accept-Ranges:
bytes``, cacheable forever (the name is the content). ``Range: bytes=a-b``,
``bytes=a-`` and ``bytes=-n`` get ``206`` with ``Content-Range``; a range
that starts past the end (or ``bytes=-0``, or any range of an empty file)
gets ``416`` with ``Content-Range: bytes */size``; several ranges, another
unit, a malformed or reversed range, or an ``If-Range`` that is not the
ETag get the whole file with ``200`` (RFC 9110 lets a server ignore Range,
and a client resuming a download asks for one range). The body is read
from disk in chunks of ``chunk_size`` (in a thread) and sent one chunk at
a time: an image is never held in memory whole.

HTTP/1.1 by h11 (not `shepherd.agent_server.http1`, whose parser is made
for small POSTs and answers whose body is in memory): keep-alive, a
request body refused (``400``, connection closed), protocol errors
answered with h11's status hint and the connection closed. Limits, like
the heartbeat server's: at most ``max_connections`` connections (more wait
in the accept queue), a TLS handshake and a request head within
``head_timeout`` of their first byte (``408`` then), a kept-alive
connection closed after ``idle_timeout`` without a request, and a client
that takes no bytes for ``send_timeout`` (a stalled download) cut off. An
error out of one connection ends that connection only.

Cancellation: cancelling `serve_images` closes the listener and every
connection.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import random
import re
import ssl
import stat
from dataclasses import dataclass
from pathlib import Path

import h11
import trio

from common.backoff import Retrier
from common.httpserver import error_answer
from common.listen import split_listen
from common.numbers import parse_decimal
from common.tcp import open_listener
from shepherd.agent_server.http1 import (
    ACCEPT_BACKOFF,
    accept_loop,
    url_of,
)
from shepherd.errors import ShepherdError

logger = logging.getLogger("shepherd.agent_server.images")

#: The one path form served; the group is the digest.
IMAGE_PATH = re.compile(rb"/images/sha256/([0-9a-f]{64})")

#: Verification results kept (beyond, the cache starts over).
VERIFIED_CACHE_SIZE = 4096

_HASH_CHUNK = 1 << 20


@dataclass(frozen=True)
class ImageServerConfig:
    """Where the images are and how to serve them."""

    #: host:port to listen on (port 0: any free port).
    listen: str
    #: The folder of the images, each named ``<64 hex>.pyz``.
    image_dir: Path
    #: Seconds a client may take no bytes of an answer before it is cut off.
    send_timeout: float = 10.0
    #: Seconds a kept-alive connection may wait for its next request.
    idle_timeout: float = 25.0
    #: Seconds within which a TLS handshake, and a request head from its
    #: first byte, must be complete.
    head_timeout: float = 10.0
    #: Connections at once; more wait in the accept queue.
    max_connections: int = 1000
    backlog: int = 128
    #: Listen with SO_REUSEPORT (every worker process serves images).
    reuse_port: bool = False
    #: Bytes read from disk and sent at a time.
    chunk_size: int = 256 * 1024
    #: Largest request head, bytes.
    max_head: int = 16 * 1024


class RangeNotSatisfiable(ShepherdError):
    """A Range that is well formed but starts beyond the file."""


def byte_range(header: bytes, size: int) -> tuple[int, int] | None:
    """The (first, last) byte positions, inclusive, that a Range header asks of
    a ``size``-byte file; None to answer the whole file (several ranges,
    another unit, malformed); `RangeNotSatisfiable` if no byte is asked for."""
    try:
        text = header.decode("ascii")
    except UnicodeDecodeError:
        return None
    unit, sep, spec = text.partition("=")
    if not sep or unit.lower() != "bytes" or "," in spec:
        return None
    first, dash, last = spec.partition("-")
    if not dash:
        return None
    try:
        if not first:
            suffix = parse_decimal(last, max_digits=19, what="suffix length")
            if suffix == 0 or size == 0:
                raise RangeNotSatisfiable
            return max(0, size - suffix), size - 1
        start = parse_decimal(first, max_digits=19, what="first byte")
        end = parse_decimal(last, max_digits=19, what="last byte") if last else size - 1
    except ValueError:
        return None
    if last and end < start:
        return None  # invalid: ignored, as RFC 9110 says
    if start >= size:
        raise RangeNotSatisfiable
    return start, min(end, size - 1)


def _sha256_of(fd: int, size: int) -> str:
    """Hex SHA-256 of the first ``size`` bytes of ``fd`` (blocking: run in a thread)."""
    digest = hashlib.sha256()
    offset = 0
    while offset < size:
        chunk = os.pread(fd, min(_HASH_CHUNK, size - offset), offset)
        if not chunk:
            break  # shortened meanwhile: the digest will not match
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()


class _Stop(ShepherdError):
    """End this connection (timed out, refused, or a stalled client)."""


class ImageServer:
    """Serves the images of ``config.image_dir``; `serve` runs it."""

    def __init__(
        self,
        config: ImageServerConfig,
        ssl_context: ssl.SSLContext | None = None,
        *,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.ssl_context = ssl_context
        self._rng = rng if rng is not None else random.Random()
        self._verified: dict[tuple[str, int, int, int, int], bool] = {}
        # One verification at a time: a first download of an image hashes it
        # once, however many agents ask at once.
        self._verifying = trio.Lock()

    async def serve(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; ``task_status`` gets the URL. OSError if it cannot bind."""
        host, port = split_listen(self.config.listen)
        listener = await open_listener(
            host, port, backlog=self.config.backlog, reuse_port=self.config.reuse_port, nodelay=True
        )
        connections = trio.Semaphore(self.config.max_connections)
        retrier = Retrier(ACCEPT_BACKOFF, self._rng)
        try:
            async with trio.open_nursery() as nursery:
                url = url_of(listener, self.ssl_context is not None)
                logger.info("image server on %s, images from %s", url, self.config.image_dir)
                task_status.started(url)
                await accept_loop(listener, connections, self._connection, nursery, retrier)
        finally:
            await trio.aclose_forcefully(listener)

    async def _connection(self, tcp: trio.SocketStream, connections: trio.Semaphore) -> None:
        stream: trio.abc.Stream = tcp
        try:
            if self.ssl_context is not None:
                tls = trio.SSLStream(tcp, self.ssl_context, server_side=True)
                stream = tls
                with trio.move_on_after(self.config.head_timeout) as handshake:
                    await tls.do_handshake()
                if handshake.cancelled_caught:
                    return
            conn = h11.Connection(h11.SERVER, max_incomplete_event_size=self.config.max_head)
            while True:
                request = await self._request(stream, conn)
                if request is None:
                    return
                await self._answer(stream, conn, request)
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    return
                conn.start_next_cycle()
        except (_Stop, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except Exception as exc:
            # A bug, reached by this connection's bytes: it ends this one only.
            logger.warning("image connection failed, closed: %r", exc)
            logger.debug("image connection failure", exc_info=True)
        finally:
            connections.release()
            await trio.aclose_forcefully(stream)

    async def _request(self, stream: trio.abc.Stream, conn: h11.Connection) -> h11.Request | None:
        """The next request's head (its body must be empty); None when the
        client closed or idled out; refusals are answered and raise `_Stop`."""
        request: h11.Request | None = None
        started = False
        with trio.CancelScope(deadline=trio.current_time() + self.config.idle_timeout) as scope:
            while True:
                try:
                    event = conn.next_event()
                except h11.RemoteProtocolError as exc:
                    await self._error(stream, conn, exc.error_status_hint, "malformed request")
                    raise _Stop from exc
                if event is h11.NEED_DATA:
                    data = await stream.receive_some(65536)
                    if data and not started:
                        started = True
                        scope.deadline = min(
                            scope.deadline, trio.current_time() + self.config.head_timeout
                        )
                    conn.receive_data(bytes(data))
                elif isinstance(event, h11.Request):
                    request = event
                elif isinstance(event, h11.EndOfMessage):
                    return request
                elif isinstance(event, h11.Data):
                    await self._error(stream, conn, 400, "request bodies are not accepted")
                    raise _Stop
                else:  # ConnectionClosed (or PAUSED, which a server never sees here)
                    return None
        if started:  # idle: closed without a word
            await self._error(stream, conn, 408, "request not complete in time")
        return None

    async def _send(self, stream: trio.abc.Stream, data: bytes) -> None:
        with trio.move_on_after(self.config.send_timeout) as scope:
            await stream.send_all(data)
        if scope.cancelled_caught:
            logger.info("image client took no bytes for %gs: cut off", self.config.send_timeout)
            raise _Stop

    async def _error(
        self, stream: trio.abc.Stream, conn: h11.Connection, status: int, text: str
    ) -> None:
        """Answer a short error and leave the connection to be closed (if an answer can
        still be sent on it)."""
        data = error_answer(conn, status, text)
        if data:
            await self._send(stream, data)

    async def _simple(
        self,
        stream: trio.abc.Stream,
        conn: h11.Connection,
        status: int,
        text: str,
        extra: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        """A short answer on a kept-alive connection (no body to a HEAD)."""
        body = text.encode() + b"\n"
        headers = [
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"content-length", b"%d" % len(body)),
            *(extra or []),
        ]
        await self._send(stream, conn.send(h11.Response(status_code=status, headers=headers)))
        if conn.our_state is h11.SEND_BODY:  # not after a HEAD
            await self._send(stream, conn.send(h11.Data(data=body)))
        await self._send(stream, conn.send(h11.EndOfMessage()))

    async def _answer(
        self, stream: trio.abc.Stream, conn: h11.Connection, request: h11.Request
    ) -> None:
        if request.method not in (b"GET", b"HEAD"):
            await self._simple(stream, conn, 405, "only GET and HEAD", [(b"allow", b"GET, HEAD")])
            return
        match = IMAGE_PATH.fullmatch(request.target)
        if match is None:
            await self._simple(stream, conn, 404, "no such image")
            return
        digest = match.group(1).decode("ascii")
        path = self.config.image_dir / f"{digest}.pyz"
        try:
            # O_NONBLOCK: opening a FIFO put there must not hang the server.
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                logger.warning("image %s: cannot open: %s", digest, exc)
            await self._simple(stream, conn, 404, "no such image")
            return
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or not await self._matches(digest, fd, info):
                await self._simple(stream, conn, 404, "no such image")
                return
            await self._file(stream, conn, request, digest, fd, info.st_size)
        finally:
            os.close(fd)

    async def _matches(self, digest: str, fd: int, info: os.stat_result) -> bool:
        """True if the file's SHA-256 is ``digest`` (hashed once per file version)."""
        key = (digest, info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
        known = self._verified.get(key)
        if known is not None:
            return known
        async with self._verifying:
            known = self._verified.get(key)
            if known is None:
                actual = await trio.to_thread.run_sync(_sha256_of, fd, info.st_size)
                known = actual == digest
                if not known:
                    logger.error(
                        "image %s: content has SHA-256 %s, not its name: not served", digest, actual
                    )
                if len(self._verified) >= VERIFIED_CACHE_SIZE:
                    self._verified.clear()
                self._verified[key] = known
        return known

    async def _file(
        self,
        stream: trio.abc.Stream,
        conn: h11.Connection,
        request: h11.Request,
        digest: str,
        fd: int,
        size: int,
    ) -> None:
        etag = f'"{digest}"'.encode()
        common = [
            (b"etag", etag),
            (b"accept-ranges", b"bytes"),
            (b"cache-control", b"public, max-age=31536000, immutable"),
        ]
        ranges = [value for name, value in request.headers if name == b"range"]
        if_range = [value for name, value in request.headers if name == b"if-range"]
        span: tuple[int, int] | None = None
        if len(ranges) == 1 and (not if_range or if_range == [etag]):
            try:
                span = byte_range(ranges[0], size)
            except RangeNotSatisfiable:
                await self._simple(
                    stream,
                    conn,
                    416,
                    "range not satisfiable",
                    [(b"content-range", b"bytes */%d" % size), *common],
                )
                return
        if span is None:
            status, first, last = 200, 0, size - 1
            headers = common
        else:
            status, (first, last) = 206, span
            headers = [(b"content-range", b"bytes %d-%d/%d" % (first, last, size)), *common]
        length = last - first + 1
        headers = [
            (b"content-type", b"application/octet-stream"),
            (b"content-length", b"%d" % length),
            *headers,
        ]
        await self._send(stream, conn.send(h11.Response(status_code=status, headers=headers)))
        if request.method == b"GET":
            offset = first
            while offset <= last:
                want = min(self.config.chunk_size, last + 1 - offset)
                chunk = await trio.to_thread.run_sync(os.pread, fd, want, offset)
                if not chunk:
                    # The file shrank under us: the answer cannot be completed.
                    logger.warning("image %s: shorter than when it was opened", digest)
                    raise _Stop
                await self._send(stream, conn.send(h11.Data(data=chunk)))
                offset += len(chunk)
        await self._send(stream, conn.send(h11.EndOfMessage()))


async def serve_images(
    config: ImageServerConfig,
    ssl_context: ssl.SSLContext | None = None,
    *,
    rng: random.Random | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the images of ``config`` until cancelled; ``task_status`` gets the URL.

    Raises OSError if the address cannot be bound.
    """
    await ImageServer(config, ssl_context, rng=rng).serve(task_status=task_status)
