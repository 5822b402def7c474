"""The gRPC engine's cheap paths hold the same guarantees as the slow ones they replace.

- :class:`~metropolis.rpc.pipe.Pipe`: writes that never wait still leave
  whole and in order, over TLS, whatever cancels a writer; a peer that
  stops reading breaks the pipe instead of holding it.
- The transport's one-pass header check accepts only what h2's check
  accepts, and decides as h2 does otherwise; its HPACK encoder's blocks
  decode to what was encoded; its copy of h2's frame dispatch is h2's.
- The server runs a call in one task; a stream's messages gathered for one
  write are sent even when the handler then waits; metadata that HTTP/2
  cannot carry is refused before anything is sent.

Real sockets and TLS on loopback; nothing asserts on time.
"""

from __future__ import annotations

import inspect
import io
import re
import socket
import textwrap
import tokenize
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import h2.connection
import h2.exceptions
import h2.utilities
import hpack
import pytest
import trio
import trio.lowlevel
import trio.testing
from hypothesis import example, given, settings
from hypothesis import strategies as st

from metropolis import pki
from metropolis.proto.common import ClusterDirectory, ClusterDirectoryNode
from metropolis.rpc import (
    Access,
    CallContext,
    Endpoint,
    Leadership,
    Method,
    RPCError,
    Server,
    ServerSecurity,
    Status,
    client_context,
    open_client,
    server_context,
    transport,
)
from metropolis.rpc.pipe import HIGH_WATER, Pipe
from tests.fixtures.rpc import ClusterPKI

_OVERALL = 60  # seconds: a generous bound on every wait, never asserted on


@pytest.fixture(scope="module")
def cluster() -> ClusterPKI:
    return ClusterPKI.new()


# --- the pipe --------------------------------------------------------------------------


