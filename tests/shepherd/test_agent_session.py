"""Agent sessions over a real server: one signature, then MACed heartbeats.

A signed heartbeat the server accepts is answered with a session; the
agent's later heartbeats carry its token and a MAC instead of a signature
and are written like signed ones. Everything that would let someone else
use a session is refused with nothing written, and an agent whose session
the server no longer knows (a restart: a new secret) signs again by itself.
"""

from __future__ import annotations

import datetime
import hmac
import json
import math
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

import bmdb
from bmdb import Queries
from shepherd.agent import ed25519, heartbeat, protocol, wire
from shepherd.agent_server import AgentServerConfig, run_agent_server
from shepherd.agent_server.server import port_of
from shepherd.agent_server.session import SessionKeys, new_secret, session_mac
from shepherd.proto.agent_callback import HeartbeatResponse
from tests.shepherd.test_agent_server import heartbeater, started_machine

SECRET = new_secret()


@dataclass
class Server:
    url: str
    conn: bmdb.Connection


async def _serve(
    conn: bmdb.Connection, nursery: trio.Nursery, listen: str = "127.0.0.1:0", **config: object
) -> tuple[str, trio.CancelScope]:
    """A server in ``nursery``; its URL and the scope that stops it."""
    scope = trio.CancelScope()
    settings = AgentServerConfig(listen=listen, **config)  # type: ignore[arg-type]

    async def serve(task_status: trio.TaskStatus[list[str]]) -> None:
        with scope:
            await run_agent_server(conn, settings, task_status=task_status)

    binds = await nursery.start(serve)
    return f"http://127.0.0.1:{port_of(binds[0])}", scope


@pytest.fixture
async def server(bmdb_conn: bmdb.Connection, nursery: trio.Nursery) -> AsyncIterator[Server]:
    url, scope = await _serve(bmdb_conn, nursery, agent_session_secret=SECRET)
    yield Server(url, bmdb_conn)
    scope.cancel()


@dataclass
class Answer:
    status: int
    #: The Connect error's code and message ("" on success).
    code: str
    message: str
    body: bytes


async def post(url: str, body: bytes, headers: dict[str, str]) -> Answer:
    async with httpx.AsyncClient() as client:
        response = await client.post(url + protocol.HEARTBEAT_PATH, content=body, headers=headers)
    if response.status_code == 200:
        return Answer(200, "", "", response.content)
    error = json.loads(response.content)
    return Answer(response.status_code, error["code"], error["message"], response.content)


async def stored(conn: bmdb.Connection, mid: uuid.UUID) -> tuple[int | None, bytes | None]:
    """(last accepted request time, hardware report) of the machine."""

    async def read(q: Queries) -> tuple[int | None, bytes | None]:
        rows = await q.execute(
            "SELECT agent_request_time_ns FROM machine_agent_heartbeat WHERE machine_id = %s",
            (mid,),
        )
        return (rows[0][0] if rows else None), await q.hardware_report(mid)

    return await conn.transact(read)


def with_session(hb: heartbeat.Heartbeater, token: bytes, key: bytes) -> None:
    """Make ``hb`` MAC its requests with this session."""
    hb.session = wire.AgentSession(token, key, 3600)
    hb.session_until = math.inf


async def test_signed_heartbeat_gets_a_session_whose_heartbeats_are_written(
    server: Server,
) -> None:
    mid, seed = await started_machine(server.conn)
    hb = heartbeater(server.url, str(mid), seed, report=True)
    body, headers = hb.request()
    assert protocol.HEADER_SIGNATURE in headers and protocol.HEADER_SESSION not in headers
    answer = await post(server.url, body, headers)
    assert answer.status == 200
    session = HeartbeatResponse.parse(answer.body).session
    assert session is not None and session.token and len(session.key) == 32
    assert session.lifetime_seconds == 3600
    # The agent's own codec reads the same session.
    hb.accepted(answer.body)
    assert hb.session == wire.AgentSession(session.token, session.key, 3600)
    _, report = await stored(server.conn, mid)
    assert report is not None

    hb.report = None
    for _ in range(3):
        body, headers = hb.request()
        assert protocol.HEADER_SESSION in headers
        assert protocol.HEADER_SIGNATURE not in headers and protocol.HEADER_KEY not in headers
        answer = await post(server.url, body, headers)
        assert answer.status == 200
        # A session heartbeat is answered without a new session.
        assert HeartbeatResponse.parse(answer.body).session is None
        assert await stored(server.conn, mid) == (int(headers[protocol.HEADER_TIME]), report)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("forged-mac", "bad session MAC"),
        ("forged-token", "session token not valid here (forged, or the server restarted)"),
        ("other-secret", "session token not valid here (forged, or the server restarted)"),
        ("expired", "session expired"),
        ("other-machine", "session token is for another machine"),
        ("malformed-token", "Monotrio-Agent-Session missing or not 89 bytes"),
        ("no-mac", "Monotrio-Agent-Mac missing or not 32 bytes"),
    ],
)
async def test_session_refusals_write_nothing(server: Server, case: str, message: str) -> None:
    mid, seed = await started_machine(server.conn)
    public = ed25519.ed25519_public_key(seed)
    hb = heartbeater(server.url, str(mid), seed, report=True)
    keys = SessionKeys(SECRET)
    token, key = keys.issue(mid, public, time.time_ns())
    target = mid  # the machine the request is for
    if case == "forged-mac":
        key = os.urandom(32)  # the right token, a MAC under another key
    elif case == "forged-token":
        # Another machine's id in a token with the original tag.
        target, target_seed = await started_machine(server.conn)
        token = token[:1] + target.bytes + token[17:]
        hb = heartbeater(server.url, str(target), target_seed, report=True)
    elif case == "other-secret":
        token, key = SessionKeys(new_secret()).issue(mid, public, time.time_ns())
    elif case == "expired":
        long_ago = time.time_ns() - 2 * 3600 * 10**9
        token, key = keys.issue(mid, public, long_ago)
    elif case == "other-machine":
        # A valid session of another machine (its agent's key), used for this one.
        other, other_seed = await started_machine(server.conn)
        token, key = keys.issue(other, ed25519.ed25519_public_key(other_seed), time.time_ns())
    elif case == "malformed-token":
        token = token[:-1]
    with_session(hb, token, key)
    body, headers = hb.request()
    if case == "no-mac":
        del headers[protocol.HEADER_MAC]
    answer = await post(server.url, body, headers)
    assert (answer.status, answer.code, answer.message) == (401, "unauthenticated", message)
    assert await stored(server.conn, target) == (None, None)
    # The agent's signed request still goes through: nothing was burnt.
    hb.session = None
    assert (await post(server.url, *hb.request())).status == 200


