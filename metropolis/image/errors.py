"""The error of the node image's builder and entry point."""

from __future__ import annotations

from metropolis.errors import MetropolisError

__all__ = ["ImageError"]


class ImageError(MetropolisError):
    """An image cannot be built (bad ``--etcd``, unwritable output, a missing
    dependency, shiv failed) or cannot run here (wrong Python, damaged cache).

    Its message is one line that says what to fix.
    """
