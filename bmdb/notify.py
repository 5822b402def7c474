"""`Listener`: PostgreSQL notifications (``LISTEN``) delivered to a callback, the connection kept.

Some waiters must act when a row is written, not at their next look: the
agent callback server, holding an agent's heartbeat until a request for
that agent appears; the approver, when an agent reports the node it
installed. The statements that write those rows send a notification in
their transaction (`bmdb.model.channels`); a `Listener` hears them::

    listener = conn.listener([channels.AGENT_REQUEST], on_notify, on_listening=catch_up)
    nursery.start_soon(listener.run)
        connect (a connection of its own, outside the pool) -> LISTEN each channel
        -> listening: await on_listening()       the caller reads what it waits for
        -> each notification: on_notify(channel, payload), as it arrives
        -> nothing for `ping_interval` s: SELECT 1 within `ping_timeout` s
        connection lost, ping unanswered, LISTEN refused, on_listening failed:
           not listening; logged (WARNING once per outage); again after a backoff

A notification only says "look again", so nothing is lost when one is
missed: ``on_listening`` runs after every ``LISTEN``, before any
notification of that connection is delivered, and reads the tables as
they are then; every write committed after the ``LISTEN`` is notified.
That covers a restarted server, a failover (a notification is not
replicated: the new primary's listeners hear only its own commits, and
the read after listening covers the rest) and a connection cut silently
(found by the ping). A listener on a standby is refused (``LISTEN`` is
not allowed in recovery) and keeps trying, not listening: its waiters
fall back to their intervals.

The ping bounds how long a connection that the network cut without a
word (no FIN, no RST) is taken for alive: `ping_interval` plus
`ping_timeout`, while the callers' own intervals keep them going.

Cost: one database connection per listener, idle but for the pings and
the notifications; nothing per waiter.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import NoReturn

import psycopg
import trio

from bmdb import pgerrors
from bmdb._pg import PgConnection
from bmdb.errors import BMDBError
from bmdb.pgbounds import Bounds
from common.backoff import ExponentialBackoff, Retrier

__all__ = ["DEFAULT_PING_INTERVAL", "DEFAULT_PING_TIMEOUT", "RECONNECT_BACKOFF", "Listener"]

logger = logging.getLogger("bmdb.notify")

#: Seconds without a word from the server before the listener asks.
DEFAULT_PING_INTERVAL = 10.0
#: Seconds the server has to answer the ping before the connection is
#: taken for lost.
DEFAULT_PING_TIMEOUT = 5.0
#: Waits between attempts to listen again; a connection that listened
#: starts the count over.
RECONNECT_BACKOFF = ExponentialBackoff(0.25, 10.0, jitter=(0.5, 1.0))


def _checked_channel(name: str) -> str:
    if not name or not all(c.islower() or c == "_" for c in name) or not name.isascii():
        raise ValueError(f"channel {name!r}: want lower-case ASCII letters and underscores")
    return name


class Listener:
    """``LISTEN`` on ``channels`` over a connection of its own to ``conninfo``
    (see the module). Made by `bmdb.Connection.listener`."""

    def __init__(
        self,
        conninfo: str,
        bounds: Bounds,
        channels: Sequence[str],
        on_notify: Callable[[str, str], None],
        *,
        on_listening: Callable[[], Awaitable[None]] | None = None,
        ping_interval: float = DEFAULT_PING_INTERVAL,
        ping_timeout: float = DEFAULT_PING_TIMEOUT,
        rng: random.Random | None = None,
    ) -> None:
        """``on_notify(channel, payload)`` runs inside the read that brought
        the notification: it must not block (set an event, wake a task).
        An exception out of it is logged and the listener goes on.
        ``on_listening`` runs after each ``LISTEN``: a `BMDBError` out of
        it counts as a lost connection (logged; listened again later)."""
        if not channels:
            raise ValueError("a listener needs a channel")
        if not ping_interval > 0 or not ping_timeout > 0:
            raise ValueError("ping_interval and ping_timeout must be positive")
        self._conninfo = conninfo
        self._bounds = bounds
        self.channels = tuple(_checked_channel(c) for c in channels)
        self._on_notify = on_notify
        self._on_listening = on_listening
        self.ping_interval = ping_interval
        self.ping_timeout = ping_timeout
        self._retrier = Retrier(RECONNECT_BACKOFF, rng if rng is not None else random.Random())
        #: Whether a ``LISTEN`` is in place now (notifications arrive).
        self.listening = False
        #: Times ``LISTEN`` succeeded (the first, then once per reconnection).
        self.listens = 0
        #: Notifications delivered.
        self.delivered = 0

    def _deliver(self, channel: str, payload: str) -> None:
        self.delivered += 1
        try:
            self._on_notify(channel, payload)
        except Exception:
            logger.exception("notification handler failed on %s", channel)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen until cancelled (see the module); ``task_status`` is told
        once the first attempt ended, listening or not. Raises nothing but
        cancellation; cancelled, the connection is closed."""
        started = False

        def start() -> None:
            nonlocal started
            if not started:
                started = True
                task_status.started()

        outage = False
        while True:
            try:
                await self._listen_once(start)
            except (BMDBError, psycopg.Error, trio.TooSlowError) as exc:
                why = _why(exc)
            finally:
                self.listening = False
            if self._retrier.failures == 0 and self.listens:  # it had listened: a new outage
                outage = False
            if not outage:
                logger.warning("not listening to %s: %s", ", ".join(self.channels), why)
                outage = True
            else:
                logger.debug("still not listening to %s: %s", ", ".join(self.channels), why)
            start()
            await self._retrier.sleep()

    async def _listen_once(self, start: Callable[[], None]) -> NoReturn:
        """One connection: LISTEN, catch up, deliver until it is lost (raises)."""
        pg = await PgConnection.connect(self._conninfo, self._bounds)
        try:
            pg.on_notify(self._deliver)
            for channel in self.channels:
                await pg.execute(f"LISTEN {channel}")
            self.listening = True
            self.listens += 1
            if self.listens > 1:
                logger.info("listening to %s again", ", ".join(self.channels))
            if self._on_listening is not None:
                await self._on_listening()
            self._retrier.reset()
            start()
            while True:
                with trio.move_on_after(self.ping_interval):
                    await pg.wait_for_input()
                    continue
                with trio.fail_after(self.ping_timeout):
                    await pg.execute("SELECT 1")
        finally:
            with trio.CancelScope(shield=True):
                await pg.close()


def _why(exc: BaseException) -> str:
    """One line on why listening ended."""
    if isinstance(exc, trio.TooSlowError):
        return "the server did not answer a ping in time"
    if isinstance(exc, psycopg.Error):
        translated = pgerrors.as_bmdb_error(exc)
        return str(translated) if translated is not None else pgerrors.error_message(exc)
    return str(exc)
