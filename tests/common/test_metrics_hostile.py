"""Hostile clients against the metrics endpoint (`common.metrics`, what
``--metrics-listen`` serves on nodes, the Shepherd and the console).

Held means: every request answered with a valid status (never a 500) or its
connection closed, the server still serving a good scrape, its memory
bounded, and its cancellation (a node's shutdown) never held up by a client.

The findings (each failed against the hypercorn server this replaced): a
client that kept its receive window shut held its connection for ever and
made the server's cancellation hang (hypercorn shields its sends and gives
them no deadline); an ``Accept`` header that was not UTF-8, or named an
OpenMetrics version that is no number, was a 500 with a traceback logged.

One server process serves the module's probes, so that its memory can be
read from /proc; the cancellation probes run a server in this process.
"""

from __future__ import annotations

import contextlib
import gzip
import logging
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from common.metrics import MetricsLimits, serve_metrics
from tests.shepherd.test_agent_server_hostile import HOSTILE, exchange, statuses

#: Samples in the test registry: an exposition of about 400 KB, more than
#: the kernel buffers between two loopback sockets with a small receive buffer.
SERIES = 6000


def big_registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    counter = Counter("probe_events", "Events seen by the probe.", ["name"], registry=registry)
    for index in range(SERIES):
        counter.labels(name=f"series-{index:06d}-{'x' * 40}").inc(index)
    return registry


def scrape(url: str, **headers: str) -> httpx.Response:
    return httpx.get(url + "/metrics", headers=headers, timeout=60)


def assert_scrapes(url: str) -> None:
    """A good scrape: 200, the text format, every series there."""
    response = scrape(url)
    assert response.status_code == 200, response
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    totals = [s for s in families["probe_events"].samples if s.name == "probe_events_total"]
    assert len(totals) == SERIES


# --- one server process for the module --------------------------------------

_SERVER = """
import logging, signal, sys
import trio
from prometheus_client import CollectorRegistry, Counter
from common.metrics import MetricsLimits, serve_metrics

logging.basicConfig(filename=sys.argv[1], level=logging.INFO)

def big_registry():  # as the test module's
    registry = CollectorRegistry()
    counter = Counter("probe_events", "Events seen by the probe.", ["name"], registry=registry)
    for index in range(int(sys.argv[2])):
        counter.labels(name=f"series-{index:06d}-{'x' * 40}").inc(index)
    return registry

async def main():
    # A backlog that holds the probes' thousand connections at once, so that
    # their connects are not held back by the kernel (which is not the probe).
    limits = MetricsLimits(head_timeout=2.0, send_timeout=2.0, backlog=1024)
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            urls = await nursery.start(
                lambda task_status: serve_metrics(
                    big_registry(), "127.0.0.1:0", limits=limits, task_status=task_status
                )
            )
            print(urls[0], flush=True)
            async for _ in signals:
                nursery.cancel_scope.cancel()

trio.run(main)
"""


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    url: str
    log: Path

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def rss(self) -> int:
        """Resident memory of the server process, bytes."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def wait_for_log(self, text: str, count: int) -> None:
        """Until the server's log holds ``text`` ``count`` times (bounded, generously)."""
        for _ in range(600):
            if self.log.read_text().count(text) >= count:
                return
            time.sleep(0.1)
        raise AssertionError(f"{text!r} not {count} times in the server's log")

    def assert_no_errors(self) -> None:
        text = self.log.read_text()
        assert "Traceback" not in text and "ERROR" not in text, text[-3000:]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("metrics") / "server.log"
    root = Path(__file__).resolve().parents[2]
    process = subprocess.Popen(
        [sys.executable, "-c", _SERVER, str(log), str(SERIES)], stdout=subprocess.PIPE, cwd=root
    )
    try:
        assert process.stdout is not None
        url = process.stdout.readline().decode().strip()
        assert url.startswith("http://"), url
        running = Server(process, url, log)
        assert_scrapes(url)  # collected once: the baseline of its memory
        yield running
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
        running.assert_no_errors()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


#: Requests a stalled client sends: their answers are more than the kernel buffers.
PIPELINED = 6

#: What the server may grow by while it holds the probes' connections.
MEMORY_BOUND = 48 * 1024 * 1024


def raw(port: int, data: bytes) -> bytes:
    """Send ``data`` on a new connection and read until the server closes it."""
    received = b""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(data)
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass
    return received


