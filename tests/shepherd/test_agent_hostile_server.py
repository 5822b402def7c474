"""The agent against a hostile agent callback server (`tests.shepherd.hostile_callback`).

Whatever a server answers a heartbeat with (huge, cut short, trickled,
of the wrong type, malformed protobuf, an installation request the agent
must refuse), the agent refuses it clearly, keeps its state (its session,
its pending hardware report, its install state), writes nothing but its
log and, for a well-formed request, its install state, and goes on
heartbeating. In process against `Heartbeater.beat` (fast, so Hypothesis
can search), and once with the real agent process.

The findings (each failed before its fix): an answer trickled a byte at a
time held a heartbeat for ever (``REQUEST_TIMEOUT`` bounded each read, not
the exchange); a ``200`` that was not ``application/proto`` (a proxy's
page) counted as accepted, so the hardware report was dropped unsent; a
server's error text went into the agent's log as it came, so it could
forge log lines.
"""

from __future__ import annotations

import http.client
import os
import re
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shepherd.agent import heartbeat, protocol, wire
from shepherd.agent.errors import AgentError
from shepherd.agent.heartbeat import MAX_ANSWER, Heartbeater
from shepherd.agent.installer import Installer
from shepherd.localfleet import agent_pid
from tests.shepherd.agent_install import encode_response, request
from tests.shepherd.agents import kill_agent, patched_agent, start_agent_process
from tests.shepherd.hostile_callback import (
    HostileServer,
    Received,
    hostile_server,
    huge,
    raw,
    reply,
    session_answer,
    trickle,
)

#: What `Heartbeater.run` catches from `beat` (then it backs off); anything
#: else would end the agent.
HANDLED = (OSError, http.client.HTTPException, AgentError)


@dataclass
class Agent:
    """An agent's heartbeat loop and installer in this process, beside a
    loopback disk, talking to a hostile server."""

    root: Path
    server: HostileServer
    hb: Heartbeater

    @property
    def installer(self) -> Installer:
        assert self.hb.installer is not None
        return self.hb.installer

    def files(self) -> dict[str, bytes]:
        """Every file under the machine's root, by relative path."""
        return {
            str(path.relative_to(self.root)): path.read_bytes()
            for path in sorted(self.root.rglob("*"))
            if path.is_file()
        }

    def beat(self) -> BaseException | None:
        """One heartbeat (in a thread, bounded generously); what it raised, if anything."""
        outcome: list[BaseException | None] = []

        def run() -> None:
            try:
                self.hb.beat()
            except BaseException as exc:  # the test's to judge
                outcome.append(exc)
            else:
                outcome.append(None)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(60)
        assert outcome, "the heartbeat did not end"
        return outcome[0]


@pytest.fixture(scope="module")
def server() -> Iterator[HostileServer]:
    with hostile_server() as running:
        yield running


def make_agent(root: Path, server: HostileServer) -> Agent:
    server.clear()
    (root / "disks" / "disk0").mkdir(parents=True)
    init = wire.TakeoverInit(str(uuid.uuid4()), server.endpoint)
    hb = Heartbeater(init, os.urandom(32), interval=0.1, backoff_cap=0.5)
    hb.report = (wire.HwNode(manufacturer="probe"), [])
    hb.installer = Installer(
        str(root / "agent"), endpoint_scheme="http", ca_certificate=b"", wake=hb.wake.set
    )
    return Agent(root, server, hb)


@pytest.fixture
def agent(tmp_path: Path, server: HostileServer) -> Agent:
    return make_agent(tmp_path / "machine", server)


