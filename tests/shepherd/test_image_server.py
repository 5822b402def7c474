"""The image server (`shepherd.agent_server.images`) over real sockets: names, ranges, limits."""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import socket
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import httpx
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from common.net import free_loopback_port
from shepherd.agent_server.__main__ import parse_options
from shepherd.agent_server.images import (
    ImageServerConfig,
    RangeNotSatisfiable,
    byte_range,
    serve_images,
)
from tests.shepherd.agents import make_tls
from tests.shepherd.test_agent_server_hostile import (
    HOSTILE,
    ThreadServer,
    exchange,
    statuses,
    thread_server,
)

CHUNK = 64 * 1024


@dataclass
class Images:
    url: str
    port: int
    data: bytes
    digest: str
    #: A file named by a digest that is not its content's.
    wrong: str


def make_images(directory: Path, size: int = 5 * CHUNK + 123) -> tuple[bytes, str, str]:
    directory.mkdir(exist_ok=True)
    data = os.urandom(size)
    digest = hashlib.sha256(data).hexdigest()
    (directory / f"{digest}.pyz").write_bytes(data)
    wrong = hashlib.sha256(b"something else").hexdigest()
    (directory / f"{wrong}.pyz").write_bytes(data)
    # Beside the folder: what a path traversal would reach.
    (directory.parent / "secret").write_bytes(b"secret")
    (directory.parent / f"{digest}.pyz").write_bytes(data)
    return data, digest, wrong


def config(directory: Path, **overrides: float) -> ImageServerConfig:
    return ImageServerConfig(
        listen="127.0.0.1:0",
        image_dir=directory,
        chunk_size=CHUNK,
        send_timeout=overrides.get("send_timeout", 5.0),
        head_timeout=overrides.get("head_timeout", 5.0),
        idle_timeout=5.0,
    )


@pytest.fixture
async def images(tmp_path: Path, nursery: trio.Nursery) -> AsyncIterator[Images]:
    data, digest, wrong = make_images(tmp_path / "images")
    url = await nursery.start(serve_images, config(tmp_path / "images"))
    yield Images(url, int(url.rsplit(":", 1)[1]), data, digest, wrong)
    nursery.cancel_scope.cancel()


def path(digest: str) -> str:
    return f"/images/sha256/{digest}"


async def test_whole_get_and_head(images: Images) -> None:
    async with httpx.AsyncClient(base_url=images.url) as client:
        got = await client.get(path(images.digest))
        head = await client.head(path(images.digest))
    assert got.status_code == 200 and got.content == images.data
    assert got.headers["etag"] == f'"{images.digest}"'
    assert got.headers["content-length"] == str(len(images.data))
    assert got.headers["accept-ranges"] == "bytes"
    assert head.status_code == 200 and head.content == b""
    assert head.headers["content-length"] == str(len(images.data))
    assert head.headers["etag"] == f'"{images.digest}"'


@pytest.mark.parametrize(
    ("spec", "span"),
    [
        ("bytes=0-99", (0, 99)),
        ("bytes=100-", (100, None)),
        ("bytes=-100", (-100, None)),
        ("bytes=70000-70000", (70000, 70000)),
        ("bytes=5-999999999999", (5, None)),  # past the end: up to the end
        ("bytes=-999999999", (0, None)),  # more than the file: all of it
    ],
)
async def test_ranges(images: Images, spec: str, span: tuple[int, int | None]) -> None:
    size = len(images.data)
    first = span[0] if span[0] >= 0 else size + span[0]
    last = size - 1 if span[1] is None else span[1]
    async with httpx.AsyncClient(base_url=images.url) as client:
        got = await client.get(path(images.digest), headers={"Range": spec})
    assert got.status_code == 206
    assert got.headers["content-range"] == f"bytes {first}-{last}/{size}"
    assert got.content == images.data[first : last + 1]


@pytest.mark.parametrize(
    "spec", ["bytes=0-0,5-9", "bytes=9-5", "items=0-5", "bytes=x-5", "bytes=+1-2", "bytes=1"]
)
async def test_several_or_malformed_ranges_get_the_whole_file(images: Images, spec: str) -> None:
    async with httpx.AsyncClient(base_url=images.url) as client:
        got = await client.get(path(images.digest), headers={"Range": spec})
    assert (got.status_code, got.content) == (200, images.data)


