"""Agent callback server throughput: accepted heartbeats/s against a bare endpoint, one run.

    python -m bench.heartbeat [--agents 1000] [--seconds 10] [--rounds 1]
                              [--workers N] [--clients 2] [--pending] [--smoke]

The server runs as ``--workers`` processes on one port (SO_REUSEPORT, as
``python -m shepherd.agent_server --workers N`` runs them; default one per
CPU), sharing one agent session secret (as those workers do), on
`shepherd.agent_server.http1`, plain HTTP on loopback, in these modes with
the same stack:

- bare: the same transport and Connect layer (framing, size and deadline
  limits) with a handler that answers an empty HeartbeatResponse and checks
  nothing, writes nothing;
- auth: the same with the full authentication that needs no database
  (parse, freshness, session token and MAC), writing nothing: full/auth is
  the share the database write (group commit, BMDB session) leaves;
- full: the real agent callback server: session check, its BMDB session,
  group commit of concurrent heartbeats in one statement that authenticates
  against the AgentStarted tag, refuses replays and writes the heartbeats,
  each answered after its commit, in a PostgreSQL 15 of its own;
- full-signed (for information): the same server with every request
  signed (Ed25519), as agents did before sessions and as each does once an
  hour (and after a server restart) to get a new session;
- bare and full again on the hand-written HTTP/1.1 parser that llhttp
  replaced (`bench.http1_handwritten`, swapped into the server processes):
  the server's CPU per answer on llhttp over that on the old parser, the
  measure the switch was decided on (goal <= 1). Before the servers, the
  parsing of one heartbeat request alone is timed with both, in this
  process (the transport's own parse path: callbacks, limits, the Connect
  check; the old: its head parser, framing and body slicing).

The load: ``--agents`` simulated agents, each with its own machine in the
BMDB and its own Ed25519 key, sent like the real agent sends: each on its
own kept-alive connection, back to back (a closed loop, no pause), all
agents at once. Before the clock starts, each agent sends one signed
heartbeat (so the server of the mode, which has a new secret, issues it a
session, as the real agent's first heartbeat does) and its requests are
prepared with that session: token and HMAC-SHA256, each with a newer time,
so none is a replay (full-signed: each signed, with ``cryptography``; bare:
the same shape with a dummy session, since bare issues none). The timed
window thus holds what an agent sends for all but its first heartbeat of
an hour. The agents are split over ``--clients`` load processes, each a
bare epoll loop so that the load costs far less CPU than the server; their
CPU is printed.

With ``--pending`` every machine has an OS installation request stored and
no report of it, so that each full-mode answer carries the request (read
by the group's statement): the heartbeat path while a fleet installs.

Prints answers/s of each mode, the ratio full/bare (goal >= 0.5; and the
same ratio of what this machine's cores sustain given each mode's CPU
per answer of server, PostgreSQL and load, which the machine's other work
moves less than wall-clock rates), the
headroom over what ``--agents`` agents at a 10 s interval need (goal >=
10x), and the cost per accepted heartbeat: database transactions, and CPU
time of server, PostgreSQL (all its processes, from /proc) and load.
Because the wall-clock rate on a shared machine follows its load (printed
too), it also prints what one core sustains given the CPU time server and
PostgreSQL spent per heartbeat.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import json
import os
import resource
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from statistics import median

import psycopg
import trio
import trio.testing
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import bmdb
from bench import http1_handwritten
from bench.ratios import report
from bench.smoke import parse_args
from bmdb import Provider, Queries
from bmdb.localserver import TEMPLATE_DB, LocalPostgres, start_with_template
from common.numbers import parse_decimal
from shepherd.agent import protocol
from shepherd.agent_server import AgentServerConfig, ConnectUnary, http1, run_agent_server
from shepherd.agent_server.answers import session_response
from shepherd.agent_server.authenticate import DEFAULT_FRESHNESS, authenticate
from shepherd.agent_server.connect import ConnectError, Handler, Limits
from shepherd.agent_server.server import serve_app, tune_gc
from shepherd.agent_server.service import HeartbeatService
from shepherd.agent_server.session import TOKEN_BYTES, SessionKeys, new_secret
from shepherd.agent_server.workers import default_workers, reserve_port
from shepherd.proto.agent_callback import (
    AgentSession,
    HeartbeatRequest,
    HeartbeatResponse,
    MetropolisInstallationRequest,
    OsInstallationRequest,
)

#: The interval the goal is stated for.
TARGET_INTERVAL = 10.0


# --- the server process -----------------------------------------------------


#: The modes, in the order they run.
async def _bare(headers: object, body: bytes) -> bytes:
    return b""


def _authenticated(sessions: SessionKeys) -> Handler:
    async def handler(headers: Mapping[str, str], body: bytes) -> bytes:
        now = time.time_ns()
        beat = authenticate(
            headers, body, now_ns=now, freshness=DEFAULT_FRESHNESS, sessions=sessions
        )
        return session_response(sessions, beat, now) if beat.signed else b""

    return handler


#: The environment variable that sets the servers' group commit window, seconds
#: (default: the server's).
BATCH_WINDOW = "HEARTBEAT_BENCH_BATCH_WINDOW"

#: A mode's suffix: the same on the hand-written parser (`bench.http1_handwritten`).
HANDWRITTEN = "-handwritten"


async def _serve(mode: str, listen: str, url: str, secret: bytes) -> None:
    # One of --workers processes on the port, as `python -m shepherd.agent_server`
    # runs them: the same session secret in all.
    if mode.endswith(HANDWRITTEN):
        http1_handwritten.install()
        mode = mode.removesuffix(HANDWRITTEN)
    config = AgentServerConfig(
        listen=listen,
        reuse_port=True,
        agent_session_secret=secret,
        batch_window=float(os.environ.get(BATCH_WINDOW, AgentServerConfig.batch_window)),
    )
    if mode in ("bare", "auth"):
        handler = _bare if mode == "bare" else _authenticated(SessionKeys(secret))
        await serve_app(ConnectUnary({protocol.HEARTBEAT_PATH: handler}, config.limits), config)
        return
    async with bmdb.open_connection(url) as conn:
        if mode == "full-relay":
            await _serve_relay(conn, config, secret)
        else:
            await run_agent_server(conn, config)


# --- a relay (measured, not adopted): one request, several agents' heartbeats ---

#: The relay's method (this benchmark's own; no server serves it).
RELAY_PATH = "/cloud.bmaas.server.api.AgentCallback/HeartbeatRelay"
#: Agents' heartbeats per relayed request.
RELAY_SIZE = 20


def relay_body(entries: list[tuple[dict[str, str], bytes]]) -> bytes:
    """A relayed request's body: each agent's heartbeat headers and body as
    it would send them alone (its own time and MAC or signature), framed by
    lengths (4 bytes each, big-endian)."""
    out = bytearray()
    for headers, body in entries:
        head = "".join(f"{name}: {value}\n" for name, value in headers.items()).encode()
        out += len(head).to_bytes(4, "big") + head + len(body).to_bytes(4, "big") + body
    return bytes(out)


def _relay_entries(body: bytes) -> list[tuple[dict[str, str], bytes]]:
    entries = []
    at = 0
    while at < len(body):
        size = int.from_bytes(body[at : at + 4], "big")
        head = body[at + 4 : at + 4 + size].decode("latin-1")
        at += 4 + size
        size = int.from_bytes(body[at : at + 4], "big")
        entries.append(
            (
                {
                    name.lower(): value
                    for name, _, value in (line.partition(": ") for line in head.splitlines())
                },
                body[at + 4 : at + 4 + size],
            )
        )
        at += 4 + size
    return entries


def relay_accepted(answer: bytes) -> tuple[int, int]:
    """(accepted, refused) entries of a relayed request's answer."""
    accepted = refused = 0
    at = 0
    while at < len(answer):
        ok = answer[at] == 0
        accepted += ok
        refused += not ok
        at += 5 + int.from_bytes(answer[at + 1 : at + 5], "big")
    return accepted, refused


