"""Arbitrary bytes, headers and gRPC messages from a caller without a certificate.

One server runs for the whole module, in a thread of its own, so that every
example hits the same ``serve``: after each example the server must have
answered (a gRPC status, RST_STREAM or GOAWAY) or closed the connection, a
node's good call must still succeed, and ``serve`` must still be running.
Its timeouts are small so that a stalled example ends quickly; nothing
asserts on time.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import pytest
import trio
from hyperframe.frame import Frame, GoAwayFrame, HeadersFrame, RstStreamFrame
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
)
from metropolis.rpc.limits import Limits
from tests.fixtures.rpc import PREFACE, ClusterPKI, RawPeer, grpc_request_headers, grpc_status

WHO = Method("/test.Fuzz/Who", ClusterDirectory, ClusterDirectory, Access.NODE)
OPEN = Method("/test.Fuzz/Open", ClusterDirectory, ClusterDirectory, Access.PROOF)

# Short, so that examples which stall end soon; not so short that a good
# client's own preface misses the frame timeout on a loaded machine (the
# server shares this process's GIL with the test).
_LIMITS = Limits(frame_timeout=0.4, request_timeout=0.4, idle_timeout=2.0)
_EXAMPLE = 10  # seconds: a generous bound on one example, never asserted on


def _fuzz(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


@dataclass
class ServerThread:
    """``Server.serve`` in a Trio run of its own thread."""

    cluster: ClusterPKI
    port: int = 0
    #: What ended serve, if it ended before the test stopped it.
    ended: BaseException | str | None = None
    _ready: threading.Event = field(default_factory=threading.Event)
    _token: trio.lowlevel.TrioToken | None = None
    _scope: trio.CancelScope | None = None
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=trio.run, args=(self._main,), daemon=True)
        self._thread.start()
        assert self._ready.wait(30)

    async def _main(self) -> None:
        cluster = self.cluster
        security = ServerSecurity(
            owner_key=lambda: pki.public_key_bytes(cluster.owner_key),
            crl=lambda: None,
            leadership=lambda: Leadership(is_leader=True),
        )
        server = Server(server_context(cluster.server), security, limits=_LIMITS)

        async def who(req: ClusterDirectory, ctx: CallContext) -> ClusterDirectory:
            return ClusterDirectory(nodes=[ClusterDirectoryNode(public_key=ctx.peer.public_key)])

        server.unary(WHO, who)
        server.unary(OPEN, who)
        self._token = trio.lowlevel.current_trio_token()
        try:
            with trio.CancelScope() as self._scope:
                async with trio.open_nursery() as nursery:
                    self.port = await nursery.start(server.serve, "127.0.0.1", 0)
                    self._ready.set()
            if not self._scope.cancelled_caught:
                self.ended = "serve returned"
        except BaseException as e:  # recorded for the test to fail on
            self.ended = e
        finally:
            self._ready.set()

    def check(self) -> None:
        assert self.ended is None, f"serve ended: {self.ended!r}"
        assert self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        if self._scope is not None and self._token is not None and self.ended is None:
            trio.from_thread.run_sync(self._scope.cancel, trio_token=self._token)
        if self._thread is not None:
            self._thread.join(30)


@pytest.fixture(scope="module")
def served() -> Iterator[ServerThread]:
    thread = ServerThread(ClusterPKI.new())
    thread.start()
    yield thread
    thread.stop()
    assert thread.ended is None, f"serve ended: {thread.ended!r}"


def _example(served: ServerThread, body: Callable[[RawPeer], Awaitable[None]]) -> None:
    """Run one example: ``body`` on a raw connection, then a node's good call."""

    async def run() -> None:
        with trio.fail_after(_EXAMPLE):
            peer = await RawPeer.connect(served.port, served.cluster.ca)
            try:
                await body(peer)
            finally:
                await peer.aclose()
            creds = served.cluster.node
            context = client_context(served.cluster.ca, creds.certificate, creds.private_key)
            async with open_client([Endpoint("127.0.0.1", served.port)], context) as client:
                got = await client.unary(WHO, ClusterDirectory())
            assert got.nodes[0].public_key == creds.public_key

    trio.run(run)
    served.check()


