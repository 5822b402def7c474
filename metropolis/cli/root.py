"""A node root named on the command line (``--root``), checked before it is used."""

from __future__ import annotations

import os
from pathlib import Path

from metropolis.localstorage import Root

__all__ = ["checked_root", "resolved_root"]


def checked_root(path: Path) -> Root:
    """The node root at ``path``, checked (:meth:`Root.check`) if anything is there.

    The folders above are resolved, the root itself is not: a symlink
    given as ``--root`` is refused by the check, not followed. A missing
    root is left to the command (bootstrap creates it, run refuses it).
    """
    root = resolved_root(path)
    if os.path.lexists(root.path):
        root.check()
    return root


def resolved_root(path: Path) -> Root:
    """The node root at ``path`` with the folders above it resolved (not checked)."""
    absolute = Path(os.path.abspath(path))
    return Root(absolute.parent.resolve() / absolute.name)
