"""Command-line entry point of the `shepherd` package: see :mod:`shepherd.cli`."""

from __future__ import annotations

from shepherd.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
