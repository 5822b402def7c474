"""``python -m metropolis.image build --out DIR [--etcd PATH]``: build a node image.

Prints the image's path, size, SHA-256 and how long the build took; on a
bad ``--etcd``, an unwritable ``--out`` or a failed build, one line on
stderr and exit status 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from metropolis.image.build import build_image
from metropolis.image.errors import ImageError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m metropolis.image", description=__doc__.splitlines()[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="build DIR/<sha256>.pyz")
    build.add_argument("--out", type=Path, required=True, help="directory to write the image to")
    build.add_argument(
        "--etcd", type=Path, default=None, help="etcd binary to bundle (default: etcd on PATH)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        image = build_image(args.out, args.etcd)
    except ImageError as exc:
        sys.stderr.write(f"metropolis image: {exc}\n")
        return 1
    sys.stdout.write(
        f"image:   {image.path}\n"
        f"size:    {image.size} bytes ({image.size / 2**20:.1f} MiB)\n"
        f"sha256:  {image.sha256}\n"
        f"built:   in {image.seconds:.1f} s\n"
        f"etcd:    {image.etcd_version}\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
