"""The root of every error the ``shepherd`` package raises.

Each module's errors derive from :class:`ShepherdError`, so a caller can
catch the whole package's failures in one clause and let anything else (a
bug) propagate.
"""

from __future__ import annotations

__all__ = ["ShepherdError"]


class ShepherdError(Exception):
    """Base class of every error raised by the ``shepherd`` package."""
