"""The calling side of a kept-open session (`common.keepopen`), and its wire.

::

    TOOL ... --keep-open SECONDS COMMAND
      │ the tool reads the options that name the session (no argparse yet)
      │ connect to <runtime dir>/<app>-<uid>/<key>.sock
      ├─ a session answers ──► its stdout and stderr, then its exit code
      └─ none, or it declines before starting the call ──► the tool runs
           the call itself, as without --keep-open, then starts a session
           for the next one (`start_session`)

Sessions are per user: the socket's folder is the user's, mode 0700 (a
folder that is not is never used), and the session checks the caller's
uid on every connection.

**Wire.** One request: a 4-byte big-endian length, then the caller's
folder and its arguments, NUL-separated (neither can hold a NUL). Then
frames from the session, each a type byte, a 4-byte length and the
payload: ``S`` the call started, ``O`` and ``E`` text for stdout and
stderr, ``X`` the exit code (ASCII digits), ``D`` declined (why; before
``S`` only).

**Errors.** :func:`forward` never raises for a missing, dead or declining
session: it returns ``None`` and the caller runs the call itself. Once
the session has started the call its outcome is the session's: when the
session dies during the call, :func:`forward` says so and returns 1
(whether the call took effect is then unknown, as for a process killed
mid-call); it never runs the call a second time.

Imports only the small part of the standard library this needs (no json,
pathlib, typing or dataclasses): it runs first, on every call.
"""

from __future__ import annotations

import hashlib
import os
import socket
import stat
import struct
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import BinaryIO, Protocol

    class Scanned(Protocol):
        """A tool's own reading of a command line: what names its session."""

        @property
        def keep_open(self) -> str | None: ...

        def session_path(self, *, create: bool = False) -> str | None: ...


__all__ = [
    "FRAME_LIMIT",
    "REQUEST_LIMIT",
    "decode_request",
    "encode_frame",
    "encode_request",
    "forward",
    "forward_scanned",
    "key_of",
    "option",
    "session_path",
    "start_session",
]

#: The longest socket path AF_UNIX takes (``sun_path`` holds 108 bytes).
_SUN_PATH = 107
#: The longest request and the longest frame, bytes.
REQUEST_LIMIT = 1 << 20
FRAME_LIMIT = 1 << 22
_LENGTH = struct.Struct(">I")
_FRAME = struct.Struct(">cI")


def key_of(parts: list[str]) -> str:
    """A session's key: a digest of ``parts`` (what the session connects
    to, as the tool writes it) and the user."""
    text = "\0".join([str(os.geteuid()), *parts])
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:24]


def _runtime_dir(app: str) -> str:
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    base = runtime if runtime.startswith("/") else "/tmp"
    return os.path.join(base, f"{app}-{os.geteuid()}")


def session_path(app: str, key: str, *, create: bool = False) -> str | None:
    """The socket of the session ``key`` of ``app``, in the user's private
    folder (made, mode 0700, when ``create``); ``None`` when that folder is
    not the user's alone or the path is too long for a UNIX socket."""
    folder = _runtime_dir(app)
    if create:
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            pass
        except OSError:
            return None
    try:
        st = os.lstat(folder)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        return None
    path = os.path.join(folder, f"{key}.sock")
    return path if len(os.fsencode(path)) <= _SUN_PATH else None


def encode_request(argv: list[str], cwd: str) -> bytes:
    payload = "\0".join([cwd, *argv]).encode("utf-8", "surrogateescape")
    return _LENGTH.pack(len(payload)) + payload


def decode_request(payload: bytes) -> tuple[list[str], str]:
    """The arguments and folder of a request's payload (after its length)."""
    cwd, *argv = payload.decode("utf-8", "surrogateescape").split("\0")
    return argv, cwd


def encode_frame(kind: bytes, payload: bytes = b"") -> bytes:
    return _FRAME.pack(kind, len(payload)) + payload


def forward(path: str, argv: list[str], prog: str) -> int | None:
    """Hand ``argv`` to the session at ``path``; its exit code, or ``None``
    when the caller must run the call itself (no live session, or it
    declined before starting the call). ``prog`` names the tool in the
    one line said when the session dies mid-call."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(os.fsencode(path))
            sock.sendall(encode_request(argv, os.getcwd()))
        except OSError:
            return None
        try:
            return _relay(sock.makefile("rb"), prog)
        except KeyboardInterrupt:
            # Closing the socket cancels the call in the session, as a
            # Ctrl-C cancels a call in a process of its own.
            return 130


def option(token: str, rest: Iterator[str]) -> tuple[str, str] | None:
    """``token`` read as ``--name=value``, or as ``--name`` with the value
    taken from ``rest``: the name and the value; None when no value follows."""
    name, equals, value = token.partition("=")
    if not equals:
        following = next(rest, None)
        if following is None:
            return None
        value = following
    return name, value


def forward_scanned(found: Scanned | None, argv: list[str], prog: str) -> int | None:
    """:func:`forward` of a command line the tool read as ``found`` (None:
    not one a session serves), to its session if it asks for
    ``--keep-open``; ``None`` when the caller must run the call itself."""
    if found is None or found.keep_open is None:
        return None
    path = found.session_path()
    return None if path is None else forward(path, argv, prog)


def _relay(frames: BinaryIO, prog: str) -> int | None:
    started = False
    for kind, payload in _frames(frames):
        if kind == b"O":
            sys.stdout.write(payload.decode("utf-8", "replace"))
            sys.stdout.flush()
        elif kind == b"E":
            sys.stderr.write(payload.decode("utf-8", "replace"))
            sys.stderr.flush()
        elif kind == b"S":
            started = True
        elif kind == b"X" and started and payload.isdigit():
            return int(payload)
        elif kind == b"D" and not started:
            return None
        else:
            break
    if not started:
        return None
    sys.stderr.write(
        f"{prog}: error: the session ended during the call; "
        "whether the call took effect is unknown\n"
    )
    return 1


def _frames(frames: BinaryIO) -> Iterator[tuple[bytes, bytes]]:
    """Each frame of the session's answer, until its end or a bad frame."""
    while True:
        try:
            head = frames.read(_FRAME.size)
            if len(head) < _FRAME.size:
                return
            kind, length = _FRAME.unpack(head)
            if length > FRAME_LIMIT:
                return
            payload = frames.read(length)
        except OSError:
            return
        if len(payload) < length:
            return
        yield kind, payload


def start_session(argv: list[str]) -> None:
    """Start a session in the background for the next call: ``python
    ARGV`` (e.g. ``-m TOOL SESSION-COMMAND OPTIONS``), detached from this
    process, its session and its terminal. It ends by itself once idle."""
    import subprocess

    subprocess.Popen(
        [sys.executable, *argv],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