def test_a_trickled_answer_is_given_up_within_the_request_timeout(
    agent: Agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(heartbeat, "REQUEST_TIMEOUT", 1.0)
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/proto\r\nContent-Length: 100000\r\n\r\n"
    for answer in (
        trickle(b"", pause=0.2, then=head),  # the status line and head, a byte at a time
        trickle(head, pause=0.2),  # the body
    ):
        agent.server.then(answer)
        failure = agent.beat()  # before the fix: 100000 reads of 0.2 s each
        assert isinstance(failure, HANDLED), failure
        assert agent.hb.report is not None  # not accepted: the report goes again
    assert agent.beat() is None  # the next answer is a good one


def test_an_answer_that_is_not_application_proto_is_a_failed_heartbeat(agent: Agent) -> None:
    for content_type in (b"text/html; charset=utf-8", b"application/json", b"application/proto2"):
        agent.server.then(reply(200, b"<html>welcome</html>", content_type=content_type))
        failure = agent.beat()
        assert isinstance(failure, AgentError), failure
        assert "application/proto" in str(failure)
        assert agent.hb.report is not None  # still to be sent
    agent.server.then(reply(200, b"", content_type=b"application/proto; charset=binary"))
    assert agent.beat() is None
    assert agent.hb.report is None  # accepted: sent


def test_a_servers_text_is_escaped_where_the_agent_logs_it(
    agent: Agent, capsys: pytest.CaptureFixture[str]
) -> None:
    forged = b"no\r\n2030-01-01T00:00:00Z agent: generation 9: installed\x1b[2J\xff"
    agent.server.then(reply(500, forged, content_type=b"text/plain"))
    failure = agent.beat()
    assert isinstance(failure, AgentError), failure
    assert str(failure).isprintable(), str(failure)  # what `run` logs
    # A session refused: logged at once, then signed again.
    agent.hb.session = wire.AgentSession(b"t" * 32, b"k" * 32, 3600)
    agent.hb.session_until = float("inf")
    agent.server.then(reply(401, forged, content_type=b"application/json"))
    assert agent.beat() is None
    lines = capsys.readouterr().err.splitlines()
    assert lines and all(re.fullmatch(r"\S+Z agent: \S.*", line) for line in lines), lines
    assert all(line.isprintable() for line in lines), lines
    assert not any(line.startswith("2030-") for line in lines), lines


def test_huge_and_cut_short_answers_are_refused_and_memory_stays_bounded(agent: Agent) -> None:
    before = agent.files()
    cases = [
        huge(64 * MAX_ANSWER),  # read up to the bound, then dropped
        raw(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort"),  # cut short
        raw(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nfffffffffffffffffff\r\n"),
        raw(b"HTTP/1.1 " + b"2" * (1 << 20) + b" OK\r\n\r\n"),  # a megabyte status line
        raw(b"HTTP/1.1 200 OK\r\n" + b"X-A: b\r\n" * 200 + b"\r\n"),  # too many headers
        raw(b"HTTP/1.1 200 OK\r\nX-A: " + b"b" * (1 << 17) + b"\r\n\r\n"),  # a header too long
        raw(b"SSH-2.0-OpenSSH_9.2\r\n"),  # not HTTP at all
        raw(b""),  # closed without a word
    ]
    for answer in cases:
        agent.server.then(answer)
        failure = agent.beat()
        assert failure is None or isinstance(failure, HANDLED), failure
        assert agent.hb.session is None
    assert agent.files() == before  # nothing written
    assert agent.beat() is None


def test_malformed_protobuf_answers_leave_the_session_and_the_install_state(agent: Agent) -> None:
    agent.server.then(reply(200, session_answer(token=b"T" * 32)))
    assert agent.beat() is None
    session = agent.hb.session
    assert session is not None and session.token == b"T" * 32
    before = agent.files()
    for body in (
        b"\xa2\x06\x03\x0a\x01",  # session (100) cut short
        b"\xa0\x06\x05",  # session as a varint
        b"\x0a\x02\x08",  # installation request cut short
        b"\x08\x01",  # installation request as a varint
        b"\x0a\x04\x12\x02\x18\x05",  # root_device (3) a varint
        b"\x0b\x0c",  # wire types 3 and 4 (groups)
        b"\x0a\x00\x0a\x00",  # the request twice
        b"\xff" * 11,  # a varint longer than 10 bytes
        encode_response(request(-3, host="h", digest="sha256:" + "a" * 64)),  # generation < 1
        encode_response(request(0, host="h", digest="sha256:" + "a" * 64)),
    ):
        agent.server.then(reply(200, body))
        assert agent.beat() is None, body  # the heartbeat itself was accepted
        assert agent.hb.session == session, body
        assert agent.installer.generation == 0, body
        agent.installer.join(30)
    assert agent.files() == before


@pytest.mark.parametrize(
    ("change", "cause"),
    [
        ({"root_device": "../../../etc"}, "is not one of this machine's loopback disks"),
        ({"root_device": "disk0/../../x"}, "is not one of this machine's loopback disks"),
        ({"digest": "sha256:" + "A" * 64}, "is not sha256:<64 lowercase hex>"),
        ({"digest": "sha256:" + "a" * 63}, "is not sha256:<64 lowercase hex>"),
        ({"digest": "sha256:../../../../etc/passwd"}, "is not sha256:<64 lowercase hex>"),
        ({"scheme": "file"}, "is neither https nor http"),
        ({"host": "evil/../x:1"}, "is not HOST[:PORT]"),
        ({"host": "127.0.0.1:99999"}, "port out of range"),
        ({"node_address": "a b"}, "is not an IP address or host name"),
        ({"node_parameters": None}, "holds no node_parameters"),
        ({"node_parameters": b"x" * (1024 * 1024 + 1)}, "over the bound of"),
    ],
)
def test_installation_requests_of_a_refused_shape_are_reported_and_write_nothing(
    tmp_path: Path, server: HostileServer, change: dict[str, object], cause: str
) -> None:
    agent = make_agent(tmp_path / "machine", server)
    fields: dict[str, object] = {
        "host": "127.0.0.1:9",
        "digest": "sha256:" + "a" * 64,
        "scheme": "http",
        "root_device": "disk0",
        "node_address": "127.0.0.2",
        "node_parameters": b"\x0a\x00",
        **change,
    }
    refused = encode_response(request(1, **fields))  # type: ignore[arg-type]
    server.then(reply(200, refused))
    assert agent.beat() is None
    agent.installer.join(60)
    count = len(server.requests)
    server.then(reply(200, refused))  # asked again: the report is due
    assert agent.beat() is None
    report = server.wait_for(count + 1).installation_report
    assert report is not None
    assert cause in wire_error(report), wire_error(report)
    assert sorted(agent.files()) == ["agent.install.json"]  # its own record only
    assert list((agent.root / "disks" / "disk0").iterdir()) == []


def wire_error(report: bytes) -> str:
    """The error cause of an OSInstallationReport's bytes ("" if none)."""
    for number, _, value in wire.iter_fields(report):
        if number == 3 and isinstance(value, bytes):
            for inner, _, text in wire.iter_fields(value):
                if inner == 1 and isinstance(text, bytes):
                    return text.decode()
    return ""


# --- Hypothesis: any answer ---------------------------------------------------


def _len_field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


#: Protobuf-shaped bodies: fields 1 (installation request) and 100 (session)
#: with random contents and wire types, and random bytes.
_field_keys = st.sampled_from([0x08, 0x0A, 0x0B, 0x0D, 0x09, 0xA0, 0xA2, 0xA5, 0x10, 0x12, 0x1A])
protobuf_like = st.recursive(
    st.binary(max_size=20),
    lambda inner: st.lists(
        st.one_of(
            st.tuples(st.sampled_from([1, 2, 3, 4, 100]), inner).map(lambda t: _len_field(*t)),
            st.tuples(_field_keys, st.binary(max_size=10)).map(lambda t: bytes([t[0]]) + t[1]),
        ),
        max_size=4,
    ).map(b"".join),
    max_leaves=12,
)
bodies = st.one_of(
    protobuf_like.map(lambda b: _len_field(1, b)),
    protobuf_like.map(lambda b: _len_field(100, b)),
    protobuf_like,
    st.binary(max_size=200),
)
statuses = st.sampled_from([200, 200, 200, 204, 301, 400, 401, 404, 500, 503, 100, 199, 999])
content_types = st.sampled_from(
    [b"application/proto", b"application/json", b"text/html", b"", b"application/proto\x00"]
)


@st.composite
def answers(draw: st.DrawFn) -> bytes:
    body = draw(bodies)
    status = draw(statuses)
    framing = draw(st.sampled_from(["length", "short", "long", "chunked", "none", "bad-length"]))
    head = b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\n" % (
        status,
        draw(st.sampled_from([b"OK", b"", b"\xff\xfe"])),
        draw(content_types),
    )
    if framing == "length":
        head += b"Content-Length: %d\r\n" % len(body)
    elif framing == "short":
        head += b"Content-Length: %d\r\n" % max(0, len(body) - 1)
    elif framing == "long":
        head += b"Content-Length: %d\r\n" % (len(body) + 5)
    elif framing == "bad-length":
        head += (
            b"Content-Length: " + draw(st.sampled_from([b"-1", b"\xb2", b"1e3", b"x"])) + b"\r\n"
        )
    elif framing == "chunked":
        head += b"Transfer-Encoding: chunked\r\n"
        body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body) if body else b"0\r\n\r\n"
    return head + b"\r\n" + body


@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(answer=answers())
def test_arbitrary_answers_are_refused_or_taken_and_the_agent_goes_on(
    tmp_path_factory: pytest.TempPathFactory, server: HostileServer, answer: bytes
) -> None:
    agent = make_agent(tmp_path_factory.mktemp("hyp") / "machine", server)
    before = agent.files()
    server.then(raw(answer))
    failure = agent.beat()
    assert failure is None or isinstance(failure, HANDLED), repr(failure)
    agent.installer.join(30)
    written = {k: v for k, v in agent.files().items() if before.get(k) != v}
    # Only a well-formed request's own record (its disk has no image: refused).
    assert set(written) <= {"agent.install.json"}, written
    assert list((agent.root / "disks" / "disk0").iterdir()) == []
    # The agent goes on: a good answer is taken.
    server.then(reply(200, b""))
    assert agent.beat() is None


# --- the real agent process ----------------------------------------------------

#: A log line of the agent's (`shepherd.agent.daemon.log`).
LOG_LINE = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ agent: \S.*")


def test_the_real_agent_goes_on_through_hostile_answers(
    tmp_path: Path, server: HostileServer
) -> None:
    """The uploaded agent (its exchange bound cut to 2 s, so that a trickled
    answer costs little) through one hostile answer of each kind: it stays
    up, heartbeats after each, keeps its key and its hardware report until
    an answer of ours takes it, writes nothing on its disk, reports the
    installation request it refuses, and its log holds only its own lines."""
    server.clear()
    root = tmp_path / "machine"
    target = root / "agent"
    (root / "disks" / "disk0").mkdir(parents=True)
    zipapp = patched_agent("heartbeat.py", b"REQUEST_TIMEOUT = 15.0", b"REQUEST_TIMEOUT = 2.0")
    refused = encode_response(
        request(1, host="127.0.0.1:9", digest="sha256:" + "a" * 64, root_device="../../etc")
    )
    trickled = b"HTTP/1.1 200 OK\r\nContent-Type: application/proto\r\nContent-Length: 99\r\n\r\n"
    forged = b"no\n2030-01-01T00:00:00Z agent: generation 9: installed\x1b[2J"
    first = len(server.requests) + 1
    server.then(
        reply(200, b"<html>sign in</html>", content_type=b"text/html"),
        raw(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort"),
        huge(8 * MAX_ANSWER),
        reply(200, b"\x08\x01"),  # the installation request as a varint
        trickle(trickled, pause=0.3),
        reply(500, forged, content_type=b"text/plain"),
        *[reply(200, refused)] * 30,
    )
    try:
        start_agent_process(
            target, str(uuid.uuid4()), server.endpoint, interval=0.2, cap=1.0, zipapp=zipapp
        )
        key = target.with_name("agent.key").read_bytes()
        # The hardware report goes again after the page that was not an answer.
        assert has_hardware_report(server.wait_for(first))
        assert has_hardware_report(server.wait_for(first + 1))
        # Through every hostile answer, to the report of the refused request.
        index = first
        while True:
            received = server.wait_for(index)
            report = received.installation_report
            if report is not None:
                break
            index += 1
        assert "root device '../../etc' is not one of" in wire_error(report), wire_error(report)
        assert agent_pid(target) is not None  # still up
        assert target.with_name("agent.key").read_bytes() == key
        assert list((root / "disks" / "disk0").iterdir()) == []
        log = target.with_name("agent.log").read_text()
        lines = log.splitlines()
        assert all(LOG_LINE.fullmatch(line) for line in lines), log
        assert "2030-01-01" not in "".join(line[:10] for line in lines), log
        assert "not application/proto" in log and "backing off" in log, log
    finally:
        kill_agent(target)


def has_hardware_report(received: Received) -> bool:
    return any(number == 2 for number, _, _ in wire.iter_fields(received.body))


def test_a_session_token_or_key_over_its_bound_is_refused_and_heartbeats_stay_signed(
    agent: Agent, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before the bound, an agent took a token of any size and sent it back
    in a header of every request: a megabyte's head, refused by every server."""
    for answer, says in (
        (session_answer(token=b"T" * (protocol.MAX_SESSION_TOKEN + 1)), "session token of 1025"),
        (session_answer(token=b"T" * (1 << 20)), "session token of 1048576 bytes"),
        (session_answer(key=b"K" * (protocol.MAX_SESSION_KEY + 1)), "session key of 65 bytes"),
    ):
        agent.server.then(reply(200, answer))
        assert agent.beat() is None  # the heartbeat itself was accepted
        assert agent.hb.session is None
        assert says in capsys.readouterr().err
        count = len(agent.server.requests)
        agent.server.then(reply(200, b""))
        assert agent.beat() is None
        sent = agent.server.wait_for(count + 1)
        assert sent.header(protocol.HEADER_SESSION) is None
        assert sent.header(protocol.HEADER_SIGNATURE) is not None
    # At the bounds: taken, and sent back.
    token, key = b"T" * protocol.MAX_SESSION_TOKEN, b"K" * protocol.MAX_SESSION_KEY
    agent.server.then(reply(200, session_answer(token=token, key=key)))
    assert agent.beat() is None
    assert agent.hb.session is not None and agent.hb.session.token == token
    count = len(agent.server.requests)
    agent.server.then(reply(200, b""))
    assert agent.beat() is None
    assert agent.server.wait_for(count + 1).header(protocol.HEADER_SESSION) is not None


def test_the_agent_frames_every_request_with_a_content_length(agent: Agent) -> None:
    """What lets the callback server refuse chunked bodies
    (`shepherd.agent_server.http1`): the agent's requests, signed or with a
    session, with a hardware report or without, carry a Content-Length that
    is their body's length, and no Transfer-Encoding."""
    agent.server.then(reply(200, session_answer()), reply(200, b""))
    assert agent.beat() is None  # signed, with the report
    assert agent.beat() is None  # with the session, no report
    for sent in agent.server.wait_for(1), agent.server.wait_for(2):
        assert sent.header("Transfer-Encoding") is None
        assert sent.header("Content-Length") == str(len(sent.body)), sent.head
    assert agent.server.requests[1].header(protocol.HEADER_SESSION) is not None