def _is_answer(frame: Frame | None) -> bool:
    """A refusal or status for the stream, a GOAWAY, or (None) the connection closed."""
    if frame is None or isinstance(frame, GoAwayFrame | RstStreamFrame):
        return True
    return isinstance(frame, HeadersFrame) and grpc_status(frame) is not None


@_fuzz(60)
@given(data=st.binary(max_size=2000) | st.binary(max_size=30).map(lambda b: PREFACE[:20] + b))
def test_arbitrary_bytes_after_the_handshake(served: ServerThread, data: bytes) -> None:
    async def body(peer: RawPeer) -> None:
        await peer.send(data)
        # Nothing here is a whole preface and SETTINGS: the server closes
        # (at once, or when its frame or idle timeout passes).
        await peer.closed()

    _example(served, body)


_NAMES = st.sampled_from(
    [
        b":path",
        b":method",
        b":authority",
        b":scheme",
        b"content-type",
        b"te",
        b"grpc-timeout",
        b"content-length",
        b"metropolis-pop-key-bin",
        b"metropolis-pop-time",
        b"metropolis-pop-signature-bin",
        b"x-metadata",
    ]
) | st.binary(max_size=20)
_VALUES = (
    st.binary(max_size=60)
    | st.sampled_from([b"\xff\xfe", b"\0", b"\r\n", b" x ", b"99999999H", b"1\xd9\xa3S", b"-1"])
    | st.integers(min_value=100, max_value=20000).map(lambda n: b"v" * n)
)


@_fuzz(80)
@given(
    path=st.sampled_from([WHO.path, OPEN.path, "/nope/Nope"]),
    extra=st.lists(st.tuples(_NAMES, _VALUES), max_size=6),
    replace=st.booleans(),
)
def test_arbitrary_request_headers(
    served: ServerThread, path: str, extra: list[tuple[bytes, bytes]], replace: bool
) -> None:
    headers = grpc_request_headers(path)
    if replace:  # the arbitrary ones instead of the request's own
        names = {name for name, _ in extra}
        headers = [h for h in headers if h[0] not in names]
    headers += extra

    async def body(peer: RawPeer) -> None:
        if not await peer.start() or not await peer.headers(1, headers, end_stream=True):
            return  # already closed by the server
        first = await peer.answer(1)
        assert _is_answer(first), first
        if isinstance(first, RstStreamFrame | HeadersFrame):
            # Only that stream was refused: the connection still serves.
            await peer.headers(3, grpc_request_headers(OPEN.path), end_stream=True)
            second = await peer.answer(3)
            # (A GOAWAY too, if a slow machine let the idle timeout pass.)
            assert _is_answer(second), second

    _example(served, body)


_MESSAGE = st.tuples(
    st.sampled_from([0, 0, 0, 1, 255]),
    st.integers(min_value=0, max_value=2**32 - 1) | st.integers(min_value=0, max_value=300),
    st.binary(max_size=300),
).map(lambda m: bytes([m[0]]) + m[1].to_bytes(4, "big") + m[2])


@_fuzz(80)
@given(
    path=st.sampled_from([WHO.path, OPEN.path]),
    chunks=st.lists(_MESSAGE | st.binary(max_size=40), max_size=8),
    end_stream=st.booleans(),
)
def test_arbitrary_grpc_messages(
    served: ServerThread, path: str, chunks: list[bytes], end_stream: bool
) -> None:
    async def body(peer: RawPeer) -> None:
        if not await peer.start() or not await peer.headers(1, grpc_request_headers(path)):
            return
        for i, chunk in enumerate(chunks):
            last = end_stream and i == len(chunks) - 1
            if not await peer.data(1, chunk, end_stream=last):
                break
        if end_stream and not chunks:
            await peer.data(1, b"", end_stream=True)
        # Answered as it arrives, or when the request timeout passes.
        answer = await peer.answer(1)
        assert _is_answer(answer), answer
        if isinstance(answer, HeadersFrame):
            assert grpc_status(answer) in {
                Status.UNAUTHENTICATED,
                Status.INTERNAL,
                Status.RESOURCE_EXHAUSTED,
                Status.DEADLINE_EXCEEDED,
            }

    _example(served, body)
