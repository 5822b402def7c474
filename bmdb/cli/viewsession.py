"""``python -m bmdb views-session [--url URL] --keep-open SECONDS``: the
session that runs the listings handed to it (`bmdb.cli.viewlink`), each
as the same command in a process of its own runs it: parsed by the CLI's
own parser (a usage error or another database's listing is declined,
and the caller runs it itself), its text and its errors (``bmdb: error:
...``, exit status 1) sent back to the caller. What the session keeps is
the imports and one connection to the database, opened at the first
listing (again after a failed open) and kept in ``nursery``; the schema
is checked again before each listing, as a process of its own checks it
when it connects. How requests are read,
answered, cancelled, and when the session ends is
`common.keepopen.session`'s; its log is beside its socket.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import trio

from bmdb.cli import viewlink, views
from bmdb.connection import Connection, open_connection
from bmdb.errors import BMDBError
from common.cli import error_line, leaf_errors
from common.keepopen import session
from common.keepopen.session import Call, Say

__all__ = ["Parse", "main"]

#: The CLI's parser: argv (after ``bmdb``) to arguments; SystemExit on a
#: usage error.
Parse = Callable[[list[str]], argparse.Namespace]


class _Listings:
    def __init__(self, key: str, parse: Parse, nursery: trio.Nursery) -> None:
        self.key = key
        self.parse = parse
        self.nursery = nursery
        self.conn: Connection | None = None
        self.opening = trio.Lock()

    async def _connection(self, url: str | None) -> Connection:
        async with self.opening:
            if self.conn is None:
                self.conn = await self.nursery.start(_hold, url)
        await self.conn.check_schema()
        return self.conn

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
                text = await views.run_on(await self._connection(args.url), args)
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
    trio.run(_serve, path, args.keep_open, found.key, parse)
    return 0


async def _serve(path: str, keep_open: float, key: str, parse: Parse) -> None:
    async with trio.open_nursery() as nursery:
        listings = _Listings(key, parse, nursery)
        await session.serve(path, keep_open, listings.accept)
        nursery.cancel_scope.cancel()


async def _hold(
    url: str | None, *, task_status: trio.TaskStatus[Connection] = trio.TASK_STATUS_IGNORED
) -> None:
    async with open_connection(url, max_connections=1) as conn:
        task_status.started(conn)
        await trio.sleep_forever()
