"""A fleet simulator: N machines in the BMDB, and a load standing in for their agents.

Two halves, used by ``bench/fleet_scale.py`` and ``tests/bench/test_fleet.py``:

- `seed_fleet` writes ``size`` machines into a BMDB in bulk (COPY) as the
  provisioner and the initializer leave them: a ``machines`` row, the
  Provided tag (static provider, an address and a location), the
  AgentStarted tag with the machine's own Ed25519 public key, the SSH host
  key the initializer trusted on first use, and the agent start's work
  history (Started, Finished). Keys and machine ids are derived from the
  fleet's ``secret`` and the machine's index (`Fleet`), so that the load
  processes derive them again instead of being sent 100,000 keys. Every
  ``silent_every``-th machine is *silent*: its agent heartbeated an hour
  ago and never again (what the recoverer looks for); the load skips it.
  ``pending`` more machines are provided but not yet taken over (what the
  initializer looks for).

- `FleetLoad` runs the agents against an agent callback server on a local
  port, in ``processes`` load processes (`load_process`), each a bare
  epoll loop driving thousands of agents, in phases (`FleetLoad.phase`)
  between which agents keep their sessions. Each agent speaks the real
  protocol with its own key: the headers are the agent's own
  (`shepherd.agent.heartbeat.request_headers`), the body the agent's codec
  (`shepherd.agent.wire`); its first heartbeat is signed and carries its
  hardware report, the answer's session MACs the following ones, a refused
  session makes it sign again at once, and a refused heartbeat is sent
  again after a backoff (1 s, doubling, at most the interval), as the agent
  does. Unlike the agent, it signs with ``cryptography`` (the agent's
  pure-Python Ed25519 takes 15 ms a signature; the bytes are the same,
  Ed25519 being deterministic).

  Agent ``g`` heartbeats at ``t0 + (g / size) * interval`` and every
  ``interval`` after (an open loop: a late answer does not move the next
  one); with ``interval`` 0 every connection sends back to back (a closed
  loop, for the most the server answers). Agents share kept-alive
  connections, ``connections`` in all, each sending one request at a time:
  a real agent has a connection of its own, but this machine allows 20,000
  open files per process, not the 200,000 that 100,000 agents and their
  server would hold. The server cannot tell: nothing in the protocol is
  tied to a connection.

What a run measures (`LoadResult`): answers by kind, per second of the run,
and each heartbeat's lag (answered at, minus due at) as a histogram, for
the heartbeats due within the measured window (after ``warmup``).
"""

from __future__ import annotations

import binascii
import bisect
import contextlib
import datetime
import hashlib
import heapq
import hmac
import io
import json
import math
import random
import resource
import select
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psycopg
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from bench.heartbeat import split_answer
from shepherd.agent import protocol, wire
from shepherd.agent.heartbeat import REQUEST_TIMEOUT, request_headers

#: How long ago a silent machine's agent last heartbeated (seeded), seconds.
SILENT_FOR = 3600.0


@dataclass(frozen=True)
class Fleet:
    """The simulated fleet: machine ``i``'s id and key follow from ``secret`` and ``i``."""

    size: int
    secret: str = "fleet"
    #: Every this many-th machine (index % silent_every == 0) is silent; 0: none.
    silent_every: int = 0
    #: Machines after the fleet's, provided but without an agent.
    pending: int = 0

    def _digest(self, kind: bytes, index: int) -> bytes:
        return hashlib.sha256(b"%s/%s/%d" % (kind, self.secret.encode(), index)).digest()

    def machine_id(self, index: int) -> str:
        return str(uuid.UUID(bytes=self._digest(b"machine", index)[:16], version=4))

    def seed(self, index: int) -> bytes:
        """Machine ``index``'s Ed25519 private key (its 32-byte seed)."""
        return self._digest(b"agent-key", index)

    def silent(self, index: int) -> bool:
        return self.silent_every > 0 and index % self.silent_every == 0

    def silent_count(self) -> int:
        return sum(1 for i in range(self.size) if self.silent(i))


def public_key(seed: bytes) -> bytes:
    return Ed25519PrivateKey.from_private_bytes(seed).public_key().public_bytes_raw()