@asynccontextmanager
async def tls_pipes(
    cluster: ClusterPKI, *, send_timeout: float = 10.0
) -> AsyncIterator[tuple[Pipe, Pipe]]:
    """A client and a server pipe over TLS on loopback, handshaken."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    node = cluster.node
    async with trio.open_nursery() as nursery:
        accepted: list[Pipe] = []

        async def accept() -> None:
            tcp = await listeners[0].accept()
            pipe = Pipe(tcp, server_context(cluster.server), server_side=True)
            await pipe.handshake()
            accepted.append(pipe)

        nursery.start_soon(accept)
        tcp = await trio.open_tcp_stream("127.0.0.1", port)
        context = client_context(cluster.ca, node.certificate, node.private_key)
        client = Pipe(tcp, context, server_hostname="127.0.0.1", send_timeout=send_timeout)
        await client.handshake()
    try:
        yield client, accepted[0]
    finally:
        await client.aclose()
        await accepted[0].aclose()
        await listeners[0].aclose()


async def _read_exactly(pipe: Pipe, size: int) -> bytes:
    got = bytearray()
    while len(got) < size:
        data = await pipe.receive_some()
        assert data, "the pipe ended early"
        got += data
    return bytes(got)


def _chunks() -> list[bytes]:
    """Writes of many sizes, each recognisable by its content."""
    return [bytes([i % 251]) * (1 + (i * 7919) % 40000) for i in range(300)]


async def test_writes_in_bursts_arrive_whole_and_in_order(cluster: ClusterPKI) -> None:
    chunks = _chunks()
    expected = b"".join(chunks)
    with trio.fail_after(_OVERALL):
        async with tls_pipes(cluster) as (client, server), trio.open_nursery() as nursery:
            nursery.start_soon(client.run_flusher)
            received: list[bytes] = []
            done = trio.Event()

            async def read() -> None:
                received.append(await _read_exactly(server, len(expected)))
                done.set()

            nursery.start_soon(read)
            for i, chunk in enumerate(chunks):
                client.write(chunk)  # several writes in a row: gathered
                if i % 7 == 0:
                    await trio.lowlevel.checkpoint()
                if client.buffered > HIGH_WATER:
                    await client.drained()
            await client.flush()
            await done.wait()
            nursery.cancel_scope.cancel()
    assert received[0] == expected


async def test_cancelled_writers_never_tear_what_they_wrote(cluster: ClusterPKI) -> None:
    chunks = _chunks()
    expected = b"".join(chunks)
    with trio.fail_after(_OVERALL):
        async with tls_pipes(cluster) as (client, server), trio.open_nursery() as nursery:
            nursery.start_soon(client.run_flusher)
            received: list[bytes] = []
            done = trio.Event()

            async def read() -> None:
                await trio.sleep(0.05)  # let the buffer fill first
                received.append(await _read_exactly(server, len(expected)))
                done.set()

            nursery.start_soon(read)
            for chunk in chunks:
                client.write(chunk)
                # Every wait for the socket is cancelled at once: a writer
                # that held half a TLS record would garble the rest.
                with trio.CancelScope() as scope:
                    scope.cancel()
                    await client.drained()
                with trio.CancelScope() as scope:
                    scope.cancel()
                    await client.flush()
            await client.flush()
            await done.wait()
            nursery.cancel_scope.cancel()
    assert received[0] == expected


async def test_a_peer_that_stops_reading_breaks_the_pipe(cluster: ClusterPKI) -> None:
    with trio.fail_after(_OVERALL):
        async with tls_pipes(cluster, send_timeout=0.5) as (client, _server):
            block = b"x" * (1 << 20)
            # More than loopback's socket buffers hold; the server reads nothing.
            for _ in range(64):
                client.write(block)
            with pytest.raises(TimeoutError):
                await client.flush()
            with pytest.raises(trio.BrokenResourceError):
                client.write(b"more")


async def test_a_pipe_over_a_stream_that_is_not_a_socket() -> None:
    left, right = trio.testing.memory_stream_pair()
    pipe = Pipe(left)
    with trio.fail_after(_OVERALL):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pipe.run_flusher)
            for chunk in (b"one ", b"two ", b"three"):
                pipe.write(chunk)
            got = b""
            while len(got) < len(b"one two three"):
                got += await right.receive_some()
            assert got == b"one two three"
            await right.send_all(b"back")
            assert await pipe.receive_some() == b"back"
            nursery.cancel_scope.cancel()


async def test_a_socket_closed_behind_the_pipes_back_is_never_written_again() -> None:
    # Closing the socket frees its descriptor's number: the next socket
    # opened may get it, and a write through the pipe's remembered number
    # would land in that stranger's connection.
    a, b = socket.socketpair()
    pipe = Pipe(trio.SocketStream(trio.socket.from_stdlib_socket(a)))
    number = a.fileno()
    a.close()
    c, d = socket.socketpair()
    with c, d, b:
        assert number in (c.fileno(), d.fileno())  # the number was reused, as it is by Linux
        with pytest.raises(trio.ClosedResourceError):
            pipe.write(b"secret")
        for sock in (c, d):
            with pytest.raises(BlockingIOError):
                sock.recv(100, socket.MSG_DONTWAIT)


async def test_an_answer_to_control_frames_does_not_hold_back_the_next_write() -> None:
    a, b = socket.socketpair()
    pipe = Pipe(trio.SocketStream(trio.socket.from_stdlib_socket(a)))
    with b:
        pipe.write(b"ack", burst=False)  # the reader answering a PING
        pipe.write(b"request")  # starts a burst: leaves at once, no flusher runs
        assert b.recv(100, socket.MSG_DONTWAIT) == b"ackrequest"
        pipe.write(b"more")  # within the burst: waits for the flusher
        with pytest.raises(BlockingIOError):
            b.recv(100, socket.MSG_DONTWAIT)
        await pipe.flush()
        assert b.recv(100, socket.MSG_DONTWAIT) == b"more"
        await pipe.aclose()


# --- header blocks ---------------------------------------------------------------------


def _h2_header_dict(
    headers: list[tuple[bytes, bytes]], flags: h2.utilities.HeaderValidationFlags
) -> dict[str, str] | None:
    """What the transport did before its one-pass check: h2's check, then UTF-8."""
    out: dict[str, str] = {}
    try:
        for name, value in h2.utilities.validate_headers(headers, flags):
            out.setdefault(name.decode(), value.decode())
    except (h2.exceptions.ProtocolError, UnicodeDecodeError):
        return None
    return out


