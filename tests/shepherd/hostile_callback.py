"""A hostile agent callback server: answers each heartbeat as a test scripts it.

Plain sockets in threads (one per connection), so that an answer can be
anything at all: a status line a megabyte long, a body cut short, bytes
trickled one at a time, a connection held open. Each request's head and
body are kept for the test to read (what the agent sent next, such as an
installation report).
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from shepherd.agent import wire

#: Writes the answer to one request on the connection; True to keep the
#: connection for the next request, False to close it.
Answer = Callable[[socket.socket], bool]


@dataclass(frozen=True)
class Received:
    """One request as the server read it."""

    head: bytes
    body: bytes

    def header(self, name: str) -> str | None:
        for line in self.head.split(b"\r\n")[1:]:
            key, _, value = line.partition(b":")
            if key.strip().lower() == name.lower().encode():
                return value.strip().decode("latin-1")
        return None

    @property
    def installation_report(self) -> bytes | None:
        """The OSInstallationReport's bytes the heartbeat carries, if any."""
        for number, wire_type, value in wire.iter_fields(self.body):
            if number == 3 and wire_type == wire.WIRE_LEN and isinstance(value, bytes):
                return value
        return None


def reply(
    status: int = 200,
    body: bytes = b"",
    *,
    content_type: bytes = b"application/proto",
    keep: bool = True,
    extra: bytes = b"",
) -> Answer:
    """A well-framed answer (Content-Length) with this status, type and body."""

    def answer(sock: socket.socket) -> bool:
        head = b"HTTP/1.1 %d X\r\nContent-Type: %s\r\nContent-Length: %d\r\n%s%s\r\n" % (
            status,
            content_type,
            len(body),
            extra,
            b"" if keep else b"Connection: close\r\n",
        )
        sock.sendall(head + body)
        return keep

    return answer


def raw(data: bytes, *, keep: bool = False) -> Answer:
    """These bytes as they are."""

    def answer(sock: socket.socket) -> bool:
        sock.sendall(data)
        return keep

    return answer


def trickle(data: bytes, *, pause: float, then: bytes = b"x") -> Answer:
    """``data``, then ``then`` one byte at a time with ``pause`` between them,
    for as long as the client listens (at most ten minutes)."""

    def answer(sock: socket.socket) -> bool:
        sock.sendall(data)
        deadline = time.monotonic() + 600
        index = 0
        while time.monotonic() < deadline:
            time.sleep(pause)
            sock.sendall(then[index % len(then) : index % len(then) + 1])
            index += 1
        return False

    return answer


def huge(size: int, *, chunk: int = 1 << 20) -> Answer:
    """A 200 of ``size`` bytes (application/proto), written a chunk at a time."""

    def answer(sock: socket.socket) -> bool:
        sock.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/proto\r\nContent-Length: %d\r\n\r\n"
            % size
        )
        block = b"\x00" * chunk
        sent = 0
        while sent < size:
            sock.sendall(block[: min(chunk, size - sent)])
            sent += chunk
        return False

    return answer


@dataclass
class HostileServer:
    """Answers requests with the scripted answers in order, then with ``default``."""

    default: Answer = field(default_factory=reply)
    port: int = 0
    requests: list[Received] = field(default_factory=list)
    _script: queue.Queue[Answer] = field(default_factory=queue.Queue)
    _arrived: threading.Condition = field(default_factory=threading.Condition)
    _listener: socket.socket | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def then(self, *answers: Answer) -> None:
        """Answer the next requests with these."""
        for answer in answers:
            self._script.put(answer)

    def clear(self) -> None:
        """Forget the answers scripted and not given yet, and the requests
        received: a test that shares the server with the module's others
        counts its own requests from 1."""
        while not self._script.empty():
            self._script.get_nowait()
        with self._arrived:
            self.requests.clear()

    def wait_for(self, count: int, timeout: float = 60.0) -> Received:
        """The ``count``-th request (1-based), waiting for it (bounded)."""
        with self._arrived:
            if not self._arrived.wait_for(lambda: len(self.requests) >= count, timeout):
                raise AssertionError(f"request {count} never came ({len(self.requests)} did)")
            return self.requests[count - 1]

    def _next(self) -> Answer:
        try:
            return self._script.get_nowait()
        except queue.Empty:
            return self.default

    def _connection(self, sock: socket.socket) -> None:
        buffer = b""
        with sock, contextlib.suppress(OSError):
            while True:
                while b"\r\n\r\n" not in buffer:
                    data = sock.recv(65536)
                    if not data:
                        return
                    buffer += data
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                request = Received(head, b"")
                length = int(request.header("Content-Length") or "0")
                while len(buffer) < length:
                    data = sock.recv(65536)
                    if not data:
                        return
                    buffer += data
                request = Received(head, buffer[:length])
                buffer = buffer[length:]
                answer = self._next()
                with self._arrived:
                    self.requests.append(request)
                    self._arrived.notify_all()
                if not answer(sock):
                    return

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._connection, args=(sock,), daemon=True).start()


@contextlib.contextmanager
def hostile_server() -> Iterator[HostileServer]:
    server = HostileServer()
    listener = socket.create_server(("127.0.0.1", 0))
    server._listener = listener
    server.port = listener.getsockname()[1]
    thread = threading.Thread(target=server._accept, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        # A shutdown wakes the accept() under way (a close alone does not).
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        thread.join(10)


def session_answer(token: bytes = b"t" * 32, key: bytes = b"k" * 32, lifetime: int = 3600) -> bytes:
    """A HeartbeatResponse holding a session, as the real server writes it."""
    return wire.encode_heartbeat_session(wire.AgentSession(token, key, lifetime))


__all__ = [
    "Answer",
    "HostileServer",
    "Received",
    "hostile_server",
    "huge",
    "raw",
    "reply",
    "session_answer",
    "trickle",
]