def get_status(server: Server, target: bytes) -> int:
    answer = raw(
        server.port, b"GET " + target + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    return int(answer.split(b" ", 2)[1])


def test_a_megabyte_request_line_is_refused(server: Server) -> None:
    before = server.rss()
    answer = raw(server.port, b"GET /" + b"a" * (1 << 20) + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    assert answer.startswith((b"HTTP/1.1 431 ", b"HTTP/1.1 414 ", b"HTTP/1.1 400 ")), answer[:200]
    assert_scrapes(server.url)
    assert server.rss() - before < MEMORY_BOUND


def test_a_thousand_idle_connections_keep_no_scraper_out(server: Server) -> None:
    before = server.rss()
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(1000)]
    try:
        assert_scrapes(server.url)  # while they are open
        assert server.rss() - before < MEMORY_BOUND
        for sock in idle:  # each closed by the server: made room for others, or timed out
            sock.settimeout(60)
            assert sock.recv(100) == b""
    finally:
        for sock in idle:
            sock.close()
    assert_scrapes(server.url)


def test_a_slowloris_is_closed_before_its_head_is_complete(server: Server) -> None:
    head = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200 + b"\r\n\r\n"
    sent = 0
    answer = b""
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        try:
            for byte in head:
                sock.sendall(bytes([byte]))
                sent += 1
                # One byte every 0.1 s: the head would take 24 s, the server
                # gives it head_timeout (2 s).
                sock.settimeout(0.1)
                with contextlib.suppress(TimeoutError):
                    answer += sock.recv(65536) or b"<closed>"
                if answer:
                    break
        except (BrokenPipeError, ConnectionResetError):
            answer = b"<reset>"
    assert sent < len(head), "the whole head went through"
    assert answer.startswith((b"HTTP/1.1 408 ", b"<closed>", b"<reset>")), answer[:200]
    assert_scrapes(server.url)


def test_clients_that_read_nothing_are_cut_off(server: Server) -> None:
    size = len(scrape(server.url).content)
    before = server.rss()
    cuts = server.log.read_text().count("cut off")
    stalled = []
    for _ in range(5):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.port))
        # More answers than the kernel buffers (up to 4 MiB for the server's
        # send buffer, tcp_wmem), so that the server's sends block.
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * PIPELINED)
        stalled.append(sock)
    try:
        assert_scrapes(server.url)  # while they hold their answers
        assert server.rss() - before < MEMORY_BOUND
        server.wait_for_log("cut off", cuts + len(stalled))
        for sock in stalled:  # the answers incomplete
            sock.settimeout(60)
            received = 0
            try:
                while chunk := sock.recv(1 << 20):
                    received += len(chunk)
            except ConnectionResetError:
                pass
            assert received < PIPELINED * size
    finally:
        for sock in stalled:
            sock.close()


def test_accept_headers_it_cannot_read_get_the_text_format(server: Server) -> None:
    for accept in (
        b"\xff\xfe",
        b"application/openmetrics-text; version=abc",
        b"application/openmetrics-text; version=1.a",
        b"text/plain; version=x.y",
    ):
        answer = raw(
            server.port,
            b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAccept: "
            + accept
            + b"\r\n\r\n",
        )
        assert answer.startswith(b"HTTP/1.1 200 "), (accept, answer[:200])
        assert b"probe_events_total{" in answer, accept
    openmetrics = scrape(server.url, accept="application/openmetrics-text; version=1.0.0")
    assert openmetrics.headers["content-type"].startswith("application/openmetrics-text")
    assert openmetrics.text.endswith("# EOF\n")
    compressed = httpx.get(
        server.url + "/metrics?name[]=probe_events_total",
        headers={"accept-encoding": "gzip"},
        timeout=60,
    )
    assert compressed.headers["content-encoding"] == "gzip"
    assert b"probe_events_total{" in compressed.content  # httpx unpacked it
    encoding = raw(
        server.port,
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAccept-Encoding: \xff\r\n\r\n",
    )
    assert encoding.startswith(b"HTTP/1.1 200 "), encoding[:200]
    server.assert_no_errors()


