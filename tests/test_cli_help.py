"""Every CLI's ``--help`` starts with what it can do, and the README agrees.

Run as a user runs them (``python -m ...``, a process each). The commands
are what comes before the first options: argparse's subcommands under
"positional arguments", or the "commands" block of `common.commands`.
The README lists them under "Every command".
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parent.parent / "README.md"

#: The README's name of each CLI, and how this test runs it.
CLIS = {
    "python -m shepherd": ["shepherd"],
    "bin/demo": ["shepherd.demo"],
    "python -m bmdb": ["bmdb"],
    "python -m console": ["console"],
    "python -m metropolis": ["metropolis"],
    "python -m metropolis node": ["metropolis", "node"],
    "python -m metropolis owner": ["metropolis", "owner"],
}

_ENTRY = re.compile(r"^ {4}(\S+)(?: {2,}\S.*)?$")


def help_commands(argv: list[str]) -> list[str]:
    """The command names ``--help`` lists before its first options section."""
    shown = subprocess.run(
        [sys.executable, "-m", *argv, "--help"], capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0, shown.stderr
    names: list[str] = []
    section = None
    for line in shown.stdout.splitlines():
        if re.match(r"^\S.*:$", line):
            section = line
            if names:  # the first section after the commands: no more
                break
            continue
        if section in ("commands:", "positional arguments:"):
            found = _ENTRY.match(line)
            if found:
                names.append(found.group(1))
        elif section is not None and not names:
            raise AssertionError(f"{argv}: {section!r} comes before any command")
    return names


def readme_commands() -> dict[str, list[str]]:
    """The README's "Every command" block: CLI name, then its commands in order."""
    text = README.read_text()
    block = text.split("### Every command", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    listed: dict[str, list[str]] = {}
    cli = None
    for line in block.splitlines():
        if not line.strip():
            continue
        if not line.startswith(" "):
            cli = line.strip()
            listed[cli] = []
        else:
            assert cli is not None
            listed[cli].append(line.split()[0])
    return listed


@pytest.mark.parametrize("cli", sorted(CLIS))
def test_help_starts_with_the_commands_the_readme_lists(cli: str) -> None:
    commands = help_commands(CLIS[cli])
    assert commands, f"{cli} --help lists no command"
    assert readme_commands().get(cli) == commands


def test_the_readme_lists_no_cli_that_is_not_checked() -> None:
    assert sorted(readme_commands()) == sorted(CLIS)
