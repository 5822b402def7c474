"""``bmdb ... LISTING ... --keep-open SECONDS``: the calling side.

A listing (``machines``, ``machine``, ``history``, ``sessions``,
``audit``) in a process of its own pays for the imports of psycopg, Trio
and the views before its query goes out. With ``--keep-open`` it is
handed to a session process that keeps them (`common.keepopen`; the
session is :mod:`bmdb.cli.viewsession`, run as the internal command
``bmdb views-session``). A session is named by the database the listing
reads: ``--url``, or without it the ``PG*`` environment variables that
locate the database. Read here without argparse: this runs before
anything else of the command. Imports only `common.keepopen.link` and
what it imports.
"""

from __future__ import annotations

import os

from common.keepopen import link

__all__ = ["APP", "VIEWS", "Scan", "forward", "scan", "start_session"]

#: The name of the folder of the listings' sessions (``APP-UID``).
APP = "bmdb-views"
#: The listings (a test holds them equal to `bmdb.__main__`'s).
VIEWS = frozenset({"machines", "machine", "history", "sessions", "audit"})
KEEP_OPEN = "--keep-open"


class Scan:
    """What names a listing's session: its ``--url`` (or None), and its
    ``--keep-open`` seconds as written."""

    __slots__ = ("keep_open", "url")

    def __init__(self, url: str | None, keep_open: str | None) -> None:
        self.url = url
        self.keep_open = keep_open

    @property
    def key(self) -> str:
        """The database: the URL, or the ``PG*`` variables without one."""
        if self.url is not None:
            return link.key_of([f"url={self.url}"])
        return link.key_of(sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith("PG")))

    def session_path(self, *, create: bool = False) -> str | None:
        return link.session_path(APP, self.key, create=create)

    @property
    def prefix(self) -> list[str]:
        """The options a session is started with."""
        url = [] if self.url is None else ["--url", self.url]
        return [*url, KEEP_OPEN, self.keep_open or ""]


def scan(argv: list[str]) -> Scan | None:
    """``[--url URL] [-v] LISTING ... [--keep-open SECONDS]``; ``None`` for
    anything this simple reading cannot vouch for (another command, an
    unknown or repeated option before the listing), which the parser then
    handles."""
    url: str | None = None
    tokens = iter(argv)
    for token in tokens:
        if token in VIEWS:
            break
        if token in ("-v", "--verbose"):
            continue
        found = link.option(token, tokens)
        if found is None:
            return None
        name, value = found
        if name != "--url" or url is not None:
            return None
        url = value
    else:
        return None
    keep_open = None
    rest = iter(tokens)
    for token in rest:
        if token == KEEP_OPEN:
            keep_open = next(rest, None)
        elif token.startswith(KEEP_OPEN + "="):
            keep_open = token.partition("=")[2]
    return Scan(url, keep_open)


def forward(argv: list[str]) -> int | None:
    """Hand the listing ``argv`` to its session (`link.forward`); its exit
    code, or ``None`` when the caller must run it itself."""
    return link.forward_scanned(scan(argv), argv, "bmdb")


def start_session(found: Scan) -> None:
    """Start ``found``'s session for the next listing; it ends after
    ``--keep-open`` seconds without one."""
    link.start_session(["-m", "bmdb", "views-session", *found.prefix])
