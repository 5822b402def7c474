"""Hostile bytes against the agent callback server, over real sockets.

Whatever one connection sends, the server answers it with a valid HTTP
status or closes it, never with a 500 (which would mean an exception
nobody expected), and goes on serving a good client afterwards: checked
with Hypothesis against `serve_http1` and against the real heartbeat
service, and once against the real multi-process server
(``python -m shepherd.agent_server``). The regression tests are the
reported findings: a Content-Length of a non-ASCII digit (``0xB2``, ``²``)
ended the server; an agent time of ``¹`` was a 500 with a traceback; two
differing Content-Length headers were taken (the last one).
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import cast

import httpx
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bmdb
from common.listen import split_listen
from common.net import free_loopback_port
from common.tcp import open_listener
from shepherd.agent import protocol as agent
from shepherd.agent_server import AgentServerConfig, ConnectUnary, Limits, http1, run_agent_server
from shepherd.agent_server.connect import Handler
from shepherd.agent_server.http1 import Timeouts, serve_http1
from shepherd.agent_server.server import port_of
from tests.shepherd.test_agent_server import heartbeater, started_machine

PATH = agent.HEARTBEAT_PATH
LIMITS = Limits(max_body=4096, body_timeout=5.0, max_head=4096)


# --- a server in a thread of its own, for blocking clients and Hypothesis ---


@dataclass
class ThreadServer:
    """A Trio server running in its own thread (and Trio run) until stopped."""

    port: int
    #: What the server's setup handed back beside the port.
    extra: object
    thread: threading.Thread
    token: trio.lowlevel.TrioToken
    scope: trio.CancelScope
    #: An exception that ended the server's run, if one did.
    crashed: list[BaseException] = field(default_factory=list)

    def alive(self) -> bool:
        return self.thread.is_alive() and not self.crashed


Serve = Callable[[trio.TaskStatus[tuple[int, object]]], Awaitable[None]]


@contextlib.contextmanager
def thread_server(serve: Serve) -> Iterator[ThreadServer]:
    """Run ``serve`` (which reports (port, extra) to its task status) in a thread."""
    started: queue.Queue[tuple[int, object, trio.lowlevel.TrioToken, trio.CancelScope]] = (
        queue.Queue()
    )
    crashed: list[BaseException] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            port, extra = await nursery.start(serve)
            started.put((port, extra, trio.lowlevel.current_trio_token(), nursery.cancel_scope))

    def run() -> None:
        try:
            trio.run(main)
        except BaseException as exc:  # the test's to report
            crashed.append(exc)
            started.put((0, None, None, None))  # type: ignore[arg-type]

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    port, extra, token, scope = started.get(timeout=60)
    if crashed:
        raise RuntimeError("server did not start") from crashed[0]
    server = ThreadServer(port, extra, thread, token, scope, crashed)
    try:
        yield server
    finally:
        if thread.is_alive():
            trio.from_thread.run_sync(scope.cancel, trio_token=token)
        thread.join(30)


async def _echo(headers: Mapping[str, str], body: bytes) -> bytes:
    return body


def _bare(app: ConnectUnary) -> Serve:
    """Serve ``app`` with `serve_http1` on a free loopback port."""

    async def serve(task_status: trio.TaskStatus[tuple[int, object]]) -> None:
        listener = await open_listener("127.0.0.1", 0, backlog=128, nodelay=True)
        async with trio.open_nursery() as nursery:
            await nursery.start(
                lambda task_status: serve_http1(
                    app,
                    [listener],
                    timeouts=Timeouts(keep_alive=5.0, send=5.0),
                    task_status=task_status,
                )
            )
            task_status.started((listener.socket.getsockname()[1], None))

    return serve


@pytest.fixture(scope="module")
def echo_server() -> Iterator[ThreadServer]:
    with thread_server(_bare(ConnectUnary({PATH: _echo}, LIMITS))) as server:
        yield server


# --- a blocking client that checks what comes back ---------------------------

_STATUS_LINE = re.compile(rb"HTTP/1\.1 ([1-5][0-9][0-9]) [\x20-\x7e]*")
_LENGTH = re.compile(rb"(?im)^content-length: *([0-9]+)\r?$")


@dataclass
class Answer:
    status: int
    head: bytes
    body: bytes


def exchange(port: int, data: bytes) -> list[Answer]:
    """Send ``data`` on a new connection, close our side, read until the
    server closes; its answers, each checked to be well-formed HTTP/1.1.

    A reset (the server closed with bytes of ours unread) may cut the last
    answer short: then the complete ones are returned.
    """
    received = b""
    reset = False
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            reset = True
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionResetError:
            reset = True
    answers: list[Answer] = []
    while received:
        head, sep, rest = received.partition(b"\r\n\r\n")
        if not sep and reset:
            break
        assert sep, f"incomplete answer head: {received[:300]!r}"
        match = _STATUS_LINE.fullmatch(head.split(b"\r\n", 1)[0])
        assert match is not None, f"not an HTTP/1.1 status line: {head[:300]!r}"
        status = int(match[1])
        if status == 100:
            answers.append(Answer(status, head, b""))
            received = rest
            continue
        length = _LENGTH.search(head)
        assert length is not None, f"answer without Content-Length: {head[:300]!r}"
        size = int(length[1])
        if len(rest) < size and reset:
            break
        assert len(rest) >= size, f"answer body cut short: {head[:300]!r}"
        answers.append(Answer(status, head, rest[:size]))
        received = rest[size:]
    return answers


def request(
    headers: list[tuple[bytes, bytes]], body: bytes = b"", *, line: bytes = b"POST " + PATH.encode()
) -> bytes:
    head = (
        line + b" HTTP/1.1\r\nHost: x\r\n" + b"".join(n + b": " + v + b"\r\n" for n, v in headers)
    )
    return head + b"\r\n" + body


def good_request(body: bytes) -> bytes:
    return request(
        [(b"Content-Type", b"application/proto"), (b"Content-Length", b"%d" % len(body))], body
    )


def assert_serves(server: ThreadServer) -> None:
    """The server is up and answers a good request as it should."""
    assert server.alive(), server.crashed
    (answer,) = exchange(server.port, good_request(b"ping"))
    assert (answer.status, answer.body) == (200, b"ping"), answer


def statuses(answers: list[Answer]) -> list[int]:
    return [a.status for a in answers if a.status != 100]


# --- the findings ------------------------------------------------------------


def test_pipelined_requests_to_a_handler_that_never_waits_let_others_run() -> None:
    """A connection reads and writes its socket directly, waiting only when
    it would block: requests that are all there already are each followed
    by a checkpoint, so that one client cannot hold the server's loop."""
    ticks = [0]
    seen: list[int] = []

    async def handler(headers: Mapping[str, str], body: bytes) -> bytes:
        seen.append(ticks[0])
        return body

    async def serve(task_status: trio.TaskStatus[tuple[int, object]]) -> None:
        async def ticker() -> None:
            while True:
                await trio.lowlevel.checkpoint()
                ticks[0] += 1

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            task_status.started(await nursery.start(_bare(ConnectUnary({PATH: handler}, LIMITS))))

    with thread_server(serve) as server:
        answers = exchange(server.port, good_request(b"x") * 200)
    assert statuses(answers) == [200] * 200
    # Without a checkpoint between them, the requests of one read share a tick
    # (1 distinct tick here without it; 149 to 200 with it).
    assert len(set(seen)) > 100, seen


