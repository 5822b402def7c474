"""The agent callback server over real HTTP: what it accepts, what it refuses, and its limits."""

from __future__ import annotations

import base64
import datetime
import json
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import bmdb
from bmdb import Queries
from shepherd.agent import ed25519, heartbeat, hwreport, protocol, wire
from shepherd.agent_server import (
    AgentServerConfig,
    ConnectError,
    HeartbeatService,
    Limits,
    run_agent_server,
)
from shepherd.agent_server.authenticate import parse_request
from shepherd.agent_server.server import port_of
from shepherd.proto.agent_callback import AgentHardwareReport, HeartbeatRequest, HeartbeatResponse
from shepherd.proto.hwreport import Node
from tests.shepherd.helpers import provide

MAX_BODY = 8192


@dataclass
class Server:
    url: str
    conn: bmdb.Connection


@pytest.fixture
async def server(bmdb_conn: bmdb.Connection, nursery: trio.Nursery) -> AsyncIterator[Server]:
    config = AgentServerConfig(
        listen="127.0.0.1:0", limits=Limits(max_body=MAX_BODY, body_timeout=1.0)
    )
    binds = await nursery.start(
        lambda task_status: run_agent_server(bmdb_conn, config, task_status=task_status)
    )
    yield Server(f"http://127.0.0.1:{port_of(binds[0])}", bmdb_conn)
    nursery.cancel_scope.cancel()


async def started_machine(conn: bmdb.Connection) -> tuple[uuid.UUID, bytes]:
    """A provided machine with an AgentStarted tag; returns it and the agent's seed."""
    (mid,) = (await provide(conn, [f"m-{uuid.uuid4()}"])).values()
    seed = os.urandom(32)

    async def start(q: Queries) -> None:
        now = datetime.datetime.now(datetime.UTC)
        await q.set_agent_started(mid, now, ed25519.ed25519_public_key(seed))

    await conn.transact(start)
    return mid, seed


def heartbeater(url: str, machine_id: str, seed: bytes, *, report: bool) -> heartbeat.Heartbeater:
    hb = heartbeat.Heartbeater(
        wire.TakeoverInit(machine_id, url), seed, interval=1.0, backoff_cap=1.0
    )
    if report:
        hb.report = hwreport.collect_hardware_report()
    return hb


async def post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, str]:
    """POST a heartbeat; (HTTP status, Connect error code or "")."""
    async with httpx.AsyncClient() as client:
        response = await client.post(url + protocol.HEARTBEAT_PATH, content=body, headers=headers)
    if response.status_code == 200:
        assert response.headers["content-type"] == "application/proto"
        return 200, ""
    assert response.headers["content-type"] == "application/json"
    return response.status_code, json.loads(response.content)["code"]


async def stored(conn: bmdb.Connection, mid: uuid.UUID) -> tuple[object, bytes | None]:
    async def read(q: Queries) -> tuple[object, bytes | None]:
        return await q.agent_heartbeat(mid), await q.hardware_report(mid)

    return await conn.transact(read)


async def test_heartbeat_with_report_is_stored_and_time_advances(server: Server) -> None:
    mid, seed = await started_machine(server.conn)
    hb = heartbeater(server.url, str(mid), seed, report=True)
    assert await post(server.url, *hb.request()) == (200, "")
    first, raw = await stored(server.conn, mid)
    assert isinstance(first, datetime.datetime) and raw is not None
    report = AgentHardwareReport.parse(raw)
    assert report.report is not None
    assert report.report.memory_installed_bytes == hb.report[0].memory_installed_bytes  # type: ignore[index]
    assert [n.mac for n in report.report.network_interface] == [
        n.mac
        for n in hb.report[0].network_interface  # type: ignore[index]
    ]

    hb.report = None
    await trio.sleep(0.01)
    assert await post(server.url, *hb.request()) == (200, "")
    second, raw_after = await stored(server.conn, mid)
    assert isinstance(second, datetime.datetime) and second > first
    assert raw_after == raw