def hardware_report(index: int) -> wire.HwNode:
    """A plausible hardware report of machine ``index`` (what its agent sends first)."""
    return wire.HwNode(
        manufacturer="Fleet Systems",
        product="FS-2U",
        serial_number=f"FS{index:08d}",
        memory_installed_bytes=256 << 30,
        memory_usable_ratio=0.98,
        cpu=[wire.HwCPU(vendor="AuthenticAMD", model="EPYC 9354", cores=32, hardware_threads=64)],
        block_device=[
            wire.HwBlockDevice(
                vendor="NVMe",
                device_model="PM9A3",
                serial_number=f"S{index:010d}",
                capacity_bytes=1920 << 30,
                logical_block_size_bytes=512,
                physical_block_size_bytes=4096,
            )
        ],
        network_interface=[
            wire.HwNetworkInterface(
                mac=index.to_bytes(6, "big"),
                driver="mlx5_core",
                link_up=True,
                current_speed_bytes=25_000_000_000 // 8,
            )
        ],
    )


# --- the BMDB side ----------------------------------------------------------------


def _copy(conn: psycopg.Connection[object], table: str, columns: str, rows: io.StringIO) -> None:
    rows.seek(0)
    with conn.cursor().copy(f"COPY {table} ({columns}) FROM STDIN") as copy:
        while block := rows.read(1 << 20):
            copy.write(block)


def seed_fleet(url: str, fleet: Fleet) -> None:
    """Write ``fleet`` into the (migrated, empty of these ids) BMDB at ``url``, in one
    transaction, then VACUUM ANALYZE; psycopg's errors propagate (nothing is written)."""
    now = time.time()

    def at(seconds_ago: float) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S+00", time.gmtime(now - seconds_ago))

    hour_ago, silent_at = at(7200), at(SILENT_FOR)
    machines, provided, started, host_keys, history, beats = (io.StringIO() for _ in range(6))
    for index in range(fleet.size + fleet.pending):
        mid = fleet.machine_id(index)
        taken_over = index < fleet.size
        # Created a millisecond apart, in index order.
        created = datetime.datetime.fromtimestamp(now - 86400 + index / 1000, datetime.UTC)
        machines.write(f"{mid}\t{created.isoformat()}\t{'t' if taken_over else 'f'}\n")
        provided.write(
            f"{mid}\tStatic\tfleet-{index}\t10.{index >> 16 & 255}.{index >> 8 & 255}."
            f"{index & 255}\track-{index // 40}\n"
        )
        if not taken_over:
            continue
        started.write(f"{mid}\t{hour_ago}\t\\\\x{public_key(fleet.seed(index)).hex()}\n")
        host_keys.write(f"{mid}\t\\\\x{fleet._digest(b'host-key', index).hex()}\t{hour_ago}\n")
        history.write(f"{mid}\tShepherdAgentStart\tStarted\t{hour_ago}\n")
        history.write(f"{mid}\tShepherdAgentStart\tFinished\t{hour_ago}\n")
        if fleet.silent(index):
            beats.write(f"{mid}\t{silent_at}\n")
    with psycopg.connect(url) as conn:
        # Triggers off (one UPDATE per row otherwise): what they would write is
        # written here, machines.agent_started with its row.
        conn.execute("SET LOCAL session_replication_role = replica")
        _copy(conn, "machines", "machine_id, machine_created_at, agent_started", machines)
        _copy(
            conn,
            "machine_provided",
            "machine_id, provider, provider_id, provider_address, provider_location",
            provided,
        )
        _copy(conn, "machine_agent_heartbeat", "machine_id, agent_heartbeat_at", beats)
        # The started rows' agent_seen_floor, as migration 0007's trigger
        # would have set it, by its own function (after the heartbeats).
        conn.execute(
            """CREATE TEMP TABLE seed_started (machine_id uuid, agent_started_at timestamptz,
                                               agent_public_key bytea) ON COMMIT DROP"""
        )
        _copy(conn, "seed_started", "machine_id, agent_started_at, agent_public_key", started)
        conn.execute(
            """INSERT INTO machine_agent_started
                   (machine_id, agent_started_at, agent_public_key, agent_seen_floor)
               SELECT s.machine_id, s.agent_started_at, s.agent_public_key,
                      agent_seen_floor(coalesce(h.agent_heartbeat_at, s.agent_started_at),
                                       s.machine_id)
               FROM seed_started s
               LEFT JOIN machine_agent_heartbeat h ON h.machine_id = s.machine_id"""
        )
        _copy(conn, "machine_ssh_host_key", "machine_id, public_key, first_seen", host_keys)
        _copy(conn, "work_history", "machine_id, process, event, at", history)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")


# --- the agents' side -------------------------------------------------------------

