"""The agent's one error: a failure it reports to the initializer."""

from __future__ import annotations


class AgentError(Exception):
    """A failure the agent reports to the initializer as TakeoverError."""
