"""What a caller without a certificate can make the gRPC server hold, and for how long.

Each test speaks raw HTTP/2 over TLS without a client certificate (as
anyone who reaches the port can), breaks one bound, and checks that the
server refused it (a status, RST_STREAM or GOAWAY, or a close), that the
server still serves a good call afterwards, and that ``serve`` never
exited. Timeouts are made small; no test asserts on time.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.errors
import h2.events
import pytest
import trio
from hyperframe.frame import GoAwayFrame, HeadersFrame, RstStreamFrame

from metropolis import pki
from metropolis.proto.common import ClusterDirectory, ClusterDirectoryNode
from metropolis.rpc import (
    Access,
    CallContext,
    Endpoint,
    Leadership,
    Method,
    Server,
    ServerSecurity,
    Status,
    client_context,
    open_client,
    server_context,
    wire,
)
from metropolis.rpc.limits import Limits
from metropolis.rpc.server import _parse as server_parse
from metropolis.rpc.status import RPCError
from tests.fixtures.rpc import (
    ClusterPKI,
    RawPeer,
    grpc_request_headers,
    grpc_status,
    raw_frame,
)

WHO = Method("/test.Bounds/Who", ClusterDirectory, ClusterDirectory, Access.NODE)
OPEN = Method("/test.Bounds/Open", ClusterDirectory, ClusterDirectory, Access.PROOF)
WATCH = Method(
    "/test.Bounds/Watch", ClusterDirectory, ClusterDirectory, Access.NODE, streaming=True
)

_OVERALL = 30  # seconds: a generous bound on every wait, never asserted on


@pytest.fixture(scope="module")
def cluster() -> ClusterPKI:
    return ClusterPKI.new()


@dataclass
class Served:
    port: int
    cluster: ClusterPKI
    #: Calls that reached a handler (path of each).
    calls: list[str] = field(default_factory=list)
    watch_started: trio.Event = field(default_factory=trio.Event)

    async def good_call(self) -> None:
        """A node's call succeeds (on a new connection)."""
        creds = self.cluster.node
        context = client_context(self.cluster.ca, creds.certificate, creds.private_key)
        async with open_client([Endpoint("127.0.0.1", self.port)], context) as client:
            got = await client.unary(WHO, ClusterDirectory())
        assert got.nodes[0].public_key == creds.public_key

    async def raw(self) -> RawPeer:
        peer = await RawPeer.connect(self.port, self.cluster.ca)
        assert await peer.start()
        return peer


@asynccontextmanager
async def serving(cluster: ClusterPKI, limits: Limits | None = None) -> AsyncIterator[Served]:
    security = ServerSecurity(
        owner_key=lambda: pki.public_key_bytes(cluster.owner_key),
        crl=lambda: None,
        leadership=lambda: Leadership(is_leader=True),
    )
    server = Server(server_context(cluster.server), security, limits=limits)
    served = Served(0, cluster)

    async def who(req: ClusterDirectory, ctx: CallContext) -> ClusterDirectory:
        served.calls.append(ctx.method.path)
        return ClusterDirectory(nodes=[ClusterDirectoryNode(public_key=ctx.peer.public_key)])

    async def watch(
        req: ClusterDirectory, ctx: CallContext, send: Callable[[ClusterDirectory], Awaitable[None]]
    ) -> None:
        served.calls.append(ctx.method.path)
        await send(ClusterDirectory())
        served.watch_started.set()
        await trio.sleep_forever()

    server.unary(WHO, who)
    server.unary(OPEN, who)
    server.stream(WATCH, watch)
    with trio.fail_after(_OVERALL):
        async with trio.open_nursery() as nursery:
            # serve never returns: if it raised, the nursery (and the test) fails.
            served.port = await nursery.start(server.serve, "127.0.0.1", 0)
            yield served
            await served.good_call()
            nursery.cancel_scope.cancel()


# --- finding 2: header bytes that are not UTF-8 -----------------------------------


