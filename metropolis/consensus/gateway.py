"""etcd's JSON gateway: POST /v3/<path> with a JSON body, typed errors back.

The layer of :mod:`metropolis.consensus.client` above ``UnixHTTP``.
The gateway's wire quirks (etcd 3.4), handled here and nowhere else:

* keys, values and range ends are base64 strings;
* int64 fields are JSON *strings*, and zero/false/empty fields are omitted
  entirely (a missing ``count`` is 0, a failed txn has no ``succeeded``);
* errors are ``{"error", "message", "code"}`` with a gRPC status code and an
  HTTP status derived from it;
* streaming calls (watch, lease keep-alive) answer one JSON object per line,
  each wrapped in ``{"result": ...}``.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from metropolis.consensus.etcderrors import (
    GRPC_CANCELED,
    GRPC_UNAVAILABLE,
    EtcdAPIError,
    EtcdClosed,
    EtcdUnavailable,
    check_socket_path,
)
from metropolis.consensus.unixhttp import (
    ResponseStream,
    TransportClosed,
    TransportError,
    UnixHTTP,
)

__all__ = ["Gateway", "Lines", "b64", "int_field", "prefix_end", "unb64"]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(data: str | None) -> bytes:
    return base64.b64decode(data) if data else b""


def int_field(obj: dict[str, Any], name: str) -> int:
    # int64s arrive as strings, and zero values are omitted.
    return int(obj.get(name, 0))


def prefix_end(prefix: bytes) -> bytes:
    """The smallest key greater than every key starting with ``prefix``.

    An all-0xff (or empty) prefix has no such key; etcd spells "to the end
    of the keyspace" as a single zero byte.
    """
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return b"\x00"
    return stripped[:-1] + bytes([stripped[-1] + 1])


class Gateway:
    """JSON calls to etcd's gateway; turns transport and API failures into typed errors."""

    def __init__(self, socket_path: Path, timeout: float) -> None:
        check_socket_path(socket_path)
        self.socket_path = socket_path
        # One lean HTTP/1.1 client (see unixhttp): unary calls on a pool of
        # kept-alive connections, each stream on a connection of its own.
        self._unary = UnixHTTP(
            socket_path, timeout=timeout, connect_timeout=min(timeout, 2.0), host="etcd"
        )
        self._timeout = timeout

    async def aclose(self) -> None:
        self._unary.close()

    @property
    def closed(self) -> bool:
        return self._unary.closed

    def _unavailable(self, e: Exception) -> EtcdUnavailable:
        return EtcdUnavailable(f"etcd at {self.socket_path} is unavailable: {e!r}")

    async def call(
        self, path: str, body: dict[str, Any], *, deadline: float | None = None
    ) -> dict[str, Any]:
        """One unary call. ``deadline`` (seconds) is passed on to etcd, which
        then gives up on the request itself (DEADLINE_EXCEEDED) once it passes."""
        if self.closed:
            raise EtcdClosed("etcd client is closed")
        payload = json.dumps(body, separators=(",", ":")).encode()
        headers: tuple[tuple[str, str], ...] = ()
        if deadline is not None:
            # The gateway turns gRPC's timeout header into the request's context
            # deadline (milliseconds: "<n>m").
            headers = (("Grpc-Timeout", f"{max(1, round(deadline * 1000))}m"),)
        try:
            status, content = await self._unary.post(f"/v3/{path}", payload, headers)
        except TransportClosed as e:
            raise EtcdClosed("etcd client was closed during the call") from e
        except TransportError as e:
            raise self._unavailable(e) from e
        return self._decode(status, content)

    @asynccontextmanager
    async def stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[Lines]:
        """POST and yield the response's JSON lines (each unwrapped from ``result``).

        Waits for the answer's head at most the client's timeout (the
        gateway sends it with the stream's first object, at once); the
        lines then come as etcd sends them, however late.
        """
        if self.closed:
            raise EtcdClosed("etcd client is closed")
        payload = json.dumps(body, separators=(",", ":")).encode()
        try:
            response = await self._unary.open_stream(
                f"/v3/{path}", payload, head_timeout=self._timeout
            )
        except TransportClosed as e:
            raise EtcdClosed("etcd client was closed during the call") from e
        except TransportError as e:
            raise self._unavailable(e) from e
        try:
            if response.status != 200:
                try:
                    content = await response.read_all()
                except TransportError as e:
                    raise self._unavailable(e) from e
                self._decode(response.status, content)
            yield Lines(self, response)
        finally:
            response.close()

    @staticmethod
    def _decode(http_status: int, content: bytes) -> dict[str, Any]:
        try:
            obj = json.loads(content)
        except ValueError:
            raise EtcdAPIError(
                content[:200].decode(errors="replace") or "empty response",
                code=0,
                http_status=http_status,
            ) from None
        return _check(obj, http_status)


def _check(obj: Any, http_status: int) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise EtcdAPIError(f"unexpected response {obj!r:.200}", 0, http_status)
    error = obj.get("error")
    if isinstance(error, dict):
        # Errors inside a stream are nested: {"error": {"grpc_code", "http_code", "message"}}.
        raise EtcdAPIError(
            str(error.get("message", error)),
            int(error.get("grpc_code", 0)),
            int(error.get("http_code", http_status)),
        )
    if error is not None:
        raise EtcdAPIError(obj.get("message") or str(error), int(obj.get("code", 0)), http_status)
    if http_status != 200:
        raise EtcdAPIError(f"unexpected response {obj!r:.200}", 0, http_status)
    return obj


class Lines:
    """The lines of one streamed gateway response, decoded."""

    def __init__(self, gateway: Gateway, response: ResponseStream) -> None:
        self._gateway = gateway
        self._response = response

    async def next(self) -> dict[str, Any]:
        """Return the next object; :class:`EtcdUnavailable` when the stream ends or breaks."""
        while True:
            try:
                line = await self._response.line()
            except TransportError as e:
                # Also when this client was closed: the caller looks at that.
                raise self._gateway._unavailable(e) from e
            if line is None:
                raise EtcdUnavailable("etcd closed the stream")
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                raise EtcdAPIError(f"undecodable stream line {line[:200]!r}", 0, 200) from None
            try:
                obj = _check(obj, 200)
                result = obj.get("result", obj)
                return _check(result, 200)
            except EtcdAPIError as e:
                # The gateway ends a stream with UNAVAILABLE ("transport is
                # closing") when etcd goes away under it, or with CANCELED
                # ("the client connection is closing") when etcd shuts down
                # gracefully: which one depends on a race inside etcd. We
                # never cancel a stream we still read, so both mean etcd left.
                if e.code in (GRPC_UNAVAILABLE, GRPC_CANCELED):
                    raise EtcdUnavailable(f"etcd stream ended: {e.message}") from e
                raise