_REQUEST = [
    (b":method", b"POST"),
    (b":scheme", b"https"),
    (b":path", b"/test.Test/Who"),
    (b":authority", b"127.0.0.1:7835"),
    (b"content-type", b"application/grpc"),
    (b"te", b"trailers"),
    (b"grpc-timeout", b"999m"),
]
_RESPONSE = [(b":status", b"200"), (b"content-type", b"application/grpc")]
_TRAILERS = [(b"grpc-status", b"0"), (b"grpc-message", b"ok")]

_names = st.sampled_from(
    [
        b":method",
        b":scheme",
        b":path",
        b":authority",
        b":status",
        b":protocol",
        b":bogus",
        b"te",
        b"host",
        b"connection",
        b"content-type",
        b"Upper",
        b"with space",
        b"a:b",
        b"",
        b"x-\xff",
        b"grpc-status",
    ]
)
_values = st.sampled_from(
    [
        *(b"", b"POST", b"CONNECT", b"trailers", b"TRAILERS", b"gzip", b" lead", b"trail\t"),
        *(b"a\nb", b"nul\x00", b"\xc3\xa9", b"\xff", b"127.0.0.1:7835", b"/p"),
    ]
)
_blocks = st.sampled_from([_REQUEST, _RESPONSE, _TRAILERS]).flatmap(
    lambda base: st.lists(
        st.tuples(
            st.sampled_from(["keep", "drop", "replace", "insert"]),
            st.integers(0, len(base)),
            _names,
            _values,
        ),
        max_size=4,
    ).map(lambda edits: _edited(base, edits))
)


def _edited(
    base: list[tuple[bytes, bytes]], edits: list[tuple[str, int, bytes, bytes]]
) -> list[tuple[bytes, bytes]]:
    block = list(base)
    for what, at, name, value in edits:
        at = min(at, len(block))
        if what == "drop" and at < len(block):
            del block[at]
        elif what == "replace" and at < len(block):
            block[at] = (block[at][0], value)
        elif what == "insert":
            block.insert(at, (name, value))
    return block


@given(block=_blocks, kind=st.sampled_from(["request", "response", "trailers"]))
@settings(max_examples=600, deadline=None)
def test_the_one_pass_header_check_decides_as_h2_does(
    block: list[tuple[bytes, bytes]], kind: str
) -> None:
    flags = h2.utilities.HeaderValidationFlags(
        is_client=kind != "request",
        is_trailer=kind == "trailers",
        is_response_header=kind == "response",
        is_push_promise=False,
    )
    assert transport._header_dict(block, flags) == _h2_header_dict(block, flags)


def test_the_one_pass_header_check_takes_the_blocks_grpc_sends() -> None:
    # What the fast path is for: these never reach h2's check.
    request = h2.utilities.HeaderValidationFlags(False, False, False, False)
    response = h2.utilities.HeaderValidationFlags(True, False, True, False)
    trailers = h2.utilities.HeaderValidationFlags(True, True, False, False)
    for block, flags in ((_REQUEST, request), (_RESPONSE, response), (_TRAILERS, trailers)):
        quick = transport._plain_header_dict(block, flags)
        assert isinstance(quick, dict)
        assert quick == _h2_header_dict(block, flags)


