"""The exit codes every command-line tool of the project uses, one meaning each.

::

    0   done          the command did what was asked
    1   failed        it could not (the error is on stderr, one line)
    2   usage         a bad option, argument or combination (argparse's code)
    75  try again     not yet: nothing is wrong, but the thing asked about is
                      not ready (a node root still being bootstrapped, a
                      machine still under work after ``--wait``); a script
                      polls on it (75 is sysexits.h's EX_TEMPFAIL)

Known gap: ``python -m metropolis`` still exits 2 (not 1) for a command
it refuses; a failure there is told apart from usage by its message only.

`EPILOG` is the same table for a parser's ``--help`` (`show_in_help`).
"""

from __future__ import annotations

import argparse
import enum

__all__ = ["EPILOG", "ExitCode", "show_in_help"]


class ExitCode(enum.IntEnum):
    """A process exit status (see the module docstring)."""

    OK = 0
    FAILED = 1
    USAGE = 2
    TRY_AGAIN = 75


#: The table as ``--help`` shows it.
EPILOG = """\
exit codes:
  0   done
  1   failed (the error on stderr)
  2   usage: a bad option or argument
  75  not yet, try again (e.g. still bootstrapping, machine still busy)"""


def show_in_help(parser: argparse.ArgumentParser) -> None:
    """End ``parser``'s ``--help`` with `EPILOG`, as written (an ``epilog=``
    would be reflowed into one paragraph), after its own epilog if any."""
    own = parser.format_help

    def format_help() -> str:
        return f"{own().rstrip()}\n\n{EPILOG}\n"

    # An instance attribute: print_help and --help call self.format_help().
    setattr(parser, "format_help", format_help)  # noqa: B010
