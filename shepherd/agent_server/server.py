"""Run the agent callback server: `http1` on Trio, under its own BMDB session.

The session is the server's presence in the BMDB (``agent-callback`` in the
sessions list, and its share of collecting expired sessions). If it is lost
(database gone, stall), a new one is opened after a wait that grows while
opening keeps failing (`SESSION_BACKOFF`, jittered) and starts over once a
session was open. Heartbeats do
not wait for it (see `shepherd.agent_server.service` for why); while the
database is away they are answered ``unavailable`` and agents back off and
retry, so nothing is lost but time.
"""

from __future__ import annotations

import functools
import gc
import logging
import random
import ssl
from dataclasses import dataclass, field
from pathlib import Path

import trio

from bmdb import Connection, Session
from bmdb.errors import BMDBError
from common.backoff import ExponentialBackoff, Retrier
from common.listen import split_listen
from common.numbers import parse_decimal
from common.tcp import open_listener
from shepherd.agent.protocol import HEARTBEAT_PATH
from shepherd.agent_server.authenticate import DEFAULT_FRESHNESS
from shepherd.agent_server.connect import ConnectUnary, Limits
from shepherd.agent_server.http1 import Timeouts, serve_http1, url_of
from shepherd.agent_server.service import HeartbeatService
from shepherd.agent_server.session import DEFAULT_LIFETIME, SessionKeys, new_secret

logger = logging.getLogger("shepherd.agent_server")

#: Component name of the server's BMDB session.
COMPONENT = "agent-callback"

#: Waits before reopening a lost BMDB session, seconds.
SESSION_BACKOFF = ExponentialBackoff(0.5, 10.0, jitter=(0.5, 1.0))


#: Net allocations between two collections of the youngest generation:
#: Python's default is 700.
GC_THRESHOLD = 20_000


def tune_gc() -> None:
    """Set this process's cyclic garbage collector up for serving heartbeats
    (for a server process's start, before it serves; not for a library's
    caller, whose process it is).

    A heartbeat makes dozens of short-lived objects and nearly no cyclic
    garbage, so at Python's default the collector ran every few dozen
    heartbeats, walking the young objects (the in-flight connections'
    tasks among them) to free next to nothing. Here it runs every
    `GC_THRESHOLD` net allocations, the older generations at Python's
    ratios (10, 10), and the objects alive now (imported modules, their
    functions and classes) are frozen out of every collection: cyclic
    garbage is still freed, later.
    """
    gc.freeze()
    gc.set_threshold(GC_THRESHOLD, 10, 10)


@dataclass(frozen=True)
class AgentServerConfig:
    """Where and how to serve."""

    #: host:port to listen on (port 0: any free port).
    listen: str = "[::]:8443"
    #: PEM certificate chain and key for TLS; None for plain HTTP (tests, or
    #: behind a TLS-terminating proxy).
    certfile: Path | None = None
    keyfile: Path | None = None
    limits: Limits = field(default_factory=Limits)
    #: Bound on |agent clock - server clock|, seconds.
    freshness: float = DEFAULT_FRESHNESS
    #: Seconds a client may take to read an answer before it is cut off.
    send_timeout: float = 10.0
    #: Kept-alive connections idle longer than this are closed, seconds;
    #: longer than the agents' heartbeat interval, so that they reuse theirs.
    keep_alive_timeout: float = 25.0
    #: Connections at once (per process); more wait in the accept queue.
    max_connections: int = 10000
    #: Pending connections the kernel queues (a fleet's agents connect at once
    #: after a server restart).
    backlog: int = 1024
    #: Listen with SO_REUSEPORT, beside other processes on the same port (the
    #: workers of `shepherd.agent_server.workers`).
    reuse_port: bool = False
    #: BMDB session interval, seconds.
    session_interval: float = 5.0
    #: Heartbeat transactions at once: fewer than the BMDB connection pool
    #: holds (32 by default), so that the session's poke finds a connection.
    db_slots: int = 24
    #: Longest wait of a heartbeat for its group's turn, seconds; then ``unavailable``.
    queue_timeout: float = 5.0
    #: How long the first heartbeat of a group waits for others, seconds.
    batch_window: float = 0.005
    #: The secret agent sessions are made with (`shepherd.agent_server.session`);
    #: None: a new one of this server's own. Workers of one server share one.
    agent_session_secret: bytes | None = field(default=None, repr=False)
    #: How long an agent session is valid, seconds.
    agent_session_lifetime: float = DEFAULT_LIFETIME
    #: Longest hold of a heartbeat's answer that carries nothing, seconds
    #: (the long poll of `shepherd.agent_server.hold`; 0: none, and no
    #: database connection to listen on).
    max_hold: float = 30.0
    #: Heartbeats held at once (per process), fewer than ``max_connections``.
    max_held: int = 8000

    def ssl_context(self) -> ssl.SSLContext | None:
        """The server's TLS context, or None for plain HTTP; OSError/SSLError if unusable."""
        if self.certfile is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.certfile, self.keyfile)
        return context


