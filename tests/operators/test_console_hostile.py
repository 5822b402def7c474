"""Hostile clients against the web UI's server (``python -m console web``),
probed as the metrics endpoint is (``tests/common/test_metrics_hostile.py``).

Held means: every request answered with a valid status (never a 500) or its
connection closed, pages still served to others meanwhile, the server's
memory bounded, and SIGTERM ending the server promptly whatever its
clients do.

One server process (the real CLI, default limits) serves the module's
probes, so that its memory can be read from /proc; the SIGTERM probes start
their own. The BMDB holds a machine whose page is about a megabyte: a few
are more than the kernel buffers between two sockets.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import trio
from hypothesis import given, settings

import bmdb
from bmdb import Backoff, Process, Provider, Queries
from tests.common.test_metrics_hostile import MEMORY_BOUND, PIPELINED, raw, requests
from tests.common.test_metrics_hostile import Server as ServerProcess
from tests.shepherd.test_agent_server_hostile import HOSTILE, exchange, statuses

ROOT = Path(__file__).resolve().parents[2]

#: How long a probe waits for the server to give up on a client
#: (`common.httpserver.HTTPLimits`' 10 s), generously.
GIVE_UP = 60.0

#: A failure cause of 320 kB: the machine's page, which shows it thrice, is
#: about a megabyte, so that a few of them fill the kernel's buffers
#: between two sockets. (ASCII: texts of every kind are the hostile-data
#: probes' business, tests/operators/test_hostile_web.py.)
LONG_CAUSE = "a cause that goes on " * 16_000


async def _huge_machine(url: str) -> uuid.UUID:
    """A failed machine whose cause is `LONG_CAUSE`."""
    async with bmdb.open_connection(url) as conn:

        async def make(q: Queries) -> uuid.UUID:
            mid = await q.new_machine()
            await q.add_provided(mid, Provider.STATIC, "m-huge", "10.0.0.1")
            return mid

        mid = await conn.transact(make)
        async with conn.session("test-console-hostile", "pytest") as sess:

            async def source(q: Queries) -> list[uuid.UUID]:
                return [mid]

            work = await sess.work(Process.SHEPHERD_AGENT_START, source)
            await work.fail(LONG_CAUSE, Backoff(initial=3600))
        return mid


@dataclass
class Server(ServerProcess):
    """The console's process, and the machine whose page is large."""

    machine: uuid.UUID

    @property
    def huge_page(self) -> bytes:
        return f"/machine/{self.machine}".encode()


