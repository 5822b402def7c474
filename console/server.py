"""Serving the web UI on the bounded HTTP/1.1 transport (`common.httpserver`,
the metrics endpoint's), inside the caller's Trio run.

Not hypercorn, which served it before: its sends are shielded and have no
deadline, so a browser (or anything) that stopped reading held its
connection for ever and made the console's shutdown (SIGTERM) hang, and it
rendered pages for up to six pipelined requests of one connection at once;
``tests/operators/test_console_hostile.py`` probes both.
"""

from __future__ import annotations

import trio

from bmdb.connection import Connection
from common.asgi import asgi_handler
from common.cli import leaf_errors
from common.httpserver import DEFAULT_LIMITS, HTTPLimits, serve_http
from console.asgi import App
from console.cluster import ClusterView
from console.counts import DEFAULT_PERIOD, CountsCache


async def serve(
    conn: Connection,
    listen: str,
    *,
    cluster: ClusterView | None = None,
    counts_period: float = DEFAULT_PERIOD,
    limits: HTTPLimits = DEFAULT_LIMITS,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the UI of ``conn`` on ``listen`` (``HOST:PORT``; port 0 picks
    one) until cancelled. ``task_status.started`` gets the bound addresses
    (``http://HOST:PORT``). ``cluster``: the cluster pages, if the owner's
    credentials were given. ``counts_period``: seconds the machine list's
    counts per state are reused (`console.counts`). ``limits``: what one
    client may take of the server (`common.httpserver`). Raises OSError if
    the address cannot be bound, ValueError if it is malformed.

    Cancellation closes the listener and every connection at once, whatever
    the clients do; the count queries run in a nursery of their own that
    lives exactly as long as the server: a query in flight is cancelled too.
    """
    try:
        async with trio.open_nursery() as nursery:
            counts = CountsCache(conn, nursery, period=counts_period)
            handler = asgi_handler(App(conn, counts, cluster))
            await serve_http(handler, listen, name="web UI", limits=limits, task_status=task_status)
    except BaseExceptionGroup as group:
        # The nursery wraps what the server raised: a bind error is the
        # caller's to read as itself.
        errors = leaf_errors(group)
        if len(errors) == 1 and isinstance(errors[0], (OSError, ValueError)):
            raise errors[0] from None
        raise
