"""The command-line options of every program that opens a BMDB
(``python -m bmdb``, ``python -m console``): where the database is."""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    import argparse

__all__ = ["add_url_option"]


def add_url_option(parser: argparse.ArgumentParser) -> None:
    """Give ``parser`` the ``--url`` option (``args.url``: the URL or None, for
    `bmdb.open_connection`) and an epilog that says what None means: the
    standard libpq ``PG*`` environment variables locate the database."""
    parser.add_argument("--url", help="libpq connection URL, e.g. postgresql://user@host/db")
    parser.epilog = "Without --url, the PG* environment variables locate the database."
