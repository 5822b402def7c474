"""The owner's kept-open session, the calling side.

``metropolis owner OPTIONS --keep-open SECONDS ACTION ...`` hands its call
to a session process that already holds the imports and a connection to
the curators, as ssh's ``ControlPersist`` hands a new ``ssh`` to a master
connection. Without a session an owner call pays, in every process, for
the interpreter, TLS, HTTP/2 and protobuf imports and for a TLS handshake
before its request goes out; through a session it pays for the
interpreter, this module and one UNIX socket round trip.

::

    metropolis owner --cluster F --owner-key K --keep-open 300 nodes
      │ scan the options before the action (no argparse: nothing heavy yet)
      │ connect to <runtime dir>/metropolis-owner-<uid>/<key of the options>.sock
      ├─ a session answers ──► its stdout and stderr, then its exit code
      └─ none (or it declines before starting the call) ──► the call runs in
           this process, as without --keep-open; if it succeeds, a session
           is started for the next one: python -m metropolis owner-session ...

The session (:mod:`metropolis.cli.ownersession`) parses the whole command
line with the CLI's own parser and reads the owner's files again for each
call, so a call through it says what the same call in a process of its
own says. Sessions are per user: the socket's folder is the user's, mode
0700 (a folder that is not is never used), and the session checks the
caller's uid on every connection.

**Errors.** :func:`forward` never raises for a missing, dead or declining
session: it returns ``None`` and the caller runs the call itself. Only
once the session has started the call is its outcome the session's: when
the session dies during the call, :func:`forward` says so and returns 1
(whether the call took effect is then unknown, as for a process killed
mid-call).

**Wire.** One request: a 4-byte big-endian length, then the caller's
folder and its arguments, NUL-separated (neither can hold a NUL). Then
frames from the session, each a type byte, a 4-byte length and the
payload: ``S`` the call started, ``O`` and ``E`` text for stdout and
stderr, ``X`` the exit code (ASCII digits), ``D`` declined (why, before
``S`` only).

Imports only the small part of the standard library this needs (no
json, pathlib, typing or dataclasses): it runs first, on every owner call,
before the CLI's parser.
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
    from typing import BinaryIO

__all__ = [
    "ACTIONS",
    "VALUE_OPTIONS",
    "Scan",
    "decode_request",
    "encode_frame",
    "encode_request",
    "forward",
    "scan",
    "session_path",
    "start_session",
]

#: The owner's actions (a test holds them equal to the parser's).
ACTIONS = frozenset(
    {"nodes", "approve", "set-roles", "delete", "tree", "ticket", "info", "snapshot", "recoveries"}
)
#: The options before the action, each with a value (the same test holds
#: them to the parser's). ``--keep-open`` is not part of a session's key.
VALUE_OPTIONS = frozenset({"--cluster", "--root", "--owner-key", "--curator-port", "--keep-open"})
_PATHS = ("--cluster", "--root", "--owner-key")
KEEP_OPEN = "--keep-open"

#: The longest socket path AF_UNIX takes (``sun_path`` holds 108 bytes).
_SUN_PATH = 107
#: The longest request and the longest frame, bytes.
REQUEST_LIMIT = 1 << 20
FRAME_LIMIT = 1 << 22
_LENGTH = struct.Struct(">I")
_FRAME = struct.Struct(">cI")


class Scan:
    """The options of an owner command line (before its action), as written."""

    __slots__ = ("options",)

    def __init__(self, options: tuple[tuple[str, str], ...]) -> None:
        self.options = options

    def value(self, name: str) -> str | None:
        return dict(self.options).get(name)

    @property
    def prefix(self) -> list[str]:
        """The options as arguments again (``--name value`` each)."""
        return [token for pair in self.options for token in pair]

    @property
    def key(self) -> str:
        """What names this command's session: its options but ``--keep-open``,
        paths made absolute, and the user."""
        return self.key_in(os.getcwd())

    def key_in(self, cwd: str) -> str:
        """:attr:`key` of the command run in the folder ``cwd``."""
        identity = sorted(
            (name, os.path.normpath(os.path.join(cwd, value)) if name in _PATHS else value)
            for name, value in self.options
            if name != KEEP_OPEN
        )
        text = "\0".join([str(os.geteuid()), *(f"{n}={v}" for n, v in identity)])
        return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:24]


def scan(argv: list[str]) -> Scan | None:
    """The options of ``owner OPTIONS ACTION ...``; ``None`` for anything
    this simple reading cannot vouch for (an unknown or repeated option,
    ``--help``, no action), which the CLI's parser then handles."""
    if argv[:1] != ["owner"]:
        return None
    options: dict[str, str] = {}
    tokens = iter(argv[1:])
    for token in tokens:
        if token in ACTIONS:
            return Scan(tuple(options.items()))
        name, equals, value = token.partition("=")
        if name not in VALUE_OPTIONS or name in options:
            return None
        if not equals:
            following = next(tokens, None)
            if following is None:
                return None
            value = following
        options[name] = value
    return None


def _runtime_dir() -> str:
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    base = runtime if runtime.startswith("/") else "/tmp"
    return os.path.join(base, f"metropolis-owner-{os.geteuid()}")


def session_path(found: Scan, *, create: bool = False) -> str | None:
    """The socket of ``found``'s session, in the user's private folder
    (made, mode 0700, when ``create``); ``None`` when that folder is not
    the user's alone or the path is too long for a UNIX socket."""
    folder = _runtime_dir()
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
    path = os.path.join(folder, f"{found.key}.sock")
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


def forward(argv: list[str]) -> int | None:
    """Hand the owner command ``argv`` to its session; its exit code, or
    ``None`` when the caller must run the call itself (no ``--keep-open``,
    no live session, or the session declined before starting the call)."""
    found = scan(argv)
    if found is None or found.value(KEEP_OPEN) is None:
        return None
    path = session_path(found)
    if path is None:
        return None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(os.fsencode(path))
            sock.sendall(encode_request(argv, os.getcwd()))
        except OSError:
            return None
        try:
            return _relay(sock.makefile("rb"))
        except KeyboardInterrupt:
            # Closing the socket cancels the call in the session, as a
            # Ctrl-C cancels a call in a process of its own.
            return 130


def _relay(frames: BinaryIO) -> int | None:
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
        "metropolis: error: the owner session ended during the call; "
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


def start_session(found: Scan) -> None:
    """Start ``found``'s session in the background, for the next call
    (``python -m metropolis owner-session OPTIONS``). It outlives this
    process and ends after ``--keep-open`` seconds without a call."""
    import subprocess

    subprocess.Popen(
        [sys.executable, "-m", "metropolis", "owner-session", *found.prefix],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
