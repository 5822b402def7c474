"""The agent callback server's hand-written HTTP/1.1 parser, kept as a baseline.

Until issue 37 `shepherd.agent_server.http1` parsed requests with this
code; it now parses them with llhttp. ``bench.heartbeat`` measures the
server's CPU per heartbeat on both in one run (`install` swaps this
parser into a server process of the benchmark's own), which is what the
switch was decided on. It is the old code as it was, on the transport's
socket I/O, and serves nothing else.
"""

from __future__ import annotations

import math

import trio

from common.numbers import parse_decimal
from shepherd.agent_server import http1
from shepherd.agent_server.connect import ConnectError, error_answer
from shepherd.agent_server.http1 import _Close, _refuse

_HEX = b"0123456789abcdefABCDEF"
#: Most digits of a Content-Length (a terabyte; any allowed body has fewer).
_LENGTH_DIGITS = 12
#: Control characters other than HTAB, CR and LF.
_CONTROL = bytes([*range(0x00, 0x09), 0x0B, 0x0C, *range(0x0E, 0x20), 0x7F])
#: RFC 9110's token characters: a method, a header name.
_TOKEN = b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
#: The headers that say where a request's body ends.
_FRAMING = ("content-length", "transfer-encoding")


def install() -> None:
    """Make this process's `http1` servers parse with the hand-written parser."""
    http1._Connection = HandwrittenConnection  # type: ignore[misc]


