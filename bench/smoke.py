"""The benchmarks' smoke mode: ``--smoke`` runs one with its smallest sizes.

A smoke run takes seconds, not minutes. It does what the full run does
(servers started, each measured operation done at least once, the table
printed and the ratios reported through `bench.ratios`), so that a change
that breaks a benchmark fails the test suite (``tests/bench/test_smoke.py``
runs every benchmark so); its figures mean nothing.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence

SMOKE_HELP = "tiny sizes, to check that the benchmark runs (its figures mean nothing)"


def parse_args(
    parser: argparse.ArgumentParser,
    smoke: Mapping[str, object],
    argv: Sequence[str] | None = None,
) -> argparse.Namespace:
    """``parser``'s arguments, with ``--smoke`` added: it makes ``smoke`` the defaults.

    ``smoke`` maps argument names (as in the namespace) to their smoke
    values; a flag given on the command line still wins. A name the parser
    does not know raises ValueError, so that a renamed option cannot leave
    a smoke run at its full size.
    """
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    known, _ = parser.parse_known_args(argv)
    unknown = sorted(set(smoke) - set(vars(known)))
    if unknown:
        raise ValueError(f"smoke sizes for options the parser lacks: {', '.join(unknown)}")
    if known.smoke:
        parser.set_defaults(**smoke)
    return parser.parse_args(argv)
