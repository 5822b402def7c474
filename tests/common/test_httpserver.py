"""`common.httpserver` and `common.asgi.asgi_handler` in what the hostile
probes of their two endpoints do not reach: a handler's bug, an ASGI app
that answers wrongly, HEAD, a request's path and query as an app sees them.
(The limits are probed on the real endpoints: tests/common/test_metrics_hostile.py
and tests/operators/test_console_hostile.py.)"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
import trio

from common.asgi import asgi_handler
from common.httpserver import Request, Response, serve_http

Message = Any


async def _echo(request: Request) -> Response:
    if request.target == b"/bug":
        raise RuntimeError("a bug reached")
    body = b"%s %s" % (request.method, request.target)
    return Response(200, [(b"content-type", b"text/plain")], body)


async def test_a_handlers_bug_is_a_500_for_that_request_only(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="common.httpserver")
    [url] = await nursery.start(lambda task_status: serve_http(
        _echo, "127.0.0.1:0", name="probe", task_status=task_status
    ))  # fmt: skip
    async with httpx.AsyncClient(base_url=url) as client:
        bug = await client.get("/bug")
        assert bug.status_code == 500 and bug.headers["connection"] == "close"
        assert "a bug reached" in caplog.text
        ok = await client.get("/x?y=1")
        assert (ok.status_code, ok.text) == (200, "GET /x?y=1")
        head = await client.head("/x")
        assert head.status_code == 200 and head.content == b""
        assert head.headers["content-length"] == str(len(b"HEAD /x"))


def _app(
    answer: Callable[[dict[str, Any], Callable[[Message], Awaitable[None]]], Awaitable[None]],
) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        assert (await receive())["type"] == "http.request"
        assert (await receive())["type"] == "http.disconnect"
        await answer(scope, send)

    return app


async def test_an_asgi_app_sees_its_scope_and_wrong_answers_are_a_500(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="common.httpserver")
    seen: list[dict[str, Any]] = []

    async def answer(scope: dict[str, Any], send: Callable[[Message], Awaitable[None]]) -> None:
        seen.append(scope)
        path = scope["path"]
        if path == "/none":
            return  # no answer at all
        if path == "/twice":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"a"})
            await send({"type": "http.response.body", "body": b"b"})
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"one ", "more_body": True})
        await send({"type": "http.response.body", "body": path.encode()})

    [url] = await nursery.start(lambda task_status: serve_http(
        asgi_handler(_app(answer)), "127.0.0.1:0", name="probe", task_status=task_status
    ))  # fmt: skip
    async with httpx.AsyncClient(base_url=url) as client:
        got = await client.get("/m%C3%A9/%FF?q=%FF&r")
        assert got.status_code == 200
        assert got.text == "one /m\u00e9/\ufffd"
        assert got.headers["content-length"] == str(len(got.content))
        scope = seen[-1]
        assert (scope["method"], scope["raw_path"], scope["query_string"]) == (
            "GET",
            b"/m%C3%A9/%FF",
            b"q=%FF&r",
        )
        assert scope["client"][0] == "127.0.0.1" and scope["server"][1] == int(url.split(":")[-1])
        for path in ("/none", "/twice"):
            assert (await client.get(path)).status_code == 500, path
        assert "without a whole answer" in caplog.text and "out of order" in caplog.text
        assert (await client.get("/after")).text == "one /after"