def test_header_blocks_decode_to_what_was_encoded_and_announce_table_changes() -> None:
    encoder = transport._HeaderEncoder()
    decoder = hpack.Decoder()
    headers = [(n.decode(), v.decode()) for n, v in _REQUEST] + [("x-extra", "ünïcode")]
    first = encoder.encode(headers)
    assert decoder.decode(first, raw=True) == [(n.encode(), v.encode()) for n, v in headers]
    # No dynamic table: the same headers make the same bytes every time.
    assert encoder.encode(headers) == first
    # A peer that shrinks its table hears of it at the start of the next block.
    encoder.header_table_size = 0
    decoder.max_allowed_table_size = 0
    resized = encoder.encode(headers)
    assert resized != first
    assert decoder.decode(resized, raw=True) == [(n.encode(), v.encode()) for n, v in headers]
    assert decoder.header_table_size == 0


_header_lists = st.lists(
    st.lists(
        st.tuples(
            st.sampled_from(["content-type", ":status", "x-a", "grpc-status", "x-b"]),
            st.sampled_from(["0", "200", "application/grpc", "x" * 40, "ü"]),
        ),
        max_size=5,
    ),
    min_size=1,
    max_size=12,
)


@given(
    blocks=_header_lists,
    indexing=st.booleans(),
    sizes=st.lists(st.sampled_from([None, 0, 64, 4096]), min_size=12, max_size=12),
)
@example(
    # A block remembered while the table could hold nothing must not stand
    # for the same bytes once it can: then they add to the table.
    blocks=[[(":status", "200")], [("x-a", "0")], [(":status", "200")], [("x-a", "0")]],
    indexing=True,
    sizes=[0, None, 4096, *[None] * 9],
)
@settings(max_examples=300, deadline=None)
def test_remembered_header_blocks_decode_as_hpack_decodes_them(
    blocks: list[list[tuple[str, str]]], indexing: bool, sizes: list[int | None]
) -> None:
    # A peer that indexes (hpack's own encoder, as Go's) or ours, shrinking
    # and growing its table now and then: our decoder must agree with
    # hpack's on every block, remembered or not.
    encoder = hpack.Encoder() if indexing else transport._HeaderEncoder()
    ours, theirs = transport._HeaderDecoder(), hpack.Decoder()
    for block, size in zip(blocks * 2, sizes * 2, strict=False):
        if size is not None:
            encoder.header_table_size = size
        data = encoder.encode(block)
        assert ours.decode(data, raw=True) == theirs.decode(data, raw=True)
        assert ours.header_table_size == theirs.header_table_size


