"""``bench.bmdb_work --compare-machines`` in its smoke mode: it runs, prints
its table and reports the one ratio of claim+finish cost by fleet size."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_compare_machines_smoke(tmp_path: Path) -> None:
    ratios = tmp_path / "ratios.jsonl"
    ratios.touch()
    run = subprocess.run(
        [sys.executable, "-m", "bench.bmdb_work", "--smoke", "--compare-machines", "100,1000"],
        cwd=ROOT,
        env={**os.environ, "BENCH_RATIOS": str(ratios)},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "cost vs smallest" in run.stdout, run.stdout
    [row] = [json.loads(line) for line in ratios.read_text().splitlines()]
    assert row["bench"] == "bmdb_work", row
    assert row["measure"] == "claim+finish cost per cycle, 1000 / 100 machines", row
    assert isinstance(row["ratio"], float) and math.isfinite(row["ratio"]), row
