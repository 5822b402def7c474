"""Serving Prometheus metrics over HTTP from inside a Trio program.

`serve_metrics` exposes a ``prometheus_client`` registry at ``/metrics`` on
``HOST:PORT`` with hypercorn's Trio worker. Collection then runs in the Trio
thread, between other tasks' steps, so collectors may read plain counters
that Trio tasks update without any locking (prometheus_client's own HTTP
server would collect in a thread of its own). A ``refresh`` coroutine, if given, runs before each
scrape's collection: values that take I/O to read (another process's
state) are read then, and only when someone scrapes.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, cast

import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from hypercorn.typing import ASGIFramework
from prometheus_client import CollectorRegistry, make_asgi_app

from common.asgi import answer_lifespan

logger = logging.getLogger("common.metrics")

Message = MutableMapping[str, Any]


def metrics_app(
    registry: CollectorRegistry, refresh: Callable[[], Awaitable[None]] | None = None
) -> Callable[..., Awaitable[None]]:
    """An ASGI app: the registry at ``/metrics``, 404 elsewhere.

    ``refresh`` is awaited before each collection (it must bound its own time).
    """
    exposition = make_asgi_app(registry)

    async def app(scope: Message, receive: Callable[[], Awaitable[Message]], send: Any) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        if scope["path"] == "/metrics":
            if refresh is not None:
                await refresh()
            await exposition(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b"see /metrics\n"})

    return app


async def serve_metrics(
    registry: CollectorRegistry,
    listen: str,
    *,
    refresh: Callable[[], Awaitable[None]] | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``registry`` on ``listen`` until cancelled; ``task_status.started``
    gets the bound base URLs. Raises OSError if the address cannot be bound.

    ``refresh``: see :func:`metrics_app`."""
    config = Config()
    config.bind = [listen]
    config.accesslog = None
    config.errorlog = logging.getLogger("common.metrics.hypercorn")
    app = cast(ASGIFramework, metrics_app(registry, refresh))
    await serve(app, config, mode="asgi", task_status=task_status)
