"""``metropolis owner ... --keep-open SECONDS``: the calling side.

An owner call in a process of its own pays for the interpreter, TLS,
HTTP/2 and protobuf imports and a TLS handshake before its request goes
out. With ``--keep-open`` it is handed to a session process that keeps
the imports and a connection to the curators (`common.keepopen`; the
session is :mod:`metropolis.cli.ownersession`, run as the internal
command ``metropolis owner-session OPTIONS``).

A session is named by the options before the action (``--cluster`` or
``--root``, ``--owner-key``, ``--curator-port``; paths made absolute),
read here without argparse: this runs before anything else of the
command. Imports only `common.keepopen.link` and what it imports.
"""

from __future__ import annotations

import os

from common.keepopen import link

__all__ = ["ACTIONS", "APP", "VALUE_OPTIONS", "Scan", "forward", "scan", "start_session"]

#: The name of the folder of the owner's sessions (``APP-UID``).
APP = "metropolis-owner"
#: The owner's actions (a test holds them equal to the parser's).
ACTIONS = frozenset(
    {"nodes", "approve", "set-roles", "delete", "tree", "ticket", "info", "snapshot", "recoveries"}
)
#: The options before the action, each with a value (the same test holds
#: them to the parser's). ``--keep-open`` is not part of a session's key.
VALUE_OPTIONS = frozenset({"--cluster", "--root", "--owner-key", "--curator-port", "--keep-open"})
_PATHS = ("--cluster", "--root", "--owner-key")
KEEP_OPEN = "--keep-open"


class Scan:
    """The options of an owner command line (before its action), as written."""

    __slots__ = ("options",)

    def __init__(self, options: tuple[tuple[str, str], ...]) -> None:
        self.options = options

    def value(self, name: str) -> str | None:
        return dict(self.options).get(name)

    @property
    def keep_open(self) -> str | None:
        """The ``--keep-open`` seconds as written, if given."""
        return self.value(KEEP_OPEN)

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
        return link.key_of([f"{name}={value}" for name, value in identity])

    def session_path(self, *, create: bool = False) -> str | None:
        return link.session_path(APP, self.key, create=create)


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
        found = link.option(token, tokens)
        if found is None:
            return None
        name, value = found
        if name not in VALUE_OPTIONS or name in options:
            return None
        options[name] = value
    return None


def forward(argv: list[str]) -> int | None:
    """Hand the owner command ``argv`` to its session (`link.forward`); its
    exit code, or ``None`` when the caller must run the call itself."""
    return link.forward_scanned(scan(argv), argv, "metropolis")


def start_session(found: Scan) -> None:
    """Start ``found``'s session for the next call; it ends after
    ``--keep-open`` seconds without one."""
    link.start_session(["-m", "metropolis", "owner-session", *found.prefix])
