"""Checking ``HOST:PORT`` listen addresses given on command lines, and splitting them."""

from __future__ import annotations

from common.numbers import parse_decimal

__all__ = ["listen_address", "split_listen"]


def listen_address(text: str) -> str:
    """``text`` if it is ``HOST:PORT`` (port 0 picks a free one); ValueError otherwise."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"not a HOST:PORT address: {text!r}")
    return text


def split_listen(listen: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port); ValueError if malformed.

    The port is ASCII digits, 0 to 65535.
    """
    host, sep, text = listen.rpartition(":")
    try:
        if not sep:
            raise ValueError("no port")
        port = parse_decimal(text, max_digits=5, what="port")
        if port > 65535:
            raise ValueError(f"port {port} above 65535")
    except ValueError as exc:
        raise ValueError(f"{listen!r}: want HOST:PORT ({exc})") from None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, port