class HandwrittenConnection(http1._Connection):
    """A connection parsed by hand (the llhttp parser of the base class unused)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.buffer = bytearray()

    async def receive(self) -> None:
        """More bytes into the buffer; `_Close` at the end of the stream."""
        data = await self.receive_some()
        if not data:
            raise _Close()
        self.buffer += data

    async def serve(self) -> None:
        buffer = self.buffer
        with self.scope:
            while True:
                self.reading = False
                self.waited = False
                if not buffer:
                    self.deadline = trio.current_time() + self.timeouts.keep_alive
                    data = await self.receive_some()
                    if not data:
                        return  # closed between requests: the normal end
                    buffer += data
                self.reading = True
                self.deadline = trio.current_time() + self.limits.body_timeout
                try:
                    keep_alive = await self.request()
                except _Close as close:
                    if close.answer is not None:
                        self.deadline = trio.current_time() + self.timeouts.send
                        await self.answer(*close.answer, keep_alive=False)
                    return
                if not keep_alive:
                    return
                if self.fd is not None and not self.waited:
                    await trio.lowlevel.checkpoint()
        if self.scope.cancelled_caught and self.reading:
            with trio.move_on_after(self.timeouts.send):
                exc = ConnectError(
                    "deadline_exceeded",
                    f"request not received within {self.limits.body_timeout:g}s",
                    408,
                )
                await self.answer(*error_answer(exc), keep_alive=False)

    async def request(self) -> bool:
        """Read, handle and answer one request; keep the connection alive?"""
        buffer = self.buffer
        max_head = self.limits.max_head
        end = buffer.find(b"\r\n\r\n")
        while end < 0:
            if len(buffer) > max_head:
                raise _refuse(ConnectError("resource_exhausted", "request head too large", 431))
            searched = max(0, len(buffer) - 3)
            await self.receive()
            end = buffer.find(b"\r\n\r\n", searched)
        if end > max_head:
            raise _refuse(ConnectError("resource_exhausted", "request head too large", 431))
        head = bytes(buffer[:end])
        del buffer[: end + 4]
        method, path, version, headers = parse_head(head)
        keep_alive = keeps_alive(version, headers.get("connection", ""))
        try:
            handler = self.app.check(method, path, headers)
        except ConnectError as exc:
            raise _refuse(exc) from None
        body = await self.body(headers)
        self.reading = False
        self.deadline = math.inf
        status, content_type, answer = await self.app.call(handler, headers, body)
        self.deadline = trio.current_time() + self.timeouts.send
        await self.answer(status, content_type, answer, keep_alive=keep_alive)
        return keep_alive

    async def body(self, headers: dict[str, str]) -> bytes:
        """The request body, at most ``Limits.max_body`` bytes."""
        limit = self.limits.max_body
        too_large = ConnectError("resource_exhausted", f"request body larger than {limit} bytes")
        expect = headers.get("expect", "").lower() == "100-continue"
        encoding = headers.get("transfer-encoding")
        if encoding is not None:
            if encoding.lower() != "chunked" or "content-length" in headers:
                raise _refuse(ConnectError("invalid_argument", "unsupported transfer-encoding"))
            if expect:
                await self.send_all(b"HTTP/1.1 100 Continue\r\n\r\n")
            return await self.chunked(limit, too_large)
        declared = headers.get("content-length")
        try:
            length = (
                0
                if declared is None
                else parse_decimal(declared, max_digits=_LENGTH_DIGITS, what="content-length")
            )
        except ValueError as exc:
            raise _refuse(ConnectError("invalid_argument", str(exc))) from None
        if length > limit:
            raise _refuse(too_large)
        if expect and len(self.buffer) < length:
            await self.send_all(b"HTTP/1.1 100 Continue\r\n\r\n")
        while len(self.buffer) < length:
            await self.receive()
        body = bytes(self.buffer[:length])
        del self.buffer[:length]
        return body

    async def chunked(self, limit: int, too_large: ConnectError) -> bytes:
        """A chunked body, at most ``limit`` bytes; trailers skipped."""
        buffer = self.buffer
        chunks: list[bytes] = []
        size = 0
        while True:
            size_text = (await self.line()).split(b";", 1)[0].strip(b" \t")
            if not size_text or len(size_text) > 8 or size_text.strip(_HEX):
                raise _refuse(ConnectError("invalid_argument", "malformed chunk size"))
            length = int(size_text, 16)
            if length == 0:
                while await self.line():
                    pass
                return b"".join(chunks)
            size += length
            if size > limit:
                raise _refuse(too_large)
            while len(buffer) < length + 2:
                await self.receive()
            if buffer[length : length + 2] != b"\r\n":
                raise _refuse(ConnectError("invalid_argument", "malformed chunked body"))
            chunks.append(bytes(buffer[:length]))
            del buffer[: length + 2]

    async def line(self) -> bytes:
        """One CRLF-terminated line of a chunked body (at most 1 KiB)."""
        buffer = self.buffer
        while (end := buffer.find(b"\r\n")) < 0:
            if len(buffer) > 1024:
                raise _refuse(ConnectError("invalid_argument", "malformed chunked body"))
            await self.receive()
        if end > 1024:
            raise _refuse(ConnectError("invalid_argument", "malformed chunked body"))
        text = bytes(buffer[:end])
        if not _clean(text):
            raise _refuse(ConnectError("invalid_argument", "control character in chunked body"))
        del buffer[: end + 2]
        return text


def _clean(text: bytes) -> bool:
    """No control character in ``text`` but HTAB and CRLF pairs."""
    crs = text.count(b"\r")
    return (
        len(text.translate(None, _CONTROL)) == len(text)
        and crs == text.count(b"\n")
        and crs == text.count(b"\r\n")
    )


def parse_head(head: bytes) -> tuple[str, str, bytes, dict[str, str]]:
    """(method, path, version, headers by lower-case name) of a request head
    (without its final empty line); `_Close` with a 400 or 505 if malformed."""
    if not _clean(head):
        raise _refuse(ConnectError("invalid_argument", "control character in request head"))
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3:
        raise _refuse(ConnectError("invalid_argument", "malformed request line"))
    method, target, version = parts
    if version not in (b"HTTP/1.1", b"HTTP/1.0"):
        raise _refuse(ConnectError("unimplemented", "HTTP/1.1 only", 505))
    if not method or method.translate(None, _TOKEN) or not target:
        raise _refuse(ConnectError("invalid_argument", "malformed request line"))
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not name or name.translate(None, _TOKEN):
            raise _refuse(ConnectError("invalid_argument", "malformed header line"))
        key = name.decode("latin-1").lower()
        text = value.strip(b" \t").decode("latin-1")
        if (
            key in headers
            and key in _FRAMING
            and (key == "transfer-encoding" or headers[key] != text)
        ):
            raise _refuse(ConnectError("invalid_argument", f"conflicting {key} headers"))
        headers[key] = text
    path = target.split(b"?", 1)[0].decode("latin-1")
    return method.decode("latin-1"), path, version, headers


def keeps_alive(version: bytes, connection: str) -> bool:
    """Whether a request of ``version`` with ``connection`` keeps its connection."""
    tokens = {t.strip() for t in connection.lower().split(",")} if connection else set()
    if version == b"HTTP/1.1":
        return "close" not in tokens
    return "keep-alive" in tokens
