"""A small bounded HTTP/1.1 server on Trio, for endpoints that anybody who
reaches their port may connect to: the Prometheus metrics (`common.metrics`)
and the operator console's web UI (``console.server``, through
`common.asgi.asgi_handler`).

`serve_http` answers each request with what a `Handler` makes of its head:
one `Response`, whole, which the server frames (``Content-Length``, no body
for ``HEAD``) and sends. Requests with a body are refused (``400``, the
connection closed then): nothing served here reads one.

HTTP/1.1 by h11, with keep-alive, and bounded (`HTTPLimits`):

- a request head must be complete within ``head_timeout`` of the moment
  the connection began to wait for it (its start, or the end of the
  previous answer), else it is closed (``408`` if part of a head came);
  a head is at most ``max_head`` bytes (``431``);
- an answer must be taken by the client within ``send_timeout``, else the
  connection is cut; nothing shields a send, so a client that reads
  nothing holds neither its connection nor the server's cancellation;
- at most ``max_connections`` connections: one more closes the one that
  has waited longest for its request head (idle or sending slowly), so
  connections that send nothing cannot keep a client out; while every
  connection is being answered (each within ``send_timeout``), new ones
  wait.

The time a handler takes is the handler's to bound (the console's pages
wait for the BMDB, whose calls have their own deadlines).

Why not hypercorn, which served both endpoints before (issue 35 for the
metrics, issue 37 for the console): its HTTP/1.1 sends are shielded from
cancellation and have no deadline, so one client that kept its receive
window shut held its connection for ever and made the server's
cancellation (a node's or the console's shutdown) wait for it; it bounds no
number of connections; and, for the console, it took up to six pipelined
requests of one connection at once, holding every answer in memory.

Cancellation: cancelling `serve_http` closes the listener and every
connection at once (a request being handled is cancelled with it). An
error out of one connection (a bug reached by its bytes, or a handler's)
ends that connection only, answered ``500`` if no answer was under way.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import h11
import trio

from common.backoff import ExponentialBackoff, Retrier
from common.listen import split_listen
from common.tcp import open_listener

__all__ = [
    "DEFAULT_LIMITS",
    "HTTPLimits",
    "Handler",
    "Request",
    "Response",
    "error_answer",
    "serve_http",
    "split_listen",
]

logger = logging.getLogger("common.httpserver")

#: accept() errors that mean "out of resources for now": logged, retried.
_ACCEPT_CAPACITY = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
#: Pauses between accept() calls that ran out of resources; an accepted
#: connection starts the count over.
_ACCEPT_BACKOFF = ExponentialBackoff(0.05, 2.0, jitter=(0.5, 1.0))


@dataclass(frozen=True)
class HTTPLimits:
    """Bounds on what one client can take of the server (see the module)."""

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


#: The limits unless a caller gives others.
DEFAULT_LIMITS = HTTPLimits()


@dataclass(frozen=True)
class Request:
    """A request's head, as h11 parsed it."""

    method: bytes
    #: The request target as sent (path and query).
    target: bytes
    #: Header names lower-cased, values as sent, in order.
    headers: list[tuple[bytes, bytes]]
    #: ``1.1`` or ``1.0``.
    http_version: bytes
    #: (host, port) of the client and of the server's socket.
    client: tuple[str, int]
    server: tuple[str, int]


@dataclass(frozen=True)
class Response:
    """A whole answer. Without a ``content-length`` header, the body's
    length is sent as one; with one (a ``HEAD`` answer that says how long
    the ``GET`` would be), it is sent as given."""

    status: int
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""


#: What answers a request. It may raise: the client then gets a 500 and
#: the connection is closed, the error logged.
Handler = Callable[[Request], Awaitable[Response]]


