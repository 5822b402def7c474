"""The lean HTTP/1.1 client's streams, against canned answers on a UNIX socket.

Real etcd (tests/metropolis/test_etcd_client.py) shows that watches and
keep-alives work; these pin the framing cases etcd rarely produces on
demand: lines split across chunks, other framings, broken and malformed
bodies, a pool closed under a reader.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
import trio.testing

from metropolis.consensus.unixhttp import (
    ResponseStream,
    TransportClosed,
    TransportError,
    UnixHTTP,
)

BOUND = 10


@asynccontextmanager
async def serving(path: Path, pieces: list[bytes], *, hold: bool = False) -> AsyncIterator[None]:
    """Answer each connection with ``pieces``, sent one by one; then close it
    (or, with ``hold``, keep it open until the test ends)."""
    listener = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    await listener.bind(str(path))
    listener.listen()

    async def answer(conn: trio.socket.SocketType) -> None:
        with conn:
            await conn.recv(65536)
            for piece in pieces:
                await conn.send(piece)
                await trio.sleep(0.01)  # separate reads on the client side
            if hold:
                await trio.sleep_forever()

    async def serve(nursery: trio.Nursery) -> None:
        while True:
            conn, _ = await listener.accept()
            nursery.start_soon(answer, conn)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve, nursery)
        yield
        nursery.cancel_scope.cancel()
    listener.close()


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


async def _lines(http: UnixHTTP) -> list[bytes]:
    stream = await http.open_stream("/v3/watch", b"{}")
    try:
        lines = []
        while (line := await stream.line()) is not None:
            lines.append(line)
        return lines
    finally:
        stream.close()


async def test_lines_come_whole_however_the_chunks_cut_them(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    body = b'{"a":1}\n{"b":2}\n{"c":3}\n{"d":'
    pieces = [
        CHUNKED_HEAD[:20],
        CHUNKED_HEAD[20:] + _chunk(body[:3]),
        _chunk(body[3:20]),  # ends a line, starts the next
        _chunk(body[20:]) + _chunk(b"4}") + b"0\r\n\r\n",
    ]
    async with serving(path, pieces):
        http = UnixHTTP(path, timeout=BOUND, connect_timeout=BOUND)
        with trio.fail_after(BOUND):
            assert await _lines(http) == [b'{"a":1}', b'{"b":2}', b'{"c":3}', b'{"d":4}']


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 16\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n",  # until the end of the connection
    ],
)
async def test_other_framings(tmp_path: Path, head: bytes) -> None:
    path = tmp_path / "s.sock"
    async with serving(path, [head, b'{"a":1}\n', b'{"b":2}\n']):
        http = UnixHTTP(path, timeout=BOUND, connect_timeout=BOUND)
        with trio.fail_after(BOUND):
            assert await _lines(http) == [b'{"a":1}', b'{"b":2}']


@pytest.mark.parametrize(
    "rest",
    [
        [_chunk(b'{"a":1}\n'), b"zz\r\n"],  # a chunk size that is not hex
        [_chunk(b'{"a":1}\n'), b"10\r\nshort"],  # dropped inside a chunk
    ],
)
async def test_a_broken_stream_is_a_transport_error(tmp_path: Path, rest: list[bytes]) -> None:
    path = tmp_path / "s.sock"
    async with serving(path, [CHUNKED_HEAD, *rest]):
        http = UnixHTTP(path, timeout=BOUND, connect_timeout=BOUND)
        with trio.fail_after(BOUND):
            stream = await http.open_stream("/v3/watch", b"{}")
            assert await stream.line() == b'{"a":1}'
            with pytest.raises(TransportError):
                await stream.line()
            stream.close()


async def test_closing_the_pool_ends_a_waiting_reader(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    async with serving(path, [CHUNKED_HEAD], hold=True):
        http = UnixHTTP(path, timeout=BOUND, connect_timeout=BOUND)
        errors: list[BaseException] = []

        async def read(stream: ResponseStream) -> None:
            try:
                await stream.line()
            except TransportError as e:
                errors.append(e)

        with trio.fail_after(BOUND):
            stream = await http.open_stream("/v3/watch", b"{}")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read, stream)
                await trio.testing.wait_all_tasks_blocked()
                http.close()
            stream.close()
        assert len(errors) == 1 and isinstance(errors[0], TransportClosed)


async def test_no_head_in_time_is_a_transport_error(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    async with serving(path, [], hold=True):
        http = UnixHTTP(path, timeout=BOUND, connect_timeout=BOUND)
        with trio.fail_after(BOUND), pytest.raises(TransportError, match="Timeout"):
            await http.open_stream("/v3/watch", b"{}", head_timeout=0.1)
