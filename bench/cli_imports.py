"""The CPU a command spends before it does anything: imports, per subcommand.

    python -m bench.cli_imports [--runs 7] [--smoke]

Each command runs as a process of its own (``python -m ... --help``), and
its CPU (user + system, from ``os.wait4``) is the median over ``--runs``.
Every figure is a ratio against a baseline measured in the same run:
``python -c pass`` (the interpreter's own start), and for a command whose
imports were cut, its old import path (``before``, the modules it imported
until the cut, imported by ``python -c``) against the command now
(``after``). No goal of its own: issue 39's "under 150 ms of CPU" is
`bench.cli`'s, this one says where each command stands.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

from bench.ratios import report
from bench.smoke import parse_args

#: (label, argv after the interpreter): each CLI's --help and common commands' --help.
COMMANDS: list[tuple[str, list[str]]] = [
    ("shepherd --help", ["-m", "shepherd", "--help"]),
    ("shepherd install --help", ["-m", "shepherd", "install", "--help"]),
    ("bmdb --help", ["-m", "bmdb", "--help"]),
    ("console --help", ["-m", "console", "--help"]),
    ("metropolis --help", ["-m", "metropolis", "--help"]),
    ("metropolis owner nodes --help", ["-m", "metropolis", "owner", "nodes", "--help"]),
]

#: (label, before: the old import path, after: the command now).
CUTS: list[tuple[str, list[str], list[str]]] = [
    (
        "shepherd install --help",
        ["-c", "import shepherd.cli, shepherd.install"],
        ["-m", "shepherd", "install", "--help"],
    ),
]


def cpu(argv: list[str]) -> float:
    """Seconds of CPU (user + system) of one ``python ARGV`` run."""
    process = subprocess.Popen(
        [sys.executable, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise SystemExit(f"bench.cli_imports: python {' '.join(argv)} exited {process.returncode}")
    return usage.ru_utime + usage.ru_stime


def median_cpu(argv: list[str], runs: int) -> float:
    return statistics.median(cpu(argv) for _ in range(runs))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cli_imports", description=__doc__)
    parser.add_argument("--runs", type=int, default=7, help="runs per command (default 7)")
    args = parse_args(parser, {"runs": 1}, argv)
    bare = median_cpu(["-c", "pass"], args.runs)
    print(f"baseline: python -c pass, {bare * 1000:.0f} ms CPU (median of {args.runs})")
    print(f"{'command':<32}{'CPU ms':>8}{'x python -c pass':>18}")
    for label, command in COMMANDS:
        took = median_cpu(command, args.runs)
        print(f"{label:<32}{took * 1000:>8.0f}{took / bare:>18.1f}")
        report("cli_imports", f"{label} / python -c pass", took / bare)
    print(f"\n{'cut':<32}{'before ms':>10}{'after ms':>10}{'after/before':>14}")
    for label, before, after in CUTS:
        old, new = median_cpu(before, args.runs), median_cpu(after, args.runs)
        print(f"{label:<32}{old * 1000:>10.0f}{new * 1000:>10.0f}{new / old:>14.2f}")
        report("cli_imports", f"{label}: after / before the cut", new / old, "< 1")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