async def test_header_that_is_not_utf8_resets_only_its_stream(cluster: ClusterPKI) -> None:
    async with serving(cluster) as served:
        peer = await served.raw()
        bad = grpc_request_headers(WHO.path, (b"x-junk", b"\xff\xfe"))
        assert await peer.headers(1, bad, end_stream=True)
        answer = await peer.answer(1)
        assert isinstance(answer, RstStreamFrame), answer
        assert answer.error_code == h2.errors.ErrorCodes.PROTOCOL_ERROR
        # The same connection goes on: the next stream is answered (no
        # certificate, so UNAUTHENTICATED).
        assert await peer.headers(3, grpc_request_headers(WHO.path))
        assert await peer.data(3, wire.frame(b""), end_stream=True)
        assert grpc_status(await peer.answer(3)) == Status.UNAUTHENTICATED
        # A non-UTF-8 header *name* too.
        assert await peer.headers(5, grpc_request_headers(WHO.path, (b"\xc3\x28", b"v")))
        answer = await peer.answer(5)
        assert isinstance(answer, RstStreamFrame), answer
        await peer.aclose()
        await served.good_call()
    assert served.calls == [WHO.path, WHO.path]


# --- finding 3: what one stream or connection can make the server hold ------------


async def test_second_message_of_a_unary_request_is_refused_at_once(
    cluster: ClusterPKI,
) -> None:
    """Refused while the caller is still sending: no END_STREAM is ever sent."""
    async with serving(cluster) as served:
        peer = await served.raw()
        assert await peer.headers(1, grpc_request_headers(OPEN.path))
        answered = trio.Event()

        async def flood() -> None:
            chunk = wire.frame(b"ab") * 2000  # 14 kB of 2-byte messages per frame
            while not answered.is_set() and await peer.data(1, chunk):
                pass

        async with trio.open_nursery() as nursery:
            nursery.start_soon(flood)
            answer = await peer.answer(1)
            answered.set()
        assert grpc_status(answer) == Status.INTERNAL
        assert isinstance(answer, HeadersFrame)
        assert "more than one" in answer.decoded["grpc-message"]  # type: ignore[attr-defined]
        assert served.calls == []
        await peer.aclose()


async def test_oversized_length_prefix_is_refused_before_the_message(
    cluster: ClusterPKI,
) -> None:
    async with serving(cluster) as served:
        peer = await served.raw()
        assert await peer.headers(1, grpc_request_headers(OPEN.path))
        assert await peer.data(1, b"\0" + (5 << 20).to_bytes(4, "big"))
        assert grpc_status(await peer.answer(1)) == Status.RESOURCE_EXHAUSTED
        await peer.aclose()


async def test_request_that_does_not_arrive_in_time_is_deadline_exceeded(
    cluster: ClusterPKI,
) -> None:
    async with serving(cluster, Limits(request_timeout=0.2)) as served:
        peer = await served.raw()
        assert await peer.headers(1, grpc_request_headers(OPEN.path))
        assert await peer.data(1, wire.frame(b"abc")[:4])  # half a message, then silence
        assert grpc_status(await peer.answer(1)) == Status.DEADLINE_EXCEEDED
        await peer.aclose()


async def test_request_buffers_share_a_per_connection_budget(cluster: ClusterPKI) -> None:
    """A stream whose message does not fit the connection's budget waits for it.

    Stream 3's request arrives whole first, but stream 1 holds the budget;
    so stream 1 is answered first. Without the budget stream 3 would be.
    """
    limits = Limits(max_message=1000, max_request_buffer=1500)
    async with serving(cluster, limits) as served:
        peer = await served.raw()
        message = wire.frame(b"m" * 995)
        assert await peer.headers(1, grpc_request_headers(OPEN.path))
        assert await peer.data(1, message[:100])
        # Let the server take stream 1's share before stream 3 asks for its own.
        assert await peer.send(raw_frame(0x6, 0, 0, b"pingpong"))  # PING
        while (frame := await peer.next_frame()) is not None and frame.type != 0x6:
            pass
        assert await peer.headers(3, grpc_request_headers(OPEN.path))
        assert await peer.data(3, message, end_stream=True)
        assert await peer.data(1, message[100:], end_stream=True)
        order: list[int] = []
        while len(order) < 2:
            frame = await peer.next_frame()
            assert frame is not None
            if isinstance(frame, HeadersFrame) and "END_STREAM" in frame.flags:
                assert grpc_status(frame) == Status.UNAUTHENTICATED  # no valid proof
                order.append(frame.stream_id)
        assert order == [1, 3]
        await peer.aclose()


