"""The takeover agent that the initializer uploads to machines.

The agent itself is :mod:`shepherd.agent.takeover`, a self-contained script
(standard library only) so that it runs on a target with nothing but
``python3``. This package only tells the rest of the Shepherd where it is.
"""

from __future__ import annotations

from pathlib import Path

#: The agent script, ready to be uploaded as-is.
AGENT_SCRIPT_PATH: Path = Path(__file__).with_name("takeover.py")


def agent_script() -> bytes:
    """Return the bytes of the agent script (read from the installed package)."""
    return AGENT_SCRIPT_PATH.read_bytes()
