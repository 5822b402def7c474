"""Test hook: a process SIGKILLs itself at a named step, as a power cut would.

Crash-safety tests run a node (or a BMDB migrator) with
``METROPOLIS_TEST_CRASH_AT=<step>`` in its environment and then check that a
restart resumes from whatever the process left on disk or in the database.
Without the variable every crash point is a no-op. (The variable is named
after the node half, which had it first; `metropolis.crashpoint` re-exports
this module.)
"""

from __future__ import annotations

import os
import signal

__all__ = ["CRASH_ENV", "crash_point"]

#: The name of the step at which the process SIGKILLs itself.
CRASH_ENV = "METROPOLIS_TEST_CRASH_AT"


def crash_point(step: str) -> None:
    """Die here (SIGKILL, no cleanup at all) if the test hook names ``step``."""
    if os.environ.get(CRASH_ENV) == step:
        os.kill(os.getpid(), signal.SIGKILL)
