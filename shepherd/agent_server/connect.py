"""Connect's unary protocol: which calls are served, their checks, their answers.

Why not ``connectrpc``: it works on Google-protobuf classes (another
runtime and code generator beside the betterproto2 classes this tree
uses), it decodes the body before the handler sees it, and the agent's
signature is over the raw body bytes, which must be bounded and hashed
before anything parses them. Connect unary is small enough to speak
directly (https://connectrpc.com/docs/protocol): ``POST /<service>/<method>``
with ``Content-Type: application/proto`` and the bare message as body; a
success is ``200`` with the bare response message; an error is a JSON
object ``{"code", "message"}`` with the code's HTTP status. The agent (a
stdlib ``http.client``) and any Connect client (Go's connect-go with
``WithProtoJSON`` off) speak it; HTTP/2 and gRPC are not needed.

The transport (HTTP/1.1, its limits and timeouts) is
`shepherd.agent_server.http1`; it asks `ConnectUnary.check` about a request
from its head alone, before reading the body (bounded by
``Limits.max_body``), and `ConnectUnary.call` for the answer.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

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


class ConnectError(ShepherdError):
    """Raised by a handler: answer with Connect error ``code`` and ``message``.

    ``http_status`` overrides the code's usual status where HTTP has a more
    precise word (404 for a path that names no method, 408 for a request that
    did not arrive in time, 431 for a head too large).
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
    #: Seconds within which a whole request (head and body) must have
    #: arrived, from its first byte.
    body_timeout: float = 10.0
    #: Largest accepted request head (request line and headers), bytes.
    max_head: int = 16 * 1024
    #: Most header lines in a request head (an agent sends about ten).
    max_headers: int = 100


class ConnectUnary:
    """Unary Connect methods from ``routes`` (path -> handler)."""

    def __init__(self, routes: Mapping[str, Handler], limits: Limits = Limits()) -> None:
        self.routes = dict(routes)
        self.limits = limits

    def check(self, method: str, path: str, headers: Mapping[str, str]) -> Handler:
        """The handler for a request, judged by its head; `ConnectError` if refused."""
        handler = self.routes.get(path)
        if handler is None:
            raise ConnectError("unimplemented", f"no method {path}", 404)
        if method != "POST":
            raise ConnectError("unimplemented", "Connect unary calls are POST")
        content_type = headers.get("content-type", "")
        # The common case first, without splitting.
        if (
            content_type != "application/proto"
            and content_type.split(";")[0].strip() != "application/proto"
        ):
            raise ConnectError("invalid_argument", "content-type must be application/proto")
        if headers.get("content-encoding", "identity") != "identity":
            raise ConnectError("unimplemented", "compressed requests are not supported")
        return handler

    async def call(
        self, handler: Handler, headers: Mapping[str, str], body: bytes
    ) -> tuple[int, bytes, bytes]:
        """(HTTP status, content type, body) of the answer to a checked request.

        A handler's `ConnectError` becomes that error; any other exception is
        logged and answered as ``internal`` (the client learns nothing more).
        Cancellation (server shutdown) propagates.
        """
        try:
            return 200, b"application/proto", await handler(headers, body)
        except ConnectError as exc:
            return error_answer(exc)
        except Exception:
            logger.exception("handler crashed")
            return error_answer(ConnectError("internal", "internal error"))


def error_answer(exc: ConnectError) -> tuple[int, bytes, bytes]:
    """(HTTP status, content type, body) of a Connect error."""
    body = json.dumps({"code": exc.code, "message": exc.message}).encode()
    return exc.http_status, b"application/json", body