async def test_unsatisfiable_ranges_are_416(images: Images) -> None:
    size = len(images.data)
    async with httpx.AsyncClient(base_url=images.url) as client:
        for spec in (f"bytes={size}-", f"bytes={size + 10}-{size + 20}", "bytes=-0"):
            got = await client.get(path(images.digest), headers={"Range": spec})
            assert got.status_code == 416, spec
            assert got.headers["content-range"] == f"bytes */{size}"
        # The connection stays usable.
        assert (await client.get(path(images.digest))).content == images.data


async def test_if_range_other_than_the_etag_gets_the_whole_file(images: Images) -> None:
    async with httpx.AsyncClient(base_url=images.url) as client:
        matching = await client.get(
            path(images.digest), headers={"Range": "bytes=1-2", "If-Range": f'"{images.digest}"'}
        )
        other = await client.get(
            path(images.digest), headers={"Range": "bytes=1-2", "If-Range": '"other"'}
        )
    assert (matching.status_code, matching.content) == (206, images.data[1:3])
    assert (other.status_code, other.content) == (200, images.data)


async def raw(port: int, data: bytes) -> bytes:
    """Send ``data``, then read until the server closes."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(data)
        received = b""
        with trio.fail_after(30):
            while chunk := await stream.receive_some(65536):
                received += chunk
    return received


@pytest.mark.parametrize(
    "target",
    [
        "/images/sha256/../secret",
        "/images/sha256/../{hex}.pyz",
        "/images/sha256/..%2f{hex}",
        "/images/sha256/{HEX}",
        "/images/sha256/{hex63}",
        "/images/sha256/{hex}0",
        "/images/sha256/{hex}.pyz",
        "/images/sha256/{hex}?x=1",
        "/images/sha256/{hex}/",
        "/images//sha256/{hex}",
        "/images/sha512/{hex}",
        "//images/sha256/{hex}",
    ],
)
async def test_only_exact_digest_names_are_served(images: Images, target: str) -> None:
    text = target.format(hex=images.digest, HEX=images.digest.upper(), hex63=images.digest[:63])
    answer = await raw(
        images.port, f"GET {text} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
    )
    assert answer.startswith(b"HTTP/1.1 404 "), answer[:100]
    assert b"secret" not in answer and images.data[:64] not in answer


async def test_content_not_matching_its_name_is_not_served(
    images: Images, caplog: pytest.LogCaptureFixture
) -> None:
    async with httpx.AsyncClient(base_url=images.url) as client:
        for _ in range(2):  # the second from the cached verdict
            assert (await client.get(path(images.wrong))).status_code == 404
            assert (await client.head(path(images.wrong))).status_code == 404
        assert (await client.get(path(images.digest))).content == images.data
    assert any(images.wrong in r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR)


async def test_a_file_replaced_under_its_name_is_checked_again(
    images: Images, tmp_path: Path
) -> None:
    target = tmp_path / "images" / f"{images.digest}.pyz"
    async with httpx.AsyncClient(base_url=images.url) as client:
        assert (await client.get(path(images.digest))).status_code == 200
        replacement = tmp_path / "images" / "tmp"
        replacement.write_bytes(b"tampered" + images.data[8:])
        replacement.replace(target)  # a new inode (and size/mtime may even match)
        assert (await client.get(path(images.digest))).status_code == 404


async def test_two_concurrent_downloads(images: Images) -> None:
    async with (
        httpx.AsyncClient(base_url=images.url) as first,
        httpx.AsyncClient(base_url=images.url) as second,
        first.stream("GET", path(images.digest)) as slow,
    ):
        pieces = slow.aiter_bytes()
        start = await pieces.__anext__()  # first download under way ...
        other = await second.get(path(images.digest), headers={"Range": "bytes=10-"})
        assert other.content == images.data[10:]  # ... while the second completes
        rest = b"".join([piece async for piece in pieces])
    assert start + rest == images.data


async def test_a_stalled_client_is_cut_off(
    tmp_path: Path, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    # Larger than what the kernel buffers between the two sockets.
    data, digest, _ = make_images(tmp_path / "images", size=32 * 1024 * 1024)
    caplog.set_level(logging.INFO, logger="shepherd.agent_server.images")
    url = await nursery.start(serve_images, config(tmp_path / "images", send_timeout=0.3))
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await sock.connect(("127.0.0.1", int(url.rsplit(":", 1)[1])))
    stream = trio.SocketStream(sock)
    async with stream:
        await stream.send_all(f"GET {path(digest)} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        with trio.fail_after(60):  # reads nothing until the server gave up on it
            while not any("cut off" in r.getMessage() for r in caplog.records):  # noqa: ASYNC110
                await trio.sleep(0.05)  # (a log record sets no event)
            received = 0
            try:
                while chunk := await stream.receive_some(1 << 20):
                    received += len(chunk)
            except trio.BrokenResourceError:
                pass  # reset: the server closed with our bytes unread
    assert received < len(data)
    nursery.cancel_scope.cancel()


async def test_serves_over_tls(tmp_path: Path, nursery: trio.Nursery) -> None:
    tls = make_tls(tmp_path / "tls")
    data, digest, _ = make_images(tmp_path / "images")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tls.certfile, tls.keyfile)
    url = await nursery.start(serve_images, config(tmp_path / "images"), context)
    assert url.startswith("https://")
    client_context = ssl.create_default_context(cadata=tls.ca_der)
    async with httpx.AsyncClient(verify=client_context) as client:
        got = await client.get(url + path(digest), headers={"Range": "bytes=-10"})
    assert (got.status_code, got.content) == (206, data[-10:])
    nursery.cancel_scope.cancel()


async def test_connections_are_bounded_and_idle_ones_closed(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    data, digest, _ = make_images(tmp_path / "images")
    bounded = ImageServerConfig(
        listen="127.0.0.1:0", image_dir=tmp_path / "images", max_connections=1, idle_timeout=0.3
    )
    url = await nursery.start(serve_images, bounded)
    port = int(url.rsplit(":", 1)[1])
    first = await trio.open_tcp_stream("127.0.0.1", port)
    answers: list[bytes] = []
    answered = trio.Event()

    async def second() -> None:
        answers.append(await raw(port, f"HEAD {path(digest)} HTTP/1.0\r\n\r\n".encode()))
        answered.set()

    async with first:
        # The second connection waits in the accept queue while the first is open ...
        nursery.start_soon(second)
        await first.send_all(f"HEAD {path(digest)} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += await first.receive_some(65536)
        assert head.startswith(b"HTTP/1.1 200 ") and not answers
        # ... until the first, kept alive but idle, is closed by the server.
        with trio.fail_after(30):
            assert await first.receive_some(65536) == b""
            await answered.wait()
    assert answers[0].startswith(b"HTTP/1.1 200 ")
    assert f"content-length: {len(data)}".encode() in answers[0].lower()
    nursery.cancel_scope.cancel()


def test_byte_range_forms() -> None:
    assert byte_range(b"bytes=0-9", 100) == (0, 9)
    assert byte_range(b"bytes=90-", 100) == (90, 99)
    assert byte_range(b"bytes=-10", 100) == (90, 99)
    assert byte_range(b"Bytes=1-2", 100) == (1, 2)  # the unit is case-insensitive
    assert byte_range(b"bytes = 1-2", 100) is None  # no spaces in a range
    for empty in (b"bytes=0-0", b"bytes=-1", b"bytes=0-"):
        with pytest.raises(RangeNotSatisfiable):
            byte_range(empty, 0)  # nothing of an empty file can be asked for
    assert byte_range("bytes=\u0663-9".encode(), 100) is None  # an Arabic-Indic 3


# --- hypothesis against a server in a thread ---------------------------------


@pytest.fixture(scope="module")
def image_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadServer]:
    directory = tmp_path_factory.mktemp("fuzz") / "images"
    data, digest, _ = make_images(directory, size=1000)

    async def serve(task_status: trio.TaskStatus[tuple[int, object]]) -> None:
        async with trio.open_nursery() as nursery:
            url = await nursery.start(serve_images, config(directory, head_timeout=2.0))
            task_status.started((int(url.rsplit(":", 1)[1]), (data, digest)))

    with thread_server(serve) as server:
        yield server


def assert_serves_image(server: ThreadServer) -> None:
    data, digest = cast(tuple[bytes, str], server.extra)
    assert server.alive(), server.crashed
    (answer,) = exchange(
        server.port, f"GET {path(digest)} HTTP/1.1\r\nHost: x\r\nRange: bytes=1-\r\n\r\n".encode()
    )
    assert (answer.status, answer.body) == (206, data[1:]), answer.head


_TARGETS = [b"/images/sha256/" + b"a" * 64, b"/images/sha256/", b"/", b"*", b"/images/sha256/%00"]
_HEADER_NAMES = [b"Range", b"If-Range", b"Content-Length", b"Transfer-Encoding", b"Connection"]


@HOSTILE
@given(
    data=st.one_of(
        st.binary(max_size=1500),
        st.tuples(
            st.sampled_from([b"GET", b"HEAD", b"POST", b"G\x00T", b""]),
            st.one_of(st.sampled_from(_TARGETS), st.binary(max_size=80)),
            st.lists(
                st.tuples(
                    st.one_of(st.sampled_from(_HEADER_NAMES), st.binary(min_size=1, max_size=20)),
                    st.one_of(
                        st.sampled_from([b"bytes=0-", b"bytes=-1,2-3", b"chunked", b"5", b"-1"]),
                        st.binary(max_size=40),
                    ),
                ),
                max_size=6,
            ),
            st.binary(max_size=40),
        ).map(
            lambda r: (
                r[0]
                + b" "
                + r[1]
                + b" HTTP/1.1\r\nHost: x\r\n"
                + b"".join(n + b": " + v + b"\r\n" for n, v in r[2])
                + b"\r\n"
                + r[3]
            )
        ),
    )
)
def test_arbitrary_request_heads_are_answered_or_closed(
    image_server: ThreadServer, data: bytes
) -> None:
    # HEAD answers have no body, which `exchange` cannot frame: only read those.
    if not data.startswith(b"HEAD"):
        # h11's hints (400, 414, 431, 501 for an unsupported transfer coding)
        # and the answers to good requests; never a 500 (a crash).
        assert 500 not in statuses(exchange(image_server.port, data))
    else:
        with socket.create_connection(("127.0.0.1", image_server.port), timeout=30) as sock:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(65536):
                pass
    assert_serves_image(image_server)


# --- python -m shepherd.agent_server --image-listen --------------------------


def test_image_options(tmp_path: Path) -> None:
    base = ["--bmdb-url", "postgresql://x/y", "--insecure-plain-http", "--workers", "2"]
    for bad in (
        ["--image-listen", "127.0.0.1:0"],  # no --image-dir
        ["--image-dir", str(tmp_path)],  # no --image-listen
        ["--image-listen", "127.0.0.1:0", "--image-dir", str(tmp_path / "absent")],
        ["--image-listen", "nowhere", "--image-dir", str(tmp_path)],
    ):
        with pytest.raises(SystemExit):
            parse_options(base + bad)
    options = parse_options([*base, "--image-listen", "127.0.0.1:0", "--image-dir", str(tmp_path)])
    assert options.images is not None and options.images.image_dir == tmp_path
    assert options.worker_argv[-3:-1] == ["--image-dir", str(tmp_path)]
    assert "--image-listen" not in options.worker_argv  # the supervisor adds the reserved port
    assert parse_options(base).images is None


async def test_workers_serve_images(bmdb_url: str, tmp_path: Path) -> None:
    data, digest, _ = make_images(tmp_path / "images")
    port, image_port = free_loopback_port(), free_loopback_port()
    process = await trio.lowlevel.open_process(
        [
            sys.executable,
            "-m",
            "shepherd.agent_server",
            "--bmdb-url",
            bmdb_url,
            "--listen",
            f"127.0.0.1:{port}",
            "--insecure-plain-http",
            "--workers",
            "2",
            "--image-listen",
            f"127.0.0.1:{image_port}",
            "--image-dir",
            str(tmp_path / "images"),
        ],
        stderr=subprocess.DEVNULL,
    )
    try:
        async with httpx.AsyncClient() as client:
            with trio.fail_after(120):
                while True:
                    try:
                        got = await client.get(
                            f"http://127.0.0.1:{image_port}{path(digest)}",
                            headers={"Range": "bytes=3-"},
                        )
                        break
                    except httpx.TransportError:
                        await trio.sleep(0.2)
        assert (got.status_code, got.content) == (206, data[3:])
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(30):
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