def _signed(
    machine_id: str, seed: bytes, body: bytes, time_ns: int | None = None
) -> dict[str, str]:
    """Headers of a correctly signed request for ``body``, at ``time_ns`` (default: now)."""
    key = Ed25519PrivateKey.from_private_bytes(seed)
    at = time.time_ns() if time_ns is None else time_ns
    message = protocol.signed_message("POST", protocol.HEARTBEAT_PATH, machine_id, at, body)
    return {
        "Content-Type": "application/proto",
        protocol.HEADER_KEY: base64.b64encode(ed25519.ed25519_public_key(seed)).decode(),
        protocol.HEADER_TIME: str(at),
        protocol.HEADER_SIGNATURE: base64.b64encode(key.sign(message)).decode(),
    }


@pytest.mark.parametrize(
    ("case", "status", "code"),
    [
        ("wrong-key", 401, "unauthenticated"),
        ("unknown-machine", 401, "unauthenticated"),
        ("malformed-id", 400, "invalid_argument"),
        ("malformed-body", 400, "invalid_argument"),
        ("stale", 401, "unauthenticated"),
        ("future", 401, "unauthenticated"),
        ("tampered", 401, "unauthenticated"),
        ("unsigned", 401, "unauthenticated"),
        ("oversized", 429, "resource_exhausted"),
        ("wrong-path", 404, "unimplemented"),
        ("wrong-content-type", 400, "invalid_argument"),
    ],
)
async def test_refusals_write_nothing(server: Server, case: str, status: int, code: str) -> None:
    mid, seed = await started_machine(server.conn)
    other_seed = os.urandom(32)
    hb = heartbeater(server.url, str(mid), seed, report=True)
    body, headers = hb.request()
    url = server.url
    if case == "wrong-key":
        # Signed correctly, by a key that is not the machine's.
        headers = _signed(str(mid), other_seed, body)
    elif case == "unknown-machine":
        other = str(uuid.uuid4())
        body = bytes(HeartbeatRequest(machine_id=other))
        headers = _signed(other, seed, body)
    elif case == "malformed-id":
        body = bytes(HeartbeatRequest(machine_id="not-a-uuid"))
        headers = _signed("not-a-uuid", seed, body)
    elif case == "malformed-body":
        body = b"\x0a\x50" + str(mid).encode()  # length past the end
        headers = _signed(str(mid), seed, body)
    elif case == "stale":
        headers = _signed(str(mid), seed, body, time.time_ns() - 600 * 10**9)
    elif case == "future":
        headers = _signed(str(mid), seed, body, time.time_ns() + 600 * 10**9)
    elif case == "tampered":
        body = bytes(HeartbeatRequest(machine_id=str(mid)))  # not what was signed
    elif case == "unsigned":
        del headers[protocol.HEADER_SIGNATURE]
    elif case == "oversized":
        report = AgentHardwareReport(report=Node(product="x" * MAX_BODY))
        body = bytes(HeartbeatRequest(machine_id=str(mid), hardware_report=report))
        headers = _signed(str(mid), seed, body)
    elif case == "wrong-path":
        url += "/nope"
    elif case == "wrong-content-type":
        headers["Content-Type"] = "application/json"
    assert await post(url, body, headers) == (status, code)
    assert await stored(server.conn, mid) == (None, None)
    # The real request still goes through afterwards: nothing was burnt.
    assert await post(server.url, *hb.request()) == (200, "")


def _len(number: int, payload: bytes) -> bytes:
    assert len(payload) < 128
    return bytes([number << 3 | 2, len(payload)]) + payload


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (b"\x0a\x50" + bytes(36), "past end of message"),
        (_len(1, b"m") + _len(1, b"n"), "machine_id, field 1: set twice"),
        # Below the report's top level, where the agent's codec did not look.
        (_len(1, b"m") + _len(2, _len(1, _len(10, _len(8, b"x")))), "cores, field 8: wire type 2"),
        (_len(1, b"m") + _len(2, _len(1, _len(1, b"\xff"))), "manufacturer, field 1: not UTF-8"),
    ],
)
def test_malformed_requests_are_invalid_arguments(body: bytes, problem: str) -> None:
    with pytest.raises(ConnectError, match=problem) as caught:
        parse_request(body)
    assert caught.value.code == "invalid_argument"