def test_non_ascii_digit_content_length_is_a_400_and_the_server_goes_on(
    echo_server: ThreadServer,
) -> None:
    for length in (b"\xb2", "²".encode(), "٣".encode(), b"+4", b" 4_0", b"4, 4"):
        headers = [(b"Content-Type", b"application/proto"), (b"Content-Length", length)]
        answers = exchange(echo_server.port, request(headers, b"ping"))
        assert statuses(answers) == [400], (length, answers)
        assert b"connection: close" in answers[-1].head.lower()
        assert_serves(echo_server)


def test_differing_content_lengths_are_a_400(echo_server: ThreadServer) -> None:
    """RFC 9112 6.3: a proxy reading the first and this server the last
    would disagree on where the next request starts."""
    for first, second in ((b"4", b"5"), (b"5", b"4"), (b"4", b"04x")):
        headers = [
            (b"Content-Type", b"application/proto"),
            (b"Content-Length", first),
            (b"Content-Length", second),
        ]
        answers = exchange(echo_server.port, request(headers, b"pingX"))
        assert statuses(answers) == [400], (first, second, answers)
    # The same length twice too: llhttp refuses any repeated Content-Length
    # (RFC 9112 6.3 lets a recipient refuse it or take the one value).
    headers = [(b"Content-Type", b"application/proto"), (b"Content-Length", b"4")] * 2
    answers = exchange(echo_server.port, request(headers, b"ping"))
    assert statuses(answers) == [400], answers
    assert b"connection: close" in answers[-1].head.lower()
    # A second Transfer-Encoding would be a second coding.
    headers = [(b"Content-Type", b"application/proto")] + [(b"Transfer-Encoding", b"chunked")] * 2
    assert statuses(exchange(echo_server.port, request(headers, b"4\r\nping\r\n0\r\n\r\n"))) == [
        400
    ]


