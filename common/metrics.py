"""Serving Prometheus metrics over HTTP/1.1 from inside a Trio program.

`serve_metrics` exposes a ``prometheus_client`` registry at ``/metrics`` on
``HOST:PORT``. Collection runs in the Trio thread, between other tasks'
steps, so collectors may read plain counters that Trio tasks update without
any locking (prometheus_client's own HTTP server would collect in a thread
of its own). A ``refresh`` coroutine, if given, runs before each scrape's
collection: values that take I/O to read (another process's state) are
read then, and only when someone scrapes.

Answers: ``GET`` or ``HEAD`` of ``/metrics`` (any query; ``name[]=NAME``
keeps only those metric families, as prometheus_client's own servers do)
gets the exposition in the format its ``Accept`` header asks for
(prometheus_client's ``choose_encoder``: the text format unless OpenMetrics
is asked for; an ``Accept`` it cannot read gets the text format),
gzip-compressed if ``Accept-Encoding`` allows it. Other paths get ``404``,
other methods ``405``, a request with a body ``400`` (the connection is
closed then).

HTTP/1.1 by h11, with keep-alive, and bounded (`MetricsLimits`), since
anybody who reaches the port may connect:

- a request head must be complete within ``head_timeout`` of the moment
  the connection began to wait for it (its start, or the end of the
  previous answer), else it is closed (``408`` if part of a head came);
  a head is at most ``max_head`` bytes (``431``);
- an answer must be taken by the client within ``send_timeout``, else the
  connection is cut; nothing shields a send, so a client that reads
  nothing holds neither its connection nor the server's cancellation;
- at most ``max_connections`` connections: one more closes the one that
  has waited longest for its request head (idle or sending slowly), so
  connections that send nothing cannot keep a scraper out; while every
  connection is being answered (each within ``send_timeout``), new ones
  wait.

Why not hypercorn, which served this before (issue 35): its HTTP/1.1 sends
are shielded from cancellation and have no deadline, so one client that
kept its receive window shut held its connection for ever and made the
server's cancellation (a node's shutdown) wait for it; and
prometheus_client's ASGI app answered an ``Accept`` header it could not
read (bytes that are not UTF-8, an OpenMetrics version that is no number)
with a ``500`` and a traceback in the log.

Cancellation: cancelling `serve_metrics` closes the listener and every
connection at once. An error out of one connection ends that connection
only.
"""

from __future__ import annotations

import errno
import gzip
import logging
import random
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import parse_qs

import h11
import trio
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import (
    CONTENT_TYPE_PLAIN_0_0_4,
    choose_encoder,
    generate_latest,
    gzip_accepted,
)

from common.backoff import ExponentialBackoff, Retrier
from common.numbers import parse_decimal

__all__ = ["MetricsLimits", "exposition", "serve_metrics"]

logger = logging.getLogger("common.metrics")

#: accept() errors that mean "out of resources for now": logged, retried.
_ACCEPT_CAPACITY = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
#: Pauses between accept() calls that ran out of resources; an accepted
#: connection starts the count over.
_ACCEPT_BACKOFF = ExponentialBackoff(0.05, 2.0, jitter=(0.5, 1.0))

Encoder = Callable[[CollectorRegistry], bytes]


@dataclass(frozen=True)
class MetricsLimits:
    """Bounds on what one client can take of the metrics server (see the module)."""

    #: Seconds within which a request head must be complete, from the
    #: moment the connection began to wait for it.
    head_timeout: float = 10.0
    #: Seconds within which the client must take a whole answer.
    send_timeout: float = 10.0
    #: Largest request head, bytes.
    max_head: int = 16 * 1024
    #: Connections at once (see the module for what one more does).
    max_connections: int = 256
    backlog: int = 128


