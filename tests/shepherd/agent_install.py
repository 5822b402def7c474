"""What the agent's install tests share: a stand-in node image, an image
server (HTTP or HTTPS, with Range requests and a connection it can cut),
installation requests, and cleanup of the nodes the installs start."""

from __future__ import annotations

import hashlib
import http.server
import io
import os
import re
import signal
import ssl
import threading
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from shepherd.agent import wire
from shepherd.localfleet import node_pid

#: The stand-in's __main__: it takes the node's command line, records it in
#: its root, prints a line, announces a key (atomically, as the node does)
#: and sleeps until killed. With FAIL in its payload it exits first.
STAND_IN_MAIN = b"""\
import os, sys, time, zipfile
args = sys.argv[1:]
def opt(name):
    return args[args.index(name) + 1]
with open(os.path.join(opt("--root"), "argv.txt"), "w") as f:
    f.write("\\n".join(args))
with zipfile.ZipFile(sys.argv[0]) as z:
    payload = z.read("payload")
print("stand-in node: starting", flush=True)
if payload.startswith(b"FAIL"):
    print("cannot register: \\x1b[31mno ticket\\x1b[0m", flush=True)
    sys.exit(3)
key = opt("--announce-key")
with open(key + ".tmp", "wb") as f:
    f.write(os.urandom(32))
os.replace(key + ".tmp", key)
while True:
    time.sleep(60)
"""


def stand_in_image(payload: bytes = b"ok", size: int = 0, *, unpackable: bool = False) -> bytes:
    """A zipapp standing in for the node image (stored, so ``size`` is about
    its size when the payload is padded). ``unpackable``: with what
    `shepherd.agent.unpack` needs of a shiv zipapp too (an entry point and
    the payload again under site-packages), as the boot helper unpacks it."""
    padded = payload + os.urandom(max(0, size - len(payload)))
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("__main__.py", STAND_IN_MAIN)
        archive.writestr("payload", padded)
        if unpackable:
            archive.writestr("environment.json", '{"entry_point": "standin:main"}')
            archive.writestr("site-packages/standin.py", "def main() -> int:\n    return 0\n")
            archive.writestr("site-packages/payload", padded)
    return buffer.getvalue()


@dataclass
class ImageServer:
    """Serves ``images`` (by hex name) on /images/sha256/<hex>, with Range."""

    images: dict[str, bytes] = field(default_factory=dict)
    #: Cut the connection after this many body bytes, for this many responses.
    cut_after: int = 0
    cuts: int = 0
    #: The Range header of each GET (None without one).
    ranges: list[str | None] = field(default_factory=list)
    port: int = 0
    scheme: str = "http"
    #: Pause after each 64 KiB of a body (a slow server), seconds.
    pause: float = 0.0

    def add(self, image: bytes, name: str | None = None) -> str:
        digest = hashlib.sha256(image).hexdigest()
        self.images[name or digest] = image
        return name or digest


def _handler(server: ImageServer) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            server.ranges.append(self.headers.get("Range"))
            match = re.fullmatch(r"/images/sha256/([0-9a-f]{64})", self.path)
            data = server.images.get(match.group(1)) if match else None
            if data is None:
                self.send_error(404)
                return
            start = 0
            ranged = re.fullmatch(r"bytes=([0-9]+)-", self.headers.get("Range") or "")
            if ranged:
                start = int(ranged.group(1))
                if start >= len(data):
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(data)}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            else:
                self.send_response(200)
            self.send_header("Content-Length", str(len(data) - start))
            self.end_headers()
            body = data[start:]
            if server.cuts > 0:
                server.cuts -= 1
                self.wfile.write(body[: server.cut_after])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(2)
                return
            for at in range(0, len(body), 64 * 1024):
                self.wfile.write(body[at : at + 64 * 1024])
                time.sleep(server.pause)

    return Handler


class QuietServer(http.server.ThreadingHTTPServer):
    """A test server that does not print the connections its clients cut."""

    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        pass


@contextmanager
def serve_images(tls: tuple[Path, Path] | None = None) -> Iterator[ImageServer]:
    """An image server on 127.0.0.1 (HTTPS with ``tls`` = (certfile, keyfile))."""
    state = ImageServer(scheme="https" if tls else "http")
    httpd = QuietServer(("127.0.0.1", 0), _handler(state))
    httpd.daemon_threads = True
    if tls is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(str(tls[0]), str(tls[1]))
        httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    state.port = httpd.server_address[1]
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


def request(
    generation: int,
    *,
    host: str,
    digest: str,
    scheme: str = "https",
    root_device: str = "disk0",
    node_address: str = "127.0.0.2",
    node_parameters: bytes | None = b"\x0a\x02params",
) -> wire.InstallationRequest:
    return wire.InstallationRequest(
        generation,
        wire.MetropolisInstallation(
            node_parameters=node_parameters,
            root_device=root_device,
            os_image=wire.OSImageRef(scheme, host, "metropolis-node", "", digest),
            node_address=node_address,
        ),
    )


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def encode_response(req: wire.InstallationRequest | None) -> bytes:
    """A HeartbeatResponse carrying ``req`` as a server writes it (fields in
    number order), for the stand-in heartbeat server."""
    if req is None:
        return b""
    inner = b"\x08" + _varint(req.generation & (2**64 - 1)) if req.generation else b""
    m = req.metropolis
    if m is not None:
        body = b""
        if m.node_parameters is not None:
            body += _field(2, m.node_parameters)
        if m.root_device:
            body += _field(3, m.root_device.encode())
        if m.os_image is not None:
            ref = m.os_image
            texts = (ref.scheme, ref.host, ref.repository, ref.tag, ref.digest)
            image = b"".join(
                _field(number, text.encode()) for number, text in enumerate(texts, 1) if text
            )
            body += _field(4, image)
        if m.node_address:
            body += _field(100, m.node_address.encode())
        inner += _field(2, body)
    return _field(1, inner)


def kill_nodes(root: Path) -> None:
    """SIGKILL every node an install started under ``root`` (test cleanup)."""
    for pid_file in root.rglob("node.pid"):
        pid = node_pid(pid_file.parent)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
