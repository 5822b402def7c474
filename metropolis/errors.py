"""The root of every error the ``metropolis`` package raises.

Each module's errors derive from :class:`MetropolisError`, so a caller can
catch the whole package's failures in one clause and let anything else (a
bug) propagate.
"""

from __future__ import annotations

__all__ = ["MetropolisError"]


class MetropolisError(Exception):
    """Base class of every error raised by the ``metropolis`` package."""
