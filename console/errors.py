"""The console's error tree: `ConsoleError` and what derives from it.

The console shows what the BMDB and the cluster say; their own errors
(`bmdb.errors.BMDBError`, `metropolis.errors.MetropolisError`) reach it
unchanged and are answered there (400, 503, a page that explains). Its own
errors are about the pages themselves.
"""

from __future__ import annotations

__all__ = ["ConsoleError", "CountsUnavailable", "NotFound"]


class ConsoleError(Exception):
    """Root of the console's errors."""


class NotFound(ConsoleError):
    """A page's subject (a machine, a cluster node) does not exist (answered with 404)."""


class CountsUnavailable(ConsoleError):
    """The machine list's count query was cancelled before it answered: the
    UI is stopping (`console.counts`)."""
