"""A gRPC server on Trio: mutual TLS, per-method access, leader-only methods.

Register handlers for :class:`~metropolis.rpc.method.Method` values, then
run :meth:`Server.serve` in a nursery (``await nursery.start(...)`` returns
the bound port)::

    server = Server(tls.server_context(credentials), security)
    server.unary(GET_NODES, get_nodes)          # async (req, ctx) -> resp
    server.stream(WATCH, watch)                 # async (req, ctx, send) -> None
    server.bidi(HEARTBEAT, heartbeat)           # async (requests, ctx, send) -> None
    port = await nursery.start(server.serve, "127.0.0.1", 0)

Order of checks for each call, all before the handler runs: known method
(UNIMPLEMENTED), well-formed request (INTERNAL/RESOURCE_EXHAUSTED), caller
admitted by the method's access (UNAUTHENTICATED/PERMISSION_DENIED, see
:mod:`metropolis.rpc.auth`), then for ``leader_only`` methods, leadership
(UNAVAILABLE with trailers ``metropolis-leader-node-id`` and
``metropolis-leader-address`` naming the leader; a ``stale_ok`` method
called with ``metropolis-stale-ok: 1`` is served by a follower too). Handlers answer an error
by raising :class:`~metropolis.rpc.status.RPCError`; any other exception is
logged and answered INTERNAL.

Bounds (:class:`~metropolis.rpc.limits.Limits`, per connection, all before
authentication because a caller needs no certificate to connect): a request
message larger than ``max_message`` is RESOURCE_EXHAUSTED as soon as its
length prefix arrives; a unary or server-streaming call's second message is
INTERNAL as soon as its first byte arrives; request bytes being assembled
share ``max_request_buffer`` per connection (a stream waits for its share,
and flow control stops its sender); a request that has not arrived whole
within ``request_timeout`` is DEADLINE_EXCEEDED. Frame, stream-count and
idle bounds are the transport's (:mod:`metropolis.rpc.transport`). Nothing
a peer sends fails the server: an unexpected error ends that stream or that
connection, logged.

Cancellation:
- The caller cancels (RST_STREAM), disconnects, or its ``grpc-timeout``
  passes: the handler's task is cancelled (it sees ``trio.Cancelled`` at its
  next checkpoint; a streaming handler also when ``send`` finds the stream
  gone). Nothing more is sent to a caller that left; a passed deadline is
  answered DEADLINE_EXCEEDED.
- ``serve`` is cancelled: every handler is cancelled, each connection gets
  a GOAWAY and is closed; callers see UNAVAILABLE and go elsewhere.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar, cast

import betterproto2
import h2.errors
import trio
from cryptography import x509

from common.protobuf import parse_checked
from metropolis.rpc import auth, tls, wire
from metropolis.rpc.limits import Limits
from metropolis.rpc.method import STALE_OK_HEADER, UNKNOWN_METHOD, Message, Method
from metropolis.rpc.pipe import Pipe
from metropolis.rpc.status import (
    LEADER_ADDRESS_HEADER,
    LEADER_NODE_HEADER,
    LeaderHint,
    RPCError,
    Status,
)
from metropolis.rpc.transport import Closed, Connection, Data, End, Reset, StreamGone

if TYPE_CHECKING:
    # Counted only when given one: a server without metrics (a node without
    # --metrics-listen) does not import prometheus_client.
    from metropolis.rpc.metrics import RPCMetrics

__all__ = ["CallContext", "Limits", "Server"]

_log = logging.getLogger("metropolis.rpc.server")

Req = TypeVar("Req", bound=Message)
Resp = TypeVar("Resp", bound=Message)

_RESPONSE_HEADERS = [(":status", "200"), ("content-type", wire.CONTENT_TYPE)]
_OK_TRAILERS = [("grpc-status", "0")]


@dataclass(frozen=True)
class CallContext:
    """What a handler knows about its call besides the request."""

    peer: auth.Peer
    method: Method[Any, Any]
    #: Request metadata (lower-case keys; ``-bin`` values still base64).
    metadata: dict[str, str] = field(default_factory=dict)


UnaryHandler = Callable[[Req, CallContext], Awaitable[Resp]]
StreamHandler = Callable[[Req, CallContext, Callable[[Resp], Awaitable[None]]], Awaitable[None]]
BidiHandler = Callable[
    [trio.MemoryReceiveChannel[Req], CallContext, Callable[[Resp], Awaitable[None]]],
    Awaitable[None],
]


@dataclass
class _Route:
    method: Method[Any, Any]
    handler: Callable[..., Awaitable[Any]]


class Server:
    """Serves registered methods; see the module docstring."""

    def __init__(
        self,
        ssl_context: Any,
        security: auth.ServerSecurity,
        *,
        limits: Limits | None = None,
        metrics: RPCMetrics | None = None,
        name: str = "rpc",
        translate: Callable[[Exception], RPCError | None] | None = None,
    ) -> None:
        """``metrics``: where every finished call is counted, as ``name``
        (:mod:`metropolis.rpc.metrics`). ``translate``: the status a
        handler's exception other than `RPCError` answers with, where the
        server's owner knows one (a store that is briefly unavailable is
        UNAVAILABLE, which a caller retries); None, or no ``translate``,
        answers INTERNAL and logs the exception."""
        self._translate = translate
        self._ssl = ssl_context
        self._metrics = metrics
        self._name = name
        self._security = security
        #: What one connection may make the server hold (see the module docstring).
        self.limits = limits or Limits()
        self._routes: dict[str, _Route] = {}
        self._replay = auth.ReplayCache()

    def unary(self, method: Method[Req, Resp], handler: UnaryHandler[Req, Resp]) -> None:
        if method.streaming:
            raise ValueError(f"{method.path} is streaming; register it with stream()")
        self._routes[method.path] = _Route(method, handler)

    def stream(self, method: Method[Req, Resp], handler: StreamHandler[Req, Resp]) -> None:
        if not method.streaming or method.client_streaming:
            raise ValueError(f"{method.path} is not server-streaming")
        self._routes[method.path] = _Route(method, handler)

    def bidi(self, method: Method[Req, Resp], handler: BidiHandler[Req, Resp]) -> None:
        """Serve a bidirectional method: ``handler(requests, ctx, send)``.

        ``requests`` yields the caller's messages until it stops sending;
        a malformed one ends the call (INTERNAL) and cancels the handler.
        """
        if not method.client_streaming:
            raise ValueError(f"{method.path} is not client-streaming")
        self._routes[method.path] = _Route(method, handler)

    async def serve(
        self,
        host: str,
        port: int = 0,
        *,
        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    ) -> NoReturn:
        """Listen on ``host:port`` (0: any free port, reported through ``task_status``).

        ``host`` is one address (``0.0.0.0`` for all of IPv4): a name that
        resolves to several would get a different free port for each.

        Runs until cancelled. A connection that fails its handshake is
        dropped and logged at debug level; the server goes on.
        """
        listeners = await trio.open_tcp_listeners(port, host=host)
        await self.serve_listeners(listeners, task_status=task_status)

    async def serve_listeners(
        self,
        listeners: list[trio.SocketListener],
        *,
        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    ) -> NoReturn:
        """:meth:`serve` on listeners opened already (their port is reported); closes them.

        Lets a caller bind before it can serve: connections wait in the
        listen backlog until this is called.
        """
        bound = listeners[0].socket.getsockname()[1]
        _log.info("RPC listening on port %d", bound)
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, self.handle_connection, listeners)
            task_status.started(bound)
            await trio.sleep_forever()
        raise AssertionError("unreachable")

    async def handle_connection(self, tcp: trio.SocketStream) -> None:
        """Serve one accepted TCP connection until it ends. Never raises.

        What ``trio.serve_listeners`` runs: an exception out of here would
        end ``serve``, so anything unexpected (a bug reached by what this
        peer sent) is logged and ends this connection only.
        """
        try:
            await self._serve_connection(tcp)
        except Exception as e:
            _log.warning("connection from %s failed: %r", _peer_address(tcp), e)
            _log.debug("connection failure", exc_info=True)
            await trio.aclose_forcefully(tcp)

    async def _serve_connection(self, tcp: trio.SocketStream) -> None:
        pipe = Pipe(tcp, self._ssl, server_side=True, ragged_eof_ok=True)
        try:
            with trio.fail_after(self.limits.handshake_timeout):
                await pipe.handshake()
        except (trio.BrokenResourceError, trio.TooSlowError) as e:
            # A refusal's alert has gone to the peer (see Pipe.handshake).
            _log.debug("TLS handshake failed: %r", e.__cause__ or e)
            await pipe.aclose()
            return
        if pipe.selected_alpn_protocol() != "h2":
            _log.debug("peer did not negotiate h2")
            await pipe.aclose()
            return
        certificate = tls.peer_certificate(pipe)
        budget = _ByteBudget(self.limits.max_request_buffer)
        async with trio.open_nursery() as nursery:

            def on_request(sid: int, headers: dict[str, str]) -> None:
                nursery.start_soon(self._call, conn, sid, headers, certificate, budget)

            conn = Connection(pipe, client_side=False, on_request=on_request, limits=self.limits)
            try:
                await conn.start()
                await conn.run()
            except StreamGone:
                pass
            finally:
                # The peer is gone (or we are shutting down): so are its calls.
                nursery.cancel_scope.cancel()
                await conn.aclose()

    async def _call(
        self,
        conn: Connection,
        sid: int,
        headers: dict[str, str],
        certificate: x509.Certificate | None,
        budget: _ByteBudget,
    ) -> None:
        call = _Call(conn, sid, self.limits, budget)
        started = trio.current_time()
        try:
            await self._dispatch(call, headers, certificate)
            if not call.request_complete and not call.gone:
                # Answered before the whole request arrived (unknown method,
                # too large): tell the caller to stop sending a body no one
                # will read, as gRPC servers do.
                await conn.reset(sid, h2.errors.ErrorCodes.NO_ERROR)
        except StreamGone:
            pass  # the caller left; there is no one to answer
        except Exception as e:
            # A bug reached by this stream: it ends this stream, not the
            # connection's other calls.
            _log.warning("stream %d failed: %r", sid, e)
            _log.debug("stream failure", exc_info=True)
            await conn.reset(sid, h2.errors.ErrorCodes.INTERNAL_ERROR)
            call.code = call.code or Status.INTERNAL
        finally:
            call.release()
            conn.forget(sid)
            if self._metrics is not None:
                path = headers.get(":path", "")
                method = path if path in self._routes else UNKNOWN_METHOD
                code = call.code if call.code is not None and not call.gone else Status.CANCELLED
                self._metrics.observe(self._name, method, code.name, trio.current_time() - started)

    async def _dispatch(
        self, call: _Call, headers: dict[str, str], certificate: x509.Certificate | None
    ) -> None:
        path = headers.get(":path", "")
        route = self._routes.get(path)
        if route is None:
            await call.fail(RPCError(Status.UNIMPLEMENTED, f"unknown method {path}"))
            return
        if headers.get(":method") != "POST" or not headers.get("content-type", "").startswith(
            wire.CONTENT_TYPE
        ):
            await call.fail(RPCError(Status.INTERNAL, "not a gRPC request"))
            return
        timeout: float | None = None
        if "grpc-timeout" in headers:
            try:
                timeout = wire.decode_timeout(headers["grpc-timeout"])
            except ValueError as e:
                await call.fail(RPCError(Status.INTERNAL, str(e)))
                return

        now = trio.current_time()
        deadline = now + timeout if timeout is not None else float("inf")
        # One scope for both deadlines, the request's arrival and then the
        # caller's: each scope costs microseconds, on every call.
        arrival = deadline
        if not route.method.client_streaming:
            arrival = min(deadline, now + self.limits.request_timeout)
        request_in = False
        with trio.CancelScope(deadline=arrival) as deadline_scope:
            try:
                # A client stream's proof covers an empty request (see auth).
                raw = b""
                if not route.method.client_streaming:
                    raw = await call.read_request()
                    if arrival != deadline:
                        deadline_scope.deadline = deadline
                request_in = True
                peer = auth.authenticate(
                    route.method.access,
                    path,
                    certificate,
                    headers,
                    raw,
                    self._security,
                    self._replay,
                )
                if route.method.leader_only and not (
                    route.method.stale_ok and headers.get(STALE_OK_HEADER) == "1"
                ):
                    leadership = self._security.leadership()
                    if not leadership.is_leader:
                        raise RPCError(
                            Status.UNAVAILABLE,
                            "this curator is not the leader",
                            leader=leadership.leader,
                        )
                request: Message | None = None
                if not route.method.client_streaming:
                    request = _parse(route.method.request_type, raw)
                context = CallContext(peer=peer, method=route.method, metadata=headers)
                _log.debug("%s from %s %s", path, peer.kind.value, peer.node_id)
                await call.run(route, request, context, deadline_scope)
            except RPCError as e:
                await call.fail(e)
            except (StreamGone, trio.Cancelled):
                raise
            except Exception as e:
                known = self._translate(e) if self._translate is not None else None
                if known is None:
                    _log.exception("handler of %s failed", path)
                    known = RPCError(Status.INTERNAL, "internal error")
                else:
                    _log.info("%s answered %s: %s", path, known.code.name, e)
                await call.fail(known)
        if deadline_scope.cancelled_caught and not call.gone:
            why = "deadline exceeded"
            if not request_in and arrival < deadline:
                why = f"request did not arrive within {self.limits.request_timeout} s"
            await call.fail(RPCError(Status.DEADLINE_EXCEEDED, why))


def _more_than_one() -> RPCError:
    return RPCError(Status.INTERNAL, "more than one request message; the method takes one")


def _parse(message_type: type[Message], raw: bytes) -> Message:
    # Checked against the declaration first: betterproto2 alone builds a
    # message of whatever arrives (a varint n in a bytes field becomes
    # bytes(n) the moment a handler writes it out again).
    try:
        # Every Message the method table names is a generated betterproto2 class.
        checked = parse_checked(cast("type[betterproto2.Message]", message_type), raw)
    except ValueError as e:
        raise RPCError(Status.INTERNAL, f"cannot parse request: {e}") from None
    return cast(Message, checked)


def _peer_address(tcp: trio.SocketStream) -> str:
    try:
        return str(tcp.socket.getpeername())
    except OSError:
        return "a peer that left"


class _ByteBudget:
    """Bytes of request messages a connection's streams may hold at once.

    :meth:`take` waits while the budget is spent; a stream waiting there
    reads no more DATA, so flow control stops its sender.
    """

    def __init__(self, total: int) -> None:
        self._free = total
        self._released = trio.Event()

    async def take(self, size: int) -> None:
        while size > self._free:
            await self._released.wait()
        self._free -= size

    def give(self, size: int) -> None:
        if size:
            self._free += size
            self._released.set()
            self._released = trio.Event()


class _Call:
    """One server-side stream: reads the request, runs the handler, answers."""

    def __init__(self, conn: Connection, sid: int, limits: Limits, budget: _ByteBudget) -> None:
        self.conn = conn
        self.sid = sid
        self.limits = limits
        self.headers_sent = False
        self.done = False
        #: The caller reset the stream or the connection ended.
        self.gone = False
        #: The caller's half of the stream ended (the whole request is in).
        self.request_complete = False
        #: A client-streamed message was malformed.
        self.pump_error: RPCError | None = None
        self._budget = budget
        #: Bytes of ``_budget`` this call holds.
        self._held = 0
        #: The status the call was answered with, once it was.
        self.code: Status | None = None

    async def _hold(self, size: int) -> None:
        """Hold ``size`` bytes of the connection's budget (waiting for them if need be)."""
        if size > self._held:
            await self._budget.take(size - self._held)
            self._held = size

    def release(self) -> None:
        """Give back what this call holds of the connection's budget."""
        self._budget.give(self._held)
        self._held = 0

    async def read_request(self) -> bytes:
        """The one request message of a unary or server-streaming call.

        A second message is refused as soon as any byte of it arrives, and
        the message being assembled holds its size of the connection's
        budget before more is read.
        """
        decoder = wire.MessageDecoder(self.limits.max_message)
        message: bytes | None = None
        while True:
            event = await self.conn.receive(self.sid)
            match event:
                case Data(data=data):
                    if message is not None and data:
                        raise _more_than_one()
                    messages = decoder.feed(data)
                    if len(messages) > 1 or (messages and decoder.pending):
                        raise _more_than_one()
                    if messages:
                        message = messages[0]
                    await self._hold(len(message) if message is not None else decoder.expected)
                case End():
                    self.request_complete = True
                    break
                case Reset() | Closed():
                    self.gone = True
                    raise StreamGone("caller left before sending its request")
                case _:
                    pass
        if message is None:
            why = "the request ends inside its message" if decoder.pending else "no request message"
            raise RPCError(Status.INTERNAL, why)
        return message

    async def _watch_caller(self, handler_scope: trio.CancelScope) -> None:
        # After the request, only a reset or the connection's end can come.
        while True:
            event = await self.conn.receive(self.sid)
            if isinstance(event, Reset | Closed):
                self.gone = True
                handler_scope.cancel()
                return

    async def _pump(
        self,
        handler_scope: trio.CancelScope,
        requests: trio.MemorySendChannel[Message],
        request_type: type[Message],
    ) -> None:
        # Client streaming: the caller's messages go to the handler one at a
        # time (an unbuffered channel), so a handler that reads slowly slows
        # the caller through flow control.
        decoder = wire.MessageDecoder(self.limits.max_message)
        async with requests:
            while not self.request_complete:
                event = await self.conn.receive(self.sid)
                match event:
                    case Data(data=data):
                        try:
                            messages = [_parse(request_type, m) for m in decoder.feed(data)]
                        except RPCError as e:
                            self.pump_error = e
                            handler_scope.cancel()
                            return
                        for message in messages:
                            with contextlib.suppress(trio.BrokenResourceError):
                                await requests.send(message)
                        # Parsed messages are the handler's; the budget
                        # covers the one being assembled.
                        self.release()
                        await self._hold(decoder.expected)
                    case End():
                        self.request_complete = True
                    case Reset() | Closed():
                        self.gone = True
                        handler_scope.cancel()
                        return
                    case _:
                        pass
        await self._watch_caller(handler_scope)

    async def run(
        self,
        route: _Route,
        request: Message | None,
        context: CallContext,
        scope: trio.CancelScope,
    ) -> None:
        """Run the handler and answer its outcome; the handler's exception propagates.

        ``scope`` (the call's, around this) is cancelled if the caller
        leaves: the transport says so (one task per call, no watcher), or
        a streaming handler's ``send`` finds the stream gone.
        """
        response: Message | None = None
        if route.method.client_streaming:
            await self._run_bidi(route, context)
        else:
            self.conn.on_gone(self.sid, partial(self._caller_left, scope))

            async def send(message: Message) -> None:
                await self._send_message(message, scope)

            try:
                if route.method.streaming:
                    await route.handler(request, context, send)
                else:
                    response = await route.handler(request, context)
            except Exception:
                if self.gone:
                    raise StreamGone("caller left") from None
                raise
        if self.gone:
            raise StreamGone("caller left")
        if response is not None:
            # Unary: headers, the message and the OK trailers in one write.
            self.headers_sent = self.done = True
            self.code = Status.OK
            await self.conn.send(
                self.sid,
                headers=_RESPONSE_HEADERS,
                data=wire.frame(bytes(response)),
                trailers=_OK_TRAILERS,
            )
            return
        await self.finish(Status.OK, "")

    def _caller_left(self, scope: trio.CancelScope) -> None:
        # Once the answer is on its way, a caller leaving changes nothing.
        if not self.done:
            self.gone = True
            scope.cancel()

    async def _run_bidi(self, route: _Route, context: CallContext) -> None:
        # The handler's exception is carried out of the nursery by hand: a
        # nursery would wrap it in an ExceptionGroup.
        error: Exception | None = None
        async with trio.open_nursery() as nursery:
            with trio.CancelScope() as handler_scope:
                send_requests, requests = trio.open_memory_channel[Message](0)
                nursery.start_soon(
                    self._pump, handler_scope, send_requests, route.method.request_type
                )
                try:

                    async def send(message: Message) -> None:
                        await self._send_message(message, handler_scope)

                    async with requests:
                        await route.handler(requests, context, send)
                except Exception as e:
                    error = e
                finally:
                    nursery.cancel_scope.cancel()
        if self.gone:
            raise StreamGone("caller left")
        if self.pump_error is not None:
            raise self.pump_error
        if error is not None:
            raise error

    async def _send_message(self, message: Message, handler_scope: trio.CancelScope) -> None:
        try:
            headers = None if self.headers_sent else _RESPONSE_HEADERS
            self.headers_sent = True
            await self.conn.send(self.sid, headers=headers, data=wire.frame(bytes(message)))
        except StreamGone:
            # The caller is gone: the handler ends by cancellation, not by an
            # exception it might catch and mistake for its own failure.
            self.gone = True
            handler_scope.cancel()
            await trio.lowlevel.checkpoint()
            raise

    async def finish(self, code: Status, message: str, leader: LeaderHint | None = None) -> None:
        if self.done or self.gone:
            return
        self.done = True
        self.code = code
        trailers = [("grpc-status", str(int(code)))]
        if message:
            trailers.append(("grpc-message", wire.encode_grpc_message(message)))
        if leader is not None:
            trailers.append((LEADER_NODE_HEADER, leader.node_id))
            if leader.address:
                trailers.append((LEADER_ADDRESS_HEADER, leader.address))
        if not self.headers_sent:
            # Trailers-only response: one HEADERS frame that ends the stream.
            self.headers_sent = True
            await self.conn.send(self.sid, headers=[*_RESPONSE_HEADERS, *trailers], end_stream=True)
            return
        await self.conn.send(self.sid, trailers=trailers)

    async def fail(self, error: RPCError) -> None:
        if error.code is not Status.UNAVAILABLE or error.leader is None:
            _log.debug("answering %s: %s", error.code.name, error.message)
        await self.finish(error.code, error.message, error.leader)