def _relay(service: HeartbeatService) -> Handler:
    """Each entry handled as the Heartbeat method handles a request (its own
    authentication, group commit with all others); the answer is each
    entry's outcome (0 and its answer, or 1 and the Connect code), in order."""

    async def handler(headers: Mapping[str, str], body: bytes) -> bytes:
        entries = _relay_entries(body)
        answers = [b""] * len(entries)

        async def one(index: int, headers: dict[str, str], body: bytes) -> None:
            try:
                answer = b"\x00" + await service.heartbeat(headers, body)
            except ConnectError as exc:
                answer = b"\x01" + exc.code.encode()
            answers[index] = answer[:1] + (len(answer) - 1).to_bytes(4, "big") + answer[1:]

        async with trio.open_nursery() as nursery:
            for index, (entry_headers, entry_body) in enumerate(entries):
                nursery.start_soon(one, index, entry_headers, entry_body)
        return b"".join(answers)

    return handler


async def _serve_relay(conn: bmdb.Connection, config: AgentServerConfig, secret: bytes) -> None:
    """The real service (without its BMDB session) with the relay beside Heartbeat."""
    service = HeartbeatService(
        conn,
        db_slots=config.db_slots,
        queue_timeout=config.queue_timeout,
        batch_window=config.batch_window,
        sessions=SessionKeys(secret),
    )
    routes = {protocol.HEARTBEAT_PATH: service.heartbeat, RELAY_PATH: _relay(service)}
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        await serve_app(ConnectUnary(routes, config.limits), config)


