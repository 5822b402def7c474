"""Which heavy modules a command imports, from ``python -X importtime``.

A command pays for every module it imports before it does anything, on
every run; these bounds keep a command from importing a stack it does not
use. They name modules, never times. Each row: the command, the top-level
packages it must not import, and one it must (so that a run that imports
nothing, or fails early, cannot pass).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

#: (argv after ``python -m``, packages it must not import, a package it must).
BOUNDS: list[tuple[list[str], set[str], str]] = [
    # install asks the BMDB and the cluster: no SSH, no metrics or web server.
    (["shepherd", "install", "--help"], {"asyncssh", "hypercorn", "prometheus_client"}, "shepherd"),
    (["shepherd", "upgrade", "--help"], {"asyncssh", "hypercorn", "prometheus_client"}, "shepherd"),
    # The control loops need SSH: the bound above is install's own, not a typo.
    (["shepherd", "--help"], set(), "asyncssh"),
    # Nothing of the node half's servers in the BMDB's CLI.
    (["bmdb", "--help"], {"asyncssh", "hypercorn", "grpclib", "cryptography"}, "bmdb"),
    (["console", "--help"], {"asyncssh", "grpclib"}, "console"),
]


def imported(argv: list[str]) -> set[str]:
    """The top-level packages ``python -m ARGV`` imports (exit status 0)."""
    run = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    names = set()
    for line in run.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            name = line.rsplit("|", 1)[1].strip()
            if name != "imported package":
                names.add(name.split(".")[0])
    return names


@pytest.mark.parametrize(
    ("argv", "banned", "needed"), BOUNDS, ids=lambda v: " ".join(v) if isinstance(v, list) else None
)
def test_a_command_imports_only_what_it_uses(
    argv: list[str], banned: set[str], needed: str
) -> None:
    names = imported(argv)
    assert needed in names
    assert names & banned == set()