#: Lag histogram bucket edges, seconds: 20 per decade from 10 us to 1000 s.
LAG_EDGES = [10 ** (k / 20) for k in range(-100, 61)]


@dataclass
class LoadResult:
    """What a load run saw; sums over its processes (`merge`)."""

    #: Answers to heartbeats due within the window, by kind.
    accepted: int = 0
    refused: int = 0
    #: Connections lost or refused (the heartbeat is sent again on a new one).
    errors: int = 0
    #: Heartbeats sent signed (first, or after a refused session) and with a session.
    signed: int = 0
    sessions: int = 0
    #: Accepted heartbeats that carried a hardware report.
    reports: int = 0
    #: Sessions the server refused (the agent then signed again).
    resigned: int = 0
    #: Heartbeats due in the window that were not answered by its end.
    unanswered: int = 0
    #: Accepted answers per second of the run (index: whole seconds since t0).
    per_second: list[int] = field(default_factory=list)
    #: Counts of lags (answered at - due at) per `LAG_EDGES` bucket, window only.
    lags: list[int] = field(default_factory=lambda: [0] * (len(LAG_EDGES) + 1))
    #: Seconds of the window, and CPU seconds the load processes spent in it.
    window: float = 0.0
    cpu: float = 0.0

    def merge(self, other: LoadResult) -> None:
        for name in (
            "accepted", "refused", "errors", "signed", "sessions", "reports", "resigned",
            "unanswered",
        ):  # fmt: skip
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for i, n in enumerate(other.per_second):
            if i >= len(self.per_second):
                self.per_second.append(0)
            self.per_second[i] += n
        self.lags = [a + b for a, b in zip(self.lags, other.lags, strict=True)]
        self.window = max(self.window, other.window)
        self.cpu += other.cpu

    def rate(self) -> float:
        """Accepted heartbeats a second in the window."""
        return self.accepted / self.window if self.window else 0.0

    def lag(self, quantile: float) -> float:
        """The ``quantile`` of lags, seconds (a bucket's upper edge; inf past the last)."""
        total = sum(self.lags)
        if not total:
            return math.nan
        seen = 0
        for i, n in enumerate(self.lags):
            seen += n
            if seen >= quantile * total:
                return LAG_EDGES[i] if i < len(LAG_EDGES) else math.inf
        return math.inf


class SessionRequests:
    """An agent's session heartbeats (no report) made from parts cut once per
    session: the bytes `request_headers` and the agent's codec would make,
    at a fifth of their CPU (what the load costs is CPU the server does not
    get on this machine). Per request only the time and the MAC are new."""

    __slots__ = ("body", "head", "key", "message_head", "message_tail", "session_line")

    def __init__(self, machine_id: str, session: wire.AgentSession, port: int) -> None:
        self.key = session.key
        self.body = wire.encode_heartbeat_request(machine_id, None)
        self.message_head = b"\n".join(
            [
                protocol.SIGNATURE_CONTEXT,
                b"POST",
                protocol.HEARTBEAT_PATH.encode(),
                machine_id.encode(),
                b"",
            ]
        )
        self.message_tail = b"\n" + hashlib.sha256(self.body).hexdigest().encode()
        self.head = (
            f"POST {protocol.HEARTBEAT_PATH} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Accept-Encoding: identity\r\nContent-Length: {len(self.body)}\r\n"
            "Content-Type: application/proto\r\nConnect-Protocol-Version: 1\r\n"
            f"Connect-Timeout-Ms: {int(REQUEST_TIMEOUT * 1000)}\r\n{protocol.HEADER_TIME}: "
        ).encode()
        self.session_line = (
            f"\r\n{protocol.HEADER_SESSION}: "
            f"{binascii.b2a_base64(session.token, newline=False).decode()}"
            f"\r\n{protocol.HEADER_MAC}: "
        ).encode()

    def request(self, time_ns: int) -> bytes:
        """The request sent at ``time_ns``."""
        now = b"%d" % time_ns
        mac = hmac.digest(self.key, self.message_head + now + self.message_tail, "sha256")
        return b"".join(
            [
                self.head,
                now,
                self.session_line,
                binascii.b2a_base64(mac, newline=False),
                b"\r\n\r\n",
                self.body,
            ]
        )