async def test_stream_beyond_the_concurrency_limit_is_refused_and_others_go_on(
    cluster: ClusterPKI,
) -> None:
    async with serving(cluster, Limits(max_concurrent_streams=2)) as served:
        peer = await served.raw()
        for sid in (1, 3, 5):
            assert await peer.headers(sid, grpc_request_headers(OPEN.path))
        answer = await peer.answer(5)
        assert isinstance(answer, RstStreamFrame), answer
        assert answer.error_code == h2.errors.ErrorCodes.REFUSED_STREAM
        # DATA for the refused stream is answered as for any reset stream.
        assert await peer.data(5, wire.frame(b""), end_stream=True)
        for sid in (1, 3):
            assert await peer.data(sid, wire.frame(b""), end_stream=True)
            assert grpc_status(await peer.answer(sid)) == Status.UNAUTHENTICATED
        # Both done: a new stream is taken again.
        assert await peer.headers(7, grpc_request_headers(OPEN.path))
        assert await peer.data(7, wire.frame(b""), end_stream=True)
        assert grpc_status(await peer.answer(7)) == Status.UNAUTHENTICATED
        await peer.aclose()


async def test_our_client_waits_for_a_stream_slot(cluster: ClusterPKI) -> None:
    """Beyond the server's MAX_CONCURRENT_STREAMS, calls wait for a free stream."""
    async with serving(cluster, Limits(max_concurrent_streams=2)) as served:
        creds = cluster.node
        context = client_context(cluster.ca, creds.certificate, creds.private_key)
        endpoints = [Endpoint("127.0.0.1", served.port)]
        async with (
            open_client(endpoints, context) as client,
            client.stream(WATCH, ClusterDirectory()) as watch,
        ):
            async for _ in watch:
                break
            async with trio.open_nursery() as nursery:
                for _ in range(10):
                    nursery.start_soon(client.unary, WHO, ClusterDirectory())
        assert served.calls == [WATCH.path] + [WHO.path] * 10


async def test_client_retries_a_call_the_server_closed_the_connection_before(
    cluster: ClusterPKI,
) -> None:
    """A GOAWAY that did not see our stream (an idle close racing our call) is retried.

    The fake server answers its first connection's first request with
    GOAWAY(last_stream_id=0) and a close, as a server closing an idle
    connection just as the request arrives does; the call must go to the
    same (only) curator again, on a new connection, and succeed.
    """
    connections = 0

    async def handle(tcp: trio.SocketStream) -> None:
        nonlocal connections
        connections += 1
        first = connections == 1
        stream = trio.SSLStream(tcp, server_context(cluster.server), server_side=True)
        await stream.do_handshake()
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        conn.initiate_connection()
        await stream.send_all(conn.data_to_send())
        with contextlib.suppress(trio.BrokenResourceError):  # the client just hangs up
            while data := await stream.receive_some():
                for event in conn.receive_data(data):
                    if not isinstance(event, h2.events.RequestReceived):
                        continue
                    sid = event.stream_id
                    assert sid is not None
                    if first:
                        conn.close_connection(last_stream_id=0)
                        await stream.send_all(conn.data_to_send())
                        await trio.aclose_forcefully(stream)
                        return
                    conn.send_headers(
                        sid, [(":status", "200"), ("content-type", wire.CONTENT_TYPE)]
                    )
                    conn.send_data(sid, wire.frame(bytes(ClusterDirectory())))
                    conn.send_headers(sid, [("grpc-status", "0")], end_stream=True)
                await stream.send_all(conn.data_to_send())

    with trio.fail_after(_OVERALL):
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(trio.serve_tcp, handle, 0)
            port = listeners[0].socket.getsockname()[1]
            context = client_context(cluster.ca)
            async with open_client([Endpoint("127.0.0.1", port)], context) as client:
                await client.unary(WHO, ClusterDirectory())
            assert connections == 2
            nursery.cancel_scope.cancel()


async def test_frame_announcing_more_than_the_frame_size_closes_at_once(
    cluster: ClusterPKI,
) -> None:
    async with serving(cluster) as served:
        peer = await served.raw()
        # A 16 MiB DATA frame header and a little of its payload.
        assert await peer.send(raw_frame(0x0, 0, 1, b"x" * 1000, length=(1 << 24) - 1))
        frames = await peer.closed()
        goaways = [f for f in frames if isinstance(f, GoAwayFrame)]
        assert goaways and goaways[0].error_code == h2.errors.ErrorCodes.FRAME_SIZE_ERROR


