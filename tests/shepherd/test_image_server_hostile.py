"""Hostile clients against the image server (`shepherd.agent_server.images`),
run as a process of its own so that its memory can be read from /proc.

Ranges and If-Range of every shape (Hypothesis, against an oracle written
from RFC 9110 section 14), digests that are not hex or not 64 characters,
``..`` and encoded slashes, HEAD floods (pipelined on one connection, and
from many at once), and clients that read a byte now and then of a large
image. Held means: each answer what the RFC and the module's docs say (or
404), never a byte from outside the image folder, the server's memory
bounded, and a good download served meanwhile.

All held; `tests/shepherd/test_image_server.py` has the server's own tests.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.shepherd.test_agent_server_hostile import HOSTILE, Answer, exchange

#: The images served: small (ranges), empty, large (slow readers).
SMALL = 1000
LARGE = 32 * 1024 * 1024
SECRET = b"the secret beside the image folder"

_SERVER = """
import logging, signal, sys
from pathlib import Path
import trio
from shepherd.agent_server.images import ImageServerConfig, serve_images

logging.basicConfig(filename=sys.argv[2], level=logging.INFO)

async def main():
    config = ImageServerConfig(
        listen="127.0.0.1:0",
        image_dir=Path(sys.argv[1]),
        send_timeout=2.0,
        head_timeout=2.0,
        idle_timeout=2.0,
    )
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            url = await nursery.start(serve_images, config)
            print(url, flush=True)
            async for _ in signals:
                nursery.cancel_scope.cancel()

