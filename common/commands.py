"""The commands block that every CLI's ``--help`` starts with.

A newcomer reads ``--help`` to learn what a tool can do, and the flags of
one command (``python -m shepherd`` has some hundred) must not hide the
others. A CLI whose commands are argparse subcommands gets this for free
(argparse lists them under "positional arguments" before the options); a
CLI whose default action has no name (``python -m shepherd`` runs the
control loops, ``install`` is dispatched before argparse) puts this block
in its description, shown with `argparse.RawDescriptionHelpFormatter`.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

__all__ = ["DEFAULT", "commands_description"]

#: The name shown for what a CLI does when given no command.
DEFAULT = "(default)"


def commands_description(commands: Sequence[tuple[str, str]], text: str) -> str:
    """A description for `argparse.RawDescriptionHelpFormatter`: a
    "commands:" section listing ``commands`` (name, one-line summary) in
    argparse's own layout, then ``text`` wrapped to 78 columns."""
    width = max(len(name) for name, _ in commands) + 2
    lines = ["commands:"]
    for name, summary in commands:
        lines.append(f"    {name.ljust(width)}{summary}")
    return "\n".join(lines) + "\n\n" + textwrap.fill(text, 78, break_on_hyphens=False)