def exposition(
    registry: CollectorRegistry, accept: str, accept_encoding: str, query: str = ""
) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """The body and content headers of a scrape of ``registry``, for a
    request with these ``Accept`` and ``Accept-Encoding`` headers and query.

    What a request may say picks a format among prometheus_client's; what
    it cannot read falls back to the text format, never to an error.
    """
    encoder: Encoder
    try:
        encoder, content_type = choose_encoder(accept)
    except (TypeError, ValueError):
        # prometheus_client compares the version a client names as numbers
        # ("version=abc" is a TypeError there).
        encoder, content_type = generate_latest, CONTENT_TYPE_PLAIN_0_0_4
    names = parse_qs(query).get("name[]")
    target = registry.restricted_registry(names) if names else registry
    try:
        body = encoder(target)
    except (TypeError, ValueError):
        if encoder is generate_latest:
            raise  # not the client's doing
        body, content_type = generate_latest(target), CONTENT_TYPE_PLAIN_0_0_4
    headers = [(b"content-type", content_type.encode("latin-1", "replace"))]
    if gzip_accepted(accept_encoding):
        body = gzip.compress(body)
        headers.append((b"content-encoding", b"gzip"))
    return body, headers


def _split_listen(listen: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port); ValueError if malformed."""
    host, sep, text = listen.rpartition(":")
    try:
        if not sep:
            raise ValueError("no port")
        port = parse_decimal(text, max_digits=5, what="port")
        if port > 65535:
            raise ValueError(f"port {port} above 65535")
    except ValueError as exc:
        raise ValueError(f"{listen!r}: want HOST:PORT ({exc})") from None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, port


async def _open_listener(host: str, port: int, backlog: int) -> trio.SocketListener:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = trio.socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and host in ("::", ""):
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        await sock.bind((host, port))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return trio.SocketListener(sock)


def _url(listener: trio.SocketListener) -> str:
    host, port = listener.socket.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class _MetricsServer:
    def __init__(
        self,
        registry: CollectorRegistry,
        refresh: Callable[[], Awaitable[None]] | None,
        limits: MetricsLimits,
    ) -> None:
        self.registry = registry
        self.refresh = refresh
        self.limits = limits
        self.slots = trio.Semaphore(limits.max_connections)
        #: The scope of each connection waiting for a request head, oldest first.
        self.waiting: dict[trio.CancelScope, None] = {}

    async def admit(self) -> None:
        """Take a connection slot for a connection just accepted: at the limit,
        close the connection that has waited longest for a head, or wait."""
        if self.slots.value == 0 and self.waiting:
            oldest = next(iter(self.waiting))
            del self.waiting[oldest]
            oldest.cancel()
        await self.slots.acquire()

    async def connection(self, stream: trio.SocketStream) -> None:
        """Serve one connection (holding a slot, released at its end)."""
        try:
            conn = h11.Connection(h11.SERVER, max_incomplete_event_size=self.limits.max_head)
            while True:
                request = await self._request(stream, conn)
                if request is None:
                    return
                if not await self._answer(stream, conn, request):
                    return  # cut off
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    return
                conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except Exception as exc:
            # A bug reached by this connection's bytes: it ends this one only.
            logger.warning("metrics connection failed, closed: %r", exc)
            logger.debug("metrics connection failure", exc_info=True)
        finally:
            self.slots.release()
            await trio.aclose_forcefully(stream)

    async def _request(self, stream: trio.SocketStream, conn: h11.Connection) -> h11.Request | None:
        """The next request's head (its body must be empty); None to close the
        connection: the client closed, timed out, was closed to make room, or
        was refused (answered)."""
        request: h11.Request | None = None
        started = False
        scope = trio.CancelScope(deadline=trio.current_time() + self.limits.head_timeout)
        self.waiting[scope] = None
        try:
            with scope:
                while True:
                    try:
                        event = conn.next_event()
                    except h11.RemoteProtocolError as exc:
                        self.waiting.pop(scope, None)
                        await self._error(stream, conn, exc.error_status_hint, "malformed request")
                        return None
                    if event is h11.NEED_DATA:
                        data = await stream.receive_some(65536)
                        started = started or bool(data)
                        conn.receive_data(bytes(data))
                    elif isinstance(event, h11.Request):
                        request = event
                    elif isinstance(event, h11.EndOfMessage):
                        return request
                    elif isinstance(event, h11.Data):
                        self.waiting.pop(scope, None)
                        await self._error(stream, conn, 400, "request bodies are not accepted")
                        return None
                    else:  # ConnectionClosed
                        return None
        finally:
            self.waiting.pop(scope, None)
        if started:  # a head begun but not finished in time
            await self._error(stream, conn, 408, "request not complete in time")
        return None

    async def _send(self, stream: trio.SocketStream, data: bytes) -> bool:
        """Send ``data`` within the send timeout; False if the client did not take it."""
        with trio.move_on_after(self.limits.send_timeout) as scope:
            await stream.send_all(data)
        if scope.cancelled_caught:
            logger.info(
                "metrics client did not take its answer within %gs: cut off",
                self.limits.send_timeout,
            )
            return False
        return True

    async def _error(
        self, stream: trio.SocketStream, conn: h11.Connection, status: int, text: str
    ) -> None:
        """A short error answer, after which the connection is closed (if an
        answer can still be sent on it)."""
        if conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        body = text.encode() + b"\n"
        headers = [
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"content-length", b"%d" % len(body)),
            (b"connection", b"close"),
        ]
        try:
            data = conn.send(h11.Response(status_code=status, headers=headers))
            data += conn.send(h11.Data(data=body)) or b""
            data += conn.send(h11.EndOfMessage()) or b""
        except h11.LocalProtocolError:
            return  # e.g. after a HEAD: no body allowed; the connection closes anyway
        await self._send(stream, data)

    async def _answer(
        self, stream: trio.SocketStream, conn: h11.Connection, request: h11.Request
    ) -> bool:
        """Answer ``request``; False if the client did not take the answer."""
        head_only = request.method == b"HEAD"
        path, _, query = request.target.partition(b"?")
        if request.method not in (b"GET", b"HEAD"):
            status, body = 405, b"only GET and HEAD\n"
            headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"allow", b"GET, HEAD")]
        elif path != b"/metrics":
            status, body = 404, b"see /metrics\n"
            headers = [(b"content-type", b"text/plain; charset=utf-8")]
        else:
            if self.refresh is not None:
                await self.refresh()
            # Headers are bytes from anybody: latin-1 decodes every byte, and
            # what is not a name prometheus_client knows picks nothing.
            accept = b",".join(v for n, v in request.headers if n == b"accept")
            encodings = b",".join(v for n, v in request.headers if n == b"accept-encoding")
            body, headers = exposition(
                self.registry,
                accept.decode("latin-1"),
                encodings.decode("latin-1"),
                query.decode("latin-1"),
            )
            status = 200
        headers = [*headers, (b"content-length", b"%d" % len(body))]
        data = conn.send(h11.Response(status_code=status, headers=headers)) or b""
        if not head_only:
            data += conn.send(h11.Data(data=body)) or b""
        data += conn.send(h11.EndOfMessage()) or b""
        return await self._send(stream, data)


async def serve_metrics(
    registry: CollectorRegistry,
    listen: str,
    *,
    refresh: Callable[[], Awaitable[None]] | None = None,
    limits: MetricsLimits = MetricsLimits(),
    rng: random.Random | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``registry`` on ``listen`` (``HOST:PORT``, port 0: any free one)
    until cancelled; ``task_status.started`` gets the bound base URL (a list
    of one, ``http://HOST:PORT``).

    ``refresh`` is awaited before each collection (it must bound its own
    time). ``rng`` jitters the pauses after an accept() out of resources.
    Raises ValueError if ``listen`` is malformed, OSError if it cannot be
    bound. Cancellation closes the listener and every connection.
    """
    host, port = _split_listen(listen)
    listener = await _open_listener(host, port, limits.backlog)
    server = _MetricsServer(registry, refresh, limits)
    retrier = Retrier(_ACCEPT_BACKOFF, rng if rng is not None else random.Random())
    try:
        async with trio.open_nursery() as nursery:
            task_status.started([_url(listener)])
            while True:
                try:
                    stream = await listener.accept()
                except OSError as exc:
                    if exc.errno not in _ACCEPT_CAPACITY:
                        raise
                    logger.error("metrics accept: %s; pausing", exc)
                    await retrier.sleep()
                    continue
                retrier.reset()
                try:
                    await server.admit()
                except BaseException:
                    await trio.aclose_forcefully(stream)
                    raise
                nursery.start_soon(server.connection, stream)
    finally:
        await trio.aclose_forcefully(listener)
