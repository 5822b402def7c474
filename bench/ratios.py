"""Where a benchmark reports its headline ratios for ``nox -s bench``.

Each benchmark prints its own detailed table. `report` also appends one JSON
line per ratio to the file named by ``$BENCH_RATIOS`` (set by the nox
session, which prints all of them as one table at the end); without the
variable it does nothing.
"""

from __future__ import annotations

import json
import os


def report(bench: str, measure: str, ratio: float, goal: str = "") -> None:
    """Record ``ratio`` of ``measure`` (``goal`` says which way is good, e.g. "<= 2")."""
    path = os.environ.get("BENCH_RATIOS")
    if not path:
        return
    with open(path, "a", encoding="utf-8") as f:
        line = {"bench": bench, "measure": measure, "ratio": ratio, "goal": goal}
        f.write(json.dumps(line) + "\n")
