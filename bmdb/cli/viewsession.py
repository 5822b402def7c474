"""``python -m bmdb views-session [--url URL] --keep-open SECONDS``: the
session that runs the listings handed to it (`bmdb.cli.viewlink`), each
as the same command in a process of its own runs it: parsed by the CLI's
own parser (a usage error or another database's listing is declined,
and the caller runs it itself), on a connection of its own, its text and
its errors (``bmdb: error: ...``, exit status 1) sent back to the
caller. What the session keeps is the imports. How requests are read,
answered, cancelled, and when the session ends is
`common.keepopen.session`'s; its log is beside its socket.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import trio

from bmdb.cli import viewlink, views
from bmdb.errors import BMDBError
from common.cli import error_line, leaf_errors
from common.keepopen import session
from common.keepopen.session import Call, Say

__all__ = ["Parse", "main"]

#: The CLI's parser: argv (after ``bmdb``) to arguments; SystemExit on a
#: usage error.
Parse = Callable[[list[str]], argparse.Namespace]


class _Listings:
    def __init__(self, key: str, parse: Parse) -> None:
        self.key = key
        self.parse = parse

    def accept(self, argv: list[str], cwd: str) -> Call | None:
        found = viewlink.scan(argv)
        if found is None or found.key != self.key:
            return None
        try:
            args = self.parse(argv)
        except SystemExit:
            return None  # a usage error: the caller's parser says it

        async def call(out: Say, err: Say) -> int:
            try:
                text = await views.run(args)
            except Exception as exc:
                leaves = leaf_errors(exc)
                if not all(isinstance(leaf, BMDBError) for leaf in leaves):
                    raise
                for leaf in leaves:
                    err(error_line("bmdb", leaf) + "\n")
                return 1
            out(text + "\n")
            return 0

        return call


def main(prefix: list[str], parse: Parse) -> int:
    """Serve until idle. Exit status 2 for options that are not a
    session's or without a private folder for the socket."""
    found = viewlink.scan([*prefix[:-2], "sessions", *prefix[-2:]])
    if found is None or found.keep_open is None:
        return 2
    args = parse([*prefix[:-2], "sessions", *prefix[-2:]])  # checks SECONDS
    path = found.session_path(create=True)
    if path is None:
        return 2
    session.log_beside(path)
    trio.run(session.serve, path, args.keep_open, _Listings(found.key, parse).accept)
    return 0