class _Agent:
    __slots__ = (
        "failures", "index", "last_ns", "machine_id", "public", "requests", "seed", "session",
        "session_until",
    )  # fmt: skip

    def __init__(self, fleet: Fleet, index: int) -> None:
        self.index = index
        self.machine_id = fleet.machine_id(index)
        self.seed = fleet.seed(index)
        self.public = public_key(self.seed)
        self.session: wire.AgentSession | None = None
        #: Its session's requests (`SessionRequests`), made at its first use.
        self.requests: SessionRequests | None = None
        self.session_until = 0.0
        self.last_ns = 0
        #: Refusals in a row (the agent backs off 1 s, doubling).
        self.failures = 0


class _Connection:
    __slots__ = ("agent", "agents", "buffer", "due", "pos", "report", "round", "signed", "sock")

    def __init__(self, agents: list[_Agent]) -> None:
        self.agents = agents
        self.pos = 0
        self.round = 0
        self.sock: socket.socket | None = None
        self.buffer = b""
        # The request in flight: whose, due when, signed, with a report.
        self.agent: _Agent | None = None
        self.due = 0.0
        self.signed = False
        self.report = False


#: What an agent MACs with where the server issued no session (a bare
#: endpoint): the same shape of request as with a real one.
DUMMY_SESSION = wire.AgentSession(bytes(32), bytes(32), 3600)


