"""The small files of /proc, /sys and beside the agent: best-effort reads,
atomic writes, and removal of what may already be gone."""

from __future__ import annotations

import contextlib
import os
import threading


def read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def read_int(path: str) -> int | None:
    text = read_text(path)
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def remove(path: str) -> None:
    """Remove the file ``path``, if it is there."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def write_atomically(path: str, data: bytes, mode: int = 0o600) -> None:
    """Write ``path`` so that a reader sees the old or the new content, never half."""
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        remove(tmp)
        raise
    dir_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
