"""Installation reports from a hostile agent, against the real agent callback
server and BMDB (`shepherd.agent_server.reports`).

The agent holds its machine's key (it signs its heartbeats), so everything
else in its reports is its to choose: a report huge or cut short, fields of
the wrong wire type, a node key that is not 32 bytes, a generation from the
future or the past, a report for a machine that was never asked. Held
means: a malformed report refuses its heartbeat (``invalid_argument``)
with nothing written, one the server cannot use is ignored (the heartbeat
accepted, the report not stored), and what is stored is bounded and
well-formed. The BMDB is read with a connection of the test's own.

The finding (it failed before its fix): a success report's unknown fields
were stored as they came, up to the request body bound (256 KiB), where
only its generation and key mean anything.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import httpx
import psycopg
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bmdb
from bmdb import Queries
from common.protobuf import parse_strict
from shepherd.agent import ed25519, protocol
from shepherd.agent.heartbeat import request_headers
from shepherd.agent_server import AgentServerConfig, run_agent_server
from shepherd.agent_server.server import port_of
from shepherd.proto.agent_callback import (
    OsInstallationReport,
    OsInstallationReportError,
    OsInstallationReportSuccess,
)
from tests.shepherd.helpers import provide
from tests.shepherd.test_agent_server_hostile import ThreadServer, thread_server
from tests.shepherd.test_agent_server_install import request_bytes

#: The generation the asked machine's pending request has at first.
ASKED = 5


@dataclass
class Machines:
    asked: uuid.UUID
    never_asked: uuid.UUID
    seeds: dict[uuid.UUID, bytes]


@dataclass
class Rig:
    server: ThreadServer
    url: str
    bmdb_url: str
    machines: Machines
    #: The test's own connection to the BMDB (autocommit: each read sees the newest).
    db: psycopg.Connection[tuple[Any, ...]]
    last_ns: int = 0

    def post(self, mid: uuid.UUID, report: bytes | None, *, seed: bytes | None = None) -> int:
        """A signed heartbeat of ``mid`` carrying ``report`` (raw
        OSInstallationReport bytes); the HTTP status."""
        body = _len_field(1, str(mid).encode()) + (
            _len_field(3, report) if report is not None else b""
        )
        key = seed if seed is not None else self.machines.seeds[mid]
        self.last_ns = max(time.time_ns(), self.last_ns + 1)
        headers = request_headers(
            str(mid),
            body,
            self.last_ns,
            None,
            public_key=ed25519.ed25519_public_key(key),
            sign=lambda message: ed25519.ed25519_sign(key, message),
        )
        response = httpx.post(self.url + protocol.HEARTBEAT_PATH, content=body, headers=headers)
        if response.status_code != 200:
            assert response.headers["content-type"] == "application/json", response
            json.loads(response.content)  # a Connect error, whatever it says
        return response.status_code

    def rows(self, mid: uuid.UUID) -> tuple[object, ...]:
        """What the BMDB holds of ``mid``'s heartbeats and installation."""
        return tuple(
            self.db.execute(
                f"SELECT * FROM {table} WHERE machine_id = %s ORDER BY 1", (mid,)
            ).fetchall()
            for table in (
                "machine_agent_heartbeat",
                "machine_os_installation_report",
                "machine_os_installation_request",
                "machine_hardware_report",
            )
        )

    def report(self, mid: uuid.UUID) -> tuple[int, bytes] | None:
        row = self.db.execute(
            "SELECT generation, os_installation_report_raw"
            " FROM machine_os_installation_report WHERE machine_id = %s",
            (mid,),
        ).fetchone()
        return None if row is None else (int(row[0]), bytes(row[1]))

    def ask(self, mid: uuid.UUID, generation: int) -> None:
        """Store a request of ``generation`` for ``mid`` (through the server's BMDB connection)."""
        conn = cast(bmdb.Connection, self.server.extra)

        async def put(q: Queries) -> None:
            await q.set_os_installation_request(mid, generation, request_bytes(generation))

        trio.from_thread.run(conn.transact, put, trio_token=self.server.token)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _len_field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def success(generation: int, key: bytes) -> bytes:
    return bytes(
        OsInstallationReport(
            generation=generation, success=OsInstallationReportSuccess(node_public_key=key)
        )
    )


def failure(generation: int, cause: str) -> bytes:
    return bytes(
        OsInstallationReport(generation=generation, error=OsInstallationReportError(error=cause))
    )


@pytest.fixture
def rig(bmdb_url: str) -> Iterator[Rig]:
    config = AgentServerConfig(listen="127.0.0.1:0")
    made: list[Machines] = []

    async def serve(task_status: trio.TaskStatus[tuple[int, object]]) -> None:
        async with bmdb.open_connection(bmdb_url) as conn:
            ids = list((await provide(conn, [f"m-{uuid.uuid4()}" for _ in range(2)])).values())
            seeds = {mid: os.urandom(32) for mid in ids}

            async def start(q: Queries) -> None:
                now = datetime.datetime.now(datetime.UTC)
                for mid, seed in seeds.items():
                    await q.set_agent_started(mid, now, ed25519.ed25519_public_key(seed))
                await q.set_os_installation_request(ids[0], ASKED, request_bytes(ASKED))

            await conn.transact(start)
            made.append(Machines(ids[0], ids[1], seeds))
            async with trio.open_nursery() as nursery:
                binds = await nursery.start(
                    lambda task_status: run_agent_server(conn, config, task_status=task_status)
                )
                task_status.started((port_of(binds[0]), conn))

    with (
        thread_server(serve) as server,
        psycopg.connect(bmdb_url, autocommit=True) as db,
    ):
        yield Rig(server, f"http://127.0.0.1:{server.port}", bmdb_url, made[0], db)


