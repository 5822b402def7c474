"""Our small ASGI apps: what they answer alike, and how one is served on
the bounded transport.

The console's web UI is an ASGI app served by `common.httpserver` through
`asgi_handler` (the metrics endpoint is a plain handler of that transport;
the agent callback server has its own, on llhttp). The BMC emulator of the
nspawn machines, on the host's loopback only, is still served by
hypercorn's Trio worker, which speaks the lifespan protocol to it:
`answer_lifespan` answers it. None of them has anything to set up or tear
down when the server starts or stops (their callers open the BMDB
connection around the server).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any
from urllib.parse import unquote

from common.httpserver import Handler, Request, Response

__all__ = ["ASGIApp", "answer_lifespan", "asgi_handler"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
#: An ASGI 3 application.
ASGIApp = Callable[
    [Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]],
    Awaitable[None],
]


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


def asgi_handler(app: ASGIApp) -> Handler:
    """``app`` as a `common.httpserver` handler: each request is one HTTP
    scope (ASGI 3, HTTP spec 2.3) whose body is empty (the transport takes
    none); the app's answer is gathered whole, then sent by the transport
    with its deadline.

    The path is percent-decoded as UTF-8, bytes that are not UTF-8 as
    U+FFFD (as hypercorn and uvicorn give it). After the request, a
    ``receive`` gets ``http.disconnect``: the transport does not watch the
    connection while the app runs. No lifespan scope is sent. An app that
    returns without a whole answer, or sends messages out of order, raises
    RuntimeError (the transport answers 500 and logs it).
    """

    async def handle(request: Request) -> Response:
        raw_path, _, query = request.target.partition(b"?")
        scope: Scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": request.http_version.decode("ascii"),
            "method": request.method.decode("ascii"),
            "scheme": "http",
            "path": unquote(raw_path.decode("latin-1"), errors="replace"),
            "raw_path": raw_path,
            "query_string": query,
            "root_path": "",
            "headers": request.headers,
            "client": request.client,
            "server": request.server,
        }
        requested = False
        status: int | None = None
        headers: list[tuple[bytes, bytes]] = []
        body: list[bytes] = []
        complete = False

        async def receive() -> Message:
            nonlocal requested
            if not requested:
                requested = True
                return {"type": "http.request", "body": b"", "more_body": False}
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            nonlocal status, headers, complete
            kind = message["type"]
            if kind == "http.response.start" and status is None:
                status = int(message["status"])
                headers = [(bytes(n), bytes(v)) for n, v in message.get("headers", [])]
            elif kind == "http.response.body" and status is not None and not complete:
                body.append(bytes(message.get("body", b"")))
                complete = not message.get("more_body", False)
            else:
                raise RuntimeError(f"ASGI message out of order: {kind!r}")

        await app(scope, receive, send)
        if status is None or not complete:
            raise RuntimeError("the ASGI app returned without a whole answer")
        return Response(status, headers, b"".join(body))

    return handle