async def test_replayed_session_request_is_refused_and_changes_nothing(server: Server) -> None:
    mid, seed = await started_machine(server.conn)
    hb = heartbeater(server.url, str(mid), seed, report=False)
    hb.accepted((await post(server.url, *hb.request())).body)
    assert hb.session is not None
    older = hb.request()
    body, headers = hb.request()
    assert (await post(server.url, body, headers)).status == 200
    accepted = await stored(server.conn, mid)
    for replay in ((body, headers), older):
        answer = await post(server.url, *replay)
        assert (answer.status, answer.message) == (401, "replayed request")
        assert await stored(server.conn, mid) == accepted


async def test_session_of_a_machine_taken_over_again_is_refused(server: Server) -> None:
    """A new agent key in the AgentStarted tag (the machine was taken over
    again) refuses the old agent's session, though its token is valid."""
    mid, seed = await started_machine(server.conn)
    hb = heartbeater(server.url, str(mid), seed, report=False)
    hb.accepted((await post(server.url, *hb.request())).body)
    assert hb.session is not None
    before = await stored(server.conn, mid)

    async def retake(q: Queries) -> None:
        now = datetime.datetime.now(datetime.UTC)
        await q.set_agent_started(mid, now, ed25519.ed25519_public_key(os.urandom(32)))

    await server.conn.transact(retake)
    answer = await post(server.url, *hb.request())
    assert (answer.status, answer.message) == (401, "machine id or public key unknown")
    assert await stored(server.conn, mid) == before


async def test_agent_signs_again_when_the_server_restarted(
    bmdb_conn: bmdb.Connection, nursery: trio.Nursery
) -> None:
    """The server comes back on the same port with a new secret: the agent's
    next heartbeat (its session refused) is sent again at once, signed, and
    it has a new session."""
    mid, seed = await started_machine(bmdb_conn)
    url, scope = await _serve(bmdb_conn, nursery)
    hb = heartbeater(url, str(mid), seed, report=False)
    await trio.to_thread.run_sync(hb.beat)
    first = hb.session
    assert first is not None
    await trio.to_thread.run_sync(hb.beat)  # with the session
    assert hb.session is first
    scope.cancel()
    _, second_scope = await _serve(bmdb_conn, nursery, listen=f"127.0.0.1:{port_of(url)}")
    try:
        before = await stored(bmdb_conn, mid)
        await trio.to_thread.run_sync(hb.beat)  # no exception: accepted
        assert hb.session is not None and hb.session.token != first.token
        after = await stored(bmdb_conn, mid)
        assert after[0] is not None and before[0] is not None and after[0] > before[0]
    finally:
        second_scope.cancel()


async def test_agent_renews_its_session_before_it_ends(
    bmdb_conn: bmdb.Connection, nursery: trio.Nursery
) -> None:
    mid, seed = await started_machine(bmdb_conn)
    url, scope = await _serve(bmdb_conn, nursery, agent_session_lifetime=1.0)
    try:
        hb = heartbeater(url, str(mid), seed, report=False)
        await trio.to_thread.run_sync(hb.beat)
        assert hb.session is not None and hb.session.lifetime_seconds == 1
        await trio.sleep(1.0)  # past 90% of the lifetime
        assert protocol.HEADER_SIGNATURE in hb.request()[1]
    finally:
        scope.cancel()


def test_token_tampering_is_detected_everywhere() -> None:
    """Any flipped bit of a token makes it invalid."""
    keys = SessionKeys(SECRET)
    token, key = keys.issue(uuid.uuid4(), os.urandom(32), time.time_ns())
    assert keys.open(token, time.time_ns()).key == key
    for index in range(len(token)):
        forged = bytearray(token)
        forged[index] ^= 1
        with pytest.raises(Exception, match="session token"):
            keys.open(bytes(forged), time.time_ns())


@settings(max_examples=100, deadline=None)
@given(key=st.binary(max_size=130), message=st.binary(max_size=300))
def test_server_mac_is_the_agents(key: bytes, message: bytes) -> None:
    """The server's MAC check (one keyed object, copied per message)
    computes what the agent's (and every) HMAC-SHA256 computes, and leaves
    its keyed object reusable."""
    keyed = hmac.new(key, digestmod="sha256")
    assert session_mac(keyed, message) == hmac.digest(key, message, "sha256")
    assert session_mac(keyed, message) == protocol.session_mac(key, message)
