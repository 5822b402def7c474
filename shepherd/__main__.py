"""Command-line entry point of the `shepherd` package: see :mod:`shepherd.cli`.

``install`` and ``upgrade`` are dispatched here, before :mod:`shepherd.cli` is imported: the
control loops' modules (asyncssh, the providers, the metrics server) cost
an ``install`` or ``upgrade`` (or their ``--help``) CPU they never use
(tests/test_cli_imports.py bounds what each command imports).
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
        from shepherd.install import main as install_main

        return install_main(argv[1:])
    if argv[:1] == ["upgrade"]:
        from shepherd.upgrade import main as upgrade_main

        return upgrade_main(argv[1:])
    from shepherd.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