def start_console(url: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """``python -m console web`` on a free port, logging (-v) to ``log``."""
    with log.open("ab") as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "console", "--url", url, "-v", "web", "--listen", "127.0.0.1:0"],
            stdout=subprocess.PIPE,
            stderr=err,
            cwd=ROOT,
        )
    assert process.stdout is not None
    line = process.stdout.readline().decode().strip()
    assert line.startswith("serving on http://"), (line, log.read_text()[-2000:])
    return process, line.split()[-1]


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def server(module_bmdb_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    machine = trio.run(_huge_machine, module_bmdb_url)
    log = tmp_path_factory.mktemp("console") / "server.log"
    process, url = start_console(module_bmdb_url, log)
    try:
        running = Server(process, url, log, machine)
        assert_serves(running)  # once: the baseline of its memory
        yield running
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
        running.assert_no_errors()
    finally:
        stop(process)


def assert_serves(server: Server) -> None:
    """A page: 200, the whole document."""
    response = httpx.get(server.url + "/machines", timeout=60)
    assert response.status_code == 200, response
    assert response.text.rstrip().endswith("</html>")


def test_a_megabyte_request_line_is_refused(server: Server) -> None:
    before = server.rss()
    answer = raw(server.port, b"GET /" + b"a" * (1 << 20) + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    assert answer.startswith((b"HTTP/1.1 431 ", b"HTTP/1.1 414 ", b"HTTP/1.1 400 ")), answer[:200]
    assert_serves(server)
    assert server.rss() - before < MEMORY_BOUND


def test_a_thousand_idle_connections_keep_no_browser_out(server: Server) -> None:
    before = server.rss()
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(1000)]
    try:
        assert_serves(server)  # while they are open
        assert server.rss() - before < MEMORY_BOUND
        for sock in idle:  # each closed by the server: made room for others, or timed out
            sock.settimeout(GIVE_UP)
            assert sock.recv(100) == b""
    finally:
        for sock in idle:
            sock.close()
    assert_serves(server)


def test_a_slowloris_is_closed_before_its_head_is_complete(server: Server) -> None:
    head = b"GET /machines HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 2000 + b"\r\n\r\n"
    sent = 0
    answer = b""
    with socket.create_connection(("127.0.0.1", server.port), timeout=GIVE_UP) as sock:
        try:
            for byte in head:
                sock.sendall(bytes([byte]))
                sent += 1
                # One byte every 0.05 s: the head would take 100 s.
                sock.settimeout(0.05)
                with contextlib.suppress(TimeoutError):
                    answer += sock.recv(65536) or b"<closed>"
                if answer:
                    break
        except (BrokenPipeError, ConnectionResetError):
            answer = b"<reset>"
    assert sent < len(head), "the whole head went through"
    assert answer.startswith((b"HTTP/1.1 408 ", b"<closed>", b"<reset>")), answer[:200]
    assert_serves(server)


def _stalled_client(server: Server) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    request = b"GET " + server.huge_page + b" HTTP/1.1\r\nHost: x\r\n\r\n"
    sock.sendall(request * PIPELINED)
    return sock


def test_clients_that_read_nothing_are_cut_off(server: Server) -> None:
    size = len(httpx.get(server.url + server.huge_page.decode(), timeout=60).content)
    assert size > 512 * 1024
    before = server.rss()
    cuts = server.log.read_text().count("cut off")
    stalled = [_stalled_client(server) for _ in range(5)]
    try:
        assert_serves(server)  # while they hold their answers
        assert server.rss() - before < MEMORY_BOUND
        server.wait_for_log("cut off", cuts + len(stalled))
        for sock in stalled:  # the answers incomplete
            sock.settimeout(GIVE_UP)
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


@settings(HOSTILE, max_examples=60)
@given(
    data=requests(
        [b"/machines", b"/machines?state=%FF", b"/machine/x", b"*", b"/", b"/audit"],
        [b"Content-Length", b"Transfer-Encoding", b"Connection", b"Host"],
        [b"chunked", b"close", b"-1", b"3", b"\xff"],
    )
)
def test_arbitrary_requests_are_answered_or_closed(server: Server, data: bytes) -> None:
    if data.startswith(b"HEAD"):  # answers without a body: `exchange` cannot frame them
        raw(server.port, data)
    else:
        assert 500 not in statuses(exchange(server.port, data))
    assert server.process.poll() is None
    assert_serves(server)


def test_sigterm_ends_the_server_while_a_client_reads_nothing(
    module_bmdb_url: str, server: Server, tmp_path: Path
) -> None:
    """Clients hold their answers unread (the kernel's buffers full, the
    server's sends blocked): SIGTERM still ends the server at once, with
    its usual exit."""
    process, url = start_console(module_bmdb_url, tmp_path / "server.log")
    try:
        probe = Server(process, url, tmp_path / "server.log", server.machine)
        stalled = [_stalled_client(probe) for _ in range(3)]
        try:
            assert_serves(probe)
            time.sleep(0.5)  # their answers are under way, their windows shut
            process.send_signal(signal.SIGTERM)
            assert process.wait(30) == 0  # generous; hypercorn's never ended
        finally:
            for sock in stalled:
                sock.close()
        probe.assert_no_errors()
    finally:
        stop(process)
