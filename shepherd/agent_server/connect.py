"""Connect's unary protocol over HTTP/1.1, as a small ASGI app for hypercorn's Trio worker.

Why not ``connectrpc``'s ASGI app: it works on Google-protobuf classes
(another runtime and code generator beside the betterproto2 classes this
tree uses), it decodes the body before the handler sees it, and the
agent's signature is over the raw body bytes, which must be bounded and
hashed before anything parses them. Connect unary is small enough to speak
directly (https://connectrpc.com/docs/protocol): ``POST /<service>/<method>``
with ``Content-Type: application/proto`` and the bare message as body; a
success is ``200`` with the bare response message; an error is a JSON
object ``{"code", "message"}`` with the code's HTTP status. The agent (a
stdlib ``http.client``) and any Connect client (Go's connect-go with
``WithProtoJSON`` off) speak it; HTTP/2 and gRPC are not needed.

Limits (so that one client cannot hold the server): a body larger than
``Limits.max_body`` is refused (by ``Content-Length`` before reading, or
as soon as the read passes it); the body must arrive within
``Limits.body_timeout``; a connection idle for ``read_timeout`` is closed
by hypercorn (see `shepherd.agent_server.server`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import trio

from monotrio.asgi import answer_lifespan
from shepherd.errors import ShepherdError

logger = logging.getLogger("shepherd.agent_server.connect")

#: Connect error codes used here, with their HTTP statuses (the Connect
#: protocol's current table; clients go by the code in the JSON body).
HTTP_STATUS = {
    "invalid_argument": 400,
    "unauthenticated": 401,
    "permission_denied": 403,
    "resource_exhausted": 429,
    "internal": 500,
    "unimplemented": 501,
    "unavailable": 503,
    "deadline_exceeded": 504,
}

#: A unary handler: request headers (lower-case names) and body -> response body.
Handler = Callable[[Mapping[str, str], bytes], Awaitable[bytes]]

ASGIScope = dict[str, Any]
ASGIReceive = Callable[[], Awaitable[dict[str, Any]]]
ASGISend = Callable[[dict[str, Any]], Awaitable[None]]


class ConnectError(ShepherdError):
    """Raised by a handler: answer with Connect error ``code`` and ``message``.

    ``http_status`` overrides the code's usual status where HTTP has a more
    precise word (404 for a path that names no method, 408 for a body that
    did not arrive in time).
    """

    def __init__(self, code: str, message: str, http_status: int | None = None) -> None:
        if code not in HTTP_STATUS:
            raise ValueError(f"unknown Connect code {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message
        self.http_status = http_status or HTTP_STATUS[code]


@dataclass(frozen=True)
class Limits:
    """Bounds on one request."""

    #: Largest accepted request body, bytes.
    max_body: int = 256 * 1024
    #: Seconds within which the whole body must have arrived.
    body_timeout: float = 10.0


class ConnectApp:
    """An ASGI app serving unary Connect methods from ``routes`` (path -> handler).

    A handler's `ConnectError` becomes that error; any other exception is
    logged and answered as ``internal`` (the client learns nothing more).
    Cancellation (server shutdown) propagates.
    """

    def __init__(self, routes: Mapping[str, Handler], limits: Limits = Limits()) -> None:
        self.routes = dict(routes)
        self.limits = limits

    async def __call__(self, scope: ASGIScope, receive: ASGIReceive, send: ASGISend) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return  # websockets: not served; hypercorn closes the connection
        try:
            body = await self._request(scope, receive)
            handler = self.routes[scope["path"]]
            response = await handler(_headers(scope), body)
        except ConnectError as exc:
            await _send_error(send, exc.http_status, exc.code, exc.message)
            return
        except Exception:
            logger.exception("handler of %s crashed", scope.get("path"))
            await _send_error(send, 500, "internal", "internal error")
            return
        await _send(send, 200, b"application/proto", response)

    async def _request(self, scope: ASGIScope, receive: ASGIReceive) -> bytes:
        """Check method, path and content type; read the body within the limits."""
        if scope["path"] not in self.routes:
            raise ConnectError("unimplemented", f"no method {scope['path']}", 404)
        if scope["method"] != "POST":
            raise ConnectError("unimplemented", "Connect unary calls are POST")
        headers = _headers(scope)
        content_type = headers.get("content-type", "").split(";")[0].strip()
        if content_type != "application/proto":
            raise ConnectError("invalid_argument", "content-type must be application/proto")
        if headers.get("content-encoding", "identity") != "identity":
            raise ConnectError("unimplemented", "compressed requests are not supported")
        limit = self.limits.max_body
        declared = headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            raise ConnectError("resource_exhausted", f"request body larger than {limit} bytes")
        chunks: list[bytes] = []
        size = 0
        with trio.move_on_after(self.limits.body_timeout) as deadline:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ConnectError("unavailable", "client went away")
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise ConnectError(
                        "resource_exhausted", f"request body larger than {limit} bytes"
                    )
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
        if deadline.cancelled_caught:
            raise ConnectError(
                "deadline_exceeded",
                f"request body not received within {self.limits.body_timeout:g}s",
                408,
            )
        return b"".join(chunks)


def _headers(scope: ASGIScope) -> dict[str, str]:
    """Request headers by lower-case name (the last of repeated ones wins)."""
    return {
        name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]
    }


async def _send(send: ASGISend, status: int, content_type: bytes, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _send_error(send: ASGISend, status: int, code: str, message: str) -> None:
    body = json.dumps({"code": code, "message": message}).encode()
    await _send(send, status, b"application/json", body)