class _Load:
    """One load process's agents and connections (see the module docstring)."""

    def __init__(
        self, fleet: Fleet, indexes: list[int], port: int, *, connections: int, dummy_sessions: bool
    ) -> None:
        self.fleet = fleet
        self.port = port
        self.dummy_sessions = dummy_sessions
        self.reports: set[int] = set(indexes)  # agents whose report is not yet accepted
        self.agents = [_Agent(fleet, i) for i in indexes]
        count = max(1, min(connections, len(self.agents)))
        self.connections = [_Connection(self.agents[c::count]) for c in range(count)]
        self.poller = select.epoll()
        self.by_fd: dict[int, _Connection] = {}
        self.timers: list[tuple[float, int, _Connection]] = []
        self.in_flight = 0
        for conn in self.connections:
            self._connect(conn)

    def close(self) -> None:
        for conn in self.connections:
            if conn.sock is not None:
                conn.sock.close()
        self.poller.close()

    def _due(self, conn: _Connection) -> float:
        """When ``conn``'s next request is due: in a closed loop, now (or never,
        once the phase ends); in an open loop, its agent's turn."""
        if self.interval == 0:
            return -math.inf
        agent = conn.agents[conn.pos]
        return self.t0 + (agent.index / self.fleet.size + conn.round) * self.interval

    def _connect(self, conn: _Connection) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.connect(("127.0.0.1", self.port))
        sock.setblocking(False)
        conn.sock, conn.buffer = sock, b""
        self.by_fd[sock.fileno()] = conn
        self.poller.register(sock.fileno(), select.EPOLLIN)

    def _close(self, conn: _Connection) -> None:
        assert conn.sock is not None
        self.poller.unregister(conn.sock.fileno())
        del self.by_fd[conn.sock.fileno()]
        conn.sock.close()
        conn.sock = None

    def _request(self, conn: _Connection) -> bytes:
        agent = conn.agents[conn.pos]
        conn.agent = agent
        report = agent.index in self.reports
        session = agent.session
        if session is not None and not report and time.monotonic() < agent.session_until:
            # The common case: a session heartbeat, from parts cut once per session.
            conn.signed = conn.report = False
            now_ns = max(time.time_ns(), agent.last_ns + 1)
            agent.last_ns = now_ns
            requests = agent.requests
            if requests is None or requests.key is not session.key:
                requests = agent.requests = SessionRequests(agent.machine_id, session, self.port)
            return requests.request(now_ns)
        body = wire.encode_heartbeat_request(
            agent.machine_id, hardware_report(agent.index) if report else None
        )
        now_ns = max(time.time_ns(), agent.last_ns + 1)
        agent.last_ns = now_ns
        if agent.session is not None and time.monotonic() >= agent.session_until:
            agent.session = None
        headers = request_headers(
            agent.machine_id,
            body,
            now_ns,
            agent.session,
            public_key=agent.public,
            sign=lambda message: Ed25519PrivateKey.from_private_bytes(agent.seed).sign(message),
        )
        conn.signed, conn.report = agent.session is None, report
        head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        return (
            f"POST {protocol.HEARTBEAT_PATH} HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\n"
            f"Accept-Encoding: identity\r\nContent-Length: {len(body)}\r\n{head}\r\n"
        ).encode() + body

    def _send(self, conn: _Connection) -> None:
        """Send ``conn``'s next request (connecting first if needed)."""
        if conn.sock is None:
            self._connect(conn)
        assert conn.sock is not None
        data = self._request(conn)
        self.in_flight += 1
        try:
            conn.sock.sendall(data)  # small: it fits in the socket buffer
        except OSError:
            self._lost(conn)

    def _lost(self, conn: _Connection) -> None:
        """The connection failed: count it and send the request again on a new one."""
        self.result.errors += 1
        self.in_flight -= 1
        if conn.sock is not None:
            self._close(conn)
        if self.result.errors > 10 * len(self.connections) + 100:
            raise RuntimeError(f"{self.result.errors} connection errors: is the server down?")
        self._send(conn)

    def _answered(self, conn: _Connection, status: bytes, body: bytes, now: float) -> None:
        agent = conn.agent
        assert agent is not None
        self.in_flight -= 1
        result = self.result
        if status == b"401" and not conn.signed:
            # The agent's way: drop the session, sign the same heartbeat again at once.
            agent.session = None
            result.resigned += 1
            self._send(conn)
            return
        # Open loop: heartbeats due in the phase; closed: answered in it.
        counted = (conn.due if self.interval else now) < self.end
        if status == b"200":
            if conn.signed or conn.report:
                if conn.report:
                    self.reports.discard(agent.index)
                session = wire.decode_heartbeat_session(body)
                if session is None and self.dummy_sessions:
                    session = DUMMY_SESSION
                if session is not None:
                    agent.session = session
                    agent.session_until = time.monotonic() + 0.9 * session.lifetime_seconds
            if counted:
                result.accepted += 1
                result.reports += conn.report
                lag = now - conn.due if self.interval else 0.0
                result.lags[bisect.bisect_left(LAG_EDGES, lag)] += 1
                second = int(now - self.t0)
                while len(result.per_second) <= second:
                    result.per_second.append(0)
                result.per_second[second] += 1
        elif counted:
            result.refused += 1
        if counted:
            if conn.signed:
                result.signed += 1
            else:
                result.sessions += 1
        conn.agent = None
        if status != b"200" and self.interval:
            # The agent's way: the same heartbeat again after a backoff (1 s,
            # doubling, jittered, at most the interval); the connection waits.
            agent.failures += 1
            backoff = min(2.0 ** (agent.failures - 1), max(self.interval, 1.0))
            conn.due = now + backoff * random.uniform(0.8, 1.0)
            heapq.heappush(self.timers, (conn.due, id(conn), conn))
            return
        agent.failures = 0
        conn.pos += 1
        if conn.pos == len(conn.agents):
            conn.pos, conn.round = 0, conn.round + 1
        conn.due = self._due(conn)
        if (now if self.interval == 0 else conn.due) >= self.end:
            return  # the phase is over for this connection
        if conn.due <= now:
            self._send(conn)
        else:
            heapq.heappush(self.timers, (conn.due, id(conn), conn))

    def _readable(self, conn: _Connection) -> None:
        assert conn.sock is not None
        try:
            data = conn.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            if conn.agent is not None:
                self._lost(conn)
            else:  # closed while idle (keep-alive timeout): reconnect when next due
                self._close(conn)
            return
        conn.buffer += data
        while (answer := split_answer(conn.buffer)) is not None:
            head, body, conn.buffer = answer
            closing = b"connection: close" in head
            if closing:
                self._close(conn)
            self._answered(conn, head[9:12], body, time.monotonic())
            if closing or conn.sock is None:
                return

    def phase(self, t0: float, interval: float, seconds: float, drain: float) -> LoadResult:
        """Heartbeat from monotonic time ``t0`` for ``seconds``: every ``interval``
        (an open loop), or back to back if it is 0 (a closed loop); then up to
        ``drain`` seconds more for the heartbeats still due (sent late, as a
        late agent sends them) and their answers. Agents keep their sessions
        from one phase to the next."""
        self.t0, self.interval, self.end = t0, interval, t0 + seconds
        self.result = result = LoadResult()
        self.timers = []
        for conn in self.connections:
            conn.pos = conn.round = 0
            conn.due = self._due(conn)
            heapq.heappush(self.timers, (conn.due, id(conn), conn))
        before = resource.getrusage(resource.RUSAGE_SELF)
        deadline = self.end + drain
        while (now := time.monotonic()) < deadline:
            while self.timers and self.timers[0][0] <= now:
                _, _, conn = heapq.heappop(self.timers)
                self._send(conn)
            if now >= self.end and not self.in_flight and not self.timers:
                break
            wake = self.timers[0][0] if self.timers else (self.end if now < self.end else deadline)
            for fd, _ in self.poller.poll(max(min(wake, deadline) - now, 0.0)):
                conn_ = self.by_fd.get(fd)
                if conn_ is not None:
                    self._readable(conn_)
        after = resource.getrusage(resource.RUSAGE_SELF)
        result.cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        for conn in self.connections:
            if conn.agent is not None:
                # Still unanswered at the deadline (counted so below): its answer
                # must not arrive in the next phase, so its connection goes.
                conn.agent = None
                if conn.sock is not None:
                    self._close(conn)
        self.in_flight = 0
        result.window = seconds
        if interval:
            due = sum(
                max(0, math.ceil(seconds / interval - a.index / self.fleet.size))
                for a in self.agents
            )
            result.unanswered = max(0, due - result.accepted - result.refused)
        return result