trio.run(main)
"""


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    port: int
    log: Path
    images: dict[str, bytes] = field(repr=False)  # by digest

    def rss(self) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def digest(self, size: int) -> str:
        return next(d for d, data in self.images.items() if len(data) == size)

    def wait_for_log(self, text: str, count: int) -> None:
        for _ in range(600):
            if self.log.read_text().count(text) >= count:
                return
            time.sleep(0.1)
        raise AssertionError(f"{text!r} not {count} times in the server's log")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    base = tmp_path_factory.mktemp("images")
    folder = base / "images"
    folder.mkdir()
    images = {}
    for data in (os.urandom(SMALL), b"", os.urandom(LARGE)):
        digest = hashlib.sha256(data).hexdigest()
        (folder / f"{digest}.pyz").write_bytes(data)
        images[digest] = data
    # What a way out of the folder would reach.
    (base / "secret").write_bytes(SECRET)
    (base / f"{hashlib.sha256(SECRET).hexdigest()}.pyz").write_bytes(SECRET)
    log = base / "server.log"
    root = Path(__file__).resolve().parents[2]
    process = subprocess.Popen(
        [sys.executable, "-c", _SERVER, str(folder), str(log)], stdout=subprocess.PIPE, cwd=root
    )
    try:
        assert process.stdout is not None
        url = process.stdout.readline().decode().strip()
        assert url.startswith("http://"), url
        running = Server(process, int(url.rsplit(":", 1)[1]), log, images)
        yield running
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
        text = log.read_text()
        assert "Traceback" not in text and "ERROR" not in text, text[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def get(server: Server, target: bytes, headers: bytes = b"", method: bytes = b"GET") -> bytes:
    """One request on a new connection; the raw answer (read until the server closes)."""
    received = b""
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(
            method
            + b" "
            + target
            + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            + headers
            + b"\r\n"
        )
        while chunk := sock.recv(1 << 20):
            received += chunk
    return received


def one_answer(server: Server, target: bytes, headers: bytes = b"") -> Answer:
    (answer,) = exchange(
        server.port, b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n"
    )
    return answer


def header(answer: Answer, name: bytes) -> bytes | None:
    match = re.search(rb"(?im)^" + re.escape(name) + rb": *([^\r\n]*)\r?$", answer.head)
    return None if match is None else match[1]


# --- Range and If-Range --------------------------------------------------------

_RANGE = re.compile(rb"(?i:bytes)=([0-9]{0,19})-([0-9]{0,19})")


def expected(
    ranges: list[bytes], if_ranges: list[bytes], etag: bytes, size: int
) -> tuple[int, int, int]:
    """(status, first, last) that RFC 9110 section 14 allows this server to
    answer: one satisfiable range of a single Range header whose If-Range,
    if any, is exactly the strong ETag, gets 206; a range that starts past
    the end (or asks for the last 0 bytes, or any byte of an empty file)
    416; anything else (several ranges, another unit, malformed, If-Range
    another validator or a date) the whole file with 200."""
    whole = (200, 0, size - 1)
    if len(ranges) != 1 or (if_ranges and if_ranges != [etag]):
        return whole
    match = _RANGE.fullmatch(ranges[0])
    if match is None or (not match[1] and not match[2]):
        return whole
    if not match[1]:  # the last N bytes
        suffix = int(match[2])
        if suffix == 0 or size == 0:
            return (416, 0, 0)
        return (206, max(0, size - suffix), size - 1)
    first = int(match[1])
    if match[2] and int(match[2]) < first:
        return whole  # invalid: ignored
    last = int(match[2]) if match[2] else size - 1
    if first >= size:
        return (416, 0, 0)
    return (206, first, min(last, size - 1))


_numbers = st.one_of(
    st.sampled_from([0, 1, 998, 999, 1000, 1001, 10**18, 10**19 - 1]),
    st.integers(min_value=0, max_value=2000),
).map(lambda n: str(n).encode())
_range_values = st.one_of(
    st.tuples(_numbers, _numbers).map(lambda t: b"bytes=" + t[0] + b"-" + t[1]),
    _numbers.map(lambda n: b"bytes=" + n + b"-"),
    _numbers.map(lambda n: b"bytes=-" + n),
    st.tuples(_numbers, _numbers, _numbers).map(lambda t: b"bytes=%s-%s,%s-" % t),
    st.sampled_from(
        [
            b"bytes=",
            b"bytes=-",
            b"bytes= 0-1",
            b"bytes=0 -1",
            b"BYTES=1-2",
            b"items=0-1",
            b"bytes=\xd9\xa3-9",  # an Arabic-Indic digit
            b"bytes=+1-2",
            b"bytes=0x1-2",
            b"bytes=99999999999999999999-",  # 20 digits
            b"bytes=1-2;x",
        ]
    ),
    st.binary(max_size=20).filter(lambda b: b"\r" not in b and b"\n" not in b),
)


@settings(HOSTILE, max_examples=120)
@given(
    size=st.sampled_from([SMALL, 0]),
    ranges=st.lists(_range_values, max_size=2),
    if_range=st.lists(
        st.sampled_from(["etag", "weak", "other", "date", "bare", "empty"]), max_size=2
    ),
)
def test_ranges_and_if_range_are_answered_as_rfc_9110_says(
    server: Server, size: int, ranges: list[bytes], if_range: list[str]
) -> None:
    digest = server.digest(size)
    data = server.images[digest]
    etag = b'"%s"' % digest.encode()
    validators = {
        "etag": etag,
        "weak": b"W/" + etag,
        "other": b'"' + b"0" * 64 + b'"',
        "date": b"Sun, 06 Dec 2026 12:00:00 GMT",
        "bare": digest.encode(),
        "empty": b"",
    }
    if_ranges = [validators[v] for v in if_range]
    # h11 refuses a header value with other control characters: not a range question.
    ranges = [r.strip(b" \t") for r in ranges if not re.search(rb"[\x00-\x1f\x7f]", r)]
    headers = b"".join(b"Range: " + r + b"\r\n" for r in ranges)
    headers += b"".join(b"If-Range: " + v + b"\r\n" for v in if_ranges)
    answer = one_answer(server, b"/images/sha256/" + digest.encode(), headers)
    status, first, last = expected(ranges, [v.strip() for v in if_ranges], etag, size)
    assert answer.status == status, (ranges, if_ranges, answer.head)
    assert header(answer, b"etag") == etag
    if status == 416:
        assert header(answer, b"content-range") == b"bytes */%d" % size
        return
    assert answer.body == data[first : last + 1]
    if status == 206:
        assert header(answer, b"content-range") == b"bytes %d-%d/%d" % (first, last, size)
    else:
        assert header(answer, b"content-range") is None


# --- names -----------------------------------------------------------------------


_segments = st.sampled_from(
    [
        "images",
        "sha256",
        "{hex}",
        "{HEX}",
        "{hex63}",
        "{hex}0",
        "{nothex}",
        "{hex}.pyz",
        "{secret}",
        "..",
        ".",
        "%2e%2e",
        "%2E%2E",
        "%2f",
        "%2F",
        "%5c",
        "\\",
        "",
        "%00",
        ";x",
        "?x=1",
        "#f",
        "secret",
        "..%2f{hex}",
        "%2e%2e%2fsecret",
    ]
)


@settings(HOSTILE, max_examples=120)
@given(
    segments=st.lists(_segments, min_size=1, max_size=6),
    prefix=st.sampled_from(["/", "//", "", "/images/sha256/"]),
    method=st.sampled_from([b"GET", b"HEAD"]),
)
def test_only_an_exact_digest_name_is_served(
    server: Server, segments: list[str], prefix: str, method: bytes
) -> None:
    digest = server.digest(SMALL)
    secret = hashlib.sha256(SECRET).hexdigest()
    names = {
        "hex": digest,
        "HEX": digest.upper(),
        "hex63": digest[:63],
        "nothex": "g" * 64,
        "secret": secret,
    }
    target = (prefix + "/".join(segments)).format(**names).encode()
    if not target.startswith(b"/"):
        target = b"/" + target
    answer = get(server, target, method=method)
    served = target == b"/images/sha256/" + digest.encode()
    if served:
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    else:
        assert answer.startswith((b"HTTP/1.1 404 ", b"HTTP/1.1 400 ")), (target, answer[:200])
        assert server.images[digest][:64] not in answer
    assert SECRET not in answer


# --- floods and slow readers -------------------------------------------------------

#: What the server may grow by while it holds the probes' connections.
MEMORY_BOUND = 64 * 1024 * 1024


def test_a_pipelined_head_flood_is_answered_in_order(server: Server) -> None:
    digest = server.digest(SMALL)
    head = b"HEAD /images/sha256/%s HTTP/1.1\r\nHost: x\r\n\r\n" % digest.encode()
    count = 3000
    received = b""
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sender = threading.Thread(target=sock.sendall, args=(head * count,), daemon=True)
        sender.start()
        while received.count(b"HTTP/1.1 200 ") < count:
            chunk = sock.recv(1 << 20)
            assert chunk, "closed early"
            received += chunk
        sender.join(60)
    assert received.count(b"HTTP/1.1 ") == count
    assert f"content-length: {SMALL}".encode() in received.lower()


def test_a_head_flood_that_reads_nothing_is_cut_off(server: Server) -> None:
    digest = server.digest(SMALL)
    head = b"HEAD /images/sha256/%s HTTP/1.1\r\nHost: x\r\n\r\n" % digest.encode()
    cuts = server.log.read_text().count("cut off")
    before = server.rss()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    with sock:
        sock.settimeout(60)
        # 10 MB of requests whose answers pile up unread (the server may cut
        # it off while it is still sending).
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(head * 100_000)
        server.wait_for_log("cut off", cuts + 1)
        assert server.rss() - before < MEMORY_BOUND
    assert_downloads(server)


def test_head_floods_from_many_connections_leave_others_served(server: Server) -> None:
    digest = server.digest(SMALL)
    head = b"HEAD /images/sha256/%s HTTP/1.1\r\nHost: x\r\n\r\n" % digest.encode()
    before = server.rss()
    answered: list[int] = []

    def flood() -> None:
        received = b""
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
            sock.sendall(head * 50 + b"HEAD / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            while chunk := sock.recv(65536):
                received += chunk
        answered.append(received.count(b"HTTP/1.1 200 "))

    floods = [threading.Thread(target=flood, daemon=True) for _ in range(100)]
    for thread in floods:
        thread.start()
    assert_downloads(server)  # while they flood
    for thread in floods:
        thread.join(120)
    assert answered == [50] * 100
    assert server.rss() - before < MEMORY_BOUND


def assert_downloads(server: Server) -> None:
    """A good client gets the large image whole."""
    digest = server.digest(LARGE)
    answer = get(server, b"/images/sha256/" + digest.encode())
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 "), head
    assert hashlib.sha256(body).hexdigest() == digest


def test_clients_that_read_a_byte_now_and_then_are_cut_off(server: Server) -> None:
    """A byte a minute, scaled down: a byte every half second, which never
    lets the server send a chunk within its send timeout (2 s here)."""
    digest = server.digest(LARGE)
    cuts = server.log.read_text().count("cut off")
    before = server.rss()
    slow = []
    for _ in range(20):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.port))
        sock.sendall(b"GET /images/sha256/%s HTTP/1.1\r\nHost: x\r\n\r\n" % digest.encode())
        slow.append(sock)
    received = [0] * len(slow)
    stop = threading.Event()

    def trickle_reads() -> None:
        while not stop.is_set():
            for index, sock in enumerate(slow):
                sock.settimeout(0.01)
                with contextlib.suppress(TimeoutError, ConnectionResetError):
                    received[index] += len(sock.recv(1))
            stop.wait(0.5)

    reader = threading.Thread(target=trickle_reads, daemon=True)
    reader.start()
    try:
        assert_downloads(server)  # meanwhile
        server.wait_for_log("cut off", cuts + len(slow))
        assert server.rss() - before < MEMORY_BOUND
    finally:
        stop.set()
        reader.join(30)
        for sock in slow:
            sock.close()
    assert all(count < LARGE for count in received)
