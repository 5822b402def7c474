"""Run the agent callback server: hypercorn on Trio, under its own BMDB session.

The session is the server's presence in the BMDB (``agent-callback`` in the
sessions list, and its share of collecting expired sessions). If it is lost
(database gone, stall), a new one is opened once a second. Heartbeats do
not wait for it (see `shepherd.agent_server.service` for why); while the
database is away they are answered ``unavailable`` and agents back off and
retry, so nothing is lost but time.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import hypercorn.trio
import trio
from hypercorn.config import Config

from bmdb import Connection, Session
from bmdb.errors import BMDBError
from shepherd.agent.takeover import HEARTBEAT_PATH
from shepherd.agent_server.connect import ConnectApp, Limits
from shepherd.agent_server.service import DEFAULT_FRESHNESS, HeartbeatService

logger = logging.getLogger("shepherd.agent_server")

#: Component name of the server's BMDB session.
COMPONENT = "agent-callback"


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
    #: A read that waits longer than this many seconds closes the connection
    #: (hypercorn applies it to every read, also between kept-alive requests,
    #: so it must exceed ``keep_alive_timeout``).
    read_timeout: int = 30
    #: Kept-alive connections idle longer than this are closed, seconds;
    #: longer than the agents' heartbeat interval, so that they reuse theirs.
    keep_alive_timeout: float = 25.0
    #: Pending connections the kernel queues (a fleet's agents connect at once
    #: after a server restart).
    backlog: int = 1024
    #: BMDB session interval, seconds.
    session_interval: float = 5.0
    #: Heartbeat transactions at once: fewer than the BMDB connection pool
    #: holds (32 by default), so that the session's poke finds a connection.
    db_slots: int = 24
    #: Longest wait for one of those, seconds; then ``unavailable``.
    queue_timeout: float = 5.0

    def hypercorn(self) -> Config:
        config = Config()
        config.bind = [self.listen]
        if self.certfile is not None:
            config.certfile = str(self.certfile)
            config.keyfile = str(self.keyfile) if self.keyfile is not None else None
        config.read_timeout = self.read_timeout
        config.keep_alive_timeout = self.keep_alive_timeout
        config.backlog = self.backlog
        # Headers beyond this are refused: a heartbeat's are a few hundred bytes.
        config.h11_max_incomplete_size = 16 * 1024
        config.graceful_timeout = 2.0
        config.accesslog = None
        config.errorlog = logging.getLogger("shepherd.agent_server.hypercorn")
        return config


async def serve_app(
    app: Callable[..., Awaitable[None]],
    config: AgentServerConfig,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` with hypercorn until cancelled; ``task_status`` gets the bound URLs."""
    await hypercorn.trio.serve(
        app,
        config.hypercorn(),
        mode="asgi",
        task_status=task_status,
    )


class _SessionHolder:
    """Keeps one live BMDB session open, replacing it when lost."""

    def __init__(self, conn: Connection, runtime_info: str, interval: float) -> None:
        self._conn = conn
        self._info = runtime_info
        self._interval = interval
        self.current: Session | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        started = False
        while True:
            try:
                async with self._conn.session(
                    COMPONENT, self._info, interval=self._interval
                ) as session:
                    self.current = session
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
            await trio.sleep(1.0)


async def run_agent_server(
    conn: Connection,
    config: AgentServerConfig,
    *,
    runtime_info: str = "",
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve heartbeats until cancelled; ``task_status`` gets the bound URLs.

    Runs without trio-asyncio (the BMDB is native Trio). Raises OSError if
    the address cannot be bound. Lost BMDB sessions are replaced; requests
    meanwhile get ``unavailable``.
    """
    holder = _SessionHolder(conn, runtime_info, config.session_interval)
    service = HeartbeatService(
        conn,
        freshness=config.freshness,
        db_slots=config.db_slots,
        queue_timeout=config.queue_timeout,
    )
    routes: Mapping[str, Callable[..., Awaitable[bytes]]] = {HEARTBEAT_PATH: service.heartbeat}
    app = ConnectApp(routes, config.limits)
    async with trio.open_nursery() as nursery:
        await nursery.start(holder.run)
        binds = await nursery.start(functools.partial(serve_app, app, config))
        logger.info("agent callback server listening on %s", ", ".join(binds))
        task_status.started(binds)


def port_of(bind: str) -> int:
    """The port of a URL hypercorn reports (``http://127.0.0.1:41234``)."""
    return int(bind.rsplit(":", 1)[1])
