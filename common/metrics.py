"""Serving Prometheus metrics over HTTP/1.1 from inside a Trio program.

`serve_metrics` exposes a ``prometheus_client`` registry at ``/metrics`` on
``HOST:PORT``. Collection runs in the Trio thread, between other tasks'
steps, so collectors may read plain counters that Trio tasks update without
any locking (prometheus_client's own HTTP server would collect in a thread
of its own). A ``refresh`` coroutine, if given, runs before each scrape's
collection: values that take I/O to read (another process's state) are
read then, and only when someone scrapes.

Answers: ``GET`` or ``HEAD`` of ``/metrics`` (any query; ``name[]=NAME``
keeps only those metric families, as prometheus_client's own servers do)
gets the exposition in the format its ``Accept`` header asks for
(prometheus_client's ``choose_encoder``: the text format unless OpenMetrics
is asked for; an ``Accept`` it cannot read gets the text format),
gzip-compressed if ``Accept-Encoding`` allows it. Other paths get ``404``,
other methods ``405``, a request with a body ``400`` (the connection is
closed then).

Served by `common.httpserver` (h11, with keep-alive), bounded by
`MetricsLimits` (the transport's `HTTPLimits`): a head timeout, a deadline
on each whole answer with nothing shielded, a cap on connections; see that
module for what each does, and why not hypercorn, which served this before
(issue 35) and also answered an ``Accept`` header it could not read (bytes
that are not UTF-8, an OpenMetrics version that is no number) with a
``500`` and a traceback in the log.

Cancellation: cancelling `serve_metrics` closes the listener and every
connection at once. An error out of one connection ends that connection
only.
"""

from __future__ import annotations

import gzip
import random
from collections.abc import Awaitable, Callable
from urllib.parse import parse_qs

import trio
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import (
    CONTENT_TYPE_PLAIN_0_0_4,
    choose_encoder,
    generate_latest,
    gzip_accepted,
)

from common.httpserver import DEFAULT_LIMITS, Handler, HTTPLimits, Request, Response, serve_http

__all__ = ["MetricsLimits", "exposition", "serve_metrics"]

Encoder = Callable[[CollectorRegistry], bytes]

#: Bounds on what one client can take of the metrics server: the
#: transport's (`common.httpserver.HTTPLimits`), by the name callers know.
MetricsLimits = HTTPLimits


def exposition(
    registry: CollectorRegistry, accept: str, accept_encoding: str, query: str = ""
) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """The body and content headers of a scrape of ``registry``, for a
    request with these ``Accept`` and ``Accept-Encoding`` headers and query.

    What a request may say picks a format among prometheus_client's; what
    it cannot read falls back to the text format, never to an error.
    """
    encoder: Encoder
    try:
        encoder, content_type = choose_encoder(accept)
    except (TypeError, ValueError):
        # prometheus_client compares the version a client names as numbers
        # ("version=abc" is a TypeError there).
        encoder, content_type = generate_latest, CONTENT_TYPE_PLAIN_0_0_4
    names = parse_qs(query).get("name[]")
    target = registry.restricted_registry(names) if names else registry
    try:
        body = encoder(target)
    except (TypeError, ValueError):
        if encoder is generate_latest:
            raise  # not the client's doing
        body, content_type = generate_latest(target), CONTENT_TYPE_PLAIN_0_0_4
    headers = [(b"content-type", content_type.encode("latin-1", "replace"))]
    if gzip_accepted(accept_encoding):
        body = gzip.compress(body)
        headers.append((b"content-encoding", b"gzip"))
    return body, headers


def _handler(registry: CollectorRegistry, refresh: Callable[[], Awaitable[None]] | None) -> Handler:
    """What answers a request for ``registry`` (see the module)."""
    text = [(b"content-type", b"text/plain; charset=utf-8")]

    async def handle(request: Request) -> Response:
        path, _, query = request.target.partition(b"?")
        if request.method not in (b"GET", b"HEAD"):
            return Response(405, [*text, (b"allow", b"GET, HEAD")], b"only GET and HEAD\n")
        if path != b"/metrics":
            return Response(404, text, b"see /metrics\n")
        if refresh is not None:
            await refresh()
        # Headers are bytes from anybody: latin-1 decodes every byte, and
        # what is not a name prometheus_client knows picks nothing.
        accept = b",".join(v for n, v in request.headers if n == b"accept")
        encodings = b",".join(v for n, v in request.headers if n == b"accept-encoding")
        body, headers = exposition(
            registry, accept.decode("latin-1"), encodings.decode("latin-1"), query.decode("latin-1")
        )
        return Response(200, headers, body)

    return handle


async def serve_metrics(
    registry: CollectorRegistry,
    listen: str,
    *,
    refresh: Callable[[], Awaitable[None]] | None = None,
    limits: MetricsLimits = DEFAULT_LIMITS,
    rng: random.Random | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``registry`` on ``listen`` (``HOST:PORT``, port 0: any free one)
    until cancelled; ``task_status.started`` gets the bound base URL (a list
    of one, ``http://HOST:PORT``).

    ``refresh`` is awaited before each collection (it must bound its own
    time). ``rng`` jitters the pauses after an accept() out of resources.
    Raises ValueError if ``listen`` is malformed, OSError if it cannot be
    bound. Cancellation closes the listener and every connection.
    """
    await serve_http(
        _handler(registry, refresh),
        listen,
        name="metrics",
        limits=limits,
        rng=rng,
        task_status=task_status,
    )