async def _serve_until_sigint(mode: str, listen: str, url: str, secret: bytes) -> None:
    """Serve until SIGINT (how the benchmark stops a server): a clean exit,
    so that a profile is written and no coroutine is abandoned."""
    with trio.open_signal_receiver(signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_serve, mode, listen, url, secret)
            async for _ in signals:
                nursery.cancel_scope.cancel()
                break


# --- the load ---------------------------------------------------------------


@dataclass
class Load:
    """Prepared requests per agent, and what came back."""

    requests: list[list[bytes]]
    ok: int = 0
    refused: int = 0
    errors: int = 0
    #: Its requests are relayed (`RELAY_PATH`): ``ok`` and ``refused`` count
    #: their entries.
    relay: bool = False


def _request(machine_id: str, time_ns: int, auth: dict[str, str]) -> bytes:
    body = bytes(HeartbeatRequest(machine_id=machine_id))
    head = (
        f"POST {protocol.HEARTBEAT_PATH} HTTP/1.1\r\n"
        "Host: 127.0.0.1\r\n"
        "Content-Type: application/proto\r\n"
        "Connect-Protocol-Version: 1\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"{protocol.HEADER_TIME}: {time_ns}\r\n"
        + "".join(f"{name}: {value}\r\n" for name, value in auth.items())
        + "\r\n"
    )
    return head.encode() + body


def _message(machine_id: str, time_ns: int) -> bytes:
    body = bytes(HeartbeatRequest(machine_id=machine_id))
    return protocol.signed_message("POST", protocol.HEARTBEAT_PATH, machine_id, time_ns, body)


def signed_request(machine_id: str, key: Ed25519PrivateKey, public: bytes, time_ns: int) -> bytes:
    signature = key.sign(_message(machine_id, time_ns))
    auth = {
        protocol.HEADER_KEY: base64.b64encode(public).decode(),
        protocol.HEADER_SIGNATURE: base64.b64encode(signature).decode(),
    }
    return _request(machine_id, time_ns, auth)


def session_request(machine_id: str, session: AgentSession, time_ns: int) -> bytes:
    mac = protocol.session_mac(session.key, _message(machine_id, time_ns))
    auth = {
        protocol.HEADER_SESSION: base64.b64encode(session.token).decode(),
        protocol.HEADER_MAC: base64.b64encode(mac).decode(),
    }
    return _request(machine_id, time_ns, auth)


Agent = tuple[str, Ed25519PrivateKey, bytes]

#: What the load uses where the server issued no session (bare): the same shape.
DUMMY_SESSION = AgentSession(bytes(TOKEN_BYTES), bytes(32), 3600)


def open_sessions(port: int, agents: list[Agent]) -> list[AgentSession]:
    """One signed heartbeat per agent, all at once; the session each was answered with."""
    now = time.time_ns()
    load = Load([[signed_request(mid, key, public, now)] for mid, key, public in agents])
    answers: list[bytes] = [b""] * len(agents)
    run_load(port, load, 120.0, answers)
    if load.ok != len(agents):
        raise RuntimeError(f"only {load.ok} of {len(agents)} signed heartbeats accepted")
    return [HeartbeatResponse.parse(a).session or DUMMY_SESSION for a in answers]


def make_load(agents: list[Agent], sessions: list[AgentSession] | None, per_agent: int) -> Load:
    """``per_agent`` requests per agent, each newer than the last: with the
    agent's session, or signed if ``sessions`` is None."""
    now = time.time_ns()
    if sessions is None:
        return Load(
            [
                [signed_request(mid, key, public, now + i) for i in range(per_agent)]
                for mid, key, public in agents
            ]
        )
    return Load(
        [
            [session_request(mid, session, now + i) for i in range(per_agent)]
            for (mid, _, _), session in zip(agents, sessions, strict=True)
        ]
    )