async def serve_app(
    app: ConnectUnary,
    config: AgentServerConfig,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` until cancelled; ``task_status`` gets the bound URLs.

    Raises OSError if the address cannot be bound (or the TLS files not read).
    """
    context = config.ssl_context()
    host, port = split_listen(config.listen)
    listener = await open_listener(
        host, port, backlog=config.backlog, reuse_port=config.reuse_port, nodelay=True
    )
    # Listening already: connections wait in the accept queue until served.
    task_status.started([url_of(listener, context is not None)])
    await serve_http1(
        app,
        [listener],
        ssl_context=context,
        timeouts=Timeouts(keep_alive=config.keep_alive_timeout, send=config.send_timeout),
        max_connections=config.max_connections,
    )


class _SessionHolder:
    """Keeps one live BMDB session open, replacing it when lost."""

    def __init__(
        self, conn: Connection, runtime_info: str, interval: float, rng: random.Random
    ) -> None:
        self._conn = conn
        self._info = runtime_info
        self._interval = interval
        self._retrier = Retrier(SESSION_BACKOFF, rng)
        self.current: Session | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        started = False
        while True:
            try:
                async with self._conn.session(
                    COMPONENT, self._info, interval=self._interval
                ) as session:
                    self.current = session
                    self._retrier.reset()
                    logger.info("BMDB session %s open", session.id)
                    if not started:
                        started = True
                        task_status.started()
                    await trio.sleep_forever()
            except BMDBError as exc:
                logger.warning("BMDB session lost, reopening: %s", exc)
            finally:
                self.current = None
            if not started:
                started = True
                task_status.started()
            await self._retrier.sleep()


async def run_agent_server(
    conn: Connection,
    config: AgentServerConfig,
    *,
    runtime_info: str = "",
    rng: random.Random | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve heartbeats until cancelled; ``task_status`` gets the bound URLs.

    Runs without trio-asyncio (the BMDB is native Trio). Raises OSError if
    the address cannot be bound. Lost BMDB sessions are replaced; requests
    meanwhile get ``unavailable``. ``rng`` jitters the waits between
    attempts to reopen the session.
    """
    holder = _SessionHolder(
        conn,
        runtime_info,
        config.session_interval,
        rng if rng is not None else random.Random(),
    )
    secret = (
        config.agent_session_secret if config.agent_session_secret is not None else new_secret()
    )
    service = HeartbeatService(
        conn,
        freshness=config.freshness,
        db_slots=config.db_slots,
        queue_timeout=config.queue_timeout,
        batch_window=config.batch_window,
        sessions=SessionKeys(secret, config.agent_session_lifetime),
        max_hold=config.max_hold,
        max_held=config.max_held,
    )
    app = ConnectUnary({HEARTBEAT_PATH: service.heartbeat}, config.limits)
    async with trio.open_nursery() as nursery:
        await nursery.start(holder.run)
        await nursery.start(service.run)
        binds = await nursery.start(functools.partial(serve_app, app, config))
        logger.info("agent callback server listening on %s", ", ".join(binds))
        task_status.started(binds)


def port_of(bind: str) -> int:
    """The port of a URL the server reports (``http://127.0.0.1:41234``); ValueError if none."""
    return parse_decimal(bind.rsplit(":", 1)[-1], max_digits=5, what="port")