def load_process() -> None:
    """A load process (started by `FleetLoad`, its config the argument): build its
    agents and open their connections, say ready, then run each phase read from
    stdin (a JSON line: start wall time, interval, seconds, drain) and print its
    result (a JSON line), until stdin ends."""
    config = json.loads(sys.argv[1])
    fleet = Fleet(**config["fleet"])
    index, processes = int(config["index"]), int(config["processes"])
    indexes = [i for i in range(index, fleet.size, processes) if not fleet.silent(i)]
    load = _Load(
        fleet,
        indexes,
        int(config["port"]),
        connections=int(config["connections"]),
        dummy_sessions=bool(config["dummy_sessions"]),
    )
    print("ready", flush=True)
    try:
        for line in sys.stdin:
            phase = json.loads(line)
            t0 = time.monotonic() + (float(phase["start"]) - time.time())
            time.sleep(max(0.0, t0 - time.monotonic()))
            result = load.phase(t0, float(phase["interval"]), float(phase["seconds"]),
                                float(phase["drain"]))  # fmt: skip
            print(json.dumps(asdict(result)), flush=True)
    finally:
        load.close()


#: How `FleetLoad` starts a load process (not ``-m``: this module is no benchmark).
_LOAD_PROCESS = "from bench.fleet import load_process; load_process()"


class FleetLoad:
    """``fleet``'s agents (all but the silent) in ``processes`` load processes,
    connected to the agent callback server on 127.0.0.1:``port`` over
    ``connections`` connections in all; a context manager (leaving it ends
    the processes).

    ``dummy_sessions``: MAC with `DUMMY_SESSION` where an answer carries no
    session (a bare endpoint), so that the requests have the same shape as
    with a real server.
    """

    def __init__(
        self,
        port: int,
        fleet: Fleet,
        *,
        processes: int = 1,
        connections: int = 1000,
        dummy_sessions: bool = False,
    ) -> None:
        self.fleet = fleet
        self.procs: list[subprocess.Popen[str]] = []
        try:
            for index in range(processes):
                config = {
                    "fleet": asdict(fleet), "index": index, "processes": processes,
                    "port": port, "connections": max(1, connections // processes),
                    "dummy_sessions": dummy_sessions,
                }  # fmt: skip
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, "-c", _LOAD_PROCESS, json.dumps(config)],
                        cwd=Path(__file__).resolve().parents[1],  # where `bench` imports from
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                )
            for proc in self.procs:
                assert proc.stdout is not None
                if proc.stdout.readline().strip() != "ready":
                    raise RuntimeError("a load process failed to start")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> FleetLoad:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        for proc in self.procs:
            if proc.stdin is not None and not proc.stdin.closed:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def phase(self, interval: float, seconds: float, drain: float = 30.0) -> LoadResult:
        """Run one phase in every load process, starting together (see
        `_Load.phase`); their merged result. Raises RuntimeError if a load
        process fails."""
        self.begin(interval, seconds, drain)
        return self.result()

    def begin(self, interval: float, seconds: float, drain: float = 30.0) -> None:
        """Start a phase (as `phase`) and return at once; `result` waits for it."""
        line = json.dumps(
            {"start": time.time() + 0.2, "interval": interval, "seconds": seconds, "drain": drain}
        )
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(line + "\n")
            proc.stdin.flush()

    def result(self) -> LoadResult:
        """The merged result of the phase `begin` started, once it is over."""
        merged = LoadResult()
        for proc in self.procs:
            assert proc.stdout is not None
            answer = proc.stdout.readline()
            if not answer:
                raise RuntimeError("a load process failed")
            merged.merge(LoadResult(**json.loads(answer)))
        return merged