def test_a_request_gives_its_machine_id_and_report() -> None:
    node, warnings = hwreport.collect_hardware_report()
    body = wire.encode_heartbeat_request("m-1", node, warnings)
    machine_id, report = parse_request(body)
    assert machine_id == "m-1" and report is not None
    assert AgentHardwareReport.parse(report) == HeartbeatRequest.parse(body).hardware_report
    assert parse_request(wire.encode_heartbeat_request("m-2")) == ("m-2", None)


def test_a_request_gives_its_report_as_sent() -> None:
    """Stored as the agent sent it (once checked), not encoded again: an
    unknown field first stays first."""
    raw = b"\xf8\x07\x01" + bytes(AgentHardwareReport(report=Node(product="p"), warning=["w"]))
    assert bytes(AgentHardwareReport.parse(raw)) != raw
    assert parse_request(_len(1, b"m-3") + _len(2, raw)) == ("m-3", raw)


async def test_replayed_request_is_refused_and_changes_nothing(server: Server) -> None:
    mid, seed = await started_machine(server.conn)
    hb = heartbeater(server.url, str(mid), seed, report=True)
    body, headers = hb.request()
    assert await post(server.url, body, headers) == (200, "")
    before = await stored(server.conn, mid)
    assert await post(server.url, body, headers) == (401, "unauthenticated")
    # An older request signed before the accepted one: also a replay.
    hb.report = None
    older_body, older_headers = hb.request()
    newer_body, newer_headers = hb.request()
    assert await post(server.url, newer_body, newer_headers) == (200, "")
    after_newer = await stored(server.conn, mid)
    assert await post(server.url, older_body, older_headers) == (401, "unauthenticated")
    assert await stored(server.conn, mid) == after_newer != before


async def test_slow_client_cannot_hold_the_server(server: Server) -> None:
    """A client that promises a body and never sends it is cut off after the
    body timeout; other agents are served meanwhile."""
    mid, seed = await started_machine(server.conn)
    hb = heartbeater(server.url, str(mid), seed, report=False)
    port = int(server.url.rsplit(":", 1)[1])
    slow = await trio.open_tcp_stream("127.0.0.1", port)
    await slow.send_all(
        f"POST {protocol.HEARTBEAT_PATH} HTTP/1.1\r\nHost: x\r\n"
        "Content-Type: application/proto\r\nContent-Length: 100\r\n\r\n".encode()
    )
    # Served while the slow one hangs.
    assert await post(server.url, *hb.request()) == (200, "")
    with trio.fail_after(30):
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = await slow.receive_some()
            if not chunk:
                break
            answer += chunk
    await slow.aclose()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:100]


async def test_overload_is_answered_unavailable_not_queued_forever(
    bmdb_conn: bmdb.Connection,
) -> None:
    """With every database slot taken for longer than the queue timeout, a
    heartbeat is refused as unavailable (the agent backs off), and written
    once a slot is free again."""
    mid, seed = await started_machine(bmdb_conn)
    service = HeartbeatService(bmdb_conn, db_slots=1, queue_timeout=0.2)
    hb = heartbeater("http://unused", str(mid), seed, report=False)
    body, headers = hb.request()
    lower = {k.lower(): v for k, v in headers.items()}
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        await service._slots.acquire()
        with pytest.raises(ConnectError) as refused:
            await service.heartbeat(lower, body)
        assert refused.value.code == "unavailable"
        assert await stored(bmdb_conn, mid) == (None, None)
        service._slots.release()
        # Accepted, signed: answered with a session.
        assert HeartbeatResponse.parse(await service.heartbeat(lower, body)).session is not None
        assert (await stored(bmdb_conn, mid))[0] is not None
        nursery.cancel_scope.cancel()


async def test_heartbeat_cancelled_while_queued_leaves_the_queue_unwritten(
    bmdb_conn: bmdb.Connection,
) -> None:
    """A request cancelled (its connection gone, the server stopping) while
    its heartbeat waits for a database slot is never written, and the writer
    goes on with the others."""
    (mid, seed), (other, other_seed) = [await started_machine(bmdb_conn) for _ in range(2)]
    service = HeartbeatService(bmdb_conn, db_slots=1, queue_timeout=60)

    def request(machine: uuid.UUID, key: bytes) -> tuple[dict[str, str], bytes]:
        body, headers = heartbeater("http://unused", str(machine), key, report=False).request()
        return {k.lower(): v for k, v in headers.items()}, body

    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        await service._slots.acquire()
        with trio.move_on_after(0.5) as waited:
            await service.heartbeat(*request(mid, seed))
        assert waited.cancelled_caught
        service._slots.release()
        await service.heartbeat(*request(other, other_seed))
        nursery.cancel_scope.cancel()
    assert await stored(bmdb_conn, mid) == (None, None)
    assert (await stored(bmdb_conn, other))[0] is not None


