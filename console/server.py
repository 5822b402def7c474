"""Serving the web UI with hypercorn's Trio worker, inside the caller's Trio run."""

from __future__ import annotations

import logging
from typing import cast

import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve
from hypercorn.typing import ASGIFramework

from bmdb.connection import Connection
from common.cli import leaf_errors
from console.asgi import App
from console.cluster import ClusterView
from console.counts import DEFAULT_PERIOD, CountsCache

logger = logging.getLogger("console")


def _config(listen: str) -> Config:
    config = Config()
    config.bind = [listen]
    # hypercorn's access log would go to stderr per request; ours is quiet.
    config.accesslog = None
    config.errorlog = logging.getLogger("console.hypercorn")
    return config


async def serve(
    conn: Connection,
    listen: str,
    *,
    cluster: ClusterView | None = None,
    counts_period: float = DEFAULT_PERIOD,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the UI of ``conn`` on ``listen`` (``HOST:PORT``; port 0 picks
    one) until cancelled. ``task_status.started`` gets the bound addresses
    (``http://HOST:PORT``). ``cluster``: the cluster pages, if the owner's
    credentials were given. ``counts_period``: seconds the machine list's
    counts per state are reused (`console.counts`). Raises OSError if the
    address cannot be bound.

    The count queries run in a nursery of their own that lives exactly as
    long as the server: cancelling `serve` cancels a query in flight too."""
    try:
        async with trio.open_nursery() as nursery:
            counts = CountsCache(conn, nursery, period=counts_period)
            # App types its scopes and messages as plain mappings; hypercorn's
            # TypedDict unions say the same thing in more words.
            app = cast(ASGIFramework, App(conn, counts, cluster))
            await hypercorn_serve(app, _config(listen), mode="asgi", task_status=task_status)
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # The nursery wraps what the server raised: a bind error is the
        # caller's to read as itself.
        errors = leaf_errors(group)
        if len(errors) == 1 and isinstance(errors[0], OSError):
            raise errors[0] from None
        raise