def make_relay_load(
    port: int, agents: list[Agent], sessions: list[AgentSession], per_agent: int
) -> Load:
    """As `make_load` with sessions, each `RELAY_SIZE` agents' heartbeats relayed
    together: one connection per relay, each request one heartbeat of each."""
    now = time.time_ns()
    requests = []
    for first in range(0, len(agents), RELAY_SIZE):
        group = list(zip(agents[first : first + RELAY_SIZE], sessions[first:], strict=False))
        queue = []
        for i in range(per_agent):
            entries = []
            for (mid, _, _), session in group:
                time_ns = now + i
                mac = protocol.session_mac(session.key, _message(mid, time_ns))
                headers = {
                    protocol.HEADER_TIME: str(time_ns),
                    protocol.HEADER_SESSION: base64.b64encode(session.token).decode(),
                    protocol.HEADER_MAC: base64.b64encode(mac).decode(),
                }
                entries.append((headers, bytes(HeartbeatRequest(machine_id=mid))))
            body = relay_body(entries)
            head = (
                f"POST {RELAY_PATH} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                f"Content-Type: application/proto\r\nContent-Length: {len(body)}\r\n\r\n"
            )
            queue.append(head.encode() + body)
        requests.append(queue)
    return Load(requests, relay=True)


class _Agent:
    """One simulated agent's connection in the load loop."""

    def __init__(self, index: int, queue: list[bytes]) -> None:
        self.index = index
        self.queue = queue
        self.next = 0
        self.sock: socket.socket | None = None
        self.out = b""
        self.buffer = b""