async def test_group_commit_writes_each_member_once_its_group_committed(
    bmdb_conn: bmdb.Connection,
) -> None:
    """Concurrent heartbeats form one group (one transaction); each is written."""
    machines = [await started_machine(bmdb_conn) for _ in range(3)]
    service = HeartbeatService(bmdb_conn, batch_window=0.5)
    answers: list[bytes] = []

    async def beat(mid: uuid.UUID, seed: bytes) -> None:
        body, headers = heartbeater("http://unused", str(mid), seed, report=False).request()
        answers.append(await service.heartbeat({k.lower(): v for k, v in headers.items()}, body))

    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        async with trio.open_nursery() as beats:
            for mid, seed in machines:
                beats.start_soon(beat, mid, seed)
        nursery.cancel_scope.cancel()
    assert [HeartbeatResponse.parse(a).session is not None for a in answers] == [True] * 3
    times = {(await stored(bmdb_conn, mid))[0] for mid, _ in machines}
    # The heartbeat time is the writing transaction's now(): one for the group.
    assert len(times) == 1 and None not in times


async def test_failed_group_answers_every_member_and_writes_nothing(
    bmdb_conn: bmdb.Connection,
) -> None:
    """A group whose transaction fails: all its heartbeats are answered
    unavailable and none is written, also those that alone would have been."""
    machines = [await started_machine(bmdb_conn) for _ in range(3)]
    poisoned = machines[1][0]

    async def poison(q: Queries) -> None:
        # A real failure inside the group's statement, for one member.
        await q.execute(
            f"""CREATE FUNCTION hb_poison() RETURNS trigger LANGUAGE plpgsql AS $$
                BEGIN
                    IF NEW.machine_id = '{poisoned}' THEN RAISE EXCEPTION 'poisoned'; END IF;
                    RETURN NEW;
                END $$;
                CREATE TRIGGER hb_poison BEFORE INSERT ON machine_agent_heartbeat
                FOR EACH ROW EXECUTE FUNCTION hb_poison()"""
        )

    await bmdb_conn.transact(poison)
    service = HeartbeatService(bmdb_conn, batch_window=0.5)
    codes: list[str] = []

    async def beat(mid: uuid.UUID, seed: bytes) -> None:
        body, headers = heartbeater("http://unused", str(mid), seed, report=True).request()
        with pytest.raises(ConnectError) as refused:
            await service.heartbeat({k.lower(): v for k, v in headers.items()}, body)
        codes.append(refused.value.code)

    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(service.run)
            async with trio.open_nursery() as beats:
                for mid, seed in machines:
                    beats.start_soon(beat, mid, seed)
            nursery.cancel_scope.cancel()
    finally:

        async def cure(q: Queries) -> None:
            await q.execute("DROP TRIGGER hb_poison ON machine_agent_heartbeat")
            await q.execute("DROP FUNCTION hb_poison()")

        await bmdb_conn.transact(cure)
    assert codes == ["unavailable"] * 3
    for mid, _ in machines:
        assert await stored(bmdb_conn, mid) == (None, None)