def _tokens(source: str) -> list[str]:
    """The code's tokens, without comments, docstrings, type annotations or module prefixes."""
    source = re.sub(r'"""[\s\S]*?"""', "", source)
    source = re.sub(r"\b(h2|hyperframe)\.(exceptions|errors|frame)\.", "", source)
    out = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE):
            continue
        if token.type in (tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            continue
        out.append(token.string)
    return out


def test_the_frame_dispatch_is_h2s_without_its_trace() -> None:
    ours = inspect.getsource(transport._H2Connection._receive_frame)
    theirs = inspect.getsource(h2.connection.H2Connection._receive_frame)
    theirs = re.sub(r"\n\s*events: list\[Event\]\n", "\n", theirs)
    theirs = re.sub(r"\n\s*self\.config\.logger\.trace\(.*\)\n", "\n", theirs)
    ours = ours.replace("frame: Any) -> Any:", "frame: Frame) -> list[Event]:")
    assert _tokens(textwrap.dedent(ours)) == _tokens(textwrap.dedent(theirs))


# --- server and client -----------------------------------------------------------------

WHO = Method("/test.Transport/Who", ClusterDirectory, ClusterDirectory, Access.NODE)
BURST = Method(
    "/test.Transport/Burst", ClusterDirectory, ClusterDirectory, Access.NODE, streaming=True
)


@asynccontextmanager
async def serving(cluster: ClusterPKI, released: trio.Event) -> AsyncIterator[int]:
    security = ServerSecurity(
        owner_key=lambda: pki.public_key_bytes(cluster.owner_key),
        crl=lambda: None,
        leadership=lambda: Leadership(is_leader=True),
    )
    server = Server(server_context(cluster.server), security)

    async def who(req: ClusterDirectory, ctx: CallContext) -> ClusterDirectory:
        return ClusterDirectory(nodes=[ClusterDirectoryNode(public_key=ctx.peer.public_key)])

    async def burst(
        req: ClusterDirectory, ctx: CallContext, send: Callable[[ClusterDirectory], Awaitable[None]]
    ) -> None:
        # Written in a row, then the handler waits for the caller to have
        # read them all: gathered writes that waited for the handler's next
        # write would never leave.
        for i in range(len(req.nodes)):
            await send(ClusterDirectory(nodes=[ClusterDirectoryNode(public_key=bytes([i]))]))
        await released.wait()

    server.unary(WHO, who)
    server.stream(BURST, burst)
    async with trio.open_nursery() as nursery:
        yield await nursery.start(server.serve, "127.0.0.1", 0)
        nursery.cancel_scope.cancel()


class _Spawns(trio.abc.Instrument):
    def __init__(self) -> None:
        self.count = 0

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        self.count += 1


async def test_a_unary_call_runs_in_one_task(cluster: ClusterPKI) -> None:
    node = cluster.node
    context = client_context(cluster.ca, node.certificate, node.private_key)
    with trio.fail_after(_OVERALL):
        async with (
            serving(cluster, trio.Event()) as port,
            open_client([Endpoint("127.0.0.1", port)], context) as client,
        ):
            await client.unary(WHO, ClusterDirectory())  # connected
            spawns = _Spawns()
            trio.lowlevel.add_instrument(spawns)
            try:
                for _ in range(10):
                    got = await client.unary(WHO, ClusterDirectory())
                    assert got.nodes[0].public_key == node.public_key
            finally:
                trio.lowlevel.remove_instrument(spawns)
    # The server's task for each call, and nothing else on either side.
    assert spawns.count == 10


async def test_messages_written_in_a_row_leave_while_the_handler_waits(
    cluster: ClusterPKI,
) -> None:
    node = cluster.node
    context = client_context(cluster.ca, node.certificate, node.private_key)
    released = trio.Event()
    with trio.fail_after(_OVERALL):
        async with (
            serving(cluster, released) as port,
            open_client([Endpoint("127.0.0.1", port)], context) as client,
            client.stream(BURST, ClusterDirectory(nodes=[ClusterDirectoryNode()] * 5)) as s,
        ):
            got = []
            async for message in s:
                got.append(message.nodes[0].public_key)
                if len(got) == 5:
                    released.set()
    assert got == [bytes([i]) for i in range(5)]


@pytest.mark.parametrize(
    "metadata",
    [
        {"x/key": "x"},
        {"x-value": "a\nb"},
        {"x-nul": "a\x00b"},
        {"te": "gzip"},
        {"x-space": " lead"},
        {"x-tab": "trail\t"},
        {"": "x"},
    ],
)
async def test_metadata_http2_cannot_carry_is_refused_before_sending(
    cluster: ClusterPKI, metadata: dict[str, str]
) -> None:
    node = cluster.node
    context = client_context(cluster.ca, node.certificate, node.private_key)
    with trio.fail_after(_OVERALL):
        async with (
            serving(cluster, trio.Event()) as port,
            open_client([Endpoint("127.0.0.1", port)], context) as client,
        ):
            with pytest.raises(RPCError) as refused:
                await client.unary(WHO, ClusterDirectory(), metadata=metadata)
            assert refused.value.code is Status.INTERNAL
            assert "metadata" in refused.value.message
            # The connection is fine.
            await client.unary(WHO, ClusterDirectory())
