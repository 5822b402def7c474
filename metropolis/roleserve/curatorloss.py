"""Losing the curator in use is expected: say so in one line and call another.

The curator a node's role fetch, directory update or status push talks to
stops during failovers, when its node's ConsensusMember role is revoked, or
when it restarts. The call then fails with UNAVAILABLE (the connection
broke, or no curator answered). Raised to the supervisor, that was logged
as an ERROR with a traceback and retried after the supervisor's growing
backoff (about a minute after a few failovers), which hid real errors and
left the node deaf meanwhile. Here it is one WARNING per outage naming the
curator and the reason, then a new client to whichever curator of the
newest directory answers, after a short backoff bounded by
:data:`MAX_DELAY`::

    endpoints() ─> open_client ─> session(client, connected)
        ▲                            │ UNAVAILABLE / stream ended
        └──── backoff (≤ MAX_DELAY) ◀┘ (other errors: raised)

Cancellation: both helpers are cancelled with their runnable; nothing is
left running. Errors: :class:`RPCError` other than UNAVAILABLE is raised
(to the supervisor, as before), and so is anything that is not an
:class:`RPCError`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NoReturn

from common.backoff import ExponentialBackoff, Retrier
from metropolis.rpc import Client, Endpoint, RPCError, Status, open_client
from metropolis.supervisor import Node

__all__ = ["FIRST_DELAY", "MAX_DELAY", "CuratorOutage", "follow_curators"]

#: The first wait before calling the curators again after losing one.
FIRST_DELAY = 0.1
#: The longest wait: the next curator (an elected leader, a restarted one)
#: is usually there within a second or two, and a node without a curator
#: neither learns its roles nor sends its heartbeat.
MAX_DELAY = 2.0


class CuratorOutage:
    """One runnable's view of losing curators: logging once per outage, and its backoff."""

    def __init__(self, logger: logging.Logger, what: str) -> None:
        """``what`` names the runnable in the log lines ("role fetch")."""
        self._logger = logger
        self._what = what
        self._retry = Retrier(ExponentialBackoff(initial=FIRST_DELAY, maximum=MAX_DELAY))
        self.failing = False

    def lost(self, error: RPCError, curator: str) -> None:
        """Note that ``curator`` failed with ``error``; raise ``error`` unless UNAVAILABLE.

        Logs a WARNING for the first failure of an outage only: a curator
        that stays away must not fill the log.
        """
        if error.code is not Status.UNAVAILABLE:
            raise error
        if not self.failing:
            self._logger.warning(
                "%s: lost curator %s (%s); calling the curators again",
                self._what,
                curator,
                error.message or error.code.name,
            )
        self.failing = True

    def recovered(self, curator: str) -> None:
        """Note that ``curator`` answers; ends an outage (and its backoff)."""
        if self.failing:
            self._logger.info("%s: curator %s answers again", self._what, curator)
        self.failing = False
        self._retry.reset()

    async def backoff(self) -> None:
        """Sleep before the next attempt: doubling from :data:`FIRST_DELAY` up to
        :data:`MAX_DELAY`. Cancellable."""
        await self._retry.sleep()


async def follow_curators(
    node: Node,
    what: str,
    endpoints: Callable[[], Awaitable[Sequence[Endpoint]]],
    context: Any,
    session: Callable[[Client, Callable[[], None]], Awaitable[None]],
) -> NoReturn:
    """Run ``session`` against the curators, again whenever the curator in use is lost.

    ``endpoints`` is asked anew before every connection (so the newest
    directory is used); ``session`` gets the client and a ``connected``
    callback to call once its stream is open (that ends an outage and
    signals the runnable healthy). A session that returns (the curator
    ended its stream) or fails with UNAVAILABLE is a lost curator; see
    :class:`CuratorOutage`. Never returns; cancellable.
    """
    outage = CuratorOutage(node.logger, what)
    while True:
        curator = "(none yet)"
        try:
            async with open_client(await endpoints(), context) as client:
                curator = client.endpoint.address

                def connected(client: Client = client) -> None:
                    nonlocal curator
                    curator = client.endpoint.address
                    outage.recovered(curator)
                    node.signal_healthy()

                await session(client, connected)
                raise RPCError(Status.UNAVAILABLE, "the curator ended the stream")
        except RPCError as e:
            outage.lost(e, curator)
        await outage.backoff()