def test_paths_and_methods_other_than_get_metrics(server: Server) -> None:
    for line, status in (
        (b"GET /", b"404"),
        (b"GET /metricsx", b"404"),
        (b"POST /metrics", b"405"),
        (b"DELETE /metrics", b"405"),
    ):
        answer = raw(server.port, line + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 " + status + b" "), (line, answer[:200])
    body = raw(server.port, b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
    assert body.startswith(b"HTTP/1.1 400 "), body[:200]
    head = raw(server.port, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and head.endswith(b"\r\n\r\n"), head[-200:]
    # Kept alive: three answers on one connection.
    get = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
    three = raw(server.port, get * 2 + b"GET /x HTTP/1.0\r\n\r\n")
    assert three.count(b"HTTP/1.1 200 ") == 2 and b"HTTP/1.1 404 " in three


_NAMES = [b"Accept", b"Accept-Encoding", b"Content-Length", b"Transfer-Encoding", b"Connection"]
_VALUES = [
    b"application/openmetrics-text; version=",
    b"application/openmetrics-text; version=1.0.0; escaping=allow-utf-8",
    b"text/plain; version=1.0.0",
    b"gzip",
    b"chunked",
    b"\xff",
    b"-1",
]


def requests(
    targets: list[bytes], names: list[bytes], values: list[bytes]
) -> st.SearchStrategy[bytes]:
    """Arbitrary bytes, and request heads of methods good and bad, of these
    ``targets`` or arbitrary ones, with headers of these ``names`` and
    ``values`` or arbitrary ones, and a few bytes after the head."""
    return st.one_of(
        st.binary(max_size=1500),
        st.tuples(
            st.sampled_from([b"GET", b"HEAD", b"POST", b"OPTIONS", b"G\x00T", b""]),
            st.one_of(st.sampled_from(targets), st.binary(max_size=80)),
            st.lists(
                st.tuples(
                    st.one_of(st.sampled_from(names), st.binary(min_size=1, max_size=20)),
                    st.one_of(st.sampled_from(values), st.binary(max_size=60)),
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


@settings(HOSTILE, max_examples=60)
@given(
    data=requests([b"/metrics", b"/metrics?name[]=probe_events_total", b"*", b"/"], _NAMES, _VALUES)
)
def test_arbitrary_requests_are_answered_or_closed(server: Server, data: bytes) -> None:
    if data.startswith(b"HEAD"):  # answers without a body: `exchange` cannot frame them
        raw(server.port, data)
    else:
        assert 500 not in statuses(exchange(server.port, data))
    # Still serving (a short answer: each example's scrape would collect
    # every series; the module's other probes scrape in full).
    assert get_status(server, b"/metrics?name[]=none") == 200
    assert server.process.poll() is None


# --- the server's cancellation ------------------------------------------------


async def _stalled_client(port: int) -> trio.SocketStream:
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await sock.connect(("127.0.0.1", port))
    stream = trio.SocketStream(sock)
    await stream.send_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * PIPELINED)
    return stream


async def test_a_client_that_reads_nothing_does_not_hold_up_the_servers_cancellation(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With a send deadline far away, a client that reads nothing is still
    being answered when the server is cancelled: the server ends at once
    (hypercorn's waited for the client for ever)."""
    caplog.set_level(logging.INFO, logger="common.metrics")
    limits = MetricsLimits(send_timeout=3600.0)
    server_scope = trio.CancelScope()
    ended = trio.Event()

    async def run(task_status: trio.TaskStatus[list[str]]) -> None:
        try:
            with server_scope:
                await serve_metrics(
                    big_registry(), "127.0.0.1:0", limits=limits, task_status=task_status
                )
        finally:
            ended.set()

    async with trio.open_nursery() as nursery:
        urls = await nursery.start(run)
        port = int(urls[0].rsplit(":", 1)[1])
        # (Closed when the block is left, also on failure: that ends a server
        # that waits for it.)
        async with await _stalled_client(port), httpx.AsyncClient(timeout=60) as client:
            response = await client.get(urls[0] + "/metrics")  # another is served meanwhile
            assert response.status_code == 200
            await trio.sleep(0.5)  # the stalled one's answer is under way, its window shut
            server_scope.cancel()
            with trio.fail_after(30):  # generous; hypercorn's never ended
                await ended.wait()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_exposition_falls_back_to_the_text_format() -> None:
    from common.metrics import exposition

    registry = big_registry()
    for accept in ("application/openmetrics-text; version=abc", "\xff", "text/plain; version=z"):
        body, headers = exposition(registry, accept, "")
        assert dict(headers)[b"content-type"].startswith(b"text/plain"), accept
        assert b"probe_events_total{" in body
    body, headers = exposition(registry, "", "gzip", "name[]=probe_events_total")
    assert dict(headers)[b"content-encoding"] == b"gzip"
    assert gzip.decompress(body).count(b"\n") > SERIES
