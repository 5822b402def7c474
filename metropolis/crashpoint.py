"""Test hook: a process SIGKILLs itself at a named step (see `common.crashpoint`,
where it lives so that the BMDB can use it too)."""

from __future__ import annotations

from common.crashpoint import CRASH_ENV, crash_point

__all__ = ["CRASH_ENV", "crash_point"]
