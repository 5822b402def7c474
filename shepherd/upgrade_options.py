"""``python -m shepherd upgrade``'s command line: its parser and the checks of
single values (machine ids, a count, seconds).

Apart from :mod:`shepherd.upgrade` (which checks the options together,
then asks the image server, the cluster and the BMDB) so that ``upgrade
--help`` and a usage error import none of them (``tests/test_cli_imports.py``).
"""

from __future__ import annotations

import argparse
import uuid
from pathlib import Path

from common.exitcodes import show_in_help

__all__ = [
    "DEFAULT_HEALTH_TIMEOUT",
    "EXAMPLES",
    "MAX_HEALTH_TIMEOUT",
    "MIN_HEALTH_TIMEOUT",
    "build_parser",
]

#: ``--health-timeout``'s default and bounds, seconds.
DEFAULT_HEALTH_TIMEOUT = 300
MIN_HEALTH_TIMEOUT, MAX_HEALTH_TIMEOUT = 5, 86400


EXAMPLES = """\
examples:
  # every installed machine, one at a time, each node given 5 minutes
  python -m shepherd upgrade --bmdb-url postgresql:///bmdb --all \\
      --image-server https://bmaas.example:7443 --image-digest sha256:<64 hex> \\
      --cluster-owner-info cluster.pb --cluster-owner-key owner.pem --wait

  python -m shepherd upgrade --bmdb-url postgresql:///bmdb --status
  python -m shepherd upgrade --bmdb-url postgresql:///bmdb --stop --reason "bad image"

Exit status: 0 done (with --wait: every machine upgraded), 1 refused or (with
--wait) stopped at a machine that went back or failed, 2 for a bad option.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shepherd upgrade",
        description="Move installed machines to a new node image, A/B, a few at a time and\n"
        "consensus members one by one, keeping the cluster's quorum; the Shepherd's\n"
        "upgrader does the work (it needs the cluster owner's credentials).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    show_in_help(parser)
    parser.add_argument("--bmdb-url", required=True, metavar="URL", help="libpq URL of the BMDB")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--status", action="store_true", help="show the latest run and its machines")
    what.add_argument("--stop", action="store_true", help="stop the running run (needs --reason)")
    choose_ = parser.add_argument_group("machines (--machines or --all)")
    choose_.add_argument(
        "--machines",
        action="append",
        default=[],
        type=_uuids,
        metavar="ID[,ID...]",
        help="machine ids (as 'python -m bmdb machines' lists them); repeat or comma-separate",
    )
    choose_.add_argument("--all", action="store_true", help="every installed machine")
    image = parser.add_argument_group("image (--image-url, or --image-server with --image-digest)")
    image.add_argument("--image-url", metavar="URL", help="https://HOST:PORT/images/sha256/<hex>")
    image.add_argument(
        "--image-server", metavar="URL", help="https://HOST:PORT of the image server"
    )
    image.add_argument("--image-digest", metavar="sha256:HEX", help="the new image's SHA-256")
    image.add_argument("--image-server-ca", type=Path, metavar="FILE", help="PEM CA of the server")
    image.add_argument(
        "--insecure-plain-http", action="store_true", help="allow an http:// image server"
    )
    parser.add_argument(
        "--max-unavailable",
        type=_count,
        default=1,
        metavar="N",
        help="nodes down at once at most, counting those the cluster already sees unhealthy "
        "(default 1; consensus members always go one at a time)",
    )
    parser.add_argument(
        "--health-timeout",
        type=_seconds,
        default=DEFAULT_HEALTH_TIMEOUT,
        metavar="S",
        help="seconds a node on its new slot has, from its boot, to be healthy in the cluster "
        f"before its machine goes back (default {DEFAULT_HEALTH_TIMEOUT})",
    )
    owner = parser.add_argument_group("cluster owner (to order the run from the cluster's view)")
    owner.add_argument("--cluster-owner-root", type=Path, metavar="DIR")
    owner.add_argument("--cluster-owner-info", type=Path, metavar="FILE")
    owner.add_argument("--cluster-owner-key", type=Path, metavar="FILE")
    parser.add_argument("--operator", help="who asks, for the audit log (default: the OS user)")
    parser.add_argument("--reason", default="", help="why, for the audit log")
    parser.add_argument("--dry-run", action="store_true", help="print the plan; write nothing")
    parser.add_argument("--wait", action="store_true", help="follow the run until it ends")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return parser


def _uuids(text: str) -> list[uuid.UUID]:
    try:
        return [uuid.UUID(part) for part in text.split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not machine ids (UUIDs): {text[:100]!r}") from None


def _count(text: str) -> int:
    if not text.isascii() or not text.isdigit() or not 1 <= int(text) <= 1000:
        raise argparse.ArgumentTypeError(f"want a count from 1 to 1000, got {text[:100]!r}")
    return int(text)


def _seconds(text: str) -> int:
    if not text.isascii() or not text.isdigit():
        raise argparse.ArgumentTypeError(f"want whole seconds, got {text[:100]!r}")
    value = int(text)
    if not MIN_HEALTH_TIMEOUT <= value <= MAX_HEALTH_TIMEOUT:
        raise argparse.ArgumentTypeError(
            f"want {MIN_HEALTH_TIMEOUT} to {MAX_HEALTH_TIMEOUT} seconds, got {value}"
        )
    return value
