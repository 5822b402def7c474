"""Every benchmark in its smoke mode: it runs, prints its table and reports its ratios.

Each benchmark (every module of ``bench/`` that runs as a program, found the
way ``nox -s bench`` finds them) runs as ``python -m bench.NAME --smoke`` in
its own process, with this virtualenv's Python, as that session runs it.
A smoke run does what the full run does with the smallest sizes (see
`bench.smoke`), so a change that breaks a benchmark fails here rather than
the next time someone measures. No figure is judged: the runs are too small
for their figures to mean anything. What is checked: exit status 0, the
line of its table that holds its result, and at least one ratio reported
through `bench.ratios`, each a finite number.

The membership benchmarks mostly wait (etcd removes a voter only once the
others have been connected to it for 5 s, and they remove one per grant and
per baseline join), so they start in the background when the first test of
this module runs and wait while the others run; their tests come last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.smoke import parse_args
from tests import loopback

ROOT = Path(__file__).resolve().parents[2]

#: What each benchmark prints in (or beside) its result table.
PRINTS = {
    "bmdb_ha": "ratio patroni/single:",
    "cli": "owner --root nodes",
    "bmdb_work": "a: ours/pgb",
    "consensus_start": "put via Client (time ratio)",
    "controlplane": "grant, n2 in its own process",
    "etcdclient": "verdict: ",
    "grant_trace": "median ratio",
    "growth": "100,000 machines a day:",
    "fleet_scale": "capacity full/bare at",
    "heartbeat": "ratio full/bare:",
    "initializer": "machines/min",
    "install": "by hand / product (time ratio)",
    "provisioner": "reconcile",
    "recover": "node recover to the owner answered",
    "rpc": "metropolis.rpc (h2 on Trio)",
    "startup_trace": "--- medians over",
    "upgrade": "upgrade/restarts (time ratio)",
    "web_pages": "metrics fleet query:",
}
#: Arguments beyond ``--smoke``: the install benchmark puts nodes on the
#: nodes' fixed ports, in this test process's block of loopback addresses.
EXTRA_ARGS = {
    "install": ("--loopback-block", str(loopback.BLOCK)),
    "upgrade": ("--loopback-block", str(loopback.BLOCK)),
}
#: Benchmarks that mostly wait: started in the background, tested last.
BACKGROUND = ("controlplane", "grant_trace")
#: Seconds a smoke run may take at most (they take seconds; this is for a hang).
TIMEOUT = 300.0
#: Seconds a run gets to clean up after SIGINT (its servers stop) before SIGKILL.
STOP_GRACE = 60.0


def _benchmarks() -> list[str]:
    names = sorted(
        path.stem
        for path in (ROOT / "bench").glob("*.py")
        if 'if __name__ == "__main__"' in path.read_text()
    )
    return [n for n in names if n not in BACKGROUND] + [n for n in names if n in BACKGROUND]


@dataclass
class SmokeRun:
    """One benchmark's smoke run in its own process."""

    name: str
    process: subprocess.Popen[bytes]
    #: Its stdout and stderr: a file, not a pipe, which nobody reads while
    #: a background run goes on.
    output: Path
    ratios: Path

    @classmethod
    def start(cls, name: str, folder: Path) -> SmokeRun:
        output, ratios = folder / f"{name}.out", folder / f"{name}.jsonl"
        ratios.touch()
        with output.open("wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", f"bench.{name}", "--smoke", *EXTRA_ARGS.get(name, ())],
                cwd=ROOT,
                env={**os.environ, "BENCH_RATIOS": str(ratios)},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        return cls(name, process, output, ratios)

    def wait(self) -> tuple[int, str, list[dict[str, object]]]:
        """Its exit status, output and reported ratios; stopped after `TIMEOUT`."""
        try:
            status = self.process.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        rows = [json.loads(line) for line in self.ratios.read_text().splitlines()]
        return status, self.output.read_text(errors="replace"), rows

    def stop(self) -> None:
        """SIGINT (a benchmark stops its servers on it), SIGKILL if it lingers."""
        if self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=STOP_GRACE)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def background(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, SmokeRun]]:
    """The selected `BACKGROUND` benchmarks' runs, started together; stopped at the end."""
    selected = {
        item.callspec.params["name"]
        for item in request.session.items
        if isinstance(item, pytest.Function)
        and item.module is not None
        and item.module.__name__ == __name__
        and hasattr(item, "callspec")
    }
    folder = tmp_path_factory.mktemp("smoke-background")
    runs: dict[str, SmokeRun] = {}
    try:
        for name in BACKGROUND:
            if name in selected:
                runs[name] = SmokeRun.start(name, folder)
        yield runs
    finally:
        for run in runs.values():
            run.stop()


@pytest.mark.parametrize("name", _benchmarks())
def test_smoke(name: str, background: dict[str, SmokeRun], tmp_path: Path) -> None:
    assert name in PRINTS, f"PRINTS lacks the line that {name}'s result table prints"
    run = background.get(name) or SmokeRun.start(name, tmp_path)
    status, output, rows = run.wait()
    assert status == 0, output
    assert PRINTS[name] in output, output
    assert rows, f"{name} reported no ratio:\n{output}"
    for row in rows:
        assert row["bench"] == name, row
        assert isinstance(row["ratio"], float) and math.isfinite(row["ratio"]), row


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--per-page", type=int, default=1000)
    return parser


def test_smoke_sizes_are_defaults_that_flags_override() -> None:
    sizes = {"runs": 1, "per_page": 4}
    assert vars(parse_args(_parser(), sizes, [])) == {"runs": 40, "per_page": 1000, "smoke": False}
    smoke = parse_args(_parser(), sizes, ["--smoke", "--runs", "3"])
    assert vars(smoke) == {"runs": 3, "per_page": 4, "smoke": True}


def test_smoke_size_of_an_unknown_option_is_refused() -> None:
    with pytest.raises(ValueError, match="per_pages"):
        parse_args(_parser(), {"per_pages": 4}, ["--smoke"])
