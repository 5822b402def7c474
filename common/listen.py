"""Checking ``HOST:PORT`` listen addresses given on command lines."""

from __future__ import annotations


def listen_address(text: str) -> str:
    """``text`` if it is ``HOST:PORT`` (port 0 picks a free one); ValueError otherwise."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"not a HOST:PORT address: {text!r}")
    return text