async def test_half_sent_frame_closes_the_connection_after_the_frame_timeout(
    cluster: ClusterPKI,
) -> None:
    async with serving(cluster, Limits(frame_timeout=0.2)) as served:
        stalled = []
        for _ in range(3):
            peer = await served.raw()
            # Half a (legal, 16 kB) frame, then silence.
            assert await peer.send(raw_frame(0x0, 0, 1, b"x" * 8000, length=16000))
            stalled.append(peer)
        partial_header = await served.raw()
        assert await partial_header.send(b"\0\0")  # not even a whole frame header
        stalled.append(partial_header)
        preface_only = await RawPeer.connect(served.port, cluster.ca)
        assert await preface_only.send(b"PRI * HTTP")  # half the client preface
        stalled.append(preface_only)
        for peer in stalled:
            await peer.closed()  # returns once the server closed it
            await peer.aclose()


async def test_header_block_that_never_ends_closes_after_the_frame_timeout(
    cluster: ClusterPKI,
) -> None:
    async with serving(cluster, Limits(frame_timeout=0.2)) as served:
        peer = await served.raw()
        block = peer.encoder.encode(grpc_request_headers(OPEN.path))
        assert await peer.send(raw_frame(0x1, 0, 1, block))  # HEADERS without END_HEADERS
        await peer.closed()
        await peer.aclose()


async def test_header_block_beyond_its_bound_closes_the_connection(cluster: ClusterPKI) -> None:
    async with serving(cluster) as served:
        peer = await served.raw()
        assert await peer.send(raw_frame(0x1, 0, 1, b"\0" * 16000))
        for _ in range(4):  # CONTINUATIONs, 80 kB in all
            if not await peer.send(raw_frame(0x9, 0, 1, b"\0" * 16000)):
                break
        frames = await peer.closed()
        goaways = [f for f in frames if isinstance(f, GoAwayFrame)]
        assert goaways and goaways[0].error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM


async def test_idle_connection_is_closed_with_goaway(cluster: ClusterPKI) -> None:
    async with serving(cluster, Limits(idle_timeout=0.2)) as served:
        peer = await served.raw()
        frames = await peer.closed()
        goaways = [f for f in frames if isinstance(f, GoAwayFrame)]
        assert goaways and goaways[0].error_code == h2.errors.ErrorCodes.NO_ERROR
        # A connection whose last stream ended is idle too.
        peer = await served.raw()
        assert await peer.headers(1, grpc_request_headers(OPEN.path))
        assert await peer.data(1, wire.frame(b""), end_stream=True)
        assert grpc_status(await peer.answer(1)) == Status.UNAUTHENTICATED
        frames = await peer.closed()
        assert any(isinstance(f, GoAwayFrame) for f in frames)


async def test_open_stream_keeps_a_connection_past_the_idle_timeout(cluster: ClusterPKI) -> None:
    """Idle means no open stream: a Watch of hours, with keepalive PINGs, stays."""
    idle = 0.1
    async with serving(cluster, Limits(idle_timeout=idle)) as served:
        creds = cluster.node
        context = client_context(cluster.ca, creds.certificate, creds.private_key)
        endpoints = [Endpoint("127.0.0.1", served.port)]
        async with open_client(endpoints, context, keepalive=(idle / 4, 5.0)) as client:
            async with client.stream(WATCH, ClusterDirectory()) as updates:
                async for _ in updates:
                    break
                conn = client._conn
                assert conn is not None
                await trio.sleep(idle * 10)  # many idle timeouts and PINGs later
                assert not conn.closed
                await client.unary(WHO, ClusterDirectory())
                assert client._conn is conn
            # The stream gone, the connection is idle: closed, and the next
            # call simply connects again.
            await trio.sleep(idle * 10)
            assert conn.closed
            await client.unary(WHO, ClusterDirectory())
            assert client._conn is not conn


# --- a request that is no message of its method's type ------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        # ClusterDirectory.nodes[0].public_key (bytes) sent as a varint of 2**40:
        # betterproto2 alone keeps the int, and writing the message out again
        # would allocate bytes(2**40).
        bytes([0x0A, 0x07, 0x08]) + bytes([0x80] * 5) + bytes([0x20]),
        bytes([0x0A, 0x05, 0x0A, 0x09]) + b"abc",  # a node cut short
        bytes([0x0A, 0x03, 0x12, 0x01, 0x0B]),  # an address with a group start
    ],
)
def test_a_request_that_is_not_its_message_is_refused_before_any_handler(raw: bytes) -> None:
    with pytest.raises(RPCError) as refused:
        server_parse(ClusterDirectory, raw)
    assert refused.value.code is Status.INTERNAL
    assert "cannot parse request" in refused.value.message