def test_a_huge_report_is_refused_unread(rig: Rig) -> None:
    mid = rig.machines.asked
    before = rig.rows(mid)
    assert rig.post(mid, failure(ASKED, "x" * (300 * 1024))) in (413, 429)
    assert rig.rows(mid) == before  # not even the heartbeat


def test_a_long_cause_is_stored_bounded_and_escaped(rig: Rig) -> None:
    mid = rig.machines.asked
    assert rig.post(mid, failure(ASKED, "\x1b[2J" + "y" * (200 * 1024))) == 200
    stored = rig.report(mid)
    assert stored is not None and stored[0] == ASKED
    assert len(stored[1]) < 1024
    cause = parse_strict(OsInstallationReport, stored[1]).error
    assert cause is not None and cause.error.startswith("\\x1b[2J"), cause


def test_a_success_reports_unknown_fields_are_not_stored(rig: Rig) -> None:
    mid = rig.machines.asked
    key = bytes(range(32))
    padded = success(ASKED, key) + _len_field(15, b"z" * (128 * 1024)) + b"\xa0\x1f\x07"
    assert rig.post(mid, padded) == 200
    stored = rig.report(mid)
    assert stored == (ASKED, success(ASKED, key))  # what it says, nothing more


@pytest.mark.parametrize("length", [1, 16, 31, 33, 64, 1000])
def test_a_node_key_that_is_not_32_bytes_refuses_the_heartbeat(rig: Rig, length: int) -> None:
    mid = rig.machines.asked
    before = rig.rows(mid)
    assert rig.post(mid, success(ASKED, b"k" * length)) == 400
    assert rig.rows(mid) == before


def test_generations_from_the_future_or_the_past_are_ignored(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    mid = rig.machines.asked
    caplog.set_level(logging.INFO, logger="shepherd.agent_server.service")
    for generation in (1, ASKED - 1, ASKED + 1, 2**62, 2**63 - 1):
        assert rig.post(mid, success(generation, bytes(32))) == 200, generation
        assert rig.report(mid) is None, generation
    ignored = [r for r in caplog.records if "ignored installation report" in r.getMessage()]
    assert len(ignored) == 5
    # Not positive (as protobuf's int64: 2**63 and up are negative): refused.
    before = rig.rows(mid)
    for raw in (success(0, bytes(32)), b"\x08" + _varint(2**63) + _len_field(2, b"")):
        assert rig.post(mid, raw) == 400
    assert rig.rows(mid) == before
    # The pending generation is stored, once.
    assert rig.post(mid, success(ASKED, bytes(32))) == 200
    assert rig.report(mid) == (ASKED, success(ASKED, bytes(32)))
    assert rig.post(mid, failure(ASKED, "again")) == 200
    assert rig.report(mid) == (ASKED, success(ASKED, bytes(32)))


def test_a_report_for_a_machine_never_asked_is_not_stored(rig: Rig) -> None:
    mid = rig.machines.never_asked
    for generation in (1, 2, ASKED):
        assert rig.post(mid, success(generation, bytes(32))) == 200
    assert rig.report(mid) is None


def test_a_report_signed_by_another_key_is_refused(rig: Rig) -> None:
    mid = rig.machines.asked
    before = rig.rows(mid)
    assert rig.post(mid, success(ASKED, bytes(32)), seed=os.urandom(32)) == 401
    assert rig.rows(mid) == before


# --- Hypothesis: any report ----------------------------------------------------

_keys = st.sampled_from([0x08, 0x10, 0x12, 0x1A, 0x0A, 0x0D, 0x09, 0x0B, 0x22, 0x7A])
_fields = st.recursive(
    st.binary(max_size=40),
    lambda inner: st.lists(
        st.one_of(
            st.tuples(st.sampled_from([1, 2, 3, 4, 15]), inner).map(lambda t: _len_field(*t)),
            st.tuples(_keys, st.binary(max_size=12)).map(lambda t: bytes([t[0]]) + t[1]),
        ),
        max_size=4,
    ).map(b"".join),
    max_leaves=10,
)
#: A report whose generation is the pending one (so that a well-formed one is
#: stored), with its result and tail mangled; or any bytes.
_reports = st.one_of(
    st.tuples(
        st.sampled_from(["success", "error", "both", "none"]),
        st.binary(max_size=40),
        _fields,
    ),
    _fields,
    st.binary(max_size=300),
)


@settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(drawn=_reports)
def test_arbitrary_reports_are_refused_ignored_or_stored_well_formed(
    rig: Rig, drawn: tuple[str, bytes, bytes] | bytes
) -> None:
    mid = rig.machines.asked
    pending = (rig.report(mid) or (ASKED - 1,))[0] + 1
    rig.ask(mid, pending)  # a request pending for every example
    if isinstance(drawn, tuple):
        kind, payload, tail = drawn
        head = b"\x08" + _varint(pending)
        if kind in ("success", "both"):
            head += _len_field(2, _len_field(1, payload))
        if kind in ("error", "both"):
            head += _len_field(3, _len_field(1, payload))
        raw = head + tail
    else:
        raw = drawn
    before = rig.rows(mid)
    status = rig.post(mid, raw)
    assert status in (200, 400), status
    stored = rig.report(mid)
    if status == 400:
        assert rig.rows(mid) == before  # nothing written
        return
    if stored is not None and stored[0] == pending:  # taken: its own, well-formed
        report = parse_strict(OsInstallationReport, stored[1])
        assert report.generation == pending
        assert (report.success is None) != (report.error is None)
        if report.success is not None:
            assert len(report.success.node_public_key) in (0, 32)
        assert len(stored[1]) < 1024