def error_answer(conn: h11.Connection, status: int, text: str) -> bytes:
    """The bytes of a short plain-text error answer on ``conn``, which says
    the connection closes after it; empty when no answer can be sent any
    more (one was begun, or the request forbids a body, as a HEAD does)."""
    if conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
        return b""
    body = text.encode() + b"\n"
    headers = [
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"content-length", b"%d" % len(body)),
        (b"connection", b"close"),
    ]
    try:
        data = conn.send(h11.Response(status_code=status, headers=headers)) or b""
        data += conn.send(h11.Data(data=body)) or b""
        data += conn.send(h11.EndOfMessage()) or b""
    except h11.LocalProtocolError:
        return b""
    return data


def _url(listener: trio.SocketListener) -> str:
    host, port = listener.socket.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _address(sock: trio.socket.SocketType, peer: bool) -> tuple[str, int]:
    try:
        name = sock.getpeername() if peer else sock.getsockname()
    except OSError:
        return ("", 0)
    return str(name[0]), int(name[1])


class _Server:
    def __init__(self, handler: Handler, limits: HTTPLimits, name: str) -> None:
        self.handler = handler
        self.limits = limits
        self.name = name
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
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=self.limits.max_head)
        try:
            client, server = _address(stream.socket, True), _address(stream.socket, False)
            while True:
                head = await self._request(stream, conn)
                if head is None:
                    return
                request = Request(
                    head.method, head.target, list(head.headers), head.http_version, client, server
                )
                if not await self._answer(stream, conn, request):
                    return  # cut off
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    return
                conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except Exception as exc:
            # A bug reached by this connection's bytes, or the handler's: it
            # ends this one only.
            logger.warning("%s connection failed, closed: %r", self.name, exc)
            logger.debug("%s connection failure", self.name, exc_info=True)
            await self._error(stream, conn, 500, "internal error")
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

    async def _send(self, stream: trio.SocketStream, *data: bytes) -> bool:
        """Send the pieces of ``data`` in turn, all within the send timeout;
        False if the client did not take them."""
        with trio.move_on_after(self.limits.send_timeout) as scope:
            for piece in data:
                if piece:
                    await stream.send_all(piece)
        if scope.cancelled_caught:
            logger.info(
                "%s client did not take its answer within %gs: cut off",
                self.name,
                self.limits.send_timeout,
            )
            return False
        return True

    async def _error(
        self, stream: trio.SocketStream, conn: h11.Connection, status: int, text: str
    ) -> None:
        """A short error answer, after which the connection is closed (if an
        answer can still be sent on it)."""
        data = error_answer(conn, status, text)
        if not data:
            return
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await self._send(stream, data)

    async def _answer(
        self, stream: trio.SocketStream, conn: h11.Connection, request: Request
    ) -> bool:
        """Answer ``request``; False if the client did not take the answer."""
        response = await self.handler(request)
        headers = list(response.headers)
        if not any(name.lower() == b"content-length" for name, _ in headers):
            headers.append((b"content-length", b"%d" % len(response.body)))
        head = conn.send(h11.Response(status_code=response.status, headers=headers)) or b""
        # The body goes out as the handler's own bytes object, never copied:
        # a connection whose client reads slowly holds one answer's bytes, once.
        body: list[bytes] = []
        if request.method != b"HEAD" and response.body:
            body = conn.send_with_data_passthrough(h11.Data(data=response.body)) or []
        end = conn.send(h11.EndOfMessage()) or b""
        return await self._send(stream, head, *body, end)


async def serve_http(
    handler: Handler,
    listen: str,
    *,
    name: str,
    limits: HTTPLimits = DEFAULT_LIMITS,
    rng: random.Random | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``handler`` on ``listen`` (``HOST:PORT``, port 0: any free one)
    until cancelled; ``task_status.started`` gets the bound base URL (a list
    of one, ``http://HOST:PORT``).

    ``name`` names the endpoint in the log (``metrics``, ``web UI``).
    ``rng`` jitters the pauses after an accept() out of resources. Raises
    ValueError if ``listen`` is malformed, OSError if it cannot be bound.
    Cancellation closes the listener and every connection.
    """
    host, port = split_listen(listen)
    listener = await open_listener(host, port, backlog=limits.backlog)
    server = _Server(handler, limits, name)
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
                    logger.error("%s accept: %s; pausing", name, exc)
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