def test_control_characters_in_the_head_are_a_400(echo_server: ThreadServer) -> None:
    """A bare LF or CR inside a line is a line end to some parsers and not to
    others; NUL and other controls have no business in a head."""
    for value in (b"a\nContent-Length: 4", b"a\rb", b"a\x00b", b"\x7f", b"\x1b[0m"):
        headers = [(b"Content-Type", b"application/proto"), (b"X-Note", value)]
        answers = exchange(echo_server.port, request(headers))
        assert statuses(answers) == [400], (value, answers)
    for name in (b"X Note", b"X-Note\xb2", b"(x)"):
        answers = exchange(echo_server.port, request([(name, b"1")]))
        assert statuses(answers) == [400], (name, answers)


class _Buggy(ConnectUnary):
    """An app with a bug that a header reaches (a stand-in for any bug)."""

    def check(self, method: str, path: str, headers: Mapping[str, str]) -> Handler:
        if "x-bug" in headers:
            raise RuntimeError("bug reached")
        return super().check(method, path, headers)


def test_an_unexpected_exception_ends_only_its_connection(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The class of the first finding: whatever escapes one connection's
    handling is logged, answered 500 and that connection closed; the
    server, and a connection open beside it, go on."""
    with thread_server(_bare(_Buggy({PATH: _echo}, LIMITS))) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as beside:
            with caplog.at_level(logging.DEBUG, logger="shepherd.agent_server.http1"):
                answers = exchange(server.port, request([(b"X-Bug", b"1")]))
            assert statuses(answers) == [500]
            assert b"connection: close" in answers[0].head.lower()
            warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
            assert len(warnings) == 1 and "bug reached" in warnings[0].getMessage()
            assert warnings[0].exc_info is None
            debug = [r for r in caplog.records if r.levelno == logging.DEBUG and r.exc_info]
            assert len(debug) == 1
            assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
            # The connection opened before is still served.
            beside.sendall(good_request(b"ping"))
            assert beside.recv(65536).startswith(b"HTTP/1.1 200 OK\r\n")
        assert_serves(server)


def test_ports_are_ascii_digits() -> None:
    assert split_listen("[::1]:8443") == ("::1", 8443)
    assert split_listen("127.0.0.1:0") == ("127.0.0.1", 0)
    for listen in ("h:٣", "h:²", "h:+1", "h: 1", "h:", "h", "h:65536", "h:123456"):
        with pytest.raises(ValueError, match="want HOST:PORT"):
            split_listen(listen)
    assert port_of("http://127.0.0.1:41234") == 41234
    with pytest.raises(ValueError):
        port_of("http://127.0.0.1:٤١")


# --- Hypothesis against serve_http1 ------------------------------------------

#: Digits other than ASCII 0-9, in Latin-1 (as the server decodes heads) and UTF-8.
_NON_ASCII_DIGITS = [b"\xb2", b"\xb9", b"1\xb3", "²".encode(), "¹".encode(), "٣".encode()]
_TRICKY_VALUES = [
    b"4\x00",
    b"\x00",
    b"\x01\x02",
    b"\xff\xfe",
    b"chunked",
    b"gzip, chunked",
    b"100-continue",
    b"close",
    b"keep-alive",
    b"application/proto",
    b"0",
    b"4",
    b"04",
    b" 4",
    b"+4",
    b"-1",
    b"4_0",
    b"0x4",
    b"4, 4",
    b"9" * 30,
    b"a" * 5000,
]
_NAMES = [
    b"Content-Length",
    b"content-length",
    b"Transfer-Encoding",
    b"Expect",
    b"Connection",
    b"Content-Type",
    b"Content-Encoding",
    b"Host",
    agent.HEADER_TIME.encode(),
]
names = st.one_of(st.sampled_from(_NAMES), st.binary(min_size=1, max_size=20))
values = st.one_of(
    st.sampled_from(_NON_ASCII_DIGITS), st.sampled_from(_TRICKY_VALUES), st.binary(max_size=40)
)
hostile_headers = st.lists(st.tuples(names, values), max_size=8)

HOSTILE = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@HOSTILE
@given(
    data=st.one_of(
        st.binary(max_size=1500),
        st.binary(max_size=600).map(lambda b: b"POST " + PATH.encode() + b" HTTP/1.1\r\n" + b),
        st.lists(st.sampled_from([b"\r\n", b"\n", b"\r", b":", b" ", b"0", b"\x00"]))
        .map(b"".join)
        .map(lambda b: b"POST / HTTP/1.1\r\nHost: x\r\n" + b),
    )
)
def test_arbitrary_bytes_are_answered_or_closed(echo_server: ThreadServer, data: bytes) -> None:
    assert 500 not in statuses(exchange(echo_server.port, data))
    assert_serves(echo_server)


@HOSTILE
@given(
    headers=hostile_headers,
    body=st.binary(max_size=64),
    line=st.sampled_from([b"POST " + PATH.encode(), b"GET " + PATH.encode(), b"POST /x?y"]),
    chunked=st.booleans(),
)
def test_requests_with_hostile_headers_are_answered_or_closed(
    echo_server: ThreadServer,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
    line: bytes,
    chunked: bool,
) -> None:
    if chunked and body:
        body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    answers = exchange(echo_server.port, request(headers, body, line=line))
    assert 500 not in statuses(answers)
    assert_serves(echo_server)


# --- Hypothesis against the real heartbeat service --------------------------

_AGENT_HEADERS = [
    agent.HEADER_TIME,
    agent.HEADER_SESSION,
    agent.HEADER_MAC,
    agent.HEADER_KEY,
    agent.HEADER_SIGNATURE,
    "Content-Length",
    "Content-Type",
]


@pytest.fixture
def heartbeat_server(bmdb_url: str) -> Iterator[ThreadServer]:
    config = AgentServerConfig(listen="127.0.0.1:0", limits=LIMITS)

    async def serve(task_status: trio.TaskStatus[tuple[int, object]]) -> None:
        async with bmdb.open_connection(bmdb_url) as conn:
            machine = await started_machine(conn)
            async with trio.open_nursery() as nursery:
                binds = await nursery.start(
                    lambda task_status: run_agent_server(conn, config, task_status=task_status)
                )
                task_status.started((port_of(binds[0]), machine))

    with thread_server(serve) as server:
        yield server


@HOSTILE
@given(
    replaced=st.lists(
        st.tuples(st.sampled_from(_AGENT_HEADERS), values, st.booleans()), min_size=1, max_size=3
    ),
    with_session=st.booleans(),
)
def test_heartbeats_with_hostile_headers_are_answered_cleanly(
    heartbeat_server: ThreadServer,
    caplog: pytest.LogCaptureFixture,
    replaced: list[tuple[str, bytes, bool]],
    with_session: bool,
) -> None:
    """A real agent's request (signed, or with a session) with headers
    replaced or repeated by hostile values: refused with a 4xx, or accepted
    if what was replaced is not needed (a MAC header beside a signature),
    never a 500 or an ERROR logged; the agent's next heartbeat is accepted."""
    mid, seed = cast(tuple[uuid.UUID, bytes], heartbeat_server.extra)
    hb = heartbeater(f"http://127.0.0.1:{heartbeat_server.port}", str(mid), seed, report=False)
    if with_session:
        hb.beat()
    body, headers = hb.request()
    wire = {name.lower(): (name.encode(), value.encode()) for name, value in headers.items()}
    wire["content-length"] = (b"Content-Length", b"%d" % len(body))
    extra: list[tuple[bytes, bytes]] = []
    for name, value, repeat in replaced:
        if repeat:
            extra.append((name.encode(), value))
        else:
            wire[name.lower()] = (name.encode(), value)
    answers = exchange(heartbeat_server.port, request([*wire.values(), *extra], body))
    assert all(s == 200 or 400 <= s < 500 for s in statuses(answers)), answers
    with caplog.at_level(logging.WARNING):
        hb.beat()  # raises unless 200
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert heartbeat_server.alive()


async def test_superscript_time_header_is_unauthenticated_without_a_traceback(
    bmdb_conn: bmdb.Connection, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    config = AgentServerConfig(listen="127.0.0.1:0", limits=LIMITS)
    binds = await nursery.start(
        lambda task_status: run_agent_server(bmdb_conn, config, task_status=task_status)
    )
    port = port_of(binds[0])
    mid, seed = await started_machine(bmdb_conn)
    hb = heartbeater(f"http://127.0.0.1:{port}", str(mid), seed, report=False)
    for time_value in (b"\xb9", "¹".encode(), b"\xb2" * 3, "١٢٣".encode(), b"1" * 20):
        body, headers = hb.request()
        wire = [(name.encode(), value.encode()) for name, value in headers.items()]
        wire = [(n, time_value if n == agent.HEADER_TIME.encode() else v) for n, v in wire]
        wire.append((b"Content-Length", b"%d" % len(body)))
        answers = await trio.to_thread.run_sync(exchange, port, request(wire, body))
        assert [(a.status, json.loads(a.body)) for a in answers] == [
            (
                401,
                {"code": "unauthenticated", "message": f"{agent.HEADER_TIME} missing or malformed"},
            )
        ], time_value
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


# --- the real server process --------------------------------------------------


async def test_real_server_survives_a_non_ascii_content_length(
    bmdb_conn: bmdb.Connection, bmdb_url: str
) -> None:
    """``python -m shepherd.agent_server --workers 1`` (one process, which
    serves itself): after the request that ended it before, the same
    process answers the next heartbeat."""
    mid, seed = await started_machine(bmdb_conn)
    port = free_loopback_port()
    url = f"http://127.0.0.1:{port}"
    server = await trio.lowlevel.open_process(
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
            "1",
        ],
        stderr=subprocess.DEVNULL,
    )
    hb = heartbeater(url, str(mid), seed, report=False)

    async def beat() -> int:
        body, headers = hb.request()
        async with httpx.AsyncClient() as client:
            response = await client.post(url + PATH, content=body, headers=headers)
        if response.status_code == 200:
            hb.accepted(response.content)
        return response.status_code

    try:
        with trio.fail_after(120):
            while True:
                try:
                    assert await beat() == 200
                    break
                except httpx.TransportError:
                    await trio.sleep(0.2)
            bad = request(
                [(b"Content-Type", b"application/proto"), (b"Content-Length", b"\xb2")], b"x"
            )
            answers = await trio.to_thread.run_sync(exchange, port, bad)
            assert statuses(answers) == [400]
            assert await beat() == 200
            assert server.returncode is None  # the same process, still up
        server.send_signal(signal.SIGTERM)
        with trio.fail_after(60):
            assert await server.wait() == 0
    finally:
        if server.returncode is None:
            server.kill()
            await server.wait()


# --- llhttp's edge cases: each a clear 400, the connection closed -----------

_TOKENS = st.text(alphabet="abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=12).map(
    lambda t: b"X-" + t.encode()
)
_VALUES = st.text(alphabet=" !#$%&'()*+,-./0123456789:;<=>?@ABCDEFGHIJKLMNOPQRSTUVWXYZ[]^_`az{|}~",
                  max_size=20).map(lambda t: t.strip().encode())  # fmt: skip
_DIGITS = st.integers(0, 4096).map(lambda n: b"%d" % n)
benign_lines = st.lists(st.tuples(_TOKENS, _VALUES).map(lambda h: h[0] + b": " + h[1] + b"\r\n"),
                        max_size=4).map(b"".join)  # fmt: skip


def _with_byte(value: bytes, byte: bytes, at: int) -> bytes:
    at %= len(value) + 1
    return value[:at] + byte + value[at:]


#: Header lines (CRLF-terminated) that llhttp refuses, by kind.
edge_cases = st.one_of(
    # obs-fold: a line continued by one starting with a space or tab.
    st.tuples(_TOKENS, _VALUES, st.sampled_from([b" ", b"\t"]), _VALUES).map(
        lambda t: t[0] + b": " + t[1] + b"\r\n" + t[2] + t[3] + b"\r\n"
    ),
    # A bare LF or CR inside or at the end of a line.
    st.tuples(_TOKENS, _VALUES, st.sampled_from([b"\n", b"\r"]), st.integers(0, 40)).map(
        lambda t: t[0] + b": " + _with_byte(t[1] + b"a", t[2], t[3]) + b"\r\n"
    ),
    st.tuples(_TOKENS, _VALUES).map(lambda t: t[0] + b": " + t[1] + b"\n"),
    # Content-Length twice, with the same value or another.
    st.tuples(_DIGITS, _DIGITS, st.booleans()).map(
        lambda t: b"Content-Length: %s\r\nContent-Length: %s\r\n" % (t[0], t[0] if t[2] else t[1])
    ),
    # A Content-Length of more digits than any body the server takes, or than 64 bits.
    st.integers(13, 40).flatmap(
        lambda n: st.text(alphabet="0123456789", min_size=n, max_size=n).map(
            lambda d: b"Content-Length: 9" + d.encode() + b"\r\n"
        )
    ),
    # Transfer-Encoding with Content-Length, in either order.
    st.tuples(_DIGITS, st.booleans()).map(
        lambda t: (
            (b"Transfer-Encoding: chunked\r\nContent-Length: %s\r\n" % t[0])
            if t[1]
            else (b"Content-Length: %s\r\nTransfer-Encoding: chunked\r\n" % t[0])
        )
    ),
    # A NUL in a name or in a value.
    st.tuples(_TOKENS, _VALUES, st.integers(0, 40), st.booleans()).map(
        lambda t: (
            (_with_byte(t[0], b"\x00", t[2]) + b": " + t[1] + b"\r\n")
            if t[3]
            else (t[0] + b": " + _with_byte(t[1], b"\x00", t[2]) + b"\r\n")
        )
    ),
)


@HOSTILE
@given(
    edge=edge_cases,
    before=benign_lines,
    after=benign_lines,
    body=st.binary(max_size=64),
    pipelined=st.booleans(),
)
def test_llhttp_edge_cases_are_a_clear_400_and_the_connection_closed(
    echo_server: ThreadServer,
    edge: bytes,
    before: bytes,
    after: bytes,
    body: bytes,
    pipelined: bool,
) -> None:
    """obs-fold, bare LF and CR, repeated and huge Content-Length,
    Transfer-Encoding with Content-Length, NUL: refused with a 400 whose
    body says why, the connection closed after it (a good request
    pipelined before it answered first), and the server serves on."""
    bad = (
        b"POST " + PATH.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/proto\r\n"
        + before + edge + after + b"\r\n" + body
    )  # fmt: skip
    good = good_request(b"ping")
    answers = exchange(echo_server.port, good + bad if pipelined else bad)
    expected = [200, 400] if pipelined else [400]
    assert statuses(answers) == expected, (edge, answers)
    last = answers[-1]
    assert b"connection: close" in last.head.lower()
    assert json.loads(last.body)["code"] == "invalid_argument", last.body
    assert_serves(echo_server)


def _connection() -> http1._Connection:
    """A connection of `serve_http1`'s, fed by hand (no socket)."""
    server = http1._Server(ConnectUnary({PATH: _echo}, LIMITS), None, Timeouts())
    return http1._Connection(server, trio.testing.MemoryReceiveStream())  # type: ignore[arg-type]


def _refused_with(connection: http1._Connection) -> int:
    failure = connection.failure
    assert isinstance(failure, http1._Close) and failure.answer is not None, failure
    return failure.answer[0]


def test_a_head_over_the_limit_across_reads_is_a_431() -> None:
    """A header value that never ends, a read at a time: refused once the
    reads after the first pass ``max_head`` (llhttp itself bounds no head,
    and httptools gathers a value's pieces until it ends)."""
    connection = _connection()
    connection.feed(b"POST " + PATH.encode() + b" HTTP/1.1\r\nX-Long: ")
    piece = b"a" * 1000
    for _ in range(LIMITS.max_head // len(piece)):
        connection.feed(piece)
        assert connection.failure is None
    connection.feed(piece)
    assert _refused_with(connection) == 431
    assert not connection.ready


def test_a_head_over_the_limit_in_one_read_is_a_431(echo_server: ThreadServer) -> None:
    padding = [(b"X-Pad%d" % i, b"p" * 1000) for i in range(LIMITS.max_head // 1000)]
    answers = exchange(echo_server.port, request(padding))
    assert statuses(answers) == [431]
    assert b"connection: close" in answers[0].head.lower()


def test_chunked_bodies_are_refused_before_their_framing_is_read(
    echo_server: ThreadServer,
) -> None:
    """No chunked body is taken (`shepherd.agent_server.http1`, "Chunked
    bodies"): 411 at the end of the head, whatever framing, trailers or
    bytes follow (they are never parsed), the connection closed; other
    codings are a 400. A request before it on the connection is answered."""
    chunked = request([(b"Content-Type", b"application/proto"), (b"Transfer-Encoding", b"chunked")])
    for framing in (
        b"4\r\nping\r\n0\r\n\r\n",  # well formed
        b"4\n\r\nping\r\n0\r\n\r\n",  # a bare LF in the framing
        b"4\r\nping\r\n0\r\nX-Trailer: " + b"t" * 1000,  # trailers that do not end
        b"fffffffffffffffffff\r\n",  # a chunk size over 64 bits
        b"",
    ):
        answers = exchange(echo_server.port, chunked + framing)
        assert statuses(answers) == [411], (framing[:40], answers)
        assert b"connection: close" in answers[0].head.lower()
        assert json.loads(answers[0].body)["code"] == "invalid_argument"
    for coding in (b"Chunked", b"CHUNKED"):
        headers = [(b"Content-Type", b"application/proto"), (b"Transfer-Encoding", coding)]
        assert statuses(exchange(echo_server.port, request(headers, b"0\r\n\r\n"))) == [411]
    for coding in (b"gzip", b"gzip, chunked", b"identity"):
        headers = [(b"Content-Type", b"application/proto"), (b"Transfer-Encoding", coding)]
        answers = exchange(echo_server.port, request(headers, b"0\r\n\r\n"))
        assert statuses(answers) == [400], (coding, answers)
    answers = exchange(echo_server.port, good_request(b"ping") + chunked + b"0\r\n\r\n")
    assert statuses(answers) == [200, 411]
    assert_serves(echo_server)


def test_too_many_header_lines_are_a_431(echo_server: ThreadServer) -> None:
    framing = [(b"Content-Type", b"application/proto"), (b"Content-Length", b"0")]
    lines = [(b"X-N%d" % i, b"1") for i in range(LIMITS.max_headers - 3)]
    answers = exchange(echo_server.port, request(lines + framing))  # with Host: the limit
    assert statuses(answers) == [200]
    answers = exchange(echo_server.port, request([*lines, (b"X-One-More", b"1"), *framing]))
    assert statuses(answers) == [431]


def test_pipelined_answers_keep_their_order_up_to_a_refusal(echo_server: ThreadServer) -> None:
    """Requests parsed in one read are answered in order; a malformed one
    after them is answered last, and ends the connection."""
    good = [good_request(b"%d" % i) for i in range(5)]
    answers = exchange(echo_server.port, b"".join(good) + b"POST / HTTP/1.1\r\nX: a\x00\r\n\r\n")
    assert [(a.status, a.body) for a in answers[:5]] == [(200, b"%d" % i) for i in range(5)]
    assert statuses(answers[5:]) == [400]


def test_expect_100_continue_is_answered_before_the_body(echo_server: ThreadServer) -> None:
    with socket.create_connection(("127.0.0.1", echo_server.port), timeout=30) as sock:
        sock.sendall(
            request(
                [
                    (b"Content-Type", b"application/proto"),
                    (b"Content-Length", b"4"),
                    (b"Expect", b"100-continue"),
                ]
            )
        )
        interim = b""
        while b"\r\n\r\n" not in interim:
            interim += sock.recv(65536)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(b"ping")
        answer = b""
        while not answer.endswith(b"ping"):
            answer += sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
