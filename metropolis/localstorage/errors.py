"""The errors of the node's local storage (one tree under MetropolisError)."""

from __future__ import annotations

from pathlib import Path

from metropolis.errors import MetropolisError

__all__ = ["CorruptFile", "InsecureSealError", "LocalStorageError", "UnsafeRootError"]


class LocalStorageError(MetropolisError):
    """A local storage file is missing, unreadable or malformed."""


class InsecureSealError(LocalStorageError):
    """Sealing or unsealing needs a TPM, or explicit consent to do without one."""


class UnsafeRootError(LocalStorageError):
    """A node root, or a folder or file in it, that another local user could
    swap or change (or read, for a secret): a symlink, someone else's, or too
    loose a mode. The message names the path and what to do."""


class CorruptFile(LocalStorageError):
    """A file the node wrote reads back cut short, changed, or not as written.

    ``path`` is the file, ``reason`` what is wrong with it; the message adds
    what the operator can do.
    """

    def __init__(self, path: Path, reason: str, advice: str = "") -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path} is damaged: {reason}" + (f"; {advice}" if advice else ""))