def split_answer(buffer: bytes) -> tuple[bytes, bytes, bytes] | None:
    """The first whole HTTP/1.1 answer in ``buffer`` (with a Content-Length):
    (its head, lowercased; its body; the bytes after it), or None if not all there."""
    end = buffer.find(b"\r\n\r\n")
    if end < 0:
        return None
    head = buffer[:end].lower()
    length = int(head.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
    if len(buffer) < end + 4 + length:
        return None
    return head, buffer[end + 4 : end + 4 + length], buffer[end + 4 + length :]


def run_load(port: int, load: Load, seconds: float, answers: list[bytes] | None = None) -> float:
    """Run every agent until ``seconds`` pass (or its requests run out); return the time taken.

    Each agent sends its requests back to back on one kept-alive connection
    (reconnecting if it closes), as the agent does. A bare epoll loop, not
    Trio: the load must cost far less CPU than the server it measures.
    ``answers``, if given, gets the body of each agent's last answer.
    """
    poller = select.epoll()
    agents: dict[int, _Agent] = {}

    def connect(agent_: _Agent) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        sock.connect_ex(("127.0.0.1", port))
        agent_.sock, agent_.buffer = sock, b""
        agent_.out = agent_.queue[agent_.next]
        agents[sock.fileno()] = agent_
        poller.register(sock.fileno(), select.EPOLLOUT)

    def drop(agent_: _Agent, error: bool) -> None:
        assert agent_.sock is not None
        if error:
            load.errors += 1
        poller.unregister(agent_.sock.fileno())
        del agents[agent_.sock.fileno()]
        agent_.sock.close()
        agent_.sock = None
        if agent_.next < len(agent_.queue):
            connect(agent_)

    for index, queue in enumerate(load.requests):
        connect(_Agent(index, queue))
    start = time.monotonic()
    end = start + seconds
    while agents and (now := time.monotonic()) < end:
        for fd, events in poller.poll(end - now):
            agent_ = agents.get(fd)
            if agent_ is None or agent_.sock is None:
                continue
            try:
                if events & select.EPOLLOUT:
                    sent = agent_.sock.send(agent_.out)
                    agent_.out = agent_.out[sent:]
                    if not agent_.out:
                        poller.modify(fd, select.EPOLLIN)
                    continue
                data = agent_.sock.recv(65536)
            except OSError:
                drop(agent_, error=True)
                continue
            if not data:
                drop(agent_, error=True)
                continue
            agent_.buffer += data
            answer = split_answer(agent_.buffer)
            if answer is None:
                continue
            head, body, agent_.buffer = answer
            if answers is not None:
                answers[agent_.index] = body
            if not head.startswith(b"http/1.1 200"):
                load.refused += 1
            elif load.relay:
                accepted, refused = relay_accepted(body)
                load.ok += accepted
                load.refused += refused
            else:
                load.ok += 1
            agent_.next += 1
            if b"connection: close" in head or agent_.next >= len(agent_.queue):
                drop(agent_, error=False)
                continue
            agent_.out = agent_.queue[agent_.next]
            sent = agent_.sock.send(agent_.out)
            agent_.out = agent_.out[sent:]
            if agent_.out:
                poller.modify(fd, select.EPOLLOUT)
    elapsed = time.monotonic() - start
    for agent_ in list(agents.values()):
        if agent_.sock is not None:
            agent_.sock.close()
    poller.close()
    return elapsed


def _client(mode: str, port: int, seconds: float, agents_file: Path) -> None:
    """A load process: open its agents' sessions, prepare their requests,
    say ready, wait for "go", load, report.

    Its result (a JSON line on stdout): answers by kind, seconds taken,
    and its own CPU seconds during the load.
    """
    rows = json.loads(agents_file.read_text())
    agents = [
        (mid, Ed25519PrivateKey.from_private_bytes(bytes.fromhex(seed)), bytes.fromhex(public))
        for mid, seed, public in rows
    ]
    sessions = None if mode == "full-signed" else open_sessions(port, agents)
    # Enough requests that no agent runs out within the time, at up to
    # PER_PROCESS_RATE answers/s for this process.
    per_agent = int(seconds * PER_PROCESS_RATE / len(agents)) + 2
    if mode == "full-relay":
        assert sessions is not None
        load = make_relay_load(port, agents, sessions, per_agent)
    else:
        load = make_load(agents, sessions, per_agent)
    print("ready", flush=True)
    sys.stdin.readline()
    before = resource.getrusage(resource.RUSAGE_SELF)
    elapsed = run_load(port, load, seconds)
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    result = {"ok": load.ok, "refused": load.refused, "errors": load.errors}
    print(json.dumps({**result, "elapsed": elapsed, "cpu": cpu}), flush=True)


#: Most answers/s one load process is expected to see (requests are made beforehand).
PER_PROCESS_RATE = 6000


# --- measurements -----------------------------------------------------------


def parse_microseconds(count: int) -> tuple[float, float]:
    """CPU microseconds to parse one session heartbeat request, in this
    process: (hand-written, llhttp), each the best of three runs of ``count``.

    Each path goes from the request's bytes to what the handler is called
    with: head, headers by name, the Connect check, framing and the body.
    """
    machine_id = "00000000-0000-4000-8000-000000000000"
    data = session_request(machine_id, DUMMY_SESSION, time.time_ns())
    app = ConnectUnary({protocol.HEARTBEAT_PATH: _bare}, Limits())
    server = http1._Server(app, None, http1.Timeouts())
    conn = http1._Connection(server, trio.testing.MemoryReceiveStream())  # type: ignore[arg-type]

    def llhttp() -> None:
        conn.feed(data)
        conn.ready.popleft()

    def handwritten() -> None:
        buffer = bytearray(data)
        end = buffer.find(b"\r\n\r\n")
        head = bytes(buffer[:end])
        del buffer[: end + 4]
        method, path, version, headers = http1_handwritten.parse_head(head)
        http1_handwritten.keeps_alive(version, headers.get("connection", ""))
        app.check(method, path, headers)
        length = parse_decimal(headers["content-length"], max_digits=12)
        bytes(buffer[:length])
        del buffer[:length]

    best = []
    for parse in (handwritten, llhttp):
        times = []
        for _ in range(3):
            started = time.process_time()
            for _ in range(count):
                parse()
            times.append((time.process_time() - started) / count * 1e6)
        best.append(min(times))
    return best[0], best[1]


def per_answer(result: Result) -> float:
    """Server CPU milliseconds per answer."""
    return 1000 * result.server_cpu / max(result.ok + result.refused, 1)


def machine_capacity(result: Result, cores: int) -> float:
    """Answers/s this machine's ``cores`` sustain at ``result``'s CPU per
    answer of server, PostgreSQL and load together."""
    cpu = result.server_cpu + result.db_cpu + result.client_cpu
    return cores * max(result.ok, 1) / max(cpu, 1e-9)


def cpu_seconds(pids: list[int]) -> dict[int, float]:
    """CPU seconds (user + system) so far of each of ``pids`` still alive."""
    cpu = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        cpu[pid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    return cpu


def postgres_pids(server: LocalPostgres) -> list[int]:
    """The postmaster and all its children now (backends come and go with pool connections)."""
    postmaster = int((server.data / "postmaster.pid").read_text().split()[0])
    children = subprocess.run(
        ["pgrep", "-P", str(postmaster)], capture_output=True, text=True, check=False
    ).stdout.split()
    return [postmaster, *(int(c) for c in children)]


def spent(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds spent between two snapshots (processes born meanwhile count whole)."""
    return sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items())


def commits(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
        assert row is not None
        return int(row[0])


async def _setup(url: str, count: int, pending: bool = False) -> list[tuple[str, bytes, bytes]]:
    """``count`` machines with started agents: (machine id, private seed, public key);
    with ``pending``, each with an OS installation request of ~450 bytes."""
    request = bytes(
        OsInstallationRequest(
            generation=1,
            metropolis=MetropolisInstallationRequest(
                node_parameters=b"p" * 300, root_device="disk0", os_image=b"i" * 120
            ),
        )
    )
    keys = [Ed25519PrivateKey.generate() for _ in range(count)]
    seeds = [k.private_bytes_raw() for k in keys]
    publics = [k.public_key().public_bytes_raw() for k in keys]

    async def fn(q: Queries) -> list[str]:
        ids = []
        now = datetime.datetime.now(datetime.UTC)
        for i, public in enumerate(publics):
            mid = await q.new_machine()
            await q.add_provided(mid, Provider.STATIC, f"bench-{i}")
            await q.set_agent_started(mid, now, public)
            if pending:
                await q.set_os_installation_request(mid, 1, request)
            ids.append(str(mid))
        return ids

    async with bmdb.open_connection(url) as conn:
        ids = await conn.transact(fn)
    return list(zip(ids, seeds, publics, strict=True))


def _wait_listening(port: int, processes: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in processes):
            raise RuntimeError("a server process exited at start")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("server did not start")


def start_servers(mode: str, url: str, workers: int) -> tuple[list[subprocess.Popen[bytes]], int]:
    """``workers`` server processes of ``mode`` on one port (SO_REUSEPORT), all listening."""
    reserved, listen = reserve_port("127.0.0.1:0")
    port = int(listen.rsplit(":", 1)[1])
    profile = os.environ.get("HEARTBEAT_BENCH_PROFILE")  # a folder: cProfile the servers
    processes: list[subprocess.Popen[bytes]] = []
    # One secret for the mode's workers, on their stdin (as the agent server's supervisor does).
    secret = new_secret().hex().encode() + b"\n"
    try:
        for index in range(workers):
            python = [sys.executable]
            if profile:
                python += ["-m", "cProfile", "-o", str(Path(profile) / f"{mode}-{index}.prof")]
            process = subprocess.Popen(
                [*python, "-m", "bench.heartbeat", "serve", mode, listen, url],
                stdin=subprocess.PIPE,
            )
            processes.append(process)
            assert process.stdin is not None
            process.stdin.write(secret)
            process.stdin.close()
        # One answering is not all listening: wait for every socket, so that
        # the load is spread over all of them from the start.
        _wait_listening(port, processes)
        _wait_all_bound(port, workers)
    except BaseException:
        stop_servers(processes)
        raise
    finally:
        reserved.close()
    return processes, port


def _wait_all_bound(port: int, workers: int) -> None:
    """Until ``workers`` sockets listen on ``port`` (per /proc/net/tcp), at most 120 s."""
    hex_port = f":{port:04X}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        listening = 0
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[1].endswith(hex_port) and fields[3] == "0A":  # LISTEN
                listening += 1
        if listening >= workers:
            return
        time.sleep(0.05)
    raise RuntimeError("not every server process listens")


def stop_servers(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)  # a clean exit, so that a profile gets written
    for process in processes:
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass
class Result:
    rate: float
    ok: int
    refused: int
    errors: int
    server_cpu: float
    db_cpu: float
    client_cpu: float
    commits: int


def measure(
    mode: str,
    server: LocalPostgres,
    url: str,
    agents_files: list[Path],
    seconds: float,
    workers: int,
) -> Result:
    processes, port = start_servers(mode, url, workers)
    clients: list[subprocess.Popen[str]] = []
    try:
        for agents_file in agents_files:
            clients.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "bench.heartbeat",
                        "client",
                        mode,
                        str(port),
                        str(seconds),
                        str(agents_file),
                    ],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        for client in clients:
            assert client.stdout is not None
            if client.stdout.readline().strip() != "ready":
                raise RuntimeError("a load process failed")
        server_pids = [p.pid for p in processes]
        pg_pids = postgres_pids(server)
        cpu0, db0, commits0 = cpu_seconds(server_pids), cpu_seconds(pg_pids), commits(url)
        for client in clients:
            assert client.stdin is not None
            client.stdin.write("go\n")
            client.stdin.flush()
        results = []
        for client in clients:
            assert client.stdout is not None
            results.append(json.loads(client.stdout.readline()))
        cpu1, db1 = cpu_seconds(server_pids), cpu_seconds(postgres_pids(server))
        commits1 = commits(url)
    finally:
        for client in clients:
            if client.poll() is None:
                client.kill()
            client.wait()
        stop_servers(processes)
    ok = sum(r["ok"] for r in results)
    refused = sum(r["refused"] for r in results)
    elapsed = max(r["elapsed"] for r in results)
    # commits' own transaction counts once.
    return Result(
        (ok + refused) / elapsed,
        ok,
        refused,
        sum(r["errors"] for r in results),
        spent(cpu0, cpu1),
        spent(db0, db1),
        sum(r["cpu"] for r in results),
        commits1 - commits0 - 1,
    )


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "serve":
        secret = bytes.fromhex(sys.stdin.readline())
        tune_gc()  # as `python -m shepherd.agent_server` does
        trio.run(_serve_until_sigint, sys.argv[2], sys.argv[3], sys.argv[4], secret)
        return
    if len(sys.argv) == 6 and sys.argv[1] == "client":
        _client(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), Path(sys.argv[5]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--workers", type=int, default=default_workers(), help="server processes (%(default)s)"
    )
    parser.add_argument("--clients", type=int, default=2, help="load processes (%(default)s)")
    parser.add_argument(
        "--pending",
        action="store_true",
        help="every machine has a pending OS installation request (answers carry it)",
    )
    parser.add_argument(
        "--parse-count", type=int, default=20000, help="requests parsed in the timing of parsing"
    )
    args = parse_args(
        parser, {"agents": 4, "seconds": 0.2, "workers": 1, "clients": 1, "parse_count": 10}
    )

    root = Path(tempfile.mkdtemp(prefix="heartbeat-bench-"))
    server = start_with_template(root)
    try:
        url = server.create_database("bench", template=TEMPLATE_DB)
        agents = trio.run(_setup, url, args.agents, args.pending)
        agents_files = []
        for index in range(args.clients):
            part = [
                (mid, seed.hex(), public.hex())
                for mid, seed, public in agents[index :: args.clients]
            ]
            agents_files.append(root / f"agents-{index}.json")
            agents_files[-1].write_text(json.dumps(part))
        old_us, new_us = parse_microseconds(args.parse_count)
        print(
            f"parsing one session heartbeat request (CPU, in this process): hand-written"
            f" {old_us:.2f} us, llhttp {new_us:.2f} us: llhttp / hand-written"
            f" {new_us / old_us:.2f}",
            flush=True,
        )
        ratios, rates, auth_ratios, capacities = [], [], [], []
        cpu_ratios, parser_ratios = [], []
        for round_ in range(args.rounds):

            def run(mode: str) -> Result:
                return measure(mode, server, url, agents_files, args.seconds, args.workers)

            bare = run("bare")
            bare_old = run("bare" + HANDWRITTEN)
            auth = run("auth")
            full = run("full")
            full_old = run("full" + HANDWRITTEN)
            signed = run("full-signed")
            relay = run("full-relay")
            parser_ratios.append(per_answer(full) / max(per_answer(full_old), 1e-9))
            ratio = full.rate / bare.rate
            auth_ratios.append(full.rate / auth.rate)
            ratios.append(ratio)
            rates.append(full.rate)
            need = args.agents / TARGET_INTERVAL
            per = max(full.ok, 1)
            # The shared test machine's wall-clock rates swing with its load;
            # CPU time per heartbeat says what one core could sustain.
            per_core = per / max(full.server_cpu + full.db_cpu, 1e-9)
            # ... and all of this machine's cores, the load's CPU counted too.
            cores = len(os.sched_getaffinity(0))
            per_machine = cores * per / max(full.server_cpu + full.db_cpu + full.client_cpu, 1e-9)
            capacities.append(per_machine)
            cpu_ratios.append(per_machine / machine_capacity(bare, cores))
            load_average = " ".join(Path("/proc/loadavg").read_text().split()[:3])
            print(
                f"round {round_ + 1}: {args.agents} agents, {args.seconds:g}s each mode,"
                f" {args.workers} server processes, {args.clients} load processes\n"
                f"  bare: {bare.rate:8.0f} answers/s  (server CPU {bare.server_cpu:.1f}s,"
                f" load CPU {bare.client_cpu:.1f}s, errors {bare.errors})\n"
                f"  auth: {auth.rate:8.0f} answers/s  (server CPU {auth.server_cpu:.1f}s,"
                f" load CPU {auth.client_cpu:.1f}s, errors {auth.errors})\n"
                f"  full: {full.rate:8.0f} heartbeats/s accepted {full.ok}, refused"
                f" {full.refused}, errors {full.errors} (server CPU {full.server_cpu:.1f}s,"
                f" PostgreSQL CPU {full.db_cpu:.1f}s, load CPU {full.client_cpu:.1f}s)\n"
                f"  on the hand-written parser: bare {bare_old.rate:8.0f} answers/s, full"
                f" {full_old.rate:8.0f} heartbeats/s (errors {bare_old.errors + full_old.errors});"
                f" server CPU per answer, llhttp / hand-written: bare"
                f" {per_answer(bare):.4f} / {per_answer(bare_old):.4f} ms ="
                f" {per_answer(bare) / max(per_answer(bare_old), 1e-9):.2f}, full"
                f" {per_answer(full):.4f} / {per_answer(full_old):.4f} ms ="
                f" {parser_ratios[-1]:.2f} (goal <= 1)\n"
                f"  full-signed (for information): {signed.rate:8.0f} heartbeats/s accepted"
                f" {signed.ok}, refused {signed.refused}, errors {signed.errors}"
                f" (server CPU {1000 * signed.server_cpu / max(signed.ok, 1):.3f} ms a heartbeat),"
                f" {signed.rate / bare.rate:.2f} of bare\n"
                f"  relayed, {RELAY_SIZE} agents' heartbeats a request (measured, not adopted):"
                f" {relay.rate:8.0f} heartbeats/s accepted {relay.ok}, refused {relay.refused},"
                f" errors {relay.errors}; per heartbeat server CPU"
                f" {1000 * relay.server_cpu / max(relay.ok, 1):.3f} ms, PostgreSQL"
                f" {1000 * relay.db_cpu / max(relay.ok, 1):.3f} ms, load"
                f" {1000 * relay.client_cpu / max(relay.ok, 1):.3f} ms;"
                f" {relay.rate / full.rate:.2f} times full's rate\n"
                f"  ratio full/bare: {ratio:.2f} (goal >= 0.5);"
                f" full/auth (the database's share): {auth_ratios[-1]:.2f};"
                f" full/bare of what this machine's CPU sustains at each mode's CPU per answer"
                f" (server, PostgreSQL, load): {cpu_ratios[-1]:.2f}\n"
                f"  headroom for {args.agents} agents every {TARGET_INTERVAL:g}s"
                f" ({need:.0f}/s): {full.rate / need:.1f}x (goal >= 10x)\n"
                f"  per accepted heartbeat: {full.commits / per:.3f} DB transactions,"
                f" {1000 * full.db_cpu / per:.3f} ms PostgreSQL CPU,"
                f" {1000 * full.server_cpu / per:.3f} ms server CPU"
                f" (bare: {1000 * bare.server_cpu / max(bare.ok, 1):.3f} ms,"
                f" auth: {1000 * auth.server_cpu / max(auth.ok, 1):.3f} ms),"
                f" {1000 * full.client_cpu / per:.3f} ms load CPU\n"
                f"  CPU-bound capacity of one core (server + PostgreSQL CPU per heartbeat):"
                f" {per_core:.0f}/s, {per_core / need:.1f}x the need\n"
                f"  CPU-bound capacity of this machine alone ({cores} cores, server + PostgreSQL"
                f" + load CPU): {per_machine:.0f}/s, {per_machine / need:.1f}x the need\n"
                f"  load average during the run: {load_average}",
                flush=True,
            )
        need = args.agents / TARGET_INTERVAL
        report("heartbeat", "full/bare", median(ratios), ">= 0.5")
        report("heartbeat", "full/bare of CPU-bound capacity", median(cpu_ratios), ">= 0.5")
        report("heartbeat", "server CPU per heartbeat, llhttp / hand-written",
               median(parser_ratios), "<= 1")  # fmt: skip
        report("heartbeat", "headroom at 10 s", median(rates) / need, ">= 10")
        if args.rounds > 1:
            print(
                f"median over {args.rounds} rounds: ratio full/bare {median(ratios):.2f}"
                f" (of CPU-bound capacity {median(cpu_ratios):.2f}),"
                f" server CPU per heartbeat llhttp / hand-written {median(parser_ratios):.2f},"
                f" full/auth {median(auth_ratios):.2f},"
                f" headroom {median(rates) / (args.agents / TARGET_INTERVAL):.1f}x,"
                f" CPU-bound headroom of this machine alone"
                f" {median(capacities) / (args.agents / TARGET_INTERVAL):.1f}x"
            )
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
