"""What every one of our small ASGI apps answers alike.

Our ASGI endpoints (the console's web UI, the BMC emulator of the nspawn
machines) are plain ASGI apps under hypercorn's Trio worker (the agent
callback server and the metrics endpoint are not: each has its own
HTTP/1.1 transport). None of them has anything to set up or
tear down when the server starts or stops (their callers open the BMDB
connection around the server), but hypercorn still speaks the lifespan
protocol to them, so they answer it here.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

__all__ = ["answer_lifespan"]


async def answer_lifespan(
    receive: Callable[[], Awaitable[Mapping[str, Any]]],
    send: Callable[[dict[str, Any]], Awaitable[None]],
) -> None:
    """Acknowledge startup and shutdown; return after shutdown.

    Cancellation: returns nothing half-sent; a cancel while waiting for the
    next lifespan message simply propagates.
    """
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
