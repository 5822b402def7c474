"""What llhttp (``httptools``) refuses by itself, and what it lets through.

The agent callback server's request parser is moving onto llhttp (issue
37); these are the llhttp behaviours it relies on, or must make up for,
pinned so that a change in a new llhttp release is seen here first.
"""

from __future__ import annotations

import httptools
import pytest

HEAD = b"POST /x HTTP/1.1\r\nHost: a\r\n"


class _Events:
    def __init__(self) -> None:
        self.complete = 0
        self.headers: list[tuple[bytes, bytes]] = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_message_complete(self) -> None:
        self.complete += 1


def _parse(data: bytes) -> _Events:
    events = _Events()
    httptools.HttpRequestParser(events).feed_data(data)
    return events


@pytest.mark.parametrize(
    "data",
    [
        HEAD + b"X-A: a\r\n b\r\nContent-Length: 0\r\n\r\n",  # obs-fold
        HEAD + b"X-A: a\r\n\tb\r\n\r\n",  # obs-fold, tab
        b"POST /x HTTP/1.1\nHost: a\n\n",  # bare LF
        HEAD + b"X-A: a\nContent-Length: 4\r\n\r\n",  # bare LF inside a value
        HEAD + b"X-A: a\rb\r\n\r\n",  # bare CR
        HEAD + b"X-A: a\x00b\r\n\r\n",  # NUL
        HEAD + b"X-A: \x1b[0m\r\n\r\n",
        HEAD + b"X-A: \x7f\r\n\r\n",
        b"POST /x\x00y HTTP/1.1\r\n\r\n",
        HEAD + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\nhi",
        # Identical duplicates too: "the same length twice is one length"
        # (the hand-written parser's choice) cannot be kept on llhttp.
        HEAD + b"Content-Length: 2\r\nContent-Length: 2\r\n\r\nhi",
        HEAD + b"Content-Length: 2, 2\r\n\r\nhi",
        HEAD + b"Content-Length: +2\r\n\r\nhi",
        HEAD + b"Content-Length: 99999999999999999999999\r\n\r\nhi",
        HEAD + b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n",
        HEAD + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        HEAD + b"Transfer-Encoding: gzip\r\n\r\nhi",
        HEAD + b"Transfer-Encoding: chunked\r\n\r\n4\n\r\nping\r\n0\r\n\r\n",
        HEAD + b"X A: b\r\n\r\n",
        HEAD + b"X-A : b\r\n\r\n",
        b"POST / HTTP/1.1 extra\r\n\r\n",
        b"POST / HTTP/1.2\r\n\r\n",
    ],
)
def test_llhttp_refuses(data: bytes) -> None:
    with pytest.raises(httptools.HttpParserError):
        _parse(data)


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (HEAD + b"Content-Length: 18446744073709551615\r\n\r\n", "huge length: ours to bound"),
        (HEAD + b"Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n", "a coding: ours to refuse"),
        (b"POST / HTTP/2.0\r\n\r\n", "a version: ours to refuse (505)"),
        (b"POST / HTTP/0.9\r\n\r\n", "a version: ours to refuse (505)"),
        (HEAD + b"X-A: ab \t\r\n\r\n", "trailing whitespace: ours to strip"),
    ],
)
def test_llhttp_lets_through(data: bytes, why: str) -> None:
    _parse(data)


def test_trailers_arrive_as_headers_after_the_body() -> None:
    """A chunked body's trailers come through on_header: the server must
    ignore headers once the head is complete."""
    events = _parse(HEAD + b"Transfer-Encoding: chunked\r\n\r\n2;e=1\r\nhi\r\n0\r\nT: t\r\n\r\n")
    assert events.headers[-1] == (b"T", b"t") and events.complete == 1