async def _exchange(port: int, data: bytes, answers: int) -> list[bytes]:
    """Send ``data`` on one connection; the heads of ``answers`` answers (fewer at EOF)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    heads: list[bytes] = []
    buffer = b""
    async with stream:
        await stream.send_all(data)
        with trio.fail_after(30):
            while len(heads) < answers:
                while b"\r\n\r\n" not in buffer:
                    chunk = await stream.receive_some()
                    if not chunk:
                        return heads
                    buffer += chunk
                head, buffer = buffer.split(b"\r\n\r\n", 1)
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                while len(buffer) < length:
                    buffer += await stream.receive_some()
                buffer = buffer[length:]
                heads.append(head)
    return heads


def _raw(body: bytes, headers: dict[str, str], *, chunked: bool = False) -> bytes:
    lines = [f"POST {protocol.HEARTBEAT_PATH} HTTP/1.1", "Host: x"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    if chunked:
        lines.append("Transfer-Encoding: chunked")
        half = len(body) // 2
        framed = b"".join(
            b"%x;ext=1\r\n%s\r\n" % (len(part), part) for part in (body[:half], body[half:])
        )
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + framed + b"0\r\nTrailer: t\r\n\r\n"
    lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def _stored_time(conn: bmdb.Connection, mid: uuid.UUID) -> int | None:
    rows = await conn.transact(
        lambda q: q.execute(
            "SELECT agent_request_time_ns FROM machine_agent_heartbeat WHERE machine_id = %s",
            (mid,),
        )
    )
    return rows[0][0] if rows else None


async def test_keep_alive_and_pipelined_requests(server: Server) -> None:
    """Two requests on one connection, sent at once, are both answered and written."""
    mid, seed = await started_machine(server.conn)
    hb = heartbeater(server.url, str(mid), seed, report=False)
    first, second = hb.request(), hb.request()
    heads = await _exchange(port_of(server.url), _raw(*first) + _raw(*second), 2)
    assert [h.split(b"\r\n")[0] for h in heads] == [b"HTTP/1.1 200 OK"] * 2
    assert not any(b"connection: close" in h.lower() for h in heads)
    assert await _stored_time(server.conn, mid) == int(second[1][protocol.HEADER_TIME])


async def test_a_chunked_body_is_refused_before_it_is_read(server: Server) -> None:
    """Agents always send a Content-Length (`shepherd.agent_server.http1`,
    "Chunked bodies"): a chunked heartbeat, even well signed, is a 411 with
    the connection closed, nothing is written, and a request pipelined after
    it is not read."""
    mid, seed = await started_machine(server.conn)
    hb = heartbeater(server.url, str(mid), seed, report=False)
    first, second = hb.request(), hb.request()
    heads = await _exchange(port_of(server.url), _raw(*first, chunked=True) + _raw(*second), 2)
    assert len(heads) == 1
    assert heads[0].startswith(b"HTTP/1.1 411 Length Required\r\n")
    assert b"connection: close" in heads[0].lower()
    assert await _stored_time(server.conn, mid) is None
    # The agent's own request, as it sends it, is taken.
    body, headers = hb.request()
    (head,) = await _exchange(port_of(server.url), _raw(body, headers), 1)
    assert head.startswith(b"HTTP/1.1 200 ")
    assert await _stored_time(server.conn, mid) == int(headers[protocol.HEADER_TIME])


async def test_oversized_head_and_malformed_requests_close_the_connection(server: Server) -> None:
    huge = {"X-Padding": "p" * (20 * 1024), "Content-Type": "application/proto"}
    (head,) = await _exchange(port_of(server.url), _raw(b"", huge), 2)
    assert head.startswith(b"HTTP/1.1 431 ") and b"connection: close" in head.lower()
    bad = b"POST / HTTP/1.1 extra\r\n\r\n"
    (head,) = await _exchange(port_of(server.url), bad, 2)
    assert head.startswith(b"HTTP/1.1 400 ") and b"connection: close" in head.lower()
    smuggle = _raw(b"", {"Content-Type": "application/proto"}).replace(
        b"Content-Length: 0", b"Content-Length: 0\r\nTransfer-Encoding: chunked"
    )
    (head,) = await _exchange(port_of(server.url), smuggle, 2)
    assert head.startswith(b"HTTP/1.1 400 ")


async def test_idle_connection_is_closed_after_the_keep_alive_timeout(
    bmdb_conn: bmdb.Connection, nursery: trio.Nursery
) -> None:
    config = AgentServerConfig(listen="127.0.0.1:0", keep_alive_timeout=0.5)
    binds = await nursery.start(
        lambda task_status: run_agent_server(bmdb_conn, config, task_status=task_status)
    )
    idle = await trio.open_tcp_stream("127.0.0.1", port_of(binds[0]))
    async with idle:
        with trio.fail_after(30):
            assert await idle.receive_some() == b""  # closed by the server, unanswered
