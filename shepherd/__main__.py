"""Command-line entry point of the `shepherd` package: see :mod:`shepherd.cli`.

``install`` and ``upgrade`` are dispatched here, to `shepherd.install` and
`shepherd.upgrade`, each parsed by its own options module first; the control
loops' command line is parsed here (`shepherd.arguments`) before
:mod:`shepherd.cli` is imported: their modules (asyncssh, the providers, the
metrics server) cost ``install``, ``upgrade``, ``--help`` and a usage error
CPU they never use (tests/test_cli_imports.py bounds what each command imports).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m shepherd [install|upgrade] ...``: `shepherd.install`,
    `shepherd.upgrade` or `shepherd.cli`."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["install"]:
        from shepherd.install_options import build_parser as install_parser

        parser = install_parser()
        parsed = parser.parse_args(argv[1:])
        from shepherd.install import run_parsed as run_install

        return run_install(parser, parsed)
    if argv[:1] == ["upgrade"]:
        from shepherd.upgrade_options import build_parser as upgrade_parser

        parser = upgrade_parser()
        parsed = parser.parse_args(argv[1:])
        from shepherd.upgrade import run_parsed as run_upgrade

        return run_upgrade(parser, parsed)
    from shepherd.arguments import build_parser

    parser = build_parser()
    args = parser.parse_args(argv)
    from shepherd.cli import run_parsed

    return run_parsed(parser, args)


if __name__ == "__main__":
    raise SystemExit(main())
