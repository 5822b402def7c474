"""The web UI as an ASGI application: routing, parameters, errors, headers.

Only GET and HEAD are answered (405 otherwise): the UI never writes. Errors
become short pages: 400 for bad parameters, 404 for unknown paths and
machines and nodes, 503 when the BMDB cannot be reached, 500 (logged) for
anything else; a cluster that does not answer is a normal page that says
so. Each response says how long its handler took in a ``Server-Timing``
header (``app;dur=MS``), which the page benchmark reads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import parse_qs

from bmdb.connection import STANDBY_NOTE, Connection
from bmdb.errors import DatabaseUnavailable, InvalidArgument
from common.asgi import answer_lifespan
from console import audit as audit_pages
from console import cluster as cluster_pages
from console import pages
from console.cluster import ClusterView
from console.counts import CountsCache
from console.errors import NotFound
from console.render import Page, render

logger = logging.getLogger("console")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_HEADERS = [
    (b"content-type", b"text/html; charset=utf-8"),
    # No scripts at all; inline styles only. Escaping is the defence, this
    # is the second line.
    (b"content-security-policy", b"default-src 'none'; style-src 'unsafe-inline'"),
    (b"x-content-type-options", b"nosniff"),
    (b"cache-control", b"no-store"),
]


#: How long one answer of `Connection.on_standby` is taken as true, in
#: seconds: a page then costs no extra round trip, and a failover shows on
#: the pages within that time.
STANDBY_CHECK_INTERVAL = 5.0


class App:
    """The ASGI callable; ``conn`` is an open BMDB `Connection` it only reads.

    A connection whose URL lets it read from a standby (libpq's
    ``target_session_attrs=prefer-standby``) may lag the primary: every page
    then says so above its content (`STANDBY_NOTE`), as the ``bmdb`` CLI
    does.
    """

    def __init__(
        self, conn: Connection, counts: CountsCache, cluster: ClusterView | None = None
    ) -> None:
        """``counts``: the machine list's counts per state (`console.counts`);
        ``cluster``: the cluster pages, or None (the cluster link says how to
        enable them)."""
        self.conn = conn
        self.counts = counts
        self.cluster = cluster
        #: (when checked, on a standby), by `time.monotonic`.
        self._standby: tuple[float, bool] | None = None

    async def _on_standby(self) -> bool:
        """Whether the pages read from a standby, as last checked (at most
        `STANDBY_CHECK_INTERVAL` ago); False while the BMDB cannot be
        reached (the page says that itself)."""
        now = time.monotonic()
        if self._standby is None or now - self._standby[0] > STANDBY_CHECK_INTERVAL:
            try:
                self._standby = (now, await self.conn.on_standby())
            except DatabaseUnavailable:
                return False
        return self._standby[1]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        started = time.perf_counter()
        status, page = await self._respond(scope)
        standby = STANDBY_NOTE if status == 200 and await self._on_standby() else None
        try:
            body = render(page, standby=standby)
        except Exception:
            logger.exception("rendering GET %s failed", scope["path"])
            status, body = 500, render(_error("Internal error", "See the server's log."))
        elapsed_ms = (time.perf_counter() - started) * 1000
        headers = [*_HEADERS, (b"server-timing", f"app;dur={elapsed_ms:.3f}".encode())]
        data = body.encode()
        headers.append((b"content-length", str(len(data)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send(
            {"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else data}
        )

    async def _respond(self, scope: Scope) -> tuple[int, Page]:
        if scope["method"] not in ("GET", "HEAD"):
            return 405, _error("Method not allowed", "This UI is read-only.")
        path: str = scope["path"]
        query = {k: v[-1] for k, v in parse_qs(scope["query_string"].decode("latin-1")).items()}
        try:
            if path in ("/", "/machines"):
                limit = _int(query.get("limit"), pages.PAGE_SIZE)
                return 200, await pages.machines(
                    self.conn,
                    self.counts,
                    state=query.get("state") or None,
                    provider=query.get("provider") or None,
                    after=query.get("after") or None,
                    limit=min(limit, pages.MAX_PAGE_SIZE),
                )
            if path.startswith("/machine/"):
                return 200, await pages.machine(self.conn, path.removeprefix("/machine/"))
            if path == "/sessions":
                return 200, await pages.sessions(self.conn)
            if path == "/audit":
                return 200, await audit_pages.audit(
                    self.conn,
                    machine=query.get("machine") or None,
                    before=_int(query["before"], 0) if query.get("before") else None,
                )
            if path == "/cluster" or path.startswith("/cluster/"):
                return await self._cluster(path)
            return 404, _error("Not found", f"No page at {path}.")
        except NotFound as e:
            return 404, _error("Not found", str(e))
        except InvalidArgument as e:
            return 400, _error("Bad request", str(e))
        except DatabaseUnavailable as e:
            return 503, _error("BMDB unavailable", str(e))
        except Exception:
            logger.exception("GET %s failed", path)
            return 500, _error("Internal error", "See the server's log.")

    async def _cluster(self, path: str) -> tuple[int, Page]:
        if self.cluster is None:
            return 200, cluster_pages.disabled()
        if path == "/cluster":
            return 200, await self.cluster.nodes(self.conn)
        node = path.removeprefix("/cluster/node/")
        if node != path and node:
            if node.endswith("/tree"):
                return 200, await self.cluster.tree(node.removesuffix("/tree"))
            if "/" not in node:
                return 200, await self.cluster.node(self.conn, node)
        return 404, _error("Not found", f"No page at {path}.")


def _int(text: str | None, default: int) -> int:
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise InvalidArgument(f"not a number: {text!r}") from None
    if value < 1:
        raise InvalidArgument(f"must be positive: {value}")
    return value


def _error(title: str, text: str) -> Page:
    return Page("error.html", title, {"text": text})
