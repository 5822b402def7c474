"""Test hook: a process SIGKILLs itself at a named step, as a power cut would.

Crash-safety tests run a node with ``METROPOLIS_TEST_CRASH_AT=<step>`` in
its environment and then check that a restart resumes from whatever the
node left on disk. Without the variable every crash point is a no-op.
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
